"""MixtureMonitor and the ComponentTokens metric: the exact tokens of each component logged per optimizer step and per
rank, for padded and packed micro-batches under accumulation, two simulated ranks and a recording logger."""

import numpy as np
import pytest
import torch
from conftest import MODULE, batch, make_trainer
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance import BalancedBatchSampler
from lit_balance.callbacks import MixtureMonitor
from lit_balance.data.collate import IGNORE_INDEX, PackedCollator, PadCollator
from lit_balance.lightning.callbacks._common import row_tokens
from lit_balance.lightning.metrics import ComponentTokens
from lit_balance.plan.mixture import MixtureSettings
from lit_balance.sampler.mixture import MixtureBatchSampler

# two components: "short" documents of 3-9 tokens, "long" ones of 20-33; a prompt of (document % 4) tokens has no
# target, so supervised tokens differ from real tokens - 1
SIZES = [40, 16]
LENGTHS = np.array([3 + (5 * d) % 7 for d in range(40)] + [20 + (5 * d) % 14 for d in range(16)])
PROMPT = np.arange(56) % 4
MIXTURE = MixtureSettings(("short", "long"), (0.4, 0.6))
ACCUMULATE = 2


def _sample(i, fill):
    length, prompt = int(LENGTHS[i]), int(PROMPT[i])
    labels = np.arange(1, length + 1)
    labels[:prompt] = IGNORE_INDEX
    return {"input_ids": np.arange(1, length + 1), "labels": labels, "index": i, "is_fill": fill}


def _samplers(packing):
    return [MixtureBatchSampler(LENGTHS, SIZES, MIXTURE, max_tokens=40, num_replicas=2, rank=r, seed=3,
                                packing=packing, accumulate_grad_batches=ACCUMULATE, pad_to_multiple_of=8)
            for r in range(2)]


def _expected(samplers):
    """Per optimizer step, per rank and component: real and supervised tokens, from the lengths and prompts."""
    out = {}
    for r, sampler in enumerate(samplers):
        for k, micro_batch in enumerate(sampler):
            step = k // ACCUMULATE
            for i, fill in zip(micro_batch, micro_batch.is_fill):
                if fill:
                    continue
                c = 0 if i < SIZES[0] else 1
                counts = out.setdefault(step, np.zeros((2, 2, 2), dtype=np.int64))  # [rank, kind, component]
                counts[r, 0, c] += LENGTHS[i]
                counts[r, 1, c] += LENGTHS[i] - max(PROMPT[i], 1)
    return out


def _run(rank, sampler, collate, others, every, epoch_start=True):
    trainer, logger = make_trainer(rank=rank, world_size=2, others=others, sampler=sampler)
    cb = MixtureMonitor(log_every_n_steps=every)
    if epoch_start:  # Lightning skips on_train_epoch_start when a fit resumes mid-epoch
        cb.on_train_epoch_start(trainer, MODULE)
    for k, micro_batch in enumerate(sampler):
        b = collate([_sample(i, f) for i, f in zip(micro_batch, micro_batch.is_fill)])
        cb.on_train_batch_start(trainer, MODULE, b, k)
        if k % ACCUMULATE == ACCUMULATE - 1:
            trainer.global_step += 1  # the optimizer stepped in this micro-batch
        cb.on_train_batch_end(trainer, MODULE, None, b, k)
    cb.on_train_epoch_end(trainer, MODULE)
    cb.on_train_end(trainer, MODULE)
    return cb, trainer, logger


