"""Schedules: a mixture's weights changed at 90 % of the run and a length warm-up, against what other libraries do.

Run:
    python -m benchmarks.schedules                                   # 2M documents; planning time at 10M
    python -m benchmarks.schedules --documents 60000 --timing-documents 20000 --warmup-tokens 1500000 --tiny-weight 1e-4

Three components of real length distributions (``lit_balance/data/lengths/``, capped at 4,096 tokens; each drawn
with replacement, seeded): ``web`` the paragraphs of the Python documentation, ``code`` the standard library's whole
source files, ``books`` the Linux kernel's documentation files; documents in proportion to what the schedule asks of
each component (by tokens). Weights by tokens 0.6 / 0.1 / 0.3, then 0.3 / 0.3 / 0.4 from the step at 90 % of the run
(the run: one epoch of each layout, :func:`at_90_percent`), 8 ranks, ``max_tokens=16384`` per
micro-batch, 4 micro-batches per rank per optimizer step (steps of 512k token slots). Plans only: nothing is trained.

* **lit_balance** (:func:`lit_balance.plan.mixture.plan_mixture` with the schedule's
  :class:`~lit_balance.plan.mixture_schedule.StepShares`, padded and packed): per component the deviation of each
  optimizer step's share of real tokens from the share the schedule gives that step (max and p95 over the steps of
  at least 256k real tokens, transition step included), U per stage (real tokens over the slowest rank's cost per
  step times the ranks: padded slots padded, tokens packed), and the planning CPU seconds per million documents at
  ``--timing-documents``.
* **Megatron static blend restarted at the transition** (a model in NumPy, after megatron-core's
  ``build_blending_indices`` and ``BlendedDataset``): a Megatron sample is ``--seq-length`` tokens cut from a
  component's documents laid end to end in a shuffled order; the blend gives sample ``i`` to the component whose
  weight times ``i + 1`` is furthest ahead of its count so far (the greedy rule of ``build_blending_indices``), and
  the component's ``k``-th sample is its ``k``-th slice. Weights are fixed per run, so the change is a restart: the
  blend index is built again for the new weights and the run resumes at the same consumed-sample count ``C`` (what
  Megatron-LM #457 describes). Component ``c`` had consumed ``n0_c`` samples (its count in the first ``C`` places of
  the old blend) and the resumed run starts it at ``n1_c`` (its count in the first ``C`` places of the new one):
  samples ``n0_c .. n1_c - 1`` are never read (lost) when ``n1_c > n0_c``, samples ``n1_c .. n0_c - 1`` are read a
  second time (repeated) when ``n1_c < n0_c``. Counted in samples, tokens, and documents (those with a token in a
  lost or repeated slice). Per-step shares: steps of ``512k / seq_length`` samples.
* **levanter-style per-block sample counts** (a model in NumPy after levanter's ``MixtureDataset``): every block of
  ``N`` samples (a sample = a document; ``N`` the mean count that fills 512k tokens, one block per optimizer step)
  holds ``round(w_c * N)`` documents of component ``c``: sample counts, not tokens, so a step's token shares follow
  the documents' lengths, and a weight below ``0.5 / N`` is rounded to zero in every block. Measured: the deviation of
  each step's token share from the schedule; and a fourth component of weight ``--tiny-weight`` (fortunes lengths)
  added to both (lit_balance: its planned tokens over the run against what the schedule asks, levanter: its
  documents).
* **Length warm-up** 256 -> 4,096 tokens over the first 10 % of the steps (doubling stages), on the same documents as
  one corpus (``--warmup-tokens`` of them): tokens a truncating warm-up (composer's ``SeqLengthWarmup``, DeepSpeed's
  curriculum) discards against :func:`lit_balance.plan_length_warmup`, which splits documents into pieces and
  discards none (the rows of :mod:`benchmarks.length_warmup`), with U per stage.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import ROOT, load_lengths, markdown_table, positive_int, write_report
from benchmarks.length_warmup import stage_rows
from lit_balance import BatchingSettings, CostModel, Schedule
from lit_balance.plan import planner_for
from lit_balance.plan.mixture import MixtureLayout, MixtureSettings, plan_mixture
from lit_balance.plan.mixture_schedule import StepShares

OUTPUT_DIR = ROOT / "docs" / "benchmarks" / "schedules"
NAMES = ("web", "code", "books")
SOURCES = {"web": "pydocs_paragraphs", "code": "stdlib_sources", "books": "linux_docs", "tiny": "fortunes"}
BEFORE, AFTER = (0.6, 0.1, 0.3), (0.3, 0.3, 0.4)
RANKS, ACC, MAX_TOKENS, MAX_LENGTH = 8, 4, 16384, 4096
STEP_SLOTS = RANKS * ACC * MAX_TOKENS  # 524,288
BIG = 256 * 1024


def corpus(num_documents: int, names: tuple[str, ...] = NAMES, weights: tuple[float, ...] | None = None,
           seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(sizes, lengths)``: documents per component, about in proportion to the tokens the schedule asks of each
    (``weights``, default 0.9 x the first weights + 0.1 x the second, and 20 % more of every component but the
    first, so that ``web`` limits the epoch), and their lengths drawn from the component's real distribution."""
    rng = np.random.default_rng(seed)
    pools = [load_lengths(SOURCES[n], max_length=MAX_LENGTH) for n in names]
    if weights is None:
        weights = tuple(0.9 * b + 0.1 * a for b, a in zip(BEFORE, AFTER))
    per_token = np.array([w / p.mean() for w, p in zip(weights, pools)]) * np.array([1.0] + [1.2] * (len(names) - 1))
    sizes = np.maximum(np.round(num_documents * per_token / per_token.sum()).astype(np.int64), 1)
    lengths = np.concatenate([rng.choice(p, size=int(n)) for p, n in zip(pools, sizes)]).astype(np.int64)
    return sizes, lengths


