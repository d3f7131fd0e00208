"""The 2-rank test fits of the fork rig, run the way users start them: every family in turn in one pair of fresh
processes whose second rank Lightning's own launcher starts (``launcher_fits.py``), each checked by the fork rig's own
test of that family, on these records.

A family's forked test runs more modes; one of them runs here (the resumes on 2 ranks: a pair of processes holds one
world size). ``test_probe_ranks_ddp.py`` runs no ``Trainer.fit``; ``test_world_ddp.py`` and
``test_torchrun_resume_ddp.py`` already run under torchrun.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import test_budget_ddp
import test_callbacks_ddp
import test_datamodule_ddp
import test_datatrove_ddp
import test_fabric_world_ddp
import test_mapstyle_ddp
import test_mapstyle_resume_ddp
import test_masked_ddp
import test_model_parallel_ddp
import test_packed_ddp
import test_ranks_agree_ddp
import test_resume_ddp
import test_store_ddp
from launch import finish  # launch.py (the repository root)
from test_datatrove_ddp import store  # noqa: F401  the datatrove store fixture

pytestmark = [pytest.mark.e2e, pytest.mark.ddp, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("launcher_fits.py")


@pytest.fixture(scope="module")
def fits(tmp_path_factory, store):  # noqa: F811
    """The launcher run's folder, one subfolder per family; about 40 s on 2 idle cores, 9 s of it a family's sleeps."""
    root = tmp_path_factory.mktemp("launcher")
    megatron, docs = test_store_ddp.megatron_store(tmp_path_factory.mktemp("megatron"))
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[2]), "LAUNCHER_FITS_OUT": str(root),
           "LAUNCHER_FITS_STORE": str(megatron), "LAUNCHER_FITS_DATATROVE": str(store)}
    for name in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "FORK_RANKS"):
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, str(SCRIPT)], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    log = finish(proc, 400)
    assert proc.returncode == 0, log[-8000:]
    return root, docs


def _ranks(out: Path, name: str = "rank", count: int = 2) -> list[dict]:
    return [json.loads((out / f"{name}{r}.json").read_text()) for r in range(count)]


def test_record(fits):
    test_datamodule_ddp.test_two_rank_fit_covers_each_epoch_once({(False, 0): fits[0] / "record"}, False, 0)


def test_callbacks(fits):
    runs = {"fixed": (fits[0] / "callbacks", _ranks(fits[0] / "callbacks"))}
    test_callbacks_ddp.test_micro_batches_per_optimizer_step_equal_accumulate_grad_batches_on_every_rank(runs, "fixed")
    test_callbacks_ddp.test_backward_is_timed_on_every_rank_exactly_where_ddp_skipped_the_all_reduce(runs, "fixed")
    test_callbacks_ddp.test_step_loss_and_gradient_equal_one_process_over_the_same_tokens(runs, "fixed", "plan")


def test_packed(fits):
    runs = {"fixed": _ranks(fits[0] / "packed")}
    test_packed_ddp.test_every_micro_batch_is_one_packed_row_within_budget_and_no_document_is_lost(runs, "fixed")
    test_packed_ddp.test_padding_monitor_logs_zero_padding_and_training_learns(runs, "fixed")
    test_packed_ddp.test_fixed_accumulation_uses_the_plan_divisor_and_the_monitor_costs_each_document(runs)


def test_masked(fits):
    mode, out = "jsonl-plan", fits[0] / "masked"
    runs = {mode: (out, _ranks(out))}
    test_masked_ddp.test_every_training_document_runs_once_per_epoch_over_both_ranks(runs, mode)
    test_masked_ddp.test_the_planned_divisor_is_the_count_of_supervised_tokens_of_each_step(runs, mode)
    test_masked_ddp.test_step_loss_and_gradient_equal_one_process_over_the_same_tokens(runs, mode)


def test_mapstyle(fits):
    run = ("classify", True, 0)
    test_mapstyle_ddp.test_two_rank_map_style_fit_trains_each_ranks_plan_column_once_per_epoch(
        {run: _ranks(fits[0] / "mapstyle")}, run)


def test_model_parallel(fits):
    runs, module = {"fsdp2": (fits[0] / "fsdp2", _ranks(fits[0] / "fsdp2"))}, test_model_parallel_ddp
    for check in (module.test_the_data_parallel_world_is_the_mesh_dimension,
                  module.test_peers_of_a_replica_train_identical_micro_batches,
                  module.test_straggler_windows_hold_the_data_parallel_ranks_and_are_the_same_on_every_process,
                  module.test_every_document_once_per_epoch_over_the_data_parallel_ranks,
                  module.test_each_update_equals_one_process_token_mean_step):
        check(runs, "fsdp2")


def test_fabric(fits):
    test_fabric_world_ddp.test_ddp_every_process_is_a_replica({"ddp": _ranks(fits[0] / "fabric")})


def test_budget(fits, monkeypatch):
    monkeypatch.setattr(test_budget_ddp, "run_ranks", lambda *_, **__: {"oom": _ranks(fits[0] / "budget")})
    test_budget_ddp.test_one_rank_out_of_memory_ends_with_its_smaller_budget_on_every_rank(fits[0] / "budget")


def test_resume(fits, tmp_path):
    out = fits[0] / "resume"
    runs = (_ranks(out, "stop_rank"), {2: _ranks(out, "resume_rank")}, tmp_path)
    test_resume_ddp.test_checkpoint_mid_epoch_resumes_exactly(runs)
    test_resume_ddp.test_resume_inside_an_accumulation_window_keeps_each_windows_divisor(runs)
    test_resume_ddp.test_resume_after_a_failure_in_training_step_reruns_only_the_failed_micro_batch(
        (runs[0], {"fail": _ranks(out, "resume_fail_rank")}, tmp_path))


def test_store(fits):
    out = fits[0] / "store"
    runs = (fits[1], _ranks(out, "stop_rank"), _ranks(out, "full_rank"), {2: _ranks(out, "resume_rank")})
    test_store_ddp.test_training_reads_each_document_from_the_store(runs)
    test_store_ddp.test_resume_mid_epoch_trains_every_document_once(runs, 2)


def test_datatrove(fits, store):  # noqa: F811
    test_datatrove_ddp.test_every_document_trains_once_with_its_stored_tokens(
        (_ranks(fits[0] / "datatrove"), None, None), store)


def test_mapstyle_resume(fits):
    runs = {phase: _ranks(fits[0] / f"mapstyle_{phase}") for phase in ("whole", "stop", "resume_fail")}
    test_mapstyle_resume_ddp.test_a_resume_from_on_exception_checkpoint_reruns_the_failed_micro_batch_and_nothing_else(
        runs)


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    spec.loader.exec_module(module := importlib.util.module_from_spec(spec))
    return module


def test_phases_(fits, monkeypatch):
    folder = Path(__file__).parents[1] / "lightning" / "callbacks"  # test_phases.py imports its conftest.py's Clock
    monkeypatch.setitem(sys.modules, "conftest", _load(folder / "conftest.py", "callbacks_conftest"))
    test_phases = _load(folder / "test_phases.py", "launcher_test_phases")
    out = fits[0] / "phases"
    fit = json.loads((out / "result.json").read_text())["rows"], test_phases.read_metrics_csv(out / "logs/metrics.csv")
    test_phases.test_each_sleep_lands_in_its_own_column_and_in_no_other(fit)
    test_phases.test_the_table_the_csv_and_the_plot_agree(fit)
    test_phases.test_one_step_numbering_for_every_key(fit)


def test_disagree(fits, monkeypatch):
    monkeypatch.setattr(test_ranks_agree_ddp, "run_script", lambda *_, **__: (1, "stopped"))
    test_ranks_agree_ddp.test_a_document_missing_on_one_rank_stops_every_rank_with_the_cause(fits[0] / "disagree")
