"""Real long-document length distributions: token counts of whole source and documentation files.

Run:
    python -m benchmarks.long_lengths                 # both, into lit_balance/data/lengths/
    python -m benchmarks.long_lengths --corpora stdlib_sources --output-dir /tmp/lengths

``stdlib_sources``: every ``*.py`` file of the running Python's standard library (``sysconfig``'s ``stdlib`` path,
``site-packages`` left out), one document per file. ``linux_docs``: every ``.rst`` / ``.rst.gz`` file under
``/usr/share/doc/linux-doc-6.1/Documentation`` (Debian's ``linux-doc-6.1``: ``apt-get install linux-doc-6.1``), one
document per file. Each file is read as UTF-8 (undecodable bytes replaced), files of only white space are left out,
and the text is tokenized whole by the built-in tokenizer (:func:`lit_balance.data.tokenizer.builtin_tokenizer`: BERT
uncased WordPiece, no truncation, no padding, no special tokens). Output: ``lengths_<name>.npy``, int32, in file-name
order. ``lit_balance/data/lengths/SOURCE.md`` records the versions the shipped files were made from.
"""

from __future__ import annotations

import argparse
import gzip
import sysconfig
from collections.abc import Callable
from pathlib import Path

import numpy as np

from lit_balance.data.tokenizer import builtin_tokenizer

LINUX_DOCS = Path("/usr/share/doc/linux-doc-6.1/Documentation")
OUTPUT_DIR = Path(__file__).resolve().parents[1] / "lit_balance" / "data" / "lengths"


def stdlib_sources() -> list[Path]:
    """The standard library's ``*.py`` files, sorted (``site-packages`` left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)


def linux_docs() -> list[Path]:
    """The kernel documentation's reStructuredText files (plain or gzip-compressed, as Debian ships them), sorted."""
    if not LINUX_DOCS.is_dir():
        raise FileNotFoundError(f"{LINUX_DOCS} not found: install Debian's linux-doc-6.1 (apt-get install "
                                "linux-doc-6.1) or leave linux_docs out of --corpora")
    return sorted(p for p in LINUX_DOCS.rglob("*") if p.is_file() and p.name.endswith((".rst", ".rst.gz")))


CORPORA: dict[str, Callable[[], list[Path]]] = {"stdlib_sources": stdlib_sources, "linux_docs": linux_docs}


def _text(path: Path) -> str:
    data = path.read_bytes()
    return (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8", errors="replace")


def token_counts(files: list[Path]) -> np.ndarray:
    """int32 ``[documents]``: tokens of each non-blank file, whole (no truncation)."""
    texts = [t for t in (_text(p) for p in files) if t.strip()]
    encodings = builtin_tokenizer().encode_batch(texts, add_special_tokens=False)
    return np.array([len(e.ids) for e in encodings], dtype=np.int32)


def main(argv: list[str] | None = None) -> dict[str, np.ndarray]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpora", nargs="*", choices=sorted(CORPORA), default=sorted(CORPORA))
    p.add_argument("--output-dir", type=Path, default=OUTPUT_DIR)
    args = p.parse_args(argv)
    out = {}
    for name in args.corpora:
        lengths = token_counts(CORPORA[name]())
        np.save(args.output_dir / f"lengths_{name}.npy", lengths)
        p50, p99 = np.percentile(lengths, [50, 99])
        print(f"{name}: {lengths.shape[0]:,} documents, p50 {p50:,.0f}, p99 {p99:,.0f}, max {int(lengths.max()):,}, "
              f"{int(lengths.sum()):,} tokens")
        out[name] = lengths
    return out


if __name__ == "__main__":
    main()
