"""Every YAML in conf/ loads and builds with hydra-core's compose API and ``hydra.utils.instantiate``."""

from __future__ import annotations

import re
from pathlib import Path

import lightning as L
import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, InstantiationException, MissingConfigException
from hydra.errors import OverrideParseException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf, open_dict, read_write
from omegaconf.errors import MissingMandatoryValue

from lit_balance import BalancedTextDataModule
from lit_balance.callbacks import (BalanceProgressBar, LastStepCheckpoint, MixtureMonitor, PaddingRatioMonitor,
                                   RunSummary, StragglerMonitor)
from lit_balance.demo import DemoTransformerLM
from lit_balance.plan.cost import CostModel

CONF = Path(__file__).resolve().parents[2] / "conf"
HYDRA_GROUPS = ("data", "model", "trainer", "callbacks", "experiment")
ALL_YAML = sorted(CONF.rglob("*.yaml"))
# keys that need no comment: import paths and headers of nested mappings
_UNCOMMENTED = re.compile(r"^\s*(-\s+)?(_target_|class_path|init_args|defaults|[\w.]+:\s*$)")


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _compose(overrides=(), config_name: str = "config", return_hydra_config: bool = False):
    """``hydra.compose`` of ``conf/<config_name>.yaml``, as ``@hydra.main`` composes it for a recipe; Hydra's own
    settings are set as a run sets them, so that ``${hydra:runtime.output_dir}`` (the run directory) resolves."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
    with read_write(cfg.hydra.runtime), open_dict(cfg.hydra.runtime):
        cfg.hydra.runtime.output_dir = str(Path(cfg.hydra.run.dir).resolve())  # as hydra.core.utils.run_job does
    HydraConfig.instance().set_config(cfg)
    if not return_hydra_config:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


@pytest.fixture
def corpus_file(tmp_path: Path) -> Path:
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(f"document {i} " + "word " * (i % 37 + 1) for i in range(60)), encoding="utf-8")
    return path


def test_conf_has_the_groups_and_the_primary_configs():
    assert (CONF / "config.yaml").is_file() and (CONF / "straggler_feedback.yaml").is_file()
    for group in HYDRA_GROUPS:
        assert _options(group), f"conf/{group}/ has no options"
    assert {"cpu_ddp", "gpu_ddp"} <= set(_options("trainer"))
    assert (CONF / "cli" / "fit_cpu.yaml").is_file()  # LightningCLI's; built by tests/cli/test_cli.py


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: str(p.relative_to(CONF)))
def test_yaml_starts_with_its_command_and_comments_every_key(path: Path):
    text = path.read_text(encoding="utf-8")
    assert isinstance(yaml.safe_load(text), dict)
    head = [line for line in text.splitlines() if line.strip()][:2]
    assert any(line.startswith("# Run: ") for line in head), f"{path} must start with '# Run: <command>'"
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#") or _UNCOMMENTED.match(line):
            continue
        if re.match(r"^\s*(-\s+)?[\w.]+:", line) or re.match(r"^\s*-\s+\w", line):
            assert "#" in line, f"{path.name}:{number}: every key needs a comment with its unit and scope: {line!r}"


def test_experiments_are_global_packages():
    # an experiment overrides keys of several groups, so Hydra must place it at the root
    for option in _options("experiment"):
        assert "# @package _global_" in (CONF / "experiment" / f"{option}.yaml").read_text().splitlines()[:2]


def _build(cfg, tmp_path: Path):
    dm = instantiate(cfg.data, cache_dir=str(tmp_path / "cache"))
    model = instantiate(cfg.model, vocab_size=dm.vocab_size)
    callbacks = list((instantiate(cfg.callbacks) or {}).values()) if cfg.get("callbacks") else []
    trainer = instantiate(cfg.trainer, callbacks=callbacks)
    return dm, model, callbacks, trainer


def test_base_config_is_the_main_job(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dm, model, callbacks, trainer = _build(_compose(), tmp_path)
    assert isinstance(dm, BalancedTextDataModule) and isinstance(model, DemoTransformerLM)
    assert (dm.max_tokens, dm.max_length, dm.val_fraction, dm.seed) == (1024, 256, 0.02, 0)
    assert dm.source.kind == "builtin"
    assert model.hparams.vocab_size == dm.vocab_size == 30522 and model.hparams.d_model == 128
    # the live figures: the monitors (a mixture's only on a mixture) and the bar that shows them; checkpoints after
    # validation and of the last step
    assert [type(c) for c in callbacks] == [RunSummary, PaddingRatioMonitor, StragglerMonitor, MixtureMonitor,
                                            BalanceProgressBar, ModelCheckpoint, LastStepCheckpoint]
    assert trainer.progress_bar_callback is callbacks[4]
    assert (trainer.world_size, trainer.max_steps, trainer.accumulate_grad_batches) == (2, 40, 1)
    assert trainer.val_check_interval == 20 and trainer.limit_val_batches == 4
    # a metrics file and a checkpoint, both in the run's directory
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    assert run_dir.parent.parent == tmp_path / "outputs" / "train"
    assert isinstance(trainer.logger, CSVLogger) and Path(trainer.logger.log_dir) == run_dir / "logs"
    assert trainer.checkpoint_callback is not None and Path(trainer.default_root_dir) == run_dir
    assert type(trainer.strategy).__name__ == "DDPStrategy" and trainer.strategy.root_device.type == "cpu"


@pytest.mark.parametrize("config_name,run_dir", [("config", "outputs/train/"),
                                                 ("straggler_feedback", "outputs/straggler_feedback/")])
def test_hydra_runs_every_rank_in_the_launch_directory(config_name, run_dir):
    # Lightning's DDP launcher starts the other ranks in the launch directory with hydra.run.dir of rank 0;
    # chdir=false keeps rank 0 there too, so relative paths mean the same on every rank
    hydra_cfg = _compose(config_name=config_name, return_hydra_config=True).hydra
    assert hydra_cfg.job.chdir is False
    assert OmegaConf.to_container(hydra_cfg.run)["dir"].startswith(run_dir)  # under the git-ignored outputs/


# per group option: overrides that let it build on a CPU-only machine
_CPU_OVERRIDES = {
    ("trainer", "gpu_ddp"): ["trainer.accelerator=cpu", "trainer.devices=2"],
}


@pytest.mark.parametrize("group,option", [(g, o) for g in HYDRA_GROUPS for o in _options(g)])
def test_every_group_option_builds(group, option, tmp_path, monkeypatch, corpus_file):
    monkeypatch.chdir(tmp_path)
    overrides = [f"{group}={option}" if group != "callbacks" else f"callbacks=[{option}]",
                 *_CPU_OVERRIDES.get((group, option), [])]
    if group == "data" and option in BUILD_OVERRIDES:
        overrides += BUILD_OVERRIDES[option](tmp_path)
    elif group == "data" and OmegaConf.is_missing(OmegaConf.load(CONF / "data" / f"{option}.yaml"), "corpus"):
        overrides.append(f"data.corpus={corpus_file}")
    dm, model, callbacks, trainer = _build(_compose(overrides), tmp_path)
    assert isinstance(dm, BalancedTextDataModule) and isinstance(model, DemoTransformerLM)
    assert isinstance(trainer, L.Trainer) and all(isinstance(c, L.Callback) for c in callbacks)
    if group == "callbacks":
        assert len(callbacks) == (2 if option == "checkpoints" else 1)
    if (group, option) == ("trainer", "gpu_ddp"):
        assert trainer.precision == "bf16-mixed" and trainer.max_steps == 1000


def test_straggler_feedback_config_holds_the_demo_settings():
    cfg = _compose(["epochs=2", "num_docs=300", "json=out.json"], config_name="straggler_feedback")
    assert OmegaConf.to_container(cfg) == {"devices": 2, "epochs": 2, "num_docs": 300, "max_tokens": 1024,
                                           "d_model": 128, "slow_rank": 1, "slowdown": 0.5, "json": "out.json"}
    assert "data" not in _compose(config_name="straggler_feedback")  # no groups of the main job


def test_data_files_builds_and_tokenizes(tmp_path, corpus_file):
    cfg = _compose(["data=files", f"data.corpus={corpus_file}", "data.num_workers=0"])
    dm = instantiate(cfg.data, cache_dir=str(tmp_path / "cache"))
    dm.prepare_data()
    dm.setup("fit")
    assert dm.source.kind == "files" and len(dm.train_dataset) + len(dm.val_dataset) == 60
    assert dm.cost_model == CostModel(linear=1.0, quadratic=0.001, per_batch=0.0)  # a nested _target_ node


def _megatron_overrides(tmp_path: Path) -> list[str]:
    from tests.data._stores import VOCAB, documents, write_megatron

    prefix = write_megatron(tmp_path / "store" / "corpus", documents())
    return [f"data.corpus.prefixes=[{prefix}]", f"data.vocab_size={VOCAB}", "data.pad_token_id=0"]


def _arrow_overrides(tmp_path: Path) -> list[str]:
    from tests.data._stores import VOCAB, documents, write_save_to_disk

    path = write_save_to_disk(tmp_path / "store" / "saved", documents())
    return [f"data.corpus.paths=[{path}]", f"data.vocab_size={VOCAB}", "data.pad_token_id=0"]


#: data configs of tokenized stores -> the overrides that point them at a store written by its own producer
STORE_CONFIGS = {"megatron": _megatron_overrides, "arrow": _arrow_overrides}


def _datatrove_overrides(tmp_path: Path) -> list[str]:
    """A datatrove store written by datatrove's DocumentTokenizer (lit-balance tokenize); it names its tokenizer, so
    vocab_size and pad_token_id need not be given."""
    from lit_balance.cli.tokenize import tokenize_corpus

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(f'{{"text": "document {i} {"word " * (i % 37 + 1)}"}}\n' for i in range(60)))
    result = tokenize_corpus(corpus, tmp_path / "tokens", tasks=1, workers=1)
    return [f"data.corpus.paths={result.output_folder}"]


def _mixture_overrides(tmp_path: Path) -> list[str]:
    """Two text files as the mixture's two components."""
    paths = []
    for name in ("web", "code"):
        path = tmp_path / f"{name}.txt"
        path.write_text("\n".join(f"{name} {i} " + "word " * (i % 23 + 1) for i in range(40)), encoding="utf-8")
        paths.append(f"data.corpus.components.{name}.corpus={path}")
    return paths