def weights_schedule(transition: int, names: tuple[str, ...] = NAMES, tiny: float = 0.0) -> Schedule:
    """0.6 / 0.1 / 0.3 until ``transition``, then 0.3 / 0.3 / 0.4 (with ``tiny``: a fourth weight, the others
    scaled by ``1 - tiny``)."""
    def point(w):
        values = {n: v * (1 - tiny) for n, v in zip(NAMES, w)}
        if len(names) > 3:
            values[names[3]] = tiny
        return values
    return Schedule([(0, point(BEFORE)), (transition, point(AFTER))], name="weights_schedule")


def _settings(packing: bool) -> BatchingSettings:
    return BatchingSettings(max_tokens=MAX_TOKENS, accumulate_grad_batches=ACC, packing=packing)


def plan(sizes: np.ndarray, lengths: np.ndarray, schedule: Schedule | None, packing: bool,
         names: tuple[str, ...] = NAMES) -> tuple[Any, float]:
    """This library's mixture plan of epoch 0 (``schedule`` None: the first weights, fixed); its CPU seconds."""
    mixture = MixtureSettings(names, schedule.vector_at(0, names) if schedule is not None else BEFORE)
    shares = None if schedule is None else StepShares(schedule, names)
    cpu = time.process_time()
    mp = plan_mixture(lengths, MixtureLayout(sizes), mixture, _settings(packing), num_replicas=RANKS, epoch=0,
                      cost_model=CostModel(), step_shares=shares)
    return mp, time.process_time() - cpu


def _deviation_pp(step_tokens: np.ndarray, targets: np.ndarray) -> tuple[list[float], list[float], int]:
    """Per component: max and p95 of |share - target| (percentage points) over the steps of at least 256k tokens."""
    big = step_tokens.sum(axis=1) >= BIG
    dev = 100.0 * np.abs(step_tokens[big] / step_tokens[big].sum(axis=1, keepdims=True) - targets[big])
    return (np.round(dev.max(axis=0), 2).tolist(), np.round(np.percentile(dev, 95, axis=0), 2).tolist(),
            int(big.sum()))


