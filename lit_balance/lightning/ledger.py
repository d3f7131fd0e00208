"""The ledger of an epoch (public home: :mod:`lit_balance.ledger`): which documents every rank trains on at every optimizer step, written before training.

The plan of an epoch is a pure function of (lengths, settings, seed, epoch, num_replicas) (:mod:`lit_balance.plan`), so
what each rank reads at each micro-step is known without a GPU and without running anything. :func:`ledger_columns`
lays it out as one row per document per micro-batch, built with NumPy from the plan's arrays (no Python loop per
document); :func:`write_ledger` writes it as Parquet (pyarrow, the ``stores`` extra) with a JSON header of the
settings and fingerprints in the file's key-value metadata (key ``lit_balance.ledger``); :func:`read_ledger` reads it back and
:func:`check_ledger_header` compares a header with a run. :class:`lit_balance.callbacks.LedgerCheck` checks, while
training, that every rank received exactly the ledger's documents.

Columns (one row per document of a micro-batch, in the order the micro-batches run: micro-step, then rank, then the
rows of the micro-batch):

========================  =======  ======================================================================================
``epoch``                 int32    the epoch
``optimizer_step``        int64    ``first_optimizer_step + k``: the plan's optimizer step ``k`` of the epoch; skipped
                                   steps (``skip_steps``) are absent, the numbering keeps them
``micro_step``            int64    the micro-step of the epoch (Lightning's ``batch_idx``), counted from its start;
                                   skipped micro-steps are not counted
``rank``                  int32    the data-parallel rank that runs the micro-batch
``micro_batch``           int32    the micro-batch's place in its rank's optimizer step, ``[0, accumulate_grad_batches)``
``row``                   int32    the document's place in its micro-batch (a padded row, or a document of a packed row)
``sample``                int64    the sampler's index (what a batch's ``indices`` carries)
``component``             dict     the component's name (``train`` for one corpus)
``document``              int64    the document's index in its component (the component's training split)
``copy``                  int16    which read of the document in the epoch's sample space (mixture ``max_repetition``)
``tokens``                int32    tokens planned (after truncation)
``supervised_tokens``     int32    next-token targets of the row (0 for a fill row, whose labels are ignored)
``fill``                  bool     a fill row: a duplicate that only gives every rank the same number of micro-batches
``repeated``              bool     ``fill`` or ``copy > 0``: the document was already read earlier in the epoch
========================  =======  ======================================================================================

With the dataset (a DataModule's training split), also: ``corpus_document`` (index in the component's corpus, before
the train/validation split), ``store_document`` (index in its store), ``store_file`` (dict: the store's file) and
``file_document`` (the document's number within that file: an Arrow row, a Megatron or datatrove document),
``document_tokens`` (its whole length) and ``truncated`` (fewer tokens planned than the document holds, cut by
``max_length`` or ``too_long="truncate"``; a document is never split over several micro-batches).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from lit_balance.errors import InputValueError
from lit_balance.lightning.resume_checks import data_identity

__all__ = ["LEDGER_KEY", "LEDGER_VERSION", "check_ledger_header", "ledger_columns", "ledger_header", "read_ledger",
           "step_documents", "write_datamodule_ledger", "write_ledger"]

#: Schema metadata key of the ledger's JSON header.
LEDGER_KEY = b"lit_balance.ledger"
#: Version of the ledger's layout (columns and header).
LEDGER_VERSION = 1
#: Header entries a run must match for its ledger to describe it (what :func:`check_ledger_header` compares).
_RUN_KEYS = ("epoch", "num_replicas", "accumulate_grad_batches", "first_micro_step", "micro_steps", "num_samples",
             "lengths_sha256", "settings", "mixture", "skip_micro_steps", "replaced_steps")
#: What a header written before an entry existed means by its absence.
_ABSENT = {"skip_micro_steps": [], "replaced_steps": []}


def _import_pyarrow() -> Any:
    try:
        import pyarrow as pa
        import pyarrow.parquet  # noqa: F401
    except ImportError as error:  # pragma: no cover - pyarrow comes with the stores and test extras
        raise ImportError('writing or reading a ledger needs pyarrow: pip install "lit_balance[stores]"') from error
    return pa


def _first_step(sampler: Any, epoch: int, first_optimizer_step: int | None) -> int:
    """The run's optimizer steps before ``epoch``: as given, else the sampler's count (0 where it has none)."""
    if first_optimizer_step is not None:
        return int(first_optimizer_step)
    if epoch != sampler.epoch:
        return 0
    counted = sampler.first_optimizer_step
    return 0 if counted is None else int(counted)


def ledger_header(sampler: Any, *, epoch: int | None = None, first_optimizer_step: int | None = None,
                  data: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ledger's header: the settings and fingerprints of ``sampler``'s plan of ``epoch``, plain JSON types.

    Returns:
        ``{"version", "epoch", "num_replicas", "accumulate_grad_batches", "first_micro_step", "micro_steps",
        "first_optimizer_step", "optimizer_steps", "num_samples", "lengths_sha256", "settings", "mixture",
        "rank_speeds", "cost_model", "data", "skip_micro_steps", "skip_steps", "replaced_steps"}``;
        ``first_micro_step`` is the
        micro-step at which this world size's plan starts (above 0 after a resume on another number of ranks: the
        micro-steps before it ran on the old ranks and are not in this ledger); ``micro_steps`` the epoch's micro-steps
        trained (``len(sampler)``); ``optimizer_steps`` the plan's, skipped ones counted; ``skip_micro_steps`` the
        skipped ranges as epoch micro-steps of the plan, ``skip_steps`` as optimizer steps of the run (``[a, b)``);
        ``replaced_steps`` the ranges of ``skip_steps(..., replace=True)`` replaced in the epoch (optimizer steps of the
        run ``[a, b)``: from ``a`` on, the rows are the re-planned rest, numbered without a gap).
    """
    epoch = sampler.epoch if epoch is None else int(epoch)
    first_optimizer_step = _first_step(sampler, epoch, first_optimizer_step)
    settings = sampler.settings
    acc = int(settings.accumulate_grad_batches)
    current = epoch == sampler.epoch
    first = int(sampler.first_micro_step) if current else 0
    micro_steps = first + sum(part.num_micro_steps for part in sampler.plan_parts(epoch)) if not current else \
        len(sampler)
    skips = [[int(a), int(b)] for a, b in sampler.skip_micro_steps] if current else []
    plan_steps = (int(sampler.first_plan_micro_step) + sum(part.num_micro_steps for part in sampler.plan_parts())
                  if skips else int(micro_steps))
    speeds = sampler.rank_speeds
    return {
        "version": LEDGER_VERSION, "epoch": epoch, "num_replicas": int(sampler.num_replicas),
        "accumulate_grad_batches": acc, "first_micro_step": first, "micro_steps": int(micro_steps),
        "first_optimizer_step": int(first_optimizer_step), "optimizer_steps": -(-plan_steps // acc),
        "num_samples": int(len(sampler.lengths)), "lengths_sha256": sampler.lengths_sha256,
        "settings": settings.to_dict(), "mixture": sampler.mixture.to_dict(),
        "rank_speeds": None if speeds is None else [float(s) for s in speeds],
        "cost_model": repr(sampler.cost_model), "data": None if data is None else dict(data),
        "skip_micro_steps": skips,
        "skip_steps": [[int(first_optimizer_step) + a // acc, int(first_optimizer_step) + -(-b // acc)]
                       for a, b in skips],
        "replaced_steps": [[int(first_optimizer_step) + a // acc, int(first_optimizer_step) + b // acc]
                           for a, b in (sampler.replaced_micro_steps if current else ())],
    }


def _part_columns(plan: Any, base: int, acc: int) -> dict[str, np.ndarray]:
    """The rows of one part of an epoch's plan (micro-steps from ``base``), in running order: sample, fill, the
    micro-step, rank and row of each."""
    steps, ranks = plan.assignment.shape
    batches = plan.assignment.reshape(-1)  # micro-step-major, then rank
    lo = plan.batch_offsets[batches]
    sizes = plan.batch_offsets[batches + 1] - lo
    total = int(sizes.sum())
    starts = np.zeros(batches.shape[0], dtype=np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    entry = np.repeat(np.arange(batches.shape[0], dtype=np.int64), sizes)
    position = np.arange(total, dtype=np.int64) - starts[entry]
    at = lo[entry] + position
    micro_step = base + entry // ranks
    return {"micro_step": micro_step, "rank": (entry % ranks).astype(np.int32),
            "micro_batch": (micro_step % acc).astype(np.int32), "row": position.astype(np.int32),
            "sample": plan.rows[at], "fill": plan.is_fill[at]}


def _ledger_parts(sampler: Any, epoch: int | None, first_optimizer_step: int | None) -> Any:
    """Yield the ledger's columns (the sampler's, without the dataset's) one part of the epoch's plan at a time (one
    window of an epoch planned in windows), in running order."""
    epoch = sampler.epoch if epoch is None else int(epoch)
    first_optimizer_step = _first_step(sampler, epoch, first_optimizer_step)
    acc = int(sampler.settings.accumulate_grad_batches)
    current = epoch == sampler.epoch
    base = int(sampler.first_plan_micro_step) if current else 0
    skips = sampler.skip_micro_steps if current else ()
    lengths, supervised_lengths = np.asarray(sampler.lengths), sampler.supervised_lengths
    for plan in sampler.plan_parts(epoch):
        columns = _part_columns(plan, base, acc)
        base += plan.num_micro_steps
        plan_step = columns["micro_step"]
        if skips:  # skipped steps are absent; micro_step counts what trains (Lightning's batch_idx)
            keep = np.ones(plan_step.shape[0], dtype=bool)
            trained = plan_step.copy()
            for a, b in skips:
                keep &= (plan_step < a) | (plan_step >= b)
                trained -= np.clip(plan_step - a, 0, b - a)
            columns = {k: v[keep] for k, v in columns.items()}
            plan_step, columns["micro_step"] = plan_step[keep], trained[keep]
        sample, fill = columns.pop("sample"), columns.pop("fill")
        n = sample.shape[0]
        component, document, copy = sampler.locate(sample)
        tokens = lengths[sample].astype(np.int32)
        supervised = (tokens - 1) if supervised_lengths is None else \
            np.asarray(supervised_lengths)[sample].astype(np.int32)
        micro_step = columns.pop("micro_step")
        yield {"epoch": np.full(n, epoch, dtype=np.int32),
               "optimizer_step": plan_step // acc + int(first_optimizer_step), "micro_step": micro_step, **columns,
               "sample": sample, "component": component.astype(np.int32), "document": document,
               "copy": copy.astype(np.int16), "tokens": tokens,
               "supervised_tokens": np.where(fill, 0, supervised).astype(np.int32), "fill": fill,
               "repeated": fill | (copy > 0)}


def ledger_columns(sampler: Any, *, dataset: Any = None, epoch: int | None = None,
                   first_optimizer_step: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, tuple[str, ...]]]:
    """The ledger of ``sampler``'s plan of ``epoch`` as NumPy columns (see the module's table).

    Every rank's micro-batches, as the sampler plans them (the same on every rank); after
    :meth:`~lit_balance.BalancedBatchSampler.load_state_dict` on another number of ranks, the micro-steps of this
    world size's plan (from ``first_micro_step``). An epoch planned in windows is laid out window by window.

    Args:
        sampler: a :class:`~lit_balance.BalancedBatchSampler` (or a mixture's), with the ``accumulate_grad_batches``
            of the run.
        dataset: the dataset the sampler's indices read (a DataModule's ``train_dataset``), which adds where each
            document comes from (``document_origins``); None: the sampler's columns only.
        epoch: the epoch (default: the sampler's).
        first_optimizer_step: optimizer steps of the run before this epoch (the ``optimizer_step`` of the epoch's
            first step); default: the sampler's count (:attr:`~lit_balance.BalancedBatchSampler.first_optimizer_step`,
            0 where it has none).

    Returns:
        ``(columns, dictionaries)``: ``columns`` maps each column's name to an array ``[num_rows]``; ``component`` and
        ``store_file`` are int32 codes into ``dictionaries["component"]`` / ``dictionaries["store_file"]``.
    """
    if sampler.plan_pieces(epoch) is not None:
        raise InputValueError("the ledger lists whole documents per micro-batch, and under a length warm-up "
                              "(max_length_schedule) the plan's rows are pieces of documents: leave the ledger "
                              "(LedgerCheck, lit-balance plan --ledger) out of a run with max_length_schedule, or "
                              "leave max_length_schedule unset", parameter="max_length_schedule")
    parts = list(_ledger_parts(sampler, epoch, first_optimizer_step))
    out = {k: np.concatenate([p[k] for p in parts]) if len(parts) != 1 else parts[0][k] for k in parts[0]}
    sample, tokens = out["sample"], out["tokens"]
    dictionaries = {"component": tuple(sampler.mixture.names)}
    if dataset is not None:
        origins, files = dataset.document_origins(sample)
        out.update(origins)
        out["truncated"] = tokens < origins["document_tokens"]
        dictionaries["store_file"] = files
    return out, dictionaries


def write_ledger(path: str | os.PathLike, sampler: Any, *, dataset: Any = None, epoch: int | None = None,
                 first_optimizer_step: int | None = None, data: Mapping[str, Any] | None = None,
                 compression: str = "zstd") -> dict[str, Any]:
    """Write the ledger of ``sampler``'s plan of ``epoch`` to ``path`` (Parquet), for every rank at once.

    Args:
        path: the Parquet file to write (replaced).
        sampler, dataset, epoch, first_optimizer_step: as :func:`ledger_columns`.
        data: what the documents are (e.g. :func:`lit_balance.lightning.resume_checks.data_identity` of a DataModule),
            kept in the header.
        compression: Parquet compression codec (pyarrow's names: ``"zstd"``, ``"snappy"``, ``"none"``).

    Returns:
        The header written (:func:`ledger_header`), with ``"rows"``, the rows written.

    Raises:
        ImportError: pyarrow is not installed (naming the extra).

    Example:
        >>> from lit_balance import BalancedBatchSampler
        >>> s = BalancedBatchSampler([95] * 5 + [20] * 5, max_tokens=100, num_replicas=2, rank=0, shuffle=False)
        >>> write_ledger(getfixture("tmp_path") / "ledger.parquet", s)["rows"]
        10
    """
    pa = _import_pyarrow()
    header = ledger_header(sampler, epoch=epoch, first_optimizer_step=first_optimizer_step, data=data)
    if dataset is None:  # window by window, one row group each: no copy of the whole ledger in memory
        parts = ((part, {"component": tuple(sampler.mixture.names)})
                 for part in _ledger_parts(sampler, epoch, first_optimizer_step))
    else:
        parts = iter([ledger_columns(sampler, dataset=dataset, epoch=epoch,
                                     first_optimizer_step=first_optimizer_step)])
    rows, writer = 0, None
    partial = f"{os.fspath(path)}.partial"
    try:
        for columns, dictionaries in parts:
            arrays = [pa.DictionaryArray.from_arrays(pa.array(values, type=pa.int32()),
                                                     pa.array(list(dictionaries[name]), type=pa.string()))
                      if name in dictionaries else pa.array(values) for name, values in columns.items()]
            table = pa.Table.from_arrays(arrays, names=list(columns))
            if writer is None:
                # integers delta-encoded (steps, ranks and rows run in order), no dictionary tried on columns of many
                # values
                encoding = {name: "DELTA_BINARY_PACKED" for name, values in columns.items()
                            if name not in dictionaries and values.dtype.kind in "iu"}
                writer = pa.parquet.ParquetWriter(partial, table.schema, compression=compression,
                                                  use_dictionary=list(dictionaries), column_encoding=encoding)
            writer.write_table(table)
            rows += table.num_rows
        header["rows"] = rows
        writer.add_key_value_metadata({LEDGER_KEY: json.dumps(header).encode()})
        writer.close()
        writer = None
        os.replace(partial, path)
    finally:
        if writer is not None:
            writer.close()
        if os.path.exists(partial):
            os.remove(partial)
    return header


def write_datamodule_ledger(path: str | os.PathLike, datamodule: Any, *, num_replicas: int,
                            accumulate_grad_batches: int = 1, epoch: int = 0,
                            first_optimizer_step: int | None = None,
                            sampler_state: Mapping[str, Any] | None = None,
                            compression: str = "zstd") -> dict[str, Any]:
    """Write the ledger of a :class:`~lit_balance.BalancedTextDataModule`'s training split for ``num_replicas`` ranks
    (after :meth:`~lit_balance.BalancedTextDataModule.setup`): the plan training on that world runs
    (:meth:`~lit_balance.BalancedTextDataModule.training_sampler`), with where each document comes from.

    Args:
        path: the Parquet file to write.
        datamodule: the DataModule, set up.
        num_replicas: data-parallel ranks of the run.
        accumulate_grad_batches: the Trainer's.
        epoch: the epoch (ignored with ``sampler_state``, which holds it).
        first_optimizer_step: as :func:`ledger_columns`.
        sampler_state: the training sampler's state saved in a checkpoint
            (``checkpoint["BalancedTextDataModule"]["train_sampler"]``): the ledger of the rest of its epoch as a
            resume on ``num_replicas`` ranks runs it (from ``first_micro_step``, the micro-step it resumes at).
        compression: as :func:`write_ledger`.

    Raises:
        RuntimeError: called before ``setup``.
        ValueError: ``max_tokens="auto"`` (the budget is measured at the fit's start: write the ledger from the
            training sampler then, or pass the budget), or as the sampler.
    """
    if datamodule.train_dataset is None:
        raise RuntimeError("write_datamodule_ledger needs the training split: call datamodule.setup('fit') first")
    if datamodule.max_tokens == "auto":
        raise InputValueError("the ledger of max_tokens='auto' is known once the budget is measured: pass the budget "
                              "the fit uses (max_tokens=N), or write the ledger of trainer.datamodule.train_sampler "
                              "with write_ledger", parameter="max_tokens")
    settings = datamodule.settings.replace(accumulate_grad_batches=accumulate_grad_batches)
    sampler = datamodule.training_sampler(settings, num_replicas, cost_model=datamodule.cost_model)
    if sampler_state is not None:
        sampler.load_state_dict(dict(sampler_state))
    else:
        sampler.set_epoch(epoch)
    if datamodule.skip_steps is not None:  # as the fit applies them
        ranges = datamodule.skip_steps
        first = sampler.first_optimizer_step if first_optimizer_step is None else int(first_optimizer_step)
        if sampler_state is None and first is not None:  # an epoch's start: the earlier steps ran in earlier epochs
            ranges = [(max(a, first), b) for a, b in ranges if b > first]
        replace = bool(datamodule.replace)
        if replace and sampler_state is None and first is not None:  # ranges begun before the epoch were replaced
            ranges = [(a, b) for a, b in datamodule.skip_steps if a >= first]
        sampler.skip_steps(ranges, first_optimizer_step=first_optimizer_step, replace=replace)
    return write_ledger(path, sampler, dataset=datamodule.train_dataset, first_optimizer_step=first_optimizer_step,
                        data=data_identity(datamodule), compression=compression)


def read_ledger(path: str | os.PathLike, *, columns: list[str] | None = None,
                rank: int | None = None) -> tuple[Any, dict[str, Any]]:
    """Read a ledger: ``(table, header)``, a ``pyarrow.Table`` (``columns`` of it; the rows of ``rank`` only when
    given) and the JSON header.

    Raises:
        ValueError: the file is not a ledger (no header), or one of another version, naming the file.
    """
    pa = _import_pyarrow()
    metadata = pa.parquet.read_metadata(str(path)).metadata or {}  # the file's key-value metadata
    if LEDGER_KEY not in metadata:
        raise InputValueError(f"{path} is not a ledger: its Parquet schema has no {LEDGER_KEY.decode()!r} header; "
                              "write it with lit_balance.ledger.write_ledger or lit-balance plan --ledger",
                              parameter="ledger")
    header = json.loads(metadata[LEDGER_KEY])
    if header.get("version") != LEDGER_VERSION:
        raise InputValueError(f"{path} is a ledger of version {header.get('version')}, this library reads version "
                              f"{LEDGER_VERSION}; write it again", parameter="ledger")
    if rank is None:
        return pa.parquet.read_table(str(path), columns=columns), header
    # one row group at a time, this rank's rows kept: memory of one rank's share plus one row group
    names = columns if columns is None or "rank" in columns else [*columns, "rank"]
    handle = pa.parquet.ParquetFile(str(path))
    parts = []
    for group in range(handle.num_row_groups):
        part = handle.read_row_group(group, columns=names)
        parts.append(part.filter(pa.array(part.column("rank").to_numpy() == int(rank))))
    table = pa.concat_tables(parts) if parts else handle.schema_arrow.empty_table()
    return (table if columns is None or "rank" in columns else table.drop_columns(["rank"])), header


def check_ledger_header(header: Mapping[str, Any], run: Mapping[str, Any], *, source: str = "the ledger") -> None:
    """Raise when ``header`` (a ledger's) does not describe ``run`` (:func:`ledger_header` of the run's sampler).

    Raises:
        ValueError: naming every setting that differs, with both values, and what to do.
    """
    def get(d: Mapping[str, Any], k: str) -> Any:
        return d.get(k, _ABSENT.get(k))

    diff = [f"{k}: ledger {get(header, k)!r}, run {get(run, k)!r}" for k in _RUN_KEYS if get(header, k) != get(run, k)]
    if diff:
        first = diff[0].split(":")[0]
        raise InputValueError(f"{source} was written for other settings than this run's: " + "; ".join(diff) +
                              ". Write the ledger again for this run's settings (lit-balance plan --ledger, or "
                              "lit_balance.ledger.write_ledger of the run's training sampler)", parameter=first)


def step_documents(table: Any) -> dict[tuple[int, int], np.ndarray]:
    """``{(micro_step, rank): int64 [rows] samples}`` of a ledger table (``micro_step``, ``rank``, ``sample``
    columns), in running order: each micro-batch's documents."""
    micro = table.column("micro_step").to_numpy()
    rank = table.column("rank").to_numpy()
    sample = table.column("sample").to_numpy()
    if not micro.size:
        return {}
    key = micro * (int(rank.max()) + 1) + rank
    cuts = np.flatnonzero(np.diff(key)) + 1
    starts = np.concatenate([[0], cuts])
    return {(int(micro[s]), int(rank[s])): part for s, part in zip(starts.tolist(), np.split(sample, cuts))}