@pytest.mark.parametrize("packing", [False, True])
def test_logs_each_components_tokens_per_step_and_per_rank_exactly(packing):
    samplers = _samplers(packing)
    for s in samplers:
        s.set_epoch(0)
    expected = _expected(samplers)
    collate = PackedCollator(0, pad_to_multiple_of=8) if packing else PadCollator(0, pad_to_multiple_of=8)
    gathered = []  # rank 1's gathers, handed to rank 0 in order

    def record(local):
        gathered.append(local.clone())
        return [torch.zeros_like(local)]

    _, _, logger1 = _run(1, samplers[1], collate, record, every=2)
    assert logger1.calls == []  # rank 1 gathers, rank 0 writes
    cb, trainer, logger = _run(0, samplers[0], collate, lambda local: [gathered.pop(0)], every=2)
    assert gathered == [] and trainer.strategy.gathers == -(-len(expected) // 2)  # one gather per 2 steps
    assert [step for step, _ in logger.calls] == sorted(expected)
    for step, metrics in logger.calls:
        counts = expected[step]
        want = {}
        total = counts.sum(axis=0)  # [kind, component]
        for c, name in enumerate(("short", "long")):
            want[f"train/tokens/{name}"] = float(total[0, c])
            want[f"train/supervised_tokens/{name}"] = float(total[1, c])
            want[f"train/share/{name}"] = float(total[0, c]) / float(total[0].sum())
        for r in range(2):
            for c, name in enumerate(("short", "long")):
                want[f"train/tokens/{name}_rank{r}"] = float(counts[r, 0, c])
                want[f"train/supervised_tokens/{name}_rank{r}"] = float(counts[r, 1, c])
        assert metrics == want
    # every document of the epoch once: the logged tokens sum to the chosen documents' tokens
    logged = sum(m["train/tokens/short"] + m["train/tokens/long"] for _, m in logger.calls)
    assert logged == sum(int(c[:, 0].sum()) for c in expected.values()) > 0
    assert cb.last_metrics == logger.calls[-1][1]
    assert float(trainer.callback_metrics["train/tokens/long"]) == logger.calls[-1][1]["train/tokens/long"]


def test_a_fit_resumed_mid_epoch_without_on_train_epoch_start_logs_the_same():
    samplers = _samplers(packing=True)
    samplers[0].set_epoch(0)
    zeros = lambda local: [torch.zeros_like(local)]  # noqa: E731
    _, _, started = _run(0, samplers[0], PackedCollator(0), zeros, every=2)
    _, _, resumed = _run(0, samplers[0], PackedCollator(0), zeros, every=2, epoch_start=False)
    assert resumed.calls == started.calls and len(started.calls) > 1


def test_a_checkpoint_saved_between_gathers_logs_and_writes_every_step_it_holds():
    # a stop by a signal saves last.ckpt between two gathers (log_every_n_steps=4): the steps since the last gather are
    # logged and written then, on every rank in one gather, whatever happens after the save
    samplers = _samplers(packing=False)
    for s in samplers:
        s.set_epoch(0)
    collate = PadCollator(0, pad_to_multiple_of=8)
    logs = {}
    for rank, sampler in enumerate(samplers):
        trainer, logger = make_trainer(rank=rank, world_size=2, sampler=sampler)
        cb = MixtureMonitor(log_every_n_steps=4)
        cb.on_train_epoch_start(trainer, MODULE)
        for k, micro_batch in zip(range(6 * ACCUMULATE), sampler):  # 6 optimizer steps, then the save
            b = collate([_sample(i, f) for i, f in zip(micro_batch, micro_batch.is_fill)])
            cb.on_train_batch_start(trainer, MODULE, b, k)
            if k % ACCUMULATE == ACCUMULATE - 1:
                trainer.global_step += 1
            cb.on_train_batch_end(trainer, MODULE, None, b, k)
        assert trainer.strategy.gathers == 1  # steps 0-3; 4 and 5 wait for the next gather
        cb.on_save_checkpoint(trainer, MODULE, {})
        assert trainer.strategy.gathers == 2  # every rank takes part
        cb.on_save_checkpoint(trainer, MODULE, {})  # nothing new: no gather
        assert trainer.strategy.gathers == 2
        logs[rank] = logger
    assert logs[1].calls == []  # rank 0 writes
    assert [step for step, _ in logs[0].calls] == [0, 1, 2, 3, 4, 5] and logs[0].saved == 6


@pytest.mark.parametrize("handed", ["one corpus", "nothing"])
def test_a_single_corpus_logs_nothing_and_gathers_nothing(handed):
    one = BalancedBatchSampler(LENGTHS, max_tokens=40, num_replicas=2, rank=0) if handed == "one corpus" else None
    trainer, logger = make_trainer(rank=0, world_size=2, sampler=one)
    cb = MixtureMonitor(log_every_n_steps=1)
    cb.on_train_epoch_start(trainer, MODULE)
    for k in range(4):
        cb.on_train_batch_start(trainer, MODULE, batch(1, 4, 4), k)
        trainer.global_step += 1
        cb.on_train_batch_end(trainer, MODULE, None, batch(1, 4, 4), k)
    cb.on_save_checkpoint(trainer, MODULE, {})
    cb.on_train_epoch_end(trainer, MODULE)
    cb.on_train_end(trainer, MODULE)
    assert logger.calls == [] and trainer.strategy.gathers == 0 and cb.last_metrics == {} and cb.names == ()


@pytest.mark.parametrize("max_documents", [4, 3])
def test_row_tokens_of_a_static_packed_row_leave_out_its_tail_and_empty_segments(max_documents):
    # 4: the tail is a segment of its own, then an empty one; 3: the row is full, the tail ends the last segment
    collate = PackedCollator(0, row_length=48, max_documents=max_documents)
    b = collate([_sample(0, False), _sample(45, False), _sample(1, True)])
    assert int(b["num_padded_tokens"]) - int(b["num_real_tokens"]) > 0  # a tail
    indices, real, supervised = row_tokens(b, "test")
    assert indices.tolist() == [0, 45]
    assert real.tolist() == [LENGTHS[0], LENGTHS[45]]
    assert supervised.tolist() == [LENGTHS[0] - 1, LENGTHS[45] - PROMPT[45]]


@pytest.mark.parametrize(("bad", "error"), [(0, ValueError), (1.5, TypeError), (True, TypeError)])
def test_rejects_bad_interval(bad, error):
    with pytest.raises(error, match="log_every_n_steps"):
        MixtureMonitor(log_every_n_steps=bad)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 50), st.integers(0, 50)), min_size=1, max_size=20),
       st.integers(1, 4))
