"""BalancedTextDataModule on a Mixture, in one process: one class whatever the corpus (a user's subclass too), one
tokenizer checked across components, the per-component validation loaders, the plan summary's shares and the errors
of bad mixtures."""

import numpy as np
import pytest

from lit_balance import BalancedTextDataModule, Mixture
from lit_balance.sampler.mixture import MixtureBatchSampler


def _docs(num, low, high, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 90, size=int(rng.integers(low, high))).tolist() for _ in range(num)]


def test_a_mixture_corpus_trains_every_component_in_its_share(tmp_path):
    corpus = {"components": {"short": {"corpus": _docs(120, 4, 20, 0), "weight": 0.5},
                             "long": {"corpus": _docs(60, 30, 60, 1), "weight": 0.5}}}
    dm = BalancedTextDataModule(corpus, vocab_size=100, pad_token_id=0, max_tokens=256, max_length=64,
                                val_fraction=0.1, cache_dir=tmp_path, seed=3)
    assert type(dm) is BalancedTextDataModule and dm.mixture.names == ("short", "long")
    assert dm.corpus_description == "mixture of short 0.5, long 0.5 (shares of tokens)"
    dm.prepare_data()
    dm.setup("fit")
    assert dm.val_names == ["short", "long"] and len(dm.val_dataloader()) == 2
    seen = {0: 0, 1: 0}
    for batch in dm.train_dataloader():
        rows = batch["attention_mask"].sum(dim=1).numpy()
        tokens = dm.component_tokens(batch["indices"].numpy(), batch["is_fill"].numpy(), rows)
        seen[0] += int(tokens[0])
        seen[1] += int(tokens[1])
    longest = int(dm.train_dataset.lengths.max())
    assert abs(seen[0] - seen[1]) <= 2 * longest  # each within one document of half
    summary = dm.plan_summary(num_replicas=2)
    assert summary["mixture"]["names"] == ["short", "long"] and summary["balanced"]["optimizer_steps"] > 0
    assert "mixture" in dm.state_dict()["train_sampler"]


def test_a_subclass_given_a_mixture_plans_the_mixture(tmp_path):
    class MyData(BalancedTextDataModule):
        pass

    corpus = {"components": {"short": {"corpus": _docs(60, 4, 20, 0), "weight": 1},
                             "long": {"corpus": _docs(30, 30, 60, 1), "weight": 1}}}
    dm = MyData(corpus, vocab_size=100, pad_token_id=0, max_tokens=256, max_length=64, val_fraction=0.1,
                cache_dir=tmp_path)
    dm.setup("fit")
    assert type(dm) is MyData and isinstance(dm.train_sampler, MixtureBatchSampler)
    assert dm.train_sampler.num_components == 2 and dm.val_names == ["short", "long"]


def test_one_corpus_is_a_blend_of_one_named_train(tmp_path):
    dm = BalancedTextDataModule(_docs(40, 4, 20, 0), vocab_size=100, pad_token_id=0, max_tokens=256,
                                val_fraction=0.1, cache_dir=tmp_path)
    assert dm.mixture.names == ("train",) and dm.mixture.plain
    dm.setup("fit")
    assert dm.val_names == ["train"] and len(dm.val_dataloader()) == 1
    assert dm.train_sampler.num_components == 1 and "mixture" not in dm.state_dict()["train_sampler"]


def test_max_documents_beside_a_mixture_names_both_settings(tmp_path):
    corpus = Mixture({"a": (["x y"], 1), "b": (["z"], 1)})
    with pytest.raises(ValueError, match=r"max_documents=5 cannot bound a Mixture corpus .*'max_documents': n"):
        BalancedTextDataModule(corpus, max_documents=5, cache_dir=tmp_path)


def test_components_of_different_vocabularies_are_refused_before_reading(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("some words here\nmore words\n")
    mixture = Mixture({"text": (text, 1.0), "ids": ([[5, 6, 7], [8, 9]], 1.0)})
    with pytest.raises(ValueError, match=r"components 'text' and 'ids' differ in vocabulary or pad id"):
        BalancedTextDataModule(mixture, cache_dir=tmp_path)
    assert not any(tmp_path.glob("**/*.npy"))  # nothing tokenized


@pytest.mark.parametrize("components, match", [
    ({"a": {"corpus": ["x"], "weight": -1}}, r"weight of component 'a' must be finite and >= 0"),
    ({"a": {"corpus": ["x"], "weight": 0}, "b": {"corpus": ["y"], "weight": 0}}, r"weights of the mixture sum to 0"),
    ({"a": {"weight": 1}}, r"component 'a' must have 'corpus' and 'weight'"),
])
def test_bad_mixtures_name_the_setting(components, match):
    with pytest.raises(ValueError, match=match):
        Mixture(components)


def test_lightning_cli_takes_a_mixture_as_data_corpus(tmp_path, monkeypatch):
    import json

    from lit_balance.cli.app import LitBalanceCLI
    from lit_balance.demo import DemoTransformerLM

    monkeypatch.chdir(tmp_path)
    for name in ("web", "code"):
        (tmp_path / f"{name}.txt").write_text("\n".join(f"{name} {i} " + "word " * (i % 9 + 1) for i in range(30)))
    corpus = {"components": {"web": {"corpus": str(tmp_path / "web.txt"), "weight": 0.7},
                             "code": {"corpus": str(tmp_path / "code.txt"), "weight": 0.3}}}
    cli = LitBalanceCLI(DemoTransformerLM, BalancedTextDataModule, run=False, seed_everything_default=0,
                        args=["--data.corpus", json.dumps(corpus), "--data.cache_dir", str(tmp_path / "cache"),
                              "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.logger", "false"])
    assert type(cli.datamodule) is BalancedTextDataModule and cli.datamodule.mixture.names == ("web", "code")
    assert cli.datamodule.mixture.settings.shares.tolist() == pytest.approx([0.7, 0.3])


@pytest.mark.e2e
def test_max_tokens_auto_measures_one_budget_for_the_mixture_and_trains(tmp_path):
    import resource

    import lightning as L

    from lit_balance.demo import DemoTransformerLM

    corpus = {"components": {"short": {"corpus": _docs(200, 4, 30, 0), "weight": 0.6},
                             "long": {"corpus": _docs(80, 40, 120, 1), "weight": 0.4}}}
    limit = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 + (600 << 20)  # bytes: 600 MiB above the peak
    dm = BalancedTextDataModule(corpus, vocab_size=100, pad_token_id=0, max_tokens="auto", memory_limit=limit,
                                max_length=128, cache_dir=tmp_path, seed=1)
    assert dm.mixture.names == ("short", "long") and dm.max_tokens == "auto"
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(DemoTransformerLM(vocab_size=dm.vocab_size), datamodule=dm)
    assert trainer.global_step == 3 and isinstance(dm.max_tokens, int) and dm.max_tokens >= 128
    assert dm.token_budget is not None and dm.token_budget.max_tokens == dm.max_tokens
    assert dm.train_dataloader().sampler.settings.max_tokens == dm.max_tokens  # the plan uses the measured budget