def _stream_overrides(tmp_path: Path) -> list[str]:
    """A glob of two JSONL files as the stream's source."""
    for k in range(2):
        (tmp_path / f"part{k}.jsonl").write_text("".join(f'{{"text": "document {k} {i} {"word " * (i % 29 + 1)}"}}\n'
                                                         for i in range(150)))
    return [f"data.corpus.source={tmp_path}/part*.jsonl"]


#: every data config that reads a store (the datatrove one needs no vocab_size), the mixture's components, the stream
BUILD_OVERRIDES = {**STORE_CONFIGS, "datatrove": _datatrove_overrides, "mixture": _mixture_overrides,
                   "mixture_schedule": _mixture_overrides, "stream": _stream_overrides}


def test_data_stream_config_reads_its_files_window_by_window(tmp_path):
    cfg = _compose(["data=stream", *_stream_overrides(tmp_path), "data.window_documents=64", "data.val_documents=10"])
    dm = instantiate(cfg.data, cache_dir=str(tmp_path / "cache"))
    dm.prepare_data()
    dm.setup("fit")
    trained = [i for b in dm.train_dataloader() for i, f in zip(b["indices"].tolist(), b["is_fill"].tolist())
               if not f]
    assert sorted(trained) == list(range(10, 300)) and dm.stream.source.files == (
        str(tmp_path / "part0.jsonl"), str(tmp_path / "part1.jsonl"))
    assert sum(len(b["indices"]) for b in dm.val_dataloader()[0]) == 10  # the first 10 documents validate
    assert not (tmp_path / "cache").exists()  # nothing tokenized before training or cached