def ours(sizes: np.ndarray, lengths: np.ndarray, schedule: Schedule, packing: bool) -> dict[str, Any]:
    """Per-step deviation from the schedule, U before and after the transition, 0 over budget."""
    mp, cpu_s = plan(sizes, lengths, schedule, packing)
    settings = _settings(packing)
    p = mp.plan
    cost, slots = planner_for(settings).batch_costs(lengths, p.rows, p.batch_offsets, 1, CostModel())
    real = p.real_tokens_per_batch(lengths)
    step_cost = cost[p.assignment].reshape(-1, ACC, RANKS).sum(axis=1)  # [steps, ranks]
    step_real = real[p.assignment].reshape(-1, ACC * RANKS).sum(axis=1)
    transition = schedule.positions[1]
    worst, p95, big = _deviation_pp(mp.step_units.astype(np.float64), mp.step_targets)
    stages = {}
    for label, lo, hi in (("before", 0, transition), ("after", transition, step_real.size)):
        stages[label] = round(float(step_real[lo:hi].sum() / (step_cost[lo:hi].max(axis=1).sum() * RANKS)), 4)
    return {"layout": "packed" if packing else "padded", "steps": int(step_real.size), "transition": transition,
            "transition_fraction": round(transition / step_real.size, 3), "max_pp": worst, "p95_pp": p95,
            "steps_256k": big, "u_before": stages["before"], "u_after": stages["after"],
            "over_budget": int((slots > MAX_TOKENS).sum()), "plan_cpu_s": round(cpu_s, 2),
            "documents": int(mp.chosen.sum())}


def megatron_blend(weights: tuple[float, ...], size: int) -> np.ndarray:
    """The component of each of ``size`` samples, by megatron-core's greedy rule (``build_blending_indices``):
    sample ``i`` goes to the component with the largest ``w_c * (i + 1) - count_c``. NumPy, one pass."""
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    counts = np.zeros(w.size)
    out = np.empty(size, dtype=np.int64)
    for i in range(size):
        c = int(np.argmax(w * (i + 1) - counts))
        out[i] = c
        counts[c] += 1
    return out


