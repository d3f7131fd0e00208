"""``lit-balance plan`` and ``fit`` on tokenized stores read in place (a Megatron store written by megatron-core)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from lit_balance import BalancedBatchSampler, BalancedTextDataModule
from lit_balance.cli import main
from lit_balance.data.stores import MegatronSource
from tests.data._stores import VOCAB, documents, write_megatron

ROOT = Path(__file__).resolve().parents[2]
FIT_CPU = ROOT / "conf" / "cli" / "fit_cpu.yaml"


@pytest.fixture(autouse=True)
def _program_name_only(monkeypatch):
    """In-process main(args) sees no pytest arguments in sys.argv (as when run from the shell)."""
    monkeypatch.setattr(sys, "argv", ["lit-balance"])


def _corpus(prefix: Path) -> str:
    return json.dumps({"class_path": "lit_balance.data.stores.MegatronSource", "init_args": {"prefixes": [str(prefix)]}})


def test_plan_reads_a_megatron_store_in_place(tmp_path):
    docs = documents(300, seed=3)
    prefix = write_megatron(tmp_path / "store" / "corpus", docs)
    out = tmp_path / "out"
    main(["plan", "--corpus", _corpus(prefix), "--data-kwargs", json.dumps({"vocab_size": VOCAB, "pad_token_id": 0}),
          "--max-tokens", "128", "--max-length", "32", "--num-replicas", "2", "--val-fraction", "0",
          "--cache-dir", str(tmp_path / "cache"), "--plots", "false", "--output-dir", str(out)])
    summary = json.loads((out / "plan_summary.json").read_text())
    lengths = np.minimum([len(d) for d in docs if d], 32)
    sampler = BalancedBatchSampler(lengths, 128, num_replicas=2, rank=0)
    assert summary["num_samples"] == len(lengths)
    assert summary["balanced"]["micro_batches_per_rank"] == len(sampler)
    assert not (tmp_path / "cache").exists()  # nothing tokenized, nothing cached


def test_plan_takes_a_fit_config_whose_corpus_is_a_store(tmp_path):
    prefix = write_megatron(tmp_path / "store" / "corpus", documents(200, seed=4))
    config = yaml.safe_load(FIT_CPU.read_text())
    config["data"].update({"corpus": json.loads(_corpus(prefix)), "vocab_size": VOCAB, "pad_token_id": 0,
                           "max_length": 32, "max_tokens": 128, "cache_dir": str(tmp_path / "cache")})
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    main(["plan", "--config", str(path), "--plots", "false", "--output-dir", str(tmp_path / "out")])
    summary = json.loads((tmp_path / "out" / "plan_summary.json").read_text())
    dm = BalancedTextDataModule(MegatronSource(prefix), vocab_size=VOCAB, pad_token_id=0, max_length=32,
                                max_tokens=128, val_fraction=config["data"].get("val_fraction", 0.05),
                                seed=config["data"].get("seed", 0), cache_dir=tmp_path / "c2")
    dm.setup("fit")
    assert summary["balanced"]["micro_batches_per_rank"] == len(BalancedBatchSampler(dm.train_dataset.lengths, 128,
                                                                         num_replicas=2, rank=0))
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_fit_trains_from_a_megatron_store(tmp_path):
    prefix = write_megatron(tmp_path / "store" / "corpus", documents(200, seed=5))
    proc = subprocess.run([sys.executable, "-m", "lit_balance.cli", "fit", "--config", str(FIT_CPU),
                           f"--data.corpus={_corpus(prefix)}", f"--data.vocab_size={VOCAB}", "--data.pad_token_id=0",
                           "--data.max_tokens=256", "--data.num_workers=0", "--trainer.devices=1",
                           "--trainer.strategy=auto", "--trainer.max_steps=3", "--trainer.val_check_interval=3",
                           "--trainer.limit_val_batches=1"],
                          check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT),
                               "LIT_BALANCE_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "Megatron store corpus.bin" in proc.stdout + proc.stderr
    assert not (tmp_path / "cache").exists()