@pytest.mark.parametrize("option", sorted(STORE_CONFIGS))
def test_data_store_configs_train_from_the_store_in_place(option, tmp_path):
    cfg = _compose([f"data={option}", *STORE_CONFIGS[option](tmp_path), "data.num_workers=0", "data.max_tokens=256"])
    dm = instantiate(cfg.data, cache_dir=str(tmp_path / "cache"))
    dm.prepare_data()
    dm.setup("fit")
    assert dm.source.kind == option and dm.vocab_size == 500 and dm.train_dataset.store is dm.source.store
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].max() < 500 and not (tmp_path / "cache").exists()  # nothing tokenized or cached
    with pytest.raises(MissingMandatoryValue, match="vocab_size"):
        instantiate(_compose([f"data={option}", *STORE_CONFIGS[option](tmp_path)[:1]]).data)


def test_mandatory_values_must_be_set(corpus_file):
    with pytest.raises(MissingMandatoryValue, match="corpus"):
        instantiate(_compose(["data=files"]).data)
    with pytest.raises(MissingMandatoryValue, match="vocab_size"):
        instantiate(_compose().model)  # the recipe passes vocab_size=dm.vocab_size


def test_key_and_group_overrides():
    cfg = _compose(["trainer.devices=4", "data.max_tokens=8192"])
    assert cfg.trainer.devices == 4 and cfg.data.max_tokens == 8192 and cfg.trainer.accelerator == "cpu"
    cfg = _compose(["trainer=gpu_ddp", "trainer.devices=8", "trainer.num_nodes=2"])
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.trainer.num_nodes) == ("gpu", 8, 2)
    cfg = _compose(["trainer=gpu_ddp", "experiment=budget_4k"])
    assert (cfg.trainer.accelerator, cfg.trainer.max_steps, cfg.data.max_tokens) == ("gpu", 20, 4096)
    # an experiment overrides the groups, the command line overrides the experiment, whatever the order
    cfg = _compose(["trainer.max_steps=7", "experiment=smoke"])
    assert cfg.trainer.max_steps == 7 and cfg.model.d_model == 32 and cfg.data.max_tokens == 512
    assert cfg.data.max_length == 256  # untouched by the experiment
    assert not _compose(["callbacks=[]"]).get("callbacks")
    cfg = _compose(["callbacks=[run_summary,straggler_monitor,cost_feedback]"])
    assert list(cfg.callbacks) == ["run_summary", "straggler_monitor", "cost_feedback"]  # named, in list order
    cfg = _compose(["+trainer.fast_dev_run=true", "++data.max_tokens=2048", "~trainer.logger", "+model.extra=[1,2]"])
    assert cfg.trainer.fast_dev_run is True and cfg.data.max_tokens == 2048 and "logger" not in cfg.trainer
    assert list(cfg.model.extra) == [1, 2]
    cfg = _compose(["data.corpus=null", "model.lr=3e-4", "data.corpus=data/*.jsonl"])
    assert cfg.data.corpus == "data/*.jsonl" and cfg.model.lr == pytest.approx(3e-4)
    assert _compose(["seed=5"]).data.seed == 5  # ${seed} interpolation


