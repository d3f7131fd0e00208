"""Mixtures: per-step token shares and useful compute fraction, this library against sample weighting.

Run:
    python -m benchmarks.mixtures                                  # 300k documents; planning time at 1M and 10M
    python -m benchmarks.mixtures --documents 60000 --timing-documents 1000000 --baseline 747dc57
    python -m benchmarks.mixtures --scales-documents 1000000 --baseline main   # three scales, this against main
    python -m benchmarks.mixtures --documents 40000 --scales-documents 0 --timing-documents 1000000 \
        --timing-settings 8x4 8x1 64x4 64x1 --baseline main                # planning time at 8 and 64 ranks

Three components with document medians of about 300, 900 and 3,000 tokens (log-normal, sigma 0.7, 8 to 8,192 tokens),
target shares 0.6 / 0.1 / 0.3 by tokens, 8 ranks, optimizer steps of 512k token slots (``max_tokens=16384`` per
micro-batch, 4 micro-batches per rank per step). For each plan, per optimizer step and component: the deviation of
the component's share of the step's real tokens from its target (max and p95 over the steps of at least 256k real
tokens), and U (real-token cost over the slowest rank's cost times the ranks, :attr:`lit_balance.PlanStats.
useful_fraction`: padded slots padded, tokens packed).

* ``lit_balance padded`` / ``packed``: :func:`lit_balance.plan.mixture.plan_mixture` (unit tokens).
* ``interleave_datasets``: the sample order of Hugging Face ``datasets.interleave_datasets(probabilities=targets,
  stopping_strategy="first_exhausted")``, cut into steps of a fixed number of samples (the mean that fills 512k
  tokens), each rank a contiguous slice of its step (4 micro-batches of equal counts); padded to the longest row of
  each micro-batch, or packed (cost = tokens).
* ``Megatron blend``: the same with the order of Megatron's ``build_blending_indices`` (megatron-core's compiled
  helper), as ``BlendedDataset`` draws its samples.
* ``interleave_datasets, length-corrected``: sample probabilities set to target / mean document length (token shares
  on average, what a user can do by hand): the per-step deviation left is the draws' own.

Three scales against one corpus: components of document medians 30, 300 and 3,000 tokens (log-normal, sigma 0.7,
8 to 8,192 tokens; documents in proportion 0.5 / 0.2 / 0.3), target shares 0.5 / 0.2 / 0.3 and 0.05 / 0.05 / 0.9,
``max_tokens=8192``, at 8 and 64 ranks and accumulation 1 and 4, padded and packed: the mixture's U, its worst step's
U, the epoch's rank imbalance (the costliest rank's cost over the mean), its optimizer steps and its planning CPU
seconds, beside the same chosen documents planned as one corpus (:func:`lit_balance.plan.plan_epoch`), in the
same run (with ``--baseline``, also that revision's mixture plan).

The planning time of a mixture epoch (padded and packed) is measured at each ``--timing-documents`` size and each
``--timing-settings`` ranks and accumulation (default 8x4, the table's), wall and CPU seconds (CPU time is steadier
on a shared machine), with ``--baseline REVISION`` also for that revision's
``plan_mixture`` on the same corpora in the same process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

from lit_balance import BatchingSettings, CostModel, plan_stats
from lit_balance.plan import planner_for
from lit_balance.plan.mixture import MixtureLayout, MixtureSettings, plan_mixture

from benchmarks._harness import write_report

ROOT = Path(__file__).resolve().parents[1]
MEDIANS, TARGETS, NAMES = (300, 900, 3000), (0.6, 0.1, 0.3), ("web", "code", "books")
RANKS, ACC, MAX_TOKENS = 8, 4, 16384


def corpus(num_documents: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(sizes, lengths)``: documents per component (in proportion to the targets) and their token lengths."""
    rng = np.random.default_rng(seed)
    sizes = np.array([int(num_documents * t) for t in TARGETS], dtype=np.int64)
    lengths = np.concatenate([np.clip(rng.lognormal(np.log(m), 0.7, n), 8, 8192).astype(np.int64)
                              for m, n in zip(MEDIANS, sizes)])
    return sizes, lengths


