"""``lit-balance tokenize``: raw text to a datatrove token store, on datatrove's own executors.

The pipeline is datatrove's: a reader (``JsonlReader``, or ``ParquetReader``) then ``DocumentTokenizer``, run by
``LocalPipelineExecutor`` with one task per input-file shard and one worker per core. The output folder then holds,
per task, ``NNNNN_unshuffled.ds`` (token ids, ``uint16`` for vocabularies up to 65,536 ids, else ``uint32``),
``.ds.index`` (``uint64`` document ends), ``.ds.metadata`` (tokenizer, token size, token count) and, with
``save_loss_metadata``, ``.ds.loss`` (one byte per token: 1 a target, 0 not; rows carrying datatrove's
``no_loss_ranges`` metadata, e.g. a prompt's characters, are masked there). Training then reads that folder in
place: :class:`lit_balance.data.stores.datatrove.DatatroveSource`.

The output folder also holds ``tokenizer_identity.json``, the identity of the tokenizer
(:mod:`lit_balance.data.tokenizer_identity`): a run that reads the store with another tokenizer is refused, also after
the folder was moved. The tokenizer written beside the output (``tokenizer.json``) is the given one with truncation
and padding cleared (datatrove keeps a file's own: the package's tokenizer would cut every document to 128 tokens)
and, unless ``add_special_tokens``, its post-processor cleared too. With the defaults the ids are those of the library's own
tokenization cache for the same documents (``add_special_tokens=False``: no ``[CLS]``/``[SEP]``, no EOS);
``add_special_tokens=True`` gives the cache's ``add_special_tokens=True`` ids; ``eos_token`` (datatrove's option,
one EOS id after each document) has no counterpart in the cache. Differences from the cache besides: a JSONL row
whose text is empty is skipped by datatrove's reader (the cache counts it as empty and drops it too); a row whose
text tokenizes to nothing is kept as a 0-token document in the store; the store's document order is task by task
(files ``rank::tasks`` of the sorted input list per task), not the input's order.

``--executor`` picks datatrove's executor: ``local`` (``LocalPipelineExecutor``, the default), ``ray``
(``RayPipelineExecutor`` on the Ray cluster that ``ray.init()`` finds: ``--ray-address`` or ``RAY_ADDRESS``, else a
local Ray with ``--workers`` CPUs) or ``slurm`` (``SlurmPipelineExecutor``: writes datatrove's job script into the
logging folder and submits it with ``sbatch``; the run goes on after the command returns). ``--executor-options``
(JSON) is passed to the executor as keyword arguments (Slurm: ``partition``, ``time``, ``cpus_per_task``,
``sbatch_args``, ...; Ray: ``cpus_per_task``, ``mem_per_cpu_gb``, ...). Every executor writes the same store.

JSONL rows that cannot be used are skipped and counted by cause (invalid UTF-8, invalid JSON, not an object, no text
key, text not a string, empty text; ``lit_balance.cli._tokenize_reader``), the file's good rows kept; the summary
names each cause and count. A run that writes no document is an error naming the input and the text key; a logging
folder that holds completion markers (of another run) is refused, since datatrove would skip those tasks.

Run:
    lit-balance tokenize data/corpus/ --output-folder data/tokens          # every *.jsonl* file of the folder
    lit-balance tokenize corpus.jsonl --output-folder data/tokens --tasks 1
    lit-balance plan --corpus '{"class_path": "lit_balance.data.stores.datatrove.DatatroveSource",
                                "init_args": {"paths": "data/tokens"}}' --num-replicas 8 --max-tokens 4096
    lit-balance fit --config conf/cli/fit_cpu.yaml --data.corpus='{"class_path": "...DatatroveSource", ...}'
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lit_balance.data.tokenizer_identity import SIDECAR_FILE, TokenizerIdentity, identity_of_file, write_sidecar
from lit_balance.errors import InputFileNotFoundError, InputTypeError, InputValueError

__all__ = ["TokenizeResult", "datatrove_pipeline", "plain_tokenizer_file", "run_tokenize", "tokenize_corpus",
           "tokenize_parser"]

TOKENIZER_FILE = "tokenizer.json"  # the plain copy of the tokenizer, written in the output folder
_READERS = ("jsonl", "parquet")
EXECUTORS = ("local", "ray", "slurm")
#: Seconds to wait for a Ray cluster or for ``sbatch`` before the command gives up with an error.
CONNECT_TIMEOUT_S = 60.0


def _require_datatrove() -> None:
    try:
        import datatrove  # noqa: F401
    except ImportError as error:
        raise ImportError('lit-balance tokenize runs datatrove, which is not installed: pip install -e '
                          '".[datatrove]" (in a clone of lit_balance)') from error


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def plain_tokenizer_file(tokenizer: str | os.PathLike | None, path: str | os.PathLike,
                         add_special_tokens: bool = False) -> Path:
    """Write a copy of a ``tokenizer.json`` with truncation and padding cleared, for datatrove to load.

    Args:
        tokenizer: path of a ``tokenizer.json``; None for the package's (BERT-uncased WordPiece, 30,522 ids).
        path: where the copy goes (its folder is created).
        add_special_tokens: keep the tokenizer's post-processor (e.g. BERT's ``[CLS] ... [SEP]``); False clears it,
            so that the ids are those of ``encode(text, add_special_tokens=False)``, the library's default.

    Returns:
        ``path``.

    Raises:
        FileNotFoundError: ``tokenizer`` is not a file.
        ValueError: ``tokenizer`` is not a valid ``tokenizer.json``.
    """
    import tokenizers

    from lit_balance.data.tokenizer import builtin_tokenizer

    if tokenizer is None:
        backend = builtin_tokenizer()
    else:
        if not Path(tokenizer).is_file():
            raise InputFileNotFoundError(f"tokenizer {str(tokenizer)!r} is not a file; pass the path of a "
                                         "tokenizer.json (--tokenizer)", parameter="tokenizer")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer))
        except Exception as error:
            raise InputValueError(f"tokenizer file {str(tokenizer)!r} is not a valid tokenizer.json: {error}",
                                  parameter="tokenizer") from error
    backend.no_truncation()
    backend.no_padding()
    if not add_special_tokens:
        backend.post_processor = None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    backend.save(str(path))
    return path


def _input_folder(input_path: str | os.PathLike, glob_pattern: str | None) -> tuple[str, str | None, int]:
    """``(data folder, glob pattern, number of files)`` for datatrove's reader from a file or a folder."""
    path = Path(input_path).expanduser()
    if path.is_file():
        if glob_pattern is not None:
            raise InputValueError(f"glob_pattern={glob_pattern!r} selects files in a folder, but the input "
                                  f"{str(path)!r} is a file; pass its folder, or leave glob_pattern out",
                                  parameter="glob_pattern")
        return str(path.parent.resolve()), glob.escape(path.name), 1
    if not path.is_dir():
        raise InputFileNotFoundError(f"input {str(input_path)!r} is neither a file nor a folder", parameter="input")
    pattern = glob_pattern or "**"
    files = [p for p in glob.glob(pattern, root_dir=path, recursive=True) if (path / p).is_file()]
    if not files:
        raise InputFileNotFoundError(f"input folder {str(path)!r} holds no file matching {pattern!r}; pass "
                                     "--glob-pattern (e.g. '*.jsonl')", parameter="glob_pattern")
    return str(path.resolve()), glob_pattern, len(files)


