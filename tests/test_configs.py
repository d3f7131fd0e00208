"""Every YAML in conf/ loads and builds; composition, overrides and instantiate follow Hydra's semantics."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import lightning as L
import pytest
import yaml
from omegaconf import OmegaConf

from lit_balance import BalancedTextDataModule, TransformerLM
from lit_balance.callbacks import RunSummary
from lit_balance.config import compose, instantiate, locate
from lit_balance.cost import CostModel

CONF = Path(__file__).resolve().parents[1] / "conf"
HYDRA_GROUPS = ("data", "model", "trainer", "callbacks", "experiment")
ALL_YAML = sorted(CONF.rglob("*.yaml"))
# keys that need no comment: import paths and headers of nested mappings
_UNCOMMENTED = re.compile(r"^\s*(-\s+)?(_target_|class_path|init_args|defaults|[\w.]+:\s*$)")


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture
def corpus_file(tmp_path: Path) -> Path:
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(f"document {i} " + "word " * (i % 37 + 1) for i in range(60)), encoding="utf-8")
    return path


def test_conf_has_the_groups_and_a_base_config():
    assert (CONF / "config.yaml").is_file()
    for group in HYDRA_GROUPS:
        assert _options(group), f"conf/{group}/ has no options"
    assert {"cpu_ddp", "gpu_ddp"} <= set(_options("trainer"))
    assert (CONF / "cli" / "fit_cpu.yaml").is_file()


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


def _build(cfg, tmp_path: Path):
    dm = instantiate(cfg.data, cache_dir=str(tmp_path / "cache"))
    model = instantiate(cfg.model, vocab_size=dm.vocab_size)
    callbacks = list((instantiate(cfg.callbacks) or {}).values())
    trainer = instantiate(cfg.trainer, callbacks=callbacks)
    return dm, model, callbacks, trainer


def test_base_config_is_the_main_job(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose("config", config_dir=CONF)
    dm, model, callbacks, trainer = _build(cfg, tmp_path)
    assert isinstance(dm, BalancedTextDataModule) and isinstance(model, TransformerLM)
    assert (dm.max_tokens, dm.max_length, dm.val_fraction, dm.seed) == (1024, 256, 0.02, 0)
    assert dm.source.kind == "builtin"
    assert model.hparams.vocab_size == dm.vocab_size == 30522 and model.hparams.d_model == 128
    assert [type(c) for c in callbacks] == [RunSummary]
    assert (trainer.world_size, trainer.max_steps, trainer.accumulate_grad_batches) == (2, 40, 1)
    assert trainer.val_check_interval == 20 and trainer.limit_val_batches == 4
    assert trainer.logger is None and trainer.checkpoint_callback is None
    assert type(trainer.strategy).__name__ == "DDPStrategy" and trainer.strategy.root_device.type == "cpu"


# per group option: overrides that let it build on a CPU-only machine
_CPU_OVERRIDES = {
    ("trainer", "gpu_ddp"): ["trainer.accelerator=cpu", "trainer.devices=2"],
}


@pytest.mark.parametrize("group,option", [(g, o) for g in HYDRA_GROUPS for o in _options(g)])
def test_every_group_option_builds(group, option, tmp_path, monkeypatch, corpus_file):
    monkeypatch.chdir(tmp_path)
    overrides = [f"{group}={option}" if group != "callbacks" else f"callbacks=[{option}]",
                 *_CPU_OVERRIDES.get((group, option), [])]
    if group == "data" and OmegaConf.is_missing(OmegaConf.load(CONF / "data" / f"{option}.yaml"), "corpus"):
        overrides.append(f"data.corpus={corpus_file}")
    cfg = compose("config", overrides, config_dir=CONF)
    dm, model, callbacks, trainer = _build(cfg, tmp_path)
    assert isinstance(dm, BalancedTextDataModule) and isinstance(model, TransformerLM)
    assert isinstance(trainer, L.Trainer) and all(isinstance(c, L.Callback) for c in callbacks)
    if group == "callbacks":
        assert len(callbacks) == 1
    if (group, option) == ("trainer", "gpu_ddp"):
        assert trainer.precision == "bf16-mixed" and trainer.max_steps == 1000


def test_data_files_builds_and_tokenizes(tmp_path, corpus_file):
    cfg = compose("config", ["data=files", f"data.corpus={corpus_file}", "data.num_workers=0"], config_dir=CONF)
    dm = instantiate(cfg.data, cache_dir=str(tmp_path / "cache"))
    dm.prepare_data()
    dm.setup("fit")
    assert dm.source.kind == "files" and len(dm.train_dataset) + len(dm.val_dataset) == 60
    assert dm.cost_model == CostModel(linear=1.0, quadratic=0.001, per_batch=0.0)  # a nested _target_ node


def test_dotlist_and_group_overrides():
    cfg = compose("config", ["trainer.devices=4", "data.max_tokens=8192"], config_dir=CONF)
    assert cfg.trainer.devices == 4 and cfg.data.max_tokens == 8192 and cfg.trainer.accelerator == "cpu"
    cfg = compose("config", ["trainer=gpu_ddp", "trainer.devices=8", "trainer.num_nodes=2"], config_dir=CONF)
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.trainer.num_nodes) == ("gpu", 8, 2)
    # an experiment overrides the groups, the command line overrides the experiment, whatever the order
    cfg = compose("config", ["trainer.max_steps=7", "experiment=smoke"], config_dir=CONF)
    assert cfg.trainer.max_steps == 7 and cfg.model.d_model == 32 and cfg.data.max_tokens == 512
    assert cfg.data.max_length == 256  # untouched by the experiment
    cfg = compose("config", ["callbacks=[]"], config_dir=CONF)
    assert "callbacks" not in cfg or not cfg.callbacks
    cfg = compose("config", ["+trainer.fast_dev_run=true", "++data.max_tokens=2048", "~trainer.logger",
                             "+model.extra=[1,2]"], config_dir=CONF)
    assert cfg.trainer.fast_dev_run is True and cfg.data.max_tokens == 2048 and "logger" not in cfg.trainer
    assert list(cfg.model.extra) == [1, 2]
    cfg = compose("config", ["data.corpus=null", "model.lr=3e-4"], config_dir=CONF)
    assert cfg.data.corpus is None and cfg.model.lr == pytest.approx(3e-4)
    assert compose("config", ["seed=5"], config_dir=CONF).data.seed == 5  # ${seed} interpolation


@pytest.mark.parametrize("override,match", [
    ("trainer.devicez=4", r"no such key.*\+trainer\.devicez=4"),
    ("trainer=tpu_pod", r"no option 'tpu_pod' in config group 'trainer'.*cpu_ddp"),
    ("+trainer=gpu_ddp", r"already in the defaults list"),
    ("+seed=1", r"the key exists"),
    ("devices", r"key=value"),
    ("~trainer.nothing", r"cannot delete"),
])
def test_bad_overrides_raise(override, match):
    with pytest.raises(ValueError, match=match):
        compose("config", [override], config_dir=CONF)


def test_bad_config_dir_or_name_raise(tmp_path):
    with pytest.raises(ValueError, match="primary config"):
        compose("nope", config_dir=CONF)
    (tmp_path / "g").mkdir()
    (tmp_path / "config.yaml").write_text("defaults:\n  - g: a\n  - _self_\nx: 1\n")
    (tmp_path / "g" / "a.yaml").write_text("defaults:\n  - override /h: b\n")
    with pytest.raises(ValueError, match="defaults lists inside group files"):
        compose("config", config_dir=tmp_path)
    with pytest.raises(TypeError, match="override must be a string"):
        compose("config", [3], config_dir=CONF)


def test_self_position_decides_who_wins(tmp_path):
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "a.yaml").write_text("x: 1\ny: 1\n")
    (tmp_path / "g" / "b.yaml").write_text("# @package _global_\ntop: 3\n")
    (tmp_path / "first.yaml").write_text("defaults:\n  - _self_\n  - g: a\ng:\n  x: 2\n")
    (tmp_path / "last.yaml").write_text("defaults:\n  - g: a\ng:\n  x: 2\n")  # no _self_: at the end
    assert compose("first", config_dir=tmp_path).g.x == 1
    assert compose("last", config_dir=tmp_path).g.x == 2
    assert compose("last", ["g=b"], config_dir=tmp_path).top == 3


class _Pair:
    def __init__(self, a, b=0):
        self.a, self.b = a, b


def test_instantiate_semantics():
    pair = f"{__name__}._Pair"
    node = OmegaConf.create({"seed": 3, "obj": {"_target_": pair, "a": {"_target_": pair, "a": "${seed}"}, "b": [1]}})
    obj = instantiate(node.obj)
    assert isinstance(obj.a, _Pair) and obj.a.a == 3 and obj.b == [1] and type(obj.b) is list
    flat = instantiate(node.obj, _recursive_=False)
    assert flat.a == {"_target_": pair, "a": 3}
    part = instantiate({"_target_": pair, "_partial_": True, "b": 2})
    assert isinstance(part, functools.partial) and part(5).a == 5 and part(5).b == 2
    assert instantiate({"_target_": pair, "_args_": [7]}).a == 7
    assert instantiate({"_target_": pair}, 8, b=9).b == 9
    built = instantiate({"x": {"_target_": pair, "a": 1}, "y": 2})
    assert isinstance(built["x"], _Pair) and built["y"] == 2
    assert instantiate(None) is None
    assert locate("lightning.Trainer") is L.Trainer


@pytest.mark.parametrize("node,error,match", [
    ({"_target_": "lit_balance.NoSuchThing"}, ImportError, "no attribute 'NoSuchThing'"),
    ({"_target_": "no_such_package_xyz.Thing"}, ImportError, "no module named"),
    ({"_target_": f"{__name__}._Pair", "a": "???"}, ValueError, "mandatory"),
    ({"_target_": f"{__name__}._Pair", "a": 1, "_convert_": "sometimes"}, ValueError, "_convert_"),
    ({"_target_": f"{__name__}._Pair", "a": 1, "_partial_": "yes"}, TypeError, "_partial_"),
    ({"_target_": f"{__name__}._Pair", "c": 1}, TypeError, r"while instantiating '.*_Pair'"),
    ({"_target_": "lit_balance.TransformerLM", "vocab_size": 10, "d_model": 30, "num_heads": 4}, ValueError,
     "divisible"),
])
def test_instantiate_errors(node, error, match):
    with pytest.raises(error, match=match):
        instantiate(node)


def test_hydra_composes_and_instantiates_our_conf(tmp_path, monkeypatch, corpus_file):
    hydra = pytest.importorskip("hydra")
    from hydra.utils import instantiate as hydra_instantiate

    monkeypatch.chdir(tmp_path)
    for overrides in ([], ["trainer=gpu_ddp", "trainer.devices=4", "experiment=smoke", "data.max_tokens=2048"]):
        with hydra.initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            theirs = hydra.compose(config_name="config", overrides=overrides)
        ours = compose("config", overrides, config_dir=CONF)
        assert OmegaConf.to_container(theirs, resolve=True) == OmegaConf.to_container(ours, resolve=True)
    with hydra.initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hydra.compose(config_name="config", overrides=["experiment=smoke"])
    dm = hydra_instantiate(cfg.data, cache_dir=str(tmp_path / "cache"))
    model = hydra_instantiate(cfg.model, vocab_size=dm.vocab_size)
    callbacks = list(hydra_instantiate(cfg.callbacks).values())
    trainer = hydra_instantiate(cfg.trainer, callbacks=callbacks)
    assert isinstance(dm, BalancedTextDataModule) and dm.max_tokens == 512 and dm.seed == 0
    assert isinstance(model, TransformerLM) and model.hparams.d_model == 32
    assert isinstance(callbacks[0], RunSummary) and trainer.max_steps == 3
    with hydra.initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hydra.compose(config_name="config", overrides=["data=files", f"data.corpus={corpus_file}",
                                                            "callbacks=[padding_monitor,straggler_monitor]"])
    dm = hydra_instantiate(cfg.data, cache_dir=str(tmp_path / "cache"))
    assert dm.cost_model == CostModel(linear=1.0, quadratic=0.001) and dm.source.kind == "files"
    assert len(hydra_instantiate(cfg.callbacks)) == 2