def _deviation(step_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Per component: max and p95 of |share - target| over steps of at least 256k real tokens; how many steps."""
    big = step_tokens[step_tokens.sum(axis=1) >= 256 * 1024]
    if not big.shape[0]:  # steps of fewer token slots (fewer ranks or micro-batches than the table's)
        return np.full(3, np.nan), np.full(3, np.nan), 0
    dev = np.abs(big / big.sum(axis=1, keepdims=True) - np.asarray(TARGETS))
    return dev.max(axis=0), np.percentile(dev, 95, axis=0), int(big.shape[0])


def ours(sizes: np.ndarray, lengths: np.ndarray, packing: bool, planner: Any = None, ranks: int = RANKS,
         acc: int = ACC) -> dict:
    """This library's mixture plan (``planner``: a ``plan_mixture`` of another revision, or None for this one) at
    ``ranks`` ranks and ``acc`` micro-batches per rank and step."""
    layout = MixtureLayout(sizes)
    settings = BatchingSettings(max_tokens=MAX_TOKENS, accumulate_grad_batches=acc, packing=packing)
    mixture = MixtureSettings(NAMES, TARGETS)
    start, cpu = time.perf_counter(), time.process_time()
    mp = (planner or plan_mixture)(lengths, layout, mixture, settings, num_replicas=ranks, epoch=0,
                                   cost_model=CostModel())
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    stats = plan_stats(mp.plan, lengths, planner=planner_for(settings), accumulate_grad_batches=acc)
    worst, p95, steps = _deviation(mp.step_units.astype(np.float64))
    return {"max": worst, "p95": p95, "steps": steps, "U": stats.useful_fraction, "seconds": seconds,
            "cpu_seconds": cpu_seconds, "documents": int(mp.chosen.sum())}


def _sample_weighted(order: np.ndarray, lengths: np.ndarray, layout: MixtureLayout, packing: bool) -> dict:
    """Steps of a fixed number of samples from ``order`` (global indices), ranks contiguous slices of ``ACC``
    micro-batches each."""
    per_step = max(RANKS * ACC, int(round(RANKS * ACC * MAX_TOKENS / lengths[order].mean())) // (RANKS * ACC)
                   * (RANKS * ACC))
    steps = order.size // per_step
    order = order[:steps * per_step].reshape(steps, RANKS, ACC, -1)
    real = lengths[order]
    comp = layout.component_of(order)
    step_tokens = np.stack([np.where(comp == c, real, 0).sum(axis=(1, 2, 3)) for c in range(3)], axis=1)
    if packing:
        rank_cost = real.sum(axis=(2, 3))
    else:
        rank_cost = (real.max(axis=3) * real.shape[3]).sum(axis=2)
    worst, p95, big = _deviation(step_tokens.astype(np.float64))
    return {"max": worst, "p95": p95, "steps": big, "U": float(real.sum() / (rank_cost.max(axis=1).sum() * RANKS)),
            "share": step_tokens.sum(axis=0) / step_tokens.sum()}


def interleave_order(sizes: np.ndarray, probabilities: tuple[float, ...] = TARGETS, seed: int = 0) -> np.ndarray:
    """The global indices in the order of ``datasets.interleave_datasets(probabilities=probabilities)``."""
    import datasets

    offsets = np.concatenate([[0], np.cumsum(sizes)])
    parts = [datasets.Dataset.from_dict({"i": np.arange(offsets[c], offsets[c + 1])}) for c in range(3)]
    mixed = datasets.interleave_datasets(parts, probabilities=list(probabilities), seed=seed,
                                         stopping_strategy="first_exhausted")
    return np.asarray(mixed["i"], dtype=np.int64)


def megatron_order(sizes: np.ndarray, seed: int = 0) -> np.ndarray:
    """The global indices in the order of Megatron's ``build_blending_indices`` (each component read in a shuffled
    order, as its dataset's own shuffle index would)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.helpers_cpp import build_blending_indices

    size = int(min(sizes[c] / TARGETS[c] for c in range(3)))
    dataset_index = np.zeros(size, dtype=np.int16)
    sample_index = np.zeros(size, dtype=np.int64)
    build_blending_indices(dataset_index, sample_index, np.asarray(TARGETS, dtype=np.float64), 3, size, False)
    keep = sample_index < sizes[dataset_index]
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    shuffled = [offsets[c] + rng.permutation(sizes[c]) for c in range(3)]
    return np.array([shuffled[d][s] for d, s in zip(dataset_index[keep], sample_index[keep])], dtype=np.int64)


def baseline_planner(revision: str) -> Any:
    """``plan_mixture`` of ``lit_balance/plan/mixture.py`` (and the step batching it imports,
    ``mixture_batches.py``) at a git ``revision`` of this repository, loaded beside this one (the rest of the package
    is this revision's), for planning times measured side by side."""
    modules = {}
    for part in ("mixture_batches", "mixture"):  # the step batching first: the mixture module imports it
        source = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:lit_balance/plan/{part}.py"],
                                capture_output=True, text=True, check=True).stdout
        if "mixture_batches" in modules:
            source = source.replace("from lit_balance.plan.mixture_batches import",
                                    f"from {modules['mixture_batches'].__name__} import")
        name = f"lit_balance.plan._{part}_at_{revision}"
        module = types.ModuleType(name)
        sys.modules[name] = module  # dataclasses look their module up
        exec(compile(source, f"{revision}:lit_balance/plan/{part}.py", "exec"), module.__dict__)
        modules[part] = module
    return modules["mixture"].plan_mixture