def datatrove_pipeline(input_folder: str, output_folder: str, tokenizer_file: str | os.PathLike, *,
                       glob_pattern: str | None = None, reader: str = "jsonl", text_key: str = "text",
                       eos_token: str | None = None, save_loss_metadata: bool = False,
                       shuffle_documents: bool = False, seed: int | None = None) -> list[Any]:
    """The datatrove steps that tokenize a corpus into a store: a reader, then ``DocumentTokenizer``.

    Give the list to any datatrove executor: ``LocalPipelineExecutor`` (:func:`tokenize_corpus`),
    ``SlurmPipelineExecutor`` or ``RayPipelineExecutor``. Paths may be any fsspec URL datatrove reads (``s3://...``).

    Args:
        input_folder: folder of the input files (datatrove gives task ``r`` of ``T`` the sorted files ``r::T``).
        output_folder: where the ``.ds`` files go.
        tokenizer_file: a ``tokenizer.json`` without truncation or padding (:func:`plain_tokenizer_file`).
        glob_pattern: which files of ``input_folder`` to read (datatrove's reader option); None: every file.
        reader: ``"jsonl"`` (``JsonlReader``, ``.jsonl`` and compressed variants) or ``"parquet"``.
        text_key: the key (column) of the text.
        eos_token: datatrove's option: the text of a token appended to each document (e.g. ``"[SEP]"``); None
            appends nothing.
        save_loss_metadata: also write ``.ds.loss`` (one byte per token); a row's ``no_loss_ranges`` (a list of
            ``[start, end)`` character ranges) marks its tokens as no target.
        shuffle_documents: let datatrove shuffle the documents within each file (the sampler shuffles anyway).
        seed: datatrove's shuffling seed.

    Returns:
        The pipeline steps.

    Raises:
        ValueError: an unknown ``reader``.
        ImportError: datatrove is not installed (``pip install -e ".[datatrove]"`` in a clone).
    """
    _require_datatrove()
    from datatrove.pipeline.readers import JsonlReader, ParquetReader
    from datatrove.pipeline.tokens import DocumentTokenizer

    if reader not in _READERS:
        raise InputValueError(f"reader must be one of {', '.join(_READERS)}, got {reader!r}", parameter="reader")
    # add_file_path=False: JsonlReader would resolve each document's file path into its metadata, which the store
    # does not keep (one fsspec path resolution per document); ParquetReader has no such option
    if reader == "jsonl":
        from lit_balance.cli._tokenize_reader import CheckedJsonlReader

        read = CheckedJsonlReader(input_folder, glob_pattern=glob_pattern, text_key=text_key, add_file_path=False)
    else:
        read = ParquetReader(input_folder, glob_pattern=glob_pattern, text_key=text_key)
    tokenize = DocumentTokenizer(output_folder=output_folder, tokenizer_name_or_path=str(tokenizer_file),
                                 eos_token=eos_token, save_loss_metadata=save_loss_metadata,
                                 shuffle_documents=shuffle_documents, seed=seed)
    return [read, tokenize]


