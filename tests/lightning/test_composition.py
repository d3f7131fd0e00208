"""Every feature composes with every other: one corpus and a mixture of three components, each written by its own
producer (a Megatron store by megatron-core's IndexedDatasetBuilder, an Arrow file by pyarrow, a bounded Hugging Face
IterableDataset stream), crossed with the padded, packed, static packed and ``padded_shapes`` plans, int, per-rank and
``auto`` budgets, and 0 or 2 DataLoader workers.

Every case runs ``BalancedTextDataModule.setup`` and its training loaders on simulated ranks (one DataModule per rank,
a Trainer as ``data_parallel_world`` reads it) and checks: every micro-batch within its rank's budget and in its
layout's shape, equal counts on every rank, each mixture step within one document of its share, every document once
per epoch, and a mid-epoch stop on 2 ranks resumed exactly on 3 (the documents of the stopped and the resumed parts are
those of an uninterrupted epoch), also with ``skip_steps`` (those steps' micro-batches left out, the rest unchanged). ``auto`` plans with a measured budget restored from a checkpoint (as a resume does;
the probe itself runs in test_mixture_datamodule.py and tests/lightning/test_budget.py). Combinations that mean nothing
are refused, naming both settings, before any token is read.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from lit_balance import BalancedTextDataModule, BatchingSettings, Mixture
from lit_balance.data.stores import ArrowSource, MegatronSource
from lit_balance.lightning.budget import TokenBudget

from tests.data._stores import VOCAB, documents, write_arrow_ipc_file, write_megatron

datasets = pytest.importorskip("datasets")

STREAM_DOCS, STREAM_BOUND = 70, 55  # the stream holds more rows than its bound: reading stops at the bound
MAX_LENGTH, STOP_AT = 48, 2
LAYOUTS = {"padded": {}, "packed": {"packing": True}, "static_packed": {"packing": True, "static_packing": True},
           "padded_shapes": {"padded_shapes": 3}}
BUDGETS = {  # world size -> max_tokens
    "int": {2: 160, 3: 160},
    "per_rank": {2: [160, 224], 3: [160, 192, 224]},
    "auto": {2: "auto", 3: "auto"},
}
MEASURED = TokenBudget(max_tokens=160, per_rank=(160, 224), measured=(170, 230), capacity_bytes=(1 << 30, 1 << 31),
                       memory_fraction=0.9, coefficients=((0.0, 1.0, 0.0),) * 2, device="cpu", probe_seconds=0.1,
                       num_probes=4)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("composition")
    write_megatron(root / "megatron", documents(90, seed=3, longest=60, empty_every=0))
    write_arrow_ipc_file(root / "docs.arrow", documents(60, seed=4, longest=30, empty_every=0))
    return root


def _stream():
    rows = documents(STREAM_DOCS, seed=5, longest=50, empty_every=0)
    return datasets.Dataset.from_dict({"input_ids": rows}).to_iterable_dataset()


def _corpus(kind: str, root):
    if kind == "one":
        return MegatronSource(str(root / "megatron"))
    return Mixture({"megatron": {"corpus": MegatronSource(str(root / "megatron")), "weight": 0.5},
                    "arrow": {"corpus": ArrowSource(root / "docs.arrow"), "weight": 0.2},
                    "stream": {"corpus": _stream(), "weight": 0.3, "max_documents": STREAM_BOUND}})


def _ranks(kind, layout, budget, workers, world, root, state=None, skip_steps=None):
    """One DataModule per simulated rank, set up, with ``state`` (a DataModule state_dict) restored."""
    modules = []
    for rank in range(world):
        dm = BalancedTextDataModule(_corpus(kind, root), vocab_size=VOCAB, pad_token_id=0,
                                    max_tokens=BUDGETS[budget][world], max_length=MAX_LENGTH, val_fraction=0.1, seed=5,
                                    num_workers=workers, cache_dir=root / "cache", skip_steps=skip_steps,
                                    **LAYOUTS[layout])
        dm.trainer = SimpleNamespace(world_size=world, global_rank=rank, current_epoch=0, accumulate_grad_batches=1,
                                     strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": world,
                                                                                          "rank": rank}),
                                     state=SimpleNamespace(fn=None), lightning_module=None)
        dm.prepare_data()
        dm.setup("fit")
        if budget == "auto":  # the budget a probe measured, restored as a resume restores it
            dm.load_state_dict({"token_budget": MEASURED.to_dict()} if state is None else state)
        elif state is not None:
            dm.load_state_dict(state)
        modules.append(dm)
    return modules


def _check_batch(batch, dm, layout, budget):
    """The micro-batch's shape is its layout's and within this rank's budget; returns its real rows' indices."""
    shape = tuple(batch["input_ids"].shape)
    settings = dm.train_sampler.settings
    if layout == "padded":
        assert shape[0] * shape[1] <= budget
    elif layout == "padded_shapes":
        assert shape in settings.padded_shapes and shape[0] * shape[1] <= budget
    elif layout == "packed":
        assert shape[0] == 1 and shape[1] <= budget
    else:  # static packed: every row exactly the budget, a fixed number of document slots
        assert shape == (1, budget) and batch["cu_seq_lens_q"].shape[0] == settings.max_batch_size + 1
    fill = batch["is_fill"].numpy()
    return batch["indices"].numpy()[~fill].tolist()


def _run(modules, layout, steps=None, loaders=None):
    """Each rank's real rows per micro-batch, ``steps`` micro-batches (None: to the end of the epoch). ``loaders``
    keeps the loaders, as a training loop does while it runs: the DataModule's state counts what its loader handed to
    the loop (workers read ahead)."""
    world = len(modules)
    out = []
    for dm in modules:
        loader = dm.train_dataloader()  # max_tokens="auto": planned here, with the budget
        if loaders is not None:
            loaders.append(loader)
        budget = dm.train_sampler.settings.rank_max_tokens(world)[dm.train_sampler.rank]
        rows = []
        for batch in loader:
            rows.append(_check_batch(batch, dm, layout, budget))
            if steps is not None and len(rows) == steps:
                break
        out.append(rows)
    return out


def _check_shares(dm, per_rank):
    """Each optimizer step (one micro-batch per rank) holds each component within one document of the epoch's share."""
    sampler = dm.train_sampler
    lengths = np.asarray(sampler.lengths, dtype=np.int64)
    k = sampler.num_components
    units = np.zeros((len(per_rank[0]), k), dtype=np.int64)
    for rows in per_rank:
        for step, real in enumerate(rows):
            np.add.at(units[step], sampler.component_of(np.asarray(real, dtype=np.int64)), lengths[real])
    shares = units.sum(axis=0) / units.sum()
    assert (units.sum(axis=0) > 0).all()  # every component trained
    assert (np.abs(units - shares * units.sum(axis=1, keepdims=True)) <= lengths.max() + 1e-6).all()