def test_metric_shares_are_ratios_of_sums_over_ranks(rows, ranks):
    """Rows split over ranks in any way: the summed states, and the shares, are those of one process."""
    whole = ComponentTokens(3)
    parts = [ComponentTokens(3) for _ in range(ranks)]
    for k, (c, real, sup) in enumerate(rows):
        sup = min(sup, real)
        whole.update([c], [real], [sup])
        parts[k % ranks].update([c], [real], [sup])
    summed = sum(p.real_tokens for p in parts)
    assert summed.tolist() == whole.real_tokens.tolist()
    real = np.zeros(3)
    for c, r, _ in rows:
        real[c] += r
    np.testing.assert_allclose(whole.compute().numpy(), real / real.sum())


def test_metric_rejects_bad_rows():
    m = ComponentTokens(2)
    with pytest.raises(ValueError, match=r"components in \[0, 2\)"):
        m.update([2], [5], [4])
    with pytest.raises(ValueError, match="supervised_tokens <= real_tokens"):
        m.update([0], [5], [6])
    with pytest.raises(ValueError, match="unit must be one of"):
        ComponentTokens(2, unit="bytes")


def test_run_summary_ends_its_table_with_each_components_tokens_per_rank(clock, capsys):
    from lit_balance.callbacks import RunSummary

    samplers = _samplers(packing=True)
    for s in samplers:
        s.set_epoch(0)
    expected = sum(_expected(samplers).values())  # [rank, kind, component] over the epoch
    docs = np.zeros(2)
    for i, fill in zip(*(lambda mbs: ([i for m in mbs for i in m], [f for m in mbs for f in m.is_fill]))(
            list(samplers[1]))):
        docs[int(i >= SIZES[0])] += not fill
    # rank 1: 9 micro-batches (counts and seconds do not matter here), then its components' counts
    other = torch.tensor([9.0, 1.0, 1.0, 0, 0, 0, 0, 0, *expected[1, 0], *expected[1, 1], *docs], dtype=torch.float64)
    trainer, _ = make_trainer(rank=0, world_size=2, others=lambda local: [other], sampler=samplers[0])
    cb = RunSummary(clock=clock)
    cb.setup(trainer, MODULE, "fit")
    cb.on_train_start(trainer, MODULE)
    cb.on_train_epoch_start(trainer, MODULE)
    collate = PackedCollator(0, pad_to_multiple_of=8)
    for k, micro_batch in enumerate(samplers[0]):
        cb.on_train_batch_end(trainer, MODULE, None,
                              collate([_sample(i, f) for i, f in zip(micro_batch, micro_batch.is_fill)]), k)
    cb.on_train_end(trainer, MODULE)
    cb.on_fit_end(trainer, MODULE)
    total = expected.sum(axis=0)
    assert [c["name"] for c in cb.components] == ["short", "long"]
    for c, comp in enumerate(cb.components):
        assert comp["rank_real_tokens"] == expected[:, 0, c].tolist()
        assert comp["rank_supervised_tokens"] == expected[:, 1, c].tolist()
        assert comp["real_tokens"] == total[0, c] and comp["supervised_tokens"] == total[1, c]
        assert comp["share"] == total[0, c] / total[0].sum() and comp["target"] == [0.4, 0.6][c]
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("component  target   share  real tokens  supervised   documents")
    assert lines[start + 1].split()[:5] == ["short", "0.4000", f"{total[0, 0] / total[0].sum():.4f}",
                                            str(total[0, 0]), str(total[1, 0])]
    assert lines[start + 4].split() == ["rank", "short", "long"]
    assert lines[start + 6].split() == ["1", str(expected[1, 0, 0]), "/", str(expected[1, 1, 0]),
                                        str(expected[1, 0, 1]), "/", str(expected[1, 1, 1])]
    assert max(len(line) for line in lines) <= 80


def test_the_bar_and_live_figures_show_each_components_last_step():
    from lit_balance.lightning.callbacks.progress import bar_figures, live_figures

    samplers = _samplers(packing=False)
    for s in samplers:
        s.set_epoch(0)
    cb, trainer, logger = _run(0, samplers[0], PadCollator(0), lambda local: [torch.zeros_like(local)], every=3)
    trainer.callbacks = [cb]
    last = logger.calls[-1][1]
    assert live_figures(trainer) == last
    items = bar_figures(trainer)
    for name, target in (("short", 0.4), ("long", 0.6)):
        assert items[name] == (f"{last[f'train/tokens/{name}']:,.0f} tokens (share "
                               f"{last[f'train/share/{name}']:.3f}, target {target:.3f})")