def megatron(sizes: np.ndarray, lengths: np.ndarray, transition: int, num_steps: int, seq_length: int,
             seed: int = 0) -> dict[str, Any]:
    """The static blend restarted at optimizer step ``transition`` of ``num_steps``: samples, tokens and documents
    lost and repeated; per-step deviation of the token shares from the schedule (steps of
    ``STEP_SLOTS // seq_length`` samples)."""
    per_step = STEP_SLOTS // seq_length
    total = num_steps * per_step
    consumed = transition * per_step  # the consumed-sample count at the restart
    old, new = megatron_blend(BEFORE, total), megatron_blend(AFTER, total)
    n0 = np.bincount(old[:consumed], minlength=3)
    n1 = np.bincount(new[:consumed], minlength=3)
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    out: dict[str, Any] = {"seq_length": seq_length, "consumed_samples": int(consumed), "components": {}}
    for c, name in enumerate(NAMES):
        docs = lengths[offsets[c]:offsets[c + 1]][rng.permutation(int(sizes[c]))]  # the component's shuffled order
        ends = np.cumsum(docs)  # token offset where each document ends in the concatenation
        lo, hi = sorted((int(n0[c]), int(n1[c])))
        first_tok, last_tok = lo * seq_length, hi * seq_length  # the lost or repeated slices' tokens
        touched = 0 if hi == lo else int(np.searchsorted(ends, last_tok, side="left")
                                          - np.searchsorted(ends, first_tok, side="right") + 1)
        kind = "lost" if n1[c] > n0[c] else "repeated"
        out["components"][name] = {"consumed_before": int(n0[c]), "resumed_at": int(n1[c]),
                                   "lost_samples": int(max(n1[c] - n0[c], 0)),
                                   "repeated_samples": int(max(n0[c] - n1[c], 0)),
                                   f"{kind}_tokens": (hi - lo) * seq_length, f"{kind}_documents": touched}
    # the run as trained: old blend up to the restart, the new blend's samples from position `consumed` on
    trained = np.concatenate([old[:consumed], new[consumed:total]])
    steps = trained[: trained.size // per_step * per_step].reshape(-1, per_step)
    step_tokens = np.stack([(steps == c).sum(axis=1) for c in range(3)], axis=1).astype(np.float64) * seq_length
    targets = np.array([BEFORE if g < transition else AFTER for g in range(steps.shape[0])])
    out["max_pp"], out["p95_pp"], out["steps_256k"] = _deviation_pp(step_tokens, targets)
    return out


def levanter(sizes: np.ndarray, lengths: np.ndarray, transition: int, num_steps: int, names: tuple[str, ...] = NAMES,
             tiny: float = 0.0, corrected: bool = True, seed: int = 0) -> dict[str, Any]:
    """Per-block sample counts: a block per optimizer step of ``N`` documents, ``round(p_c * N)`` of component ``c``,
    each component's documents in a shuffled order (reread when exhausted). ``p`` the schedule's weights taken as
    sample shares (``corrected=False``, what a user who gives the token weights gets), or corrected by the components'
    mean lengths (``p_c`` proportional to ``w_c / mean_c``, token shares on average); ``N`` the documents whose
    expected tokens fill a 512k-token step. Returns the per-step deviation of the token shares from the schedule and
    each component's documents and tokens over the run."""
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    orders = [lengths[offsets[c]:offsets[c + 1]][rng.permutation(int(sizes[c]))] for c in range(len(names))]
    means = np.array([o.mean() for o in orders])
    cursors = np.zeros(len(names), dtype=np.int64)
    step_tokens = np.zeros((num_steps, len(names)))
    documents = np.zeros(len(names), dtype=np.int64)
    targets = np.zeros((num_steps, len(names)))
    blocks = set()
    schedule = weights_schedule(transition, names, tiny)
    for g in range(num_steps):
        w = np.asarray(schedule.vector_at(g, names), dtype=np.float64)
        targets[g] = w / w.sum()
        p = targets[g] / means if corrected else targets[g]
        p = p / p.sum()
        block = int(round(STEP_SLOTS / float(p @ means)))
        blocks.add(block)
        counts = np.round(p * block).astype(np.int64)
        for c, k in enumerate(counts):
            idx = (cursors[c] + np.arange(k)) % orders[c].size
            step_tokens[g, c] = orders[c][idx].sum()
            cursors[c] += k
            documents[c] += k
    worst, p95, big = _deviation_pp(step_tokens, targets)
    return {"corrected": corrected, "block_samples": sorted(blocks), "max_pp": worst, "p95_pp": p95,
            "steps_256k": big, "documents": documents.tolist(),
            "tokens": step_tokens.sum(axis=0).astype(np.int64).tolist(),
            "asked_tokens": np.round((targets * step_tokens.sum(axis=1, keepdims=True)).sum(axis=0)).tolist()}


def tiny_weight(num_documents: int, transition: int, tiny: float) -> dict[str, Any]:
    """A fourth component of weight ``tiny``: its tokens over the run in this library's plan against what the
    schedule asks of it, and in the levanter model."""
    names = (*NAMES, "tiny")
    weights = tuple(0.9 * b + 0.1 * a for b, a in zip(BEFORE, AFTER)) + (tiny * 3,)
    sizes, lengths = corpus(num_documents, names, weights)
    schedule = weights_schedule(transition, names, tiny)
    mp, _ = plan(sizes, lengths, schedule, packing=True, names=names)
    units = mp.step_units.astype(np.float64)
    asked = float((mp.step_targets[:, 3] * units.sum(axis=1)).sum())
    lev = levanter(sizes, lengths, transition, units.shape[0], names, tiny)
    return {"weight": tiny, "steps": int(units.shape[0]), "asked_tokens": round(asked, 1),
            "planned_tokens": int(units[:, 3].sum()), "planned_documents": int(mp.chosen[int(sizes[:3].sum()):].sum()),
            "longest_document": int(lengths[sizes[:3].sum():].max()),
            "levanter_block_samples": lev["block_samples"], "levanter_documents": lev["documents"][3],
            "levanter_tokens": lev["tokens"][3], "levanter_asked_tokens": lev["asked_tokens"][3]}


def at_90_percent(sizes: np.ndarray, lengths: np.ndarray, packing: bool) -> int:
    """The optimizer step ``T`` at 90 % of the scheduled epoch, ``T = 0.9 * N(T)``: the epoch's length ``N`` depends
    on where the transition falls (the limiting component is read at another rate after it), about linearly, so
    two plans at ``T0 = 0.9 x`` the first weights' epoch and ``T1 = 0.9 * N(T0)`` give the line that is solved.

    Raises:
        ValueError: an epoch too short for a transition inside it (``--documents`` too small).
    """
    fixed, _ = plan(sizes, lengths, None, packing)
    t0 = int(0.9 * fixed.step_units.shape[0])
    n0 = plan(sizes, lengths, weights_schedule(t0), packing)[0].step_units.shape[0]
    t1 = int(round(0.9 * n0))
    n1 = plan(sizes, lengths, weights_schedule(t1), packing)[0].step_units.shape[0] if t1 != t0 else n0
    slope = (n1 - n0) / (t1 - t0) if t1 != t0 else 0.0
    transition = int(round(0.9 * (n0 - slope * t0) / (1 - 0.9 * slope))) if slope < 1 else t1
    if not 0 < transition < max(n0, n1):  # a short epoch's step counts are too coarse for the line
        transition = t1
    while transition > 1 and transition >= plan(sizes, lengths, weights_schedule(transition),
                                                 packing)[0].step_units.shape[0]:
        transition -= 1  # a short epoch: the transition inside it
    if not 0 < transition < max(n0, n1):
        raise ValueError(f"the epoch of {lengths.size} documents has {fixed.step_units.shape[0]} optimizer steps, too "
                         "few for a transition at 90 % of it; raise --documents")
    return transition


def timing(num_documents: int, packing: bool) -> dict[str, Any]:
    """Planning CPU seconds of one scheduled epoch at ``num_documents``, per million documents (of the corpus and of
    those chosen), beside fixed weights on the same corpus."""
    sizes, lengths = corpus(num_documents, seed=1)
    fixed, fixed_s = plan(sizes, lengths, None, packing)
    transition = int(0.9 * fixed.step_units.shape[0])
    mp, cpu_s = plan(sizes, lengths, weights_schedule(transition), packing)
    chosen = int(mp.chosen.sum())
    return {"documents": int(lengths.size), "layout": "packed" if packing else "padded", "chosen": chosen,
            "cpu_s": round(cpu_s, 2), "cpu_s_per_million": round(cpu_s / lengths.size * 1e6, 3),
            "cpu_s_per_million_chosen": round(cpu_s / chosen * 1e6, 3), "fixed_cpu_s": round(fixed_s, 2),
            "fixed_cpu_s_per_million": round(fixed_s / lengths.size * 1e6, 3)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--documents", type=positive_int, default=2_000_000, help="documents of the three components")
    p.add_argument("--timing-documents", type=positive_int, nargs="*", default=[10_000_000])
    p.add_argument("--warmup-tokens", type=positive_int, default=100_000_000,
                   help="tokens of the length warm-up's corpus (the run's first documents)")
    p.add_argument("--seq-length", type=positive_int, default=4096, help="a Megatron sample's tokens")
    p.add_argument("--tiny-weight", type=float, nargs="*", default=[1e-4, 1e-6])
    p.add_argument("--output-dir", type=Path, default=OUTPUT_DIR)
    args = p.parse_args(argv)
    load = os.getloadavg()[0]
    sizes, lengths = corpus(args.documents)
    rows = [ours(sizes, lengths, weights_schedule(at_90_percent(sizes, lengths, packing)), packing)
            for packing in (False, True)]
    transition = rows[1]["transition"]  # the packed epoch's: the steps of the models below
    schedule = weights_schedule(transition)
    steps = rows[1]["steps"]
    mp, _ = plan(sizes, lengths, schedule, packing=True)
    step_real = mp.step_units.sum(axis=1)
    meg = megatron(sizes, lengths, transition, steps, args.seq_length)
    lev = [levanter(sizes, lengths, transition, steps, corrected=corrected) for corrected in (False, True)]
    tiny = [tiny_weight(args.documents, transition, w) for w in args.tiny_weight]
    warm_lengths = lengths[np.random.default_rng(2).permutation(lengths.size)]
    warm_lengths = warm_lengths[: int(np.searchsorted(np.cumsum(warm_lengths), args.warmup_tokens)) + 1]
    warmup = [{**r, "planned_tokens": int(warm_lengths.sum())}
              for packing in (False, True) for r in stage_rows(warm_lengths, packing, "stages", RANKS, MAX_TOKENS, ACC)]
    times = [timing(n, packing) for n in args.timing_documents for packing in (False, True)]
    results = {"documents": int(lengths.size), "sizes": dict(zip(NAMES, sizes.tolist())),
               "component_lengths": {n: SOURCES[n] for n in NAMES}, "max_length": MAX_LENGTH,
               "ranks": RANKS, "accumulate_grad_batches": ACC, "max_tokens": MAX_TOKENS, "step_slots": STEP_SLOTS,
               "schedule": schedule.to_dict(), "run_tokens": int(step_real.sum()), "load_average": load,
               "lit_balance": rows, "megatron_restart": meg, "levanter_blocks": lev, "tiny_weight": tiny,
               "length_warmup": warmup, "timing": times}
    return write_report(args.output_dir, "benchmarks.schedules", argv, results, _markdown(results))


def _pp(worst: list[float], p95: list[float]) -> list[str]:
    return [f"{w:.2f} / {q:.2f}" for w, q in zip(worst, p95)]


def _markdown(r: dict[str, Any]) -> str:
    out = [f"{r['documents']:,} documents ({', '.join(f'{n} {s:,}' for n, s in r['sizes'].items())}), lengths "
           f"capped at {r['max_length']}; weights 0.6 / 0.1 / 0.3 -> 0.3 / 0.3 / 0.4; {r['ranks']} ranks, "
           f"{r['step_slots']:,}-slot steps; load average {r['load_average']:.1f} at the start", ""]
    rows = [[f"lit_balance {x['layout']}", *_pp(x["max_pp"], x["p95_pp"]), str(x["steps_256k"]),
             f"{x['transition']} of {x['steps']} ({x['transition_fraction']:.2f})", f"{x['u_before']:.4f}",
             f"{x['u_after']:.4f}", str(x["over_budget"])] for x in r["lit_balance"]]
    m = r["megatron_restart"]
    rows.append([f"Megatron blend restarted ({m['seq_length']}-token samples)", *_pp(m["max_pp"], m["p95_pp"]),
                 str(m["steps_256k"]), "restart", "--", "--", "--"])
    for lev in r["levanter_blocks"]:
        what = "length-corrected sample weights" if lev["corrected"] else "token weights as sample weights"
        rows.append([f"levanter blocks, {what} ({'/'.join(map(str, lev['block_samples']))} documents)",
                     *_pp(lev["max_pp"], lev["p95_pp"]), str(lev["steps_256k"]), "block", "--", "--", "--"])
    out.append(markdown_table(["plan", "web max / p95 (pp)", "code", "books", "steps >= 256k", "transition step",
                               "U before", "U after", "over budget"], rows))
    out += ["", "Megatron blend restarted at the transition (the same consumed-sample count "
            f"{m['consumed_samples']:,}):", ""]
    out.append(markdown_table(
        ["component", "samples consumed (old blend)", "resumed at (new blend)", "lost: samples / tokens / documents",
         "repeated: samples / tokens / documents"],
        [[name, f"{c['consumed_before']:,}", f"{c['resumed_at']:,}",
          f"{c['lost_samples']:,} / {c.get('lost_tokens', 0):,} / {c.get('lost_documents', 0):,}",
          f"{c['repeated_samples']:,} / {c.get('repeated_tokens', 0):,} / {c.get('repeated_documents', 0):,}"]
         for name, c in m["components"].items()]))
    out.append("")
    for t in r["tiny_weight"]:
        out += [f"a fourth component of weight {t['weight']:g} ({t['steps']} steps): lit_balance plans "
            f"{t['planned_tokens']:,} of its tokens where the schedule asks {t['asked_tokens']:,.1f} (longest "
            f"document {t['longest_document']:,}); levanter blocks (length-corrected) of "
            f"{'/'.join(map(str, t['levanter_block_samples']))} documents give it {t['levanter_documents']} documents "
            f"({t['levanter_tokens']:,} tokens, asked {t['levanter_asked_tokens']:,.0f})", ""]
    out.append(markdown_table(
        ["layout", "steps", "max_length", "U", "over budget", "truncation discards", "tokens", "pieces discard"],
        [[w["layout"], w["steps"], w["max_length"], f"{w['u']:.4f}", str(w["over_budget"]),
          f"{w['truncation_discards']:,}", f"{w['tokens']:,}", "0"] for w in r["length_warmup"]]))
    out += ["", "planning CPU seconds of one epoch (goal: 0.6 s per million documents)", ""]
    out.append(markdown_table(
        ["documents", "layout", "chosen", "schedule CPU s", "per million documents", "per million chosen",
         "fixed weights CPU s", "fixed per million"],
        [[f"{x['documents']:,}", x["layout"], f"{x['chosen']:,}", f"{x['cpu_s']:.2f}",
          f"{x['cpu_s_per_million']:.3f}", f"{x['cpu_s_per_million_chosen']:.3f}", f"{x['fixed_cpu_s']:.2f}",
          f"{x['fixed_cpu_s_per_million']:.3f}"] for x in r["timing"]]))
    return "\n".join(out)


if __name__ == "__main__":
    main()