def _case(kind, layout, budget, workers, root):
    full_ranks = _ranks(kind, layout, budget, workers, 2, root)
    full = _run(full_ranks, layout)
    assert len({len(rows) for rows in full}) == 1  # equal counts
    epoch = Counter(i for rows in full for real in rows for i in real)
    assert max(epoch.values()) == 1  # no document twice in an epoch
    dm = full_ranks[0]
    if kind == "one":
        assert sorted(epoch) == list(range(len(dm.train_dataset)))  # every document once
        assert dm.train_sampler.num_components == 1
    else:
        assert dm.train_sampler.num_components == 3 and dm.val_names == ["megatron", "arrow", "stream"]
        assert len(dm.corpus.corpora[2].lengths) == STREAM_BOUND  # the stream read to its bound
        # max_repetition=1: the limiting component is read whole, once; the others are subsampled
        read = np.bincount(dm.train_sampler.component_of(np.fromiter(epoch, np.int64)), minlength=3)
        assert (read == dm.train_dataset.layout.sizes).any()
        _check_shares(dm, full)
    # a new pass over the epoch, stopped after STOP_AT micro-batches on 2 ranks, resumed on 3
    stop_ranks = full_ranks
    running = []
    stopped = _run(stop_ranks, layout, steps=STOP_AT, loaders=running)
    state = stop_ranks[0].state_dict()
    assert all(m.state_dict() == state for m in stop_ranks)  # the same on every rank
    resumed = _run(_ranks(kind, layout, budget, workers, 3, root, state=state), layout)
    assert len({len(rows) for rows in resumed}) == 1
    after = Counter(i for rows in stopped + resumed for real in rows for i in real)
    assert after == epoch  # exactly the uninterrupted epoch's documents
    # resumed again with skip_steps (optimizer steps of the run; one micro-step each here): those steps' documents
    # are left out, every other step trains what the resumed plan has there
    assert len(resumed[0]) > 1
    skip = (STOP_AT + 1, STOP_AT + min(3, len(resumed[0])))
    skipped = _run(_ranks(kind, layout, budget, workers, 3, root, state=state, skip_steps=[skip]), layout)
    assert skipped == [rows[:1] + rows[skip[1] - STOP_AT:] for rows in resumed]