SCALE_MEDIANS, SCALE_TARGETS, SCALE_MAX_TOKENS = (30, 300, 3000), (0.5, 0.2, 0.3), 8192
SCALE_WEIGHTS = ((0.5, 0.2, 0.3), (0.05, 0.05, 0.9))  # the mixtures planned over those documents


def scales_corpus(num_documents: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(sizes, lengths)`` of the three-scales comparison: medians 30 / 300 / 3,000 tokens, documents in proportion
    to the targets."""
    rng = np.random.default_rng(seed)
    sizes = np.array([int(num_documents * t) for t in SCALE_TARGETS], dtype=np.int64)
    lengths = np.concatenate([np.clip(rng.lognormal(np.log(m), 0.7, n), 8, 8192).astype(np.int64)
                              for m, n in zip(SCALE_MEDIANS, sizes)])
    return sizes, lengths


def _figures(stats: Any, num_replicas: int) -> dict:
    """U, the worst step's U and the epoch's rank imbalance of a plan's :class:`~lit_balance.PlanStats`."""
    cost = stats.rank_cost
    per_rank = cost.sum(axis=0)
    step_u = cost.sum(axis=1) / (cost.max(axis=1) * num_replicas)
    return {"U": float(stats.useful_fraction), "worst_step_balance": float(step_u.min()),
            "rank_imbalance": float(per_rank.max() / per_rank.mean())}


def three_scales(num_documents: int, planner: Any = None) -> list[dict]:
    """The three-scales rows: per ranks, accumulation and layout, the mixture against one corpus (and ``planner``'s
    mixture: another revision's ``plan_mixture``, or None)."""
    from lit_balance.plan import plan_epoch

    sizes, lengths = scales_corpus(num_documents)
    layout = MixtureLayout(sizes)
    out = []
    for weights in SCALE_WEIGHTS:
        mixture = MixtureSettings(NAMES, weights)
        for ranks in (8, 64):
            for acc in (1, 4):
                for packing in (False, True):
                    settings = BatchingSettings(max_tokens=SCALE_MAX_TOKENS, accumulate_grad_batches=acc,
                                                packing=packing)
                    layout_planner = planner_for(settings)
                    row = {"weights": list(weights), "ranks": ranks, "accumulate_grad_batches": acc,
                           "packing": packing, "micro_batches_per_step": ranks * acc}
                    for name, plan_fn in (("mixture", plan_mixture), ("baseline", planner)):
                        if plan_fn is None:
                            continue
                        start = time.process_time()
                        mp = plan_fn(lengths, layout, mixture, settings, num_replicas=ranks, epoch=0,
                                     cost_model=CostModel())
                        cpu = time.process_time() - start
                        row[name] = _figures(plan_stats(mp.plan, lengths, planner=layout_planner,
                                                        accumulate_grad_batches=acc), ranks)
                        row[name]["cpu_s"] = cpu
                        row[name]["steps"] = int(mp.step_units.shape[0])
                        if name == "mixture":
                            chosen = mp.chosen
                    one = plan_epoch(lengths, settings, num_replicas=ranks, epoch=0, eligible=chosen)
                    row["one_corpus"] = _figures(plan_stats(one, lengths, planner=layout_planner,
                                                            accumulate_grad_batches=acc), ranks)
                    row["one_corpus"]["steps"] = -(-one.num_micro_steps // acc)
                    out.append(row)
    return out


def _scales_row(r: dict, baseline: str | None) -> str:
    cells = [" / ".join(f"{w:g}" for w in r["weights"]), f"{r['ranks']}", f"{r['accumulate_grad_batches']}",
             "packed" if r["packing"] else "padded"]
    for name in ("mixture", "one_corpus") + (("baseline",) if baseline else ()):
        f = r[name]
        cells.append(f"{f['U']:.4f} / {f['worst_step_balance']:.3f} / {f['rank_imbalance']:.4f} / {f['steps']}")
    cells.append(f"{r['mixture']['cpu_s']:.2f}" + (f" / {r['baseline']['cpu_s']:.2f}" if baseline else ""))
    return "| " + " | ".join(cells) + " |"


def _row(name: str, r: dict) -> str:
    cells = [f"{100 * r['max'][c]:.1f} / {100 * r['p95'][c]:.1f}" for c in range(3)]
    return f"| {name} | " + " | ".join(cells) + f" | {r['U']:.4f} | {r['steps']} |"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=300_000, help="documents over the three components")
    parser.add_argument("--timing-documents", type=int, nargs="+", default=[1_000_000, 10_000_000],
                        help="documents of the timed plans (one or more sizes)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each plan (the median is reported)")
    parser.add_argument("--timing-settings", nargs="+", default=[f"{RANKS}x{ACC}"], metavar="RANKSxACCUMULATION",
                        help="ranks and accumulate_grad_batches of the timed plans, e.g. 8x4 8x1 64x4 64x1")
    parser.add_argument("--baseline", default=None, metavar="REVISION",
                        help="also time plan_mixture of this git revision, side by side on the same corpora")
    parser.add_argument("--scales-documents", type=int, default=1_000_000,
                        help="documents of the three-scales comparison against one corpus (0: leave it out)")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/mixtures"),
                        help="where the dated report (results.json, results.md) is written")
    args = parser.parse_args(argv)
    timed = []
    for value in args.timing_settings:
        try:
            ranks, acc = (int(v) for v in value.lower().split("x"))
        except ValueError:
            parser.error(f"--timing-settings takes RANKSxACCUMULATION pairs such as 8x4, got {value!r}")
        timed.append((ranks, acc))
    old = baseline_planner(args.baseline) if args.baseline else None
    sizes, lengths = corpus(args.documents)
    layout = MixtureLayout(sizes)
    rows = {"lit_balance padded": ours(sizes, lengths, False), "lit_balance packed": ours(sizes, lengths, True)}
    # sample weights corrected by each component's mean length: token shares on average, not per step
    means = [lengths[o:o + n].mean() for o, n in zip(np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)]
    corrected = np.asarray(TARGETS) / np.asarray(means)
    orders = (("interleave_datasets", interleave_order(sizes)), ("Megatron blend", megatron_order(sizes)),
              ("interleave_datasets, length-corrected", interleave_order(sizes, tuple(corrected / corrected.sum()))))
    for name, order in orders:
        for packing in (False, True):
            rows[f"{name} {'packed' if packing else 'padded'}"] = _sample_weighted(order, lengths, layout, packing)
    lines = [f"{args.documents} documents; targets {dict(zip(NAMES, TARGETS))} by tokens; {RANKS} ranks; steps of "
             f"{RANKS * ACC * MAX_TOKENS} token slots; load average {os.getloadavg()[0]:.1f} at the start", "",
             "| plan | web dev. max / p95 (pp) | code | books | U | steps >= 256k |", "|---|---|---|---|---|---|",
             *(_row(name, r) for name, r in rows.items())]
    for name in ("interleave_datasets padded", "Megatron blend padded"):
        share = rows[name]["share"]
        lines += ["", f"{name.split()[0]}: token shares over the epoch " + " / ".join(f"{100 * s:.0f}" for s in share)]
    scales = three_scales(args.scales_documents, old) if args.scales_documents else []
    if scales:
        head = ("| targets | ranks | accumulation | layout | mixture U / worst step / rank imbalance / steps | "
                "one corpus |")
        cpu = "mixture CPU s" + (f" (this / {args.baseline})" if old else "")
        lines += ["", f"three scales ({args.scales_documents} documents; medians {list(SCALE_MEDIANS)} tokens; "
                  f"documents in proportion {list(SCALE_TARGETS)}; max_tokens={SCALE_MAX_TOKENS}): the mixture against "
                  "the same chosen documents planned as one corpus" +
                  (f", and the mixture of {args.baseline}" if old else ""), "",
                  head + (f" {args.baseline} mixture |" if old else "") + f" {cpu} |",
                  "|---|---|---|---|---|---|---|" + ("---|" if old else ""),
                  *(_scales_row(r, args.baseline if old else None) for r in scales)]
    lines += ["", f"planning time of one epoch: medians of {args.repeats} runs, the revisions alternating (wall and CPU "
              "seconds, and CPU seconds per million chosen documents; goal 0.6 s per million)", "",
              "| documents | chosen | ranks | accumulation | plan | revision | wall s | CPU s | CPU s per million |",
              "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    timing = []
    for count in args.timing_documents:
        sizes, lengths = corpus(count, seed=1)
        for (ranks, acc), packing in ((t, packing) for packing in (False, True) for t in timed):
            runs = [("this", None)] + ([(args.baseline, old)] if old else [])
            times: dict[str, list[tuple[float, float, int]]] = {revision: [] for revision, _ in runs}
            for _ in range(args.repeats):
                for revision, planner in runs:
                    r = ours(sizes, lengths, packing, planner, ranks, acc)
                    times[revision].append((r["seconds"], r["cpu_seconds"], r["documents"]))
            for revision, measured in times.items():
                wall, cpu = (float(np.median([m[i] for m in measured])) for i in (0, 1))
                chosen = measured[0][2]
                timing.append({"documents": count, "chosen": chosen, "ranks": ranks, "accumulate_grad_batches": acc,
                               "packing": packing, "revision": revision, "wall_s": wall, "cpu_s": cpu,
                               "cpu_s_per_million": cpu / chosen * 1e6})
                lines.append(f"| {count:,} | {chosen:,} | {ranks} | {acc} | {'packed' if packing else 'padded'} | "
                             f"{revision} | {wall:.2f} | {cpu:.2f} | {cpu / chosen * 1e6:.2f} |")
                print(lines[-1], flush=True)
    results = {"settings": vars(args), "rows": {name: {k: np.asarray(v).tolist() for k, v in r.items()} for name, r in rows.items()},
               "three_scales": scales, "planning_time": timing}
    return write_report(args.output_dir, "benchmarks.mixtures", argv, results, markdown="\n".join(lines))


if __name__ == "__main__":
    main()