@pytest.mark.parametrize("override,error,match", [
    ("trainer.devicez=4", ConfigCompositionException,
     r"Could not override 'trainer\.devicez'(?s:.*)\+trainer\.devicez=4"),
    ("trainer=tpu_pod", MissingConfigException, r"Could not find 'trainer/tpu_pod'(?s:.*)cpu_ddp"),
    ("callbacks=[run_summary,nope]", MissingConfigException, r"Could not load 'callbacks/nope'"),
    ("+trainer=gpu_ddp", ConfigCompositionException, r"Multiple values for trainer"),
    ("+seed=1", ConfigCompositionException, r"An item is already at 'seed'"),
    ("devices", OverrideParseException, r"Error parsing override 'devices'"),
    ("~trainer.nothing", ConfigCompositionException, r"'trainer\.nothing' does not exist"),
])
def test_bad_overrides_raise_hydras_errors(override, error, match):
    with pytest.raises(error, match=match):
        _compose([override])


def test_a_target_rejecting_its_arguments_names_the_target():
    cfg = _compose(["model.d_model=30"])  # num_heads=4 does not divide it
    with pytest.raises(InstantiationException,
                       match=r"Error in call to target 'lit_balance\.[\w.]+'(?s:.*)d_model \(30\) must be divisible"):
        instantiate(cfg.model, vocab_size=10)


def test_data_skip_steps_reaches_the_datamodule_from_a_hydra_override(tmp_path, corpus_file):
    assert _compose(["data=files", f"data.corpus={corpus_file}"]).data.skip_steps is None
    cfg = _compose(["data=files", f"data.corpus={corpus_file}", "data.skip_steps=[[3,5],[8,9]]"])
    dm = instantiate(cfg.data, cache_dir=str(tmp_path / "cache"))
    assert dm.skip_steps == [(3, 5), (8, 9)]
    bad = _compose(["data=files", f"data.corpus={corpus_file}", "data.skip_steps=[[5,3]]"])
    with pytest.raises(InstantiationException, match=r"skip_steps range \(5, 3\)"):
        instantiate(bad.data, cache_dir=str(tmp_path / "cache"))


def test_data_max_length_schedule_reaches_the_datamodule_from_a_hydra_override(tmp_path, corpus_file):
    assert _compose(["data=files", f"data.corpus={corpus_file}"]).data.max_length_schedule is None
    cfg = _compose(["data=files", f"data.corpus={corpus_file}", "data.max_length=null",
                    "data.max_length_schedule=[[0,32],[10,128]]"])
    dm = instantiate(cfg.data, cache_dir=str(tmp_path / "cache"))
    assert dm.max_length_schedule.points_as_given() == [(0, 32), (10, 128)]
    kept = _compose(["data=files", f"data.corpus={corpus_file}", "data.max_length_schedule=[[0,32]]"])
    with pytest.raises(InstantiationException, match=r"max_length=\d+.*max_length=None"):
        instantiate(kept.data, cache_dir=str(tmp_path / "cache"))