@dataclass(frozen=True)
class TokenizeResult:
    """What :func:`tokenize_corpus` wrote.

    Attributes:
        output_folder: the store's folder (pass it to ``DatatroveSource``).
        files: the ``.ds`` files written, sorted.
        num_documents: documents in the store (from the ``.ds.index`` files).
        num_tokens: tokens in the store.
        seconds: wall time of the executor's run (s).
        tasks: tasks run; workers: processes that ran them at once.
        skipped_rows: input rows skipped (JSONL: the sum of ``skipped``; Parquet: None, not counted).
        skipped: JSONL rows skipped per cause (``"invalid UTF-8"``, ``"no text key"``, ...; see
            ``lit_balance.cli._tokenize_reader.CAUSES``); the task logs name the first rows of each file.
        executor: ``"local"``, ``"ray"`` or ``"slurm"``.
        job_id: the Slurm job submitted (``executor="slurm"``: the run goes on after the command; the counts are
            then 0 and the store is written when the job ends), else None.
        logging_dir: datatrove's logging folder (task logs, statistics, the Slurm job script).
    """

    output_folder: str
    files: tuple[str, ...]
    num_documents: int
    num_tokens: int
    seconds: float
    tasks: int
    workers: int
    skipped_rows: int | None = None
    skipped: dict[str, int] | None = None
    executor: str = "local"
    job_id: str | None = None
    logging_dir: str | None = None

    @property
    def tokens_per_s(self) -> float:
        """Tokens written per second of the executor's run."""
        return self.num_tokens / self.seconds if self.seconds > 0 else float("inf")


@contextlib.contextmanager
def _one_tokenizer_thread_per_worker(workers: int) -> Iterator[None]:
    """With several workers, ``TOKENIZERS_PARALLELISM=false`` while they run (unless the caller set it).

    Each worker process would otherwise start the ``tokenizers`` thread pool of as many threads as cores, so one
    worker per core runs cores x workers threads and they fight for the cores: on 2 cores, 2 workers took 57 s on a
    150 MiB corpus with their own pools and 31 s with one thread each
    (``python -m benchmarks.tokenizing --peer datatrove``).
    """
    if workers < 2 or "TOKENIZERS_PARALLELISM" in os.environ:
        yield
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)