STATIC = {"static_packed", "padded_shapes"}  # one shape set for every rank: one budget for every rank
CASES = [(kind, layout, budget) for kind in ("one", "mixture") for layout in LAYOUTS for budget in BUDGETS
         if not (layout in STATIC and budget == "per_rank")]


@pytest.mark.parametrize("kind, layout, budget", CASES)
def test_every_corpus_layout_and_budget_composes_without_workers(stores, kind, layout, budget):
    _case(kind, layout, budget, 0, stores)


@pytest.mark.parametrize("kind, layout, budget", [(k, lay, "per_rank" if lay not in STATIC else "auto")
                                                  for k in ("one", "mixture") for lay in LAYOUTS])
def test_every_corpus_and_layout_composes_with_two_workers(stores, kind, layout, budget):
    _case(kind, layout, budget, 2, stores)


# ---- combinations that mean nothing: refused, naming both settings, before any token is read ----------------------


@pytest.mark.parametrize("kind", ["one", "mixture"])
@pytest.mark.parametrize("layout", sorted(STATIC))
def test_static_shapes_with_per_rank_budgets_are_refused_naming_both(stores, kind, layout):
    name = "static_packing" if layout == "static_packed" else "padded_shapes"
    with pytest.raises(ValueError, match=rf"{name} needs one max_tokens for every rank, got per-rank budgets"):
        BalancedTextDataModule(_corpus(kind, stores), vocab_size=VOCAB, pad_token_id=0, max_tokens=[160, 224],
                               cache_dir=stores / "refused", **LAYOUTS[layout])


@pytest.mark.parametrize("layout", sorted(STATIC))
def test_an_auto_budget_measured_per_rank_plans_static_shapes_with_the_smallest(stores, layout):
    for dm in _ranks("mixture", layout, "auto", 0, 2, stores):  # the ranks measured different budgets
        dm.train_dataloader()
        assert dm.train_sampler.settings.max_tokens == MEASURED.max_tokens == min(MEASURED.per_rank)


def test_max_documents_beside_a_mixture_is_refused(stores):
    with pytest.raises(ValueError, match=r"max_documents=5 cannot bound a Mixture corpus.*'max_documents': n"):
        BalancedTextDataModule(_corpus("mixture", stores), max_documents=5, vocab_size=VOCAB, pad_token_id=0,
                               cache_dir=stores / "refused")


def test_a_stream_component_without_its_bound_is_refused(stores):
    mixture = Mixture({"megatron": (MegatronSource(str(stores / "megatron")), 1), "stream": (_stream(), 1)})
    with pytest.raises(ValueError, match=r"max_documents"):
        BalancedTextDataModule(mixture, vocab_size=VOCAB, pad_token_id=0, cache_dir=stores / "refused")


def test_a_mixture_larger_than_plan_window_is_refused_naming_both(stores):
    settings = BatchingSettings(max_tokens=160, plan_window=50)
    dm = BalancedTextDataModule(_corpus("mixture", stores), vocab_size=VOCAB, pad_token_id=0, settings=settings,
                                max_length=MAX_LENGTH, cache_dir=stores / "cache")
    with pytest.raises(ValueError, match=r"more than plan_window=50.*a mixture plans whole epochs.*raise plan_window"):
        dm.setup("fit")
    # one corpus plans the same window by window
    one = BalancedTextDataModule(_corpus("one", stores), vocab_size=VOCAB, pad_token_id=0, settings=settings,
                                 max_length=MAX_LENGTH, cache_dir=stores / "cache")
    one.setup("fit")
    assert one.train_sampler.windows is not None
