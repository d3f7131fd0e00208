"""The families of 2-rank test fits, in turn, in one pair of processes started as users start them.

Run: LAUNCHER_FITS_OUT=DIR LAUNCHER_FITS_STORE=MEGATRON_PREFIX LAUNCHER_FITS_DATATROVE=FOLDER \
     python tests/ddp/launcher_fits.py
Nothing forks here: the first fit's ``Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(...))`` has
Lightning's own launcher start this script again as rank 1, and both processes run every step of :data:`STEPS` in
turn: a fit script's ``main()`` with its arguments, its output folder ``DIR/<family>`` first, writing its records there
as under the fork rig (``test_launcher_ddp.py`` checks them with the fork rig's own tests). The folders come from the
environment, since Lightning's launcher starts rank 1 with the ``sys.argv`` of the moment.
"""

import importlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parents[1] / "lightning" / "callbacks"))  # fit_phases.py

#: (family, fit script, its arguments after the output folder, the checkpoint copied in from another family's folder
#: first, whether the step stops with an error on every rank on purpose)
STEPS = [
    ("record", "fit_record", ["0", "0"], None, False),
    ("callbacks", "fit_callbacks", ["fixed"], None, False),
    ("packed", "fit_packed", ["{out}/cache", "fixed"], None, False),
    ("masked", "fit_masked", ["jsonl-plan"], None, False),
    ("mapstyle", "fit_mapstyle", ["classify", "1", "0"], None, False),
    ("fsdp2", "fit_model_parallel", ["2", "1", "fsdp2"], None, False),
    ("fabric", "fabric_world", ["ddp"], None, False),
    ("budget", "fit_budget", ["300"], None, False),
    ("resume", "fit_resume", ["stop", "2", "2", "2"], None, False),
    ("resume", "fit_resume", ["resume", "2", "2", "2"], None, False),
    ("resume", "fit_resume", ["resume_fail", "2", "2", "2"], None, False),
    ("store", "fit_store", ["megatron", "{store}", "full", "2"], None, False),
    ("store", "fit_store", ["megatron", "{store}", "stop", "2"], None, False),
    ("store", "fit_store", ["megatron", "{store}", "resume", "2"], None, False),
    ("datatrove", "fit_datatrove", ["full", "2", "1", "{datatrove}"], None, False),
    ("mapstyle_whole", "fit_mapstyle_resume", ["whole"], None, False),
    ("mapstyle_stop", "fit_mapstyle_resume", ["stop"], None, False),
    ("mapstyle_resume_fail", "fit_mapstyle_resume", ["resume_fail"], "mapstyle_stop/fail.ckpt", False),
    ("phases", "fit_phases", ["3.0", "3.0", "3.0"], None, False),
    ("disagree", "fit_disagree", [], None, True),
]


def main() -> None:
    root, store = Path(os.environ["LAUNCHER_FITS_OUT"]), os.environ["LAUNCHER_FITS_STORE"]
    datatrove = os.environ["LAUNCHER_FITS_DATATROVE"]
    script, seconds = sys.argv[0], []
    for family, module, args, checkpoint, fails in STEPS:
        out = root / family
        out.mkdir(exist_ok=True)
        if checkpoint is not None:  # rank 0 copies it while rank 1 waits (the process group is up by now)
            if dist.get_rank() == 0:
                shutil.copy(root / checkpoint, out)
            dist.barrier()
        sys.argv = [script, str(out), *(a.format(out=out, store=store, datatrove=datatrove) for a in args)]
        start = time.perf_counter()
        try:
            fit = importlib.import_module(module).main
            fit(*sys.argv[1:2], *map(float, sys.argv[2:])) if module == "fit_phases" else fit()
        except Exception:  # noqa: BLE001  the error the step ends with on every rank, on purpose
            if not fails:
                raise
        else:
            assert not fails, f"{module} {args} was to stop with an error"
        seconds.append([family, args, time.perf_counter() - start])
    (root / f"seconds_rank{dist.get_rank()}.json").write_text(json.dumps(seconds))


if __name__ == "__main__":
    main()