def _skipped_rows(logging_dir: Path) -> dict[str, int]:
    """Rows skipped per cause, summed over the tasks' statistics (``stats/NNNNN.json``) in ``logging_dir``."""
    counts: dict[str, int] = {}
    for path in sorted((logging_dir / "stats").glob("*.json")):
        for step in json.loads(path.read_text()):
            for key, value in (step.get("stats") or {}).items():
                if key.startswith("skipped: "):
                    total = value.get("total", 0) if isinstance(value, dict) else value
                    counts[key[len("skipped: "):]] = counts.get(key[len("skipped: "):], 0) + int(total)
    return counts


def _check_logging_dir(logging_dir: Path) -> None:
    """Refuse a logging folder with completion markers: datatrove would skip the tasks it marks done."""
    done = sorted((logging_dir / "completions").glob("*")) if (logging_dir / "completions").is_dir() else []
    if done:
        raise InputValueError(f"logging folder {str(logging_dir)!r} holds completion markers of another run "
                              f"({len(done)} task(s) marked done, e.g. {done[0].name}): datatrove would skip those "
                              "tasks and their documents would be missing from the store; pass a new --logging-dir "
                              "(or leave it out: OUTPUT/logs)", parameter="logging_dir")


def _within(seconds: float, what: str, run: Any) -> Any:
    """``run()`` in a daemon thread; its result, its exception, or an error naming ``what`` past ``seconds``."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = run()
        except BaseException as error:  # noqa: BLE001  handed to the caller
            box["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise InputValueError(what.format(seconds=seconds), parameter="executor")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _connect_ray(address: str | None, num_cpus: int, timeout_s: float) -> None:
    """Connect to the Ray cluster at ``address`` (or ``RAY_ADDRESS``), or start a local one with ``num_cpus``."""
    try:
        import ray
    except ImportError:
        raise ImportError('--executor ray runs datatrove\'s RayPipelineExecutor, which needs Ray: pip install -e '
                          '".[ray]" (in a clone of lit_balance)') from None
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None:  # in the main thread: Ray installs its signal handlers there
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
        return
    host_port = address.split("://", 1)[-1]
    if address != "auto" and ":" in host_port:
        import socket

        host, _, port = host_port.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=min(timeout_s, 10.0)).close()
        except (OSError, ValueError) as error:
            raise InputValueError(f"--ray-address {address!r}: no Ray cluster answers at {host_port} ({error}); start "
                                  "one there (ray start --head), or leave --ray-address and RAY_ADDRESS unset to run "
                                  "a local Ray", parameter="ray_address") from None
    try:
        ray.init(address=address, log_to_driver=False)
    except ConnectionError as error:
        raise InputValueError(f"--ray-address {address!r}: no Ray cluster found ({error}); start one (ray start "
                              "--head), or leave --ray-address and RAY_ADDRESS unset to run a local Ray",
                              parameter="ray_address") from None


def _executor(kind: str, steps: list[Any], *, tasks: int, workers: int, logging_dir: Path,
              options: dict[str, Any]) -> Any:
    """datatrove's executor of ``kind`` for ``steps``, with ``options`` passed through as keyword arguments."""
    import inspect

    from datatrove.executor import LocalPipelineExecutor

    if kind == "local":
        cls, kwargs = LocalPipelineExecutor, {"tasks": tasks, "workers": workers}
    elif kind == "ray":
        from datatrove.executor import RayPipelineExecutor

        cls, kwargs = RayPipelineExecutor, {"tasks": tasks, "workers": workers}
    else:
        from datatrove.executor import SlurmPipelineExecutor

        cls, kwargs = SlurmPipelineExecutor, {"tasks": tasks, "workers": workers if workers != tasks else -1,
                                              "job_name": "lit_balance_tokenize"}
        missing = [name for name in ("time", "partition") if name not in options]
        if missing:
            raise InputValueError(f"--executor slurm needs {' and '.join(missing)} in --executor-options (datatrove's "
                                  "SlurmPipelineExecutor: e.g. '{\"partition\": \"cpu\", \"time\": \"04:00:00\"}')",
                                  parameter="executor_options")
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "pipeline", "logging_dir"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise InputValueError(f"--executor-options: {cls.__name__} takes no {', '.join(map(repr, unknown))} (it takes "
                              f"{', '.join(sorted(accepted))})", parameter="executor_options")
    return cls(pipeline=steps, logging_dir=str(logging_dir), **{**kwargs, **options})


def tokenize_corpus(input_path: str | os.PathLike, output_folder: str | os.PathLike,
                    tokenizer: str | os.PathLike | None = None, *, glob_pattern: str | None = None,
                    reader: str = "jsonl", text_key: str = "text", tasks: int | None = None,
                    workers: int | None = None, add_special_tokens: bool = False, eos_token: str | None = None,
                    save_loss_metadata: bool = False, logging_dir: str | os.PathLike | None = None,
                    executor: str = "local", executor_options: dict[str, Any] | None = None,
                    ray_address: str | None = None, timeout_s: float = CONNECT_TIMEOUT_S) -> TokenizeResult:
    """Tokenize a corpus into a datatrove store with one of datatrove's executors.

    Args:
        input_path: a JSONL (or Parquet) file, or a folder of them.
        output_folder: the store's folder: must hold no ``.ds`` file yet (created if missing).
        tokenizer: path of a ``tokenizer.json``; None for the package's.
        glob_pattern: with a folder, which of its files to read (default: all, recursively).
        reader: ``"jsonl"`` or ``"parquet"``.
        text_key: key (column) of the text.
        tasks: datatrove tasks (each reads the sorted files ``rank::tasks`` and writes its own ``.ds``); default:
            the number of cores, at most the number of input files.
        workers: tasks run at once (processes; with Ray, the local Ray's CPUs when one is started); default:
            ``min(tasks, cores)``. Locally, with more than one, each tokenizes on one thread
            (``TOKENIZERS_PARALLELISM=false`` while they run, unless set already), so that the workers' thread pools
            do not oversubscribe the cores.
        add_special_tokens: keep the tokenizer's post-processor (:func:`plain_tokenizer_file`).
        eos_token: datatrove's ``eos_token`` (:func:`datatrove_pipeline`).
        save_loss_metadata: write ``.ds.loss`` files (:func:`datatrove_pipeline`).
        logging_dir: datatrove's logs, statistics and completion markers; default: ``<output_folder>/logs``. On Ray
            or Slurm, every node must reach it (and the output folder).
        executor: ``"local"``, ``"ray"`` or ``"slurm"`` (see the module docstring).
        executor_options: keyword arguments for datatrove's executor (Slurm needs ``partition`` and ``time``).
        ray_address: the Ray cluster (``ray.init(address=...)``); None: ``RAY_ADDRESS``, else a local Ray.
        timeout_s: seconds to wait for the Ray cluster or ``sbatch`` before giving up with an error.

    Returns:
        A :class:`TokenizeResult`.

    Raises:
        FileNotFoundError: the input does not exist or the folder holds no matching file.
        ValueError: ``tasks``/``workers`` below 1, more tasks than input files, the output folder holds ``.ds``
            files already, a logging folder with completion markers, an unknown executor or executor option, no Ray
            cluster or ``sbatch`` answering within ``timeout_s``, or no document written (naming the input and the
            text key).
        ImportError: datatrove (``pip install -e ".[datatrove]"`` in a clone) or, for Ray, ray
            (``pip install -e ".[ray]"``) is not installed.
    """
    import numpy as np

    if executor not in EXECUTORS:
        raise InputValueError(f"--executor must be one of {', '.join(EXECUTORS)}, got {executor!r}",
                              parameter="executor")
    options = dict(executor_options or {})
    if not isinstance(executor_options, (dict, type(None))):
        raise InputTypeError(f"--executor-options must be a JSON object (keyword arguments of datatrove's "
                             f"executor), got {executor_options!r:.80}", parameter="executor_options")
    _require_datatrove()
    input_folder, pattern, num_files = _input_folder(input_path, glob_pattern)
    for name, value in (("tasks", tasks), ("workers", workers)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InputValueError(f"{name} must be an int >= 1, got {value!r}", parameter=name)
    tasks = tasks if tasks is not None else max(1, min(_cores(), num_files))
    if tasks > num_files:
        raise InputValueError(f"tasks={tasks} but the input holds {num_files} file(s): datatrove gives each task "
                              "whole files, so a task would have none; split the corpus into at least as many "
                              "files, or lower --tasks", parameter="tasks")
    workers = workers if workers is not None else min(tasks, _cores())
    output = Path(output_folder).expanduser().resolve()
    blocking = next((p for p in (output, *output.parents) if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        got = "an existing file" if blocking == output else f"a path under the file {str(blocking)!r}"
        raise InputValueError(f"--output-folder {str(output_folder)!r}: expected a new or empty folder, got {got}; "
                              "pass a folder path as --output-folder", parameter="output_folder")
    existing = sorted(output.glob("*.ds")) if output.is_dir() else []
    if existing:
        raise InputValueError(f"output folder {str(output)!r} holds .ds files already ({existing[0].name}, ...); "
                              "expected a new or empty folder: pass another --output-folder", parameter="output_folder")
    logs = Path(logging_dir).expanduser().resolve() if logging_dir is not None else output / "logs"
    _check_logging_dir(logs)
    if executor == "slurm" and shutil.which("sbatch") is None:
        raise InputValueError("--executor slurm submits datatrove's job with sbatch, which is not on PATH: run the "
                              "command on a Slurm login node, or use --executor local or ray", parameter="executor")
    if executor == "ray":
        _connect_ray(ray_address, workers, timeout_s)
    tokenizer_file = plain_tokenizer_file(tokenizer, output / TOKENIZER_FILE, add_special_tokens)
    identity = identity_of_file(tokenizer_file)  # kept beside the store: survives moving the folder
    write_sidecar(output / SIDECAR_FILE, TokenizerIdentity(
        "the built-in tokenizer" if tokenizer is None else os.path.abspath(tokenizer), identity.sha256))
    steps = datatrove_pipeline(input_folder, str(output), tokenizer_file, glob_pattern=pattern, reader=reader,
                               text_key=text_key, eos_token=eos_token, save_loss_metadata=save_loss_metadata)
    runner = _executor(executor, steps, tasks=tasks, workers=workers, logging_dir=logs, options=options)
    start = time.perf_counter()
    if executor == "slurm":
        try:
            _within(timeout_s, "--executor slurm: sbatch did not answer within {seconds:.0f} s; check the cluster "
                    "(sinfo), or raise --timeout-s", runner.run)
        except subprocess.CalledProcessError as error:
            raise InputValueError(f"--executor slurm: sbatch refused datatrove's job script "
                                  f"({logs / 'launch_script.slurm'}): {error}; check --executor-options",
                                  parameter="executor_options") from None
        return TokenizeResult(str(output), (), 0, 0, time.perf_counter() - start, tasks, workers, None, None,
                              executor, str(runner.job_id), str(logs))
    with _one_tokenizer_thread_per_worker(workers if executor == "local" else 1):
        runner.run()
    seconds = time.perf_counter() - start
    files = tuple(sorted(str(p) for p in output.glob("*.ds")))
    ends = [np.fromfile(f + ".index", dtype="<u8") for f in files]
    num_documents = sum(len(e) for e in ends)
    num_tokens = sum(int(e[-1]) if len(e) else 0 for e in ends)
    skipped = _skipped_rows(logs) if reader == "jsonl" else None
    if num_documents == 0:
        why = ", ".join(f"{n} {cause}" for cause, n in sorted(skipped.items())) if skipped else "no row read"
        raise InputValueError(f"no document was written to {str(output)!r}: no row of {input_folder!r}"
                              f"{' (' + pattern + ')' if pattern else ''} has a non-empty text under the key "
                              f"{text_key!r} ({why}); check --text-key and the input", parameter="text_key")
    total = None if skipped is None else sum(skipped.values())
    return TokenizeResult(str(output), files, num_documents, num_tokens, seconds, tasks, workers, total, skipped,
                          executor, None, str(logs))


def tokenize_parser() -> Any:
    """The ``tokenize`` subcommand's parser (jsonargparse, errors first like the other subcommands)."""
    from lit_balance.cli.messages import ErrorFirstParser

    parser = ErrorFirstParser(allow_abbrev=False, prog="lit-balance tokenize",
                              description="Tokenize a JSONL (or Parquet) corpus into a datatrove token store with "
                                          "datatrove's LocalPipelineExecutor, then train from the store in place "
                                          "(DatatroveSource)")
    parser.add_argument("input", type=Path, help="a JSONL/Parquet file, or a folder of them")
    parser.add_argument("--output-folder", type=Path, required=True, help="the store's folder (new or empty)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a tokenizer.json (default: the package's BERT-uncased WordPiece)")
    parser.add_argument("--glob-pattern", type=str, default=None, help="with a folder: which files (default: all)")
    parser.add_argument("--reader", type=str, default="jsonl", help="jsonl or parquet")
    parser.add_argument("--text-key", type=str, default="text", help="the key (column) of the text")
    parser.add_argument("--tasks", type=int, default=None, help="datatrove tasks (default: cores, at most files)")
    parser.add_argument("--workers", type=int, default=None, help="tasks run at once (default: min(tasks, cores))")
    parser.add_argument("--add-special-tokens", type=bool, default=False,
                        help="keep the tokenizer's special tokens (BERT: [CLS] ... [SEP])")
    parser.add_argument("--eos-token", type=str, default=None, help="append this token after each document")
    parser.add_argument("--save-loss-metadata", type=bool, default=False,
                        help="write .ds.loss label masks (rows' no_loss_ranges)")
    parser.add_argument("--logging-dir", type=Path, default=None, help="datatrove's logs (default: OUTPUT/logs)")
    parser.add_argument("--executor", type=str, default="local",
                        help="datatrove's executor: local, ray (the Ray cluster ray.init() finds, else a local Ray "
                             "with --workers CPUs) or slurm (submits datatrove's job with sbatch)")
    parser.add_argument("--executor-options", type=str, default=None,
                        help="JSON object of keyword arguments for the executor (slurm: partition, time, "
                             "cpus_per_task, sbatch_args, ...; ray: cpus_per_task, mem_per_cpu_gb, ...)")
    parser.add_argument("--ray-address", type=str, default=None,
                        help="the Ray cluster (default: RAY_ADDRESS, else a local Ray)")
    parser.add_argument("--timeout-s", type=float, default=CONNECT_TIMEOUT_S,
                        help="seconds to wait for the Ray cluster or sbatch")
    return parser


def _options_json(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as error:
        raise InputValueError(f"--executor-options must be a JSON object, got {text!r:.80} ({error})",
                              parameter="executor_options") from None
    if not isinstance(value, dict):
        raise InputValueError(f"--executor-options must be a JSON object (keyword arguments of datatrove's executor), "
                              f"got {text!r:.80}", parameter="executor_options")
    return value


def run_tokenize(options: Any) -> TokenizeResult:
    """Run ``tokenize`` with parsed options (jsonargparse's ``Namespace``) and print a summary."""
    result = tokenize_corpus(options.input, options.output_folder, options.tokenizer,
                             glob_pattern=options.glob_pattern, reader=options.reader, text_key=options.text_key,
                             tasks=options.tasks, workers=options.workers,
                             add_special_tokens=options.add_special_tokens, eos_token=options.eos_token,
                             save_loss_metadata=options.save_loss_metadata, logging_dir=options.logging_dir,
                             executor=options.executor, executor_options=_options_json(options.executor_options),
                             ray_address=options.ray_address, timeout_s=options.timeout_s)
    if result.job_id is not None:
        print(f"submitted Slurm job {result.job_id}: {result.tasks} tasks tokenizing into {result.output_folder} "
              f"(job script: {Path(result.logging_dir) / 'launch_script.slurm'}); when it has ended, train from it in "
              f"place: corpus=DatatroveSource({result.output_folder!r})", flush=True)
        return result
    print(f"wrote {result.num_documents} documents, {result.num_tokens} tokens in {len(result.files)} .ds file(s) "
          f"to {result.output_folder} in {result.seconds:.1f} s ({result.tokens_per_s:,.0f} tokens/s, "
          f"{result.tasks} tasks on {result.workers} workers, executor {result.executor})", flush=True)
    if result.skipped_rows:
        causes = ", ".join(f"{n} {cause}" for cause, n in sorted(result.skipped.items()))
        print(f"skipped {result.skipped_rows} input row(s) under --text-key {options.text_key!r}: {causes}; the other "
              f"rows of their files are in the store; the task logs name the rows ({result.logging_dir})", flush=True)
    print(f"train from it in place: corpus=DatatroveSource({result.output_folder!r})", flush=True)
    return result
