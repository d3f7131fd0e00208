"""Which tokenizer wrote a tokenized store, and whether the run's is the same: :class:`TokenizerIdentity`.

A store's token ids mean something only with the tokenizer that wrote them: a tokenizer with the same vocabulary
size and padding id but other ids for the same strings trains silently on the wrong text. The identity of a tokenizer
is a sha256 of the parts of its ``tokenizer.json`` that decide the ids of a text (``added_tokens``, ``normalizer``,
``pre_tokenizer``, ``model``: the vocabulary and merges), with its name or path kept for messages. Padding, truncation
and the post-processor (the special tokens ``add_special_tokens`` adds) are left out: ``lit-balance tokenize`` and
datatrove clear them in the copy they use, and they do not change the id of any string.

Where a store says its tokenizer (the stores set :attr:`lit_balance.data.stores.TokenStore.tokenizer_identity`):

* datatrove's ``.ds.metadata`` names it (``TOKENIZER|TOKEN_SIZE``); a local file is hashed; else the
  ``tokenizer.json`` beside the ``.ds`` files (what ``lit-balance tokenize`` writes) is, else only the name is known;
* a sidecar ``<store>.tokenizer_identity.json`` (:data:`SIDECAR_SUFFIX`; for a Megatron ``PREFIX.bin/.idx`` pair
  ``PREFIX.tokenizer_identity.json``), written by :func:`write_sidecar` (``lit-balance tokenize`` writes one into its
  output folder, as ``tokenizer_identity.json``);
* Arrow / Parquet schema metadata: the keys ``lit_balance.tokenizer`` (name) and ``lit_balance.tokenizer_sha256``
  (:data:`SCHEMA_NAME_KEY`, :data:`SCHEMA_SHA256_KEY`).

:func:`check_store_tokenizer` compares (:func:`lit_balance.data.vocabulary.decide_vocabulary` calls it, once per
corpus or mixture component).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, NamedTuple

from lit_balance.errors import InputValueError

__all__ = ["SCHEMA_NAME_KEY", "SCHEMA_SHA256_KEY", "SIDECAR_FILE", "SIDECAR_SUFFIX", "TokenizerIdentity",
           "check_store_tokenizer", "datatrove_tokenizer", "identity_of_adapter", "identity_of_file",
           "identity_of_json", "one_tokenizer", "read_sidecar", "schema_tokenizer", "write_sidecar"]

#: The parts of a ``tokenizer.json`` that decide the ids of a text (hashed, in this order of keys, sorted inside).
_ID_PARTS = ("added_tokens", "normalizer", "pre_tokenizer", "model")
#: Suffix of the sidecar JSON beside a store (``PREFIX`` + suffix for a Megatron pair).
SIDECAR_SUFFIX = ".tokenizer_identity.json"
#: The sidecar's name in a store's folder (``lit-balance tokenize``'s output folder, a datatrove folder).
SIDECAR_FILE = "tokenizer_identity.json"
#: Arrow / Parquet schema metadata keys of the tokenizer's name and identity.
SCHEMA_NAME_KEY, SCHEMA_SHA256_KEY = "lit_balance.tokenizer", "lit_balance.tokenizer_sha256"
_SIDECAR_FORMAT = "lit_balance.tokenizer_identity"


class TokenizerIdentity(NamedTuple):
    """A tokenizer as a store or a run knows it.

    Attributes:
        name: its name or path, for messages (e.g. ``/data/tokenizer.json``, ``gpt2``).
        sha256: hex sha256 of the parts of its ``tokenizer.json`` that decide ids (:func:`identity_of_json`), or
            None when only the name is known (e.g. a Hugging Face model name not on this machine).
    """

    name: str
    sha256: str | None

    def describe(self) -> str:
        """E.g. ``"/data/tokenizer.json (sha256 3f2a9c1b0d4e)"``."""
        return f"{self.name} (sha256 {self.sha256[:12]})" if self.sha256 else f"{self.name} (not hashed)"


def identity_of_json(text: str, name: str) -> TokenizerIdentity:
    """The identity of a tokenizer from its ``tokenizer.json`` text (``tokenizers.Tokenizer.to_str()``).

    Raises:
        ValueError: ``text`` is not JSON of an object.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputValueError(f"tokenizer {name}: expected a tokenizer.json (JSON), got {text[:80]!r}: {error}",
                              parameter="tokenizer") from None
    if not isinstance(data, dict):
        raise InputValueError(f"tokenizer {name}: expected a JSON object, got {type(data).__name__}",
                              parameter="tokenizer")
    parts = json.dumps([data.get(k) for k in _ID_PARTS], sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return TokenizerIdentity(name, hashlib.sha256(parts.encode("utf-8")).hexdigest())


def identity_of_file(path: str | os.PathLike) -> TokenizerIdentity | None:
    """The identity of the ``tokenizer.json`` at ``path``, or None when it is no readable tokenizer file."""
    try:
        return identity_of_json(Path(path).read_text(encoding="utf-8"), os.fspath(path))
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def identity_of_adapter(adapter: Any, name: str | None = None) -> TokenizerIdentity | None:
    """The identity of the tokenizer a :class:`~lit_balance.data.tokenizer.TokenizerAdapter` wraps (None for an
    adapter of bare token ids)."""
    import tokenizers

    backend = getattr(adapter, "backend", None)
    name = name or getattr(adapter, "name", None) or "the given tokenizer"
    if backend is None:
        return None
    if isinstance(backend, tokenizers.Tokenizer):
        return identity_of_json(backend.to_str(), name)
    inner = getattr(backend, "backend_tokenizer", None)
    if isinstance(inner, tokenizers.Tokenizer):  # a Hugging Face fast tokenizer
        return identity_of_json(inner.to_str(), getattr(backend, "name_or_path", None) or name)
    vocab = json.dumps(sorted(backend.get_vocab().items()), ensure_ascii=False)  # a slow one: its vocabulary
    return TokenizerIdentity(getattr(backend, "name_or_path", None) or name,
                             hashlib.sha256(("slow\0" + vocab).encode("utf-8")).hexdigest())


def write_sidecar(path: str | os.PathLike, tokenizer: Any) -> Path:
    """Write the identity of ``tokenizer`` as a sidecar JSON: ``{"format": "lit_balance.tokenizer_identity",
    "version": 1, "tokenizer": NAME, "sha256": HEX}``.

    Args:
        path: the sidecar's path: ``PREFIX.tokenizer_identity.json`` beside a Megatron ``PREFIX.idx``, or
            ``tokenizer_identity.json`` in a datatrove folder.
        tokenizer: a ``tokenizer.json`` path, a :class:`TokenizerIdentity`, or anything
            :func:`~lit_balance.data.tokenizer.resolve_tokenizer` takes.

    Returns:
        The path written.
    """
    if isinstance(tokenizer, TokenizerIdentity):
        identity = tokenizer
    elif isinstance(tokenizer, (str, os.PathLike)) and (found := identity_of_file(tokenizer)) is not None:
        identity = TokenizerIdentity(os.path.abspath(os.fspath(tokenizer)), found.sha256)
    else:
        from lit_balance.data.tokenizer import resolve_tokenizer

        identity = identity_of_adapter(resolve_tokenizer(tokenizer))
    path = Path(path)
    path.write_text(json.dumps({"format": _SIDECAR_FORMAT, "version": 1, "tokenizer": identity.name,
                                "sha256": identity.sha256}, indent=1) + "\n", encoding="utf-8")
    return path


def read_sidecar(path: str | os.PathLike) -> TokenizerIdentity | None:
    """The identity a sidecar JSON holds, None when there is no file at ``path``.

    Raises:
        ValueError: the file is not a sidecar :func:`write_sidecar` writes (naming the file and what it holds).
    """
    path = Path(path)
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    sha = data.get("sha256") if isinstance(data, dict) else None
    if (not isinstance(data, dict) or data.get("format") != _SIDECAR_FORMAT
            or not isinstance(data.get("tokenizer"), str)
            or not (sha is None or (isinstance(sha, str) and len(sha) == 64))):
        raise InputValueError(f"{path}: expected a tokenizer identity sidecar ({{\"format\": \"{_SIDECAR_FORMAT}\", "
                              f"\"version\": 1, \"tokenizer\": NAME, \"sha256\": HEX}}), got {text[:160]!r}; rewrite "
                              "it with lit_balance.data.tokenizer_identity.write_sidecar or remove it",
                              parameter="corpus")
    return TokenizerIdentity(data["tokenizer"], sha)


def schema_tokenizer(metadata: dict[bytes, bytes] | None) -> TokenizerIdentity | None:
    """The tokenizer Arrow / Parquet schema metadata names (:data:`SCHEMA_NAME_KEY`, :data:`SCHEMA_SHA256_KEY`), or
    None."""
    metadata = metadata or {}
    name, sha = metadata.get(SCHEMA_NAME_KEY.encode()), metadata.get(SCHEMA_SHA256_KEY.encode())
    if name is None and sha is None:
        return None
    return TokenizerIdentity(name.decode("utf-8", "replace") if name else "(unnamed)",
                             sha.decode("ascii", "replace") if sha else None)


def datatrove_tokenizer(ds_file: str | os.PathLike, metadata_name: str | None) -> TokenizerIdentity | None:
    """What a datatrove ``.ds`` file says of its tokenizer: the sidecar :data:`SIDECAR_FILE` in its folder (written by
    ``lit-balance tokenize``), else the tokenizer its ``.ds.metadata`` names (``metadata_name``: hashed when it is a
    local file, else known by name), else None."""
    sidecar = read_sidecar(Path(ds_file).parent / SIDECAR_FILE)
    if sidecar is not None or metadata_name is None:
        return sidecar
    return identity_of_file(metadata_name) or TokenizerIdentity(metadata_name, None)


def one_tokenizer(found: list[tuple[str, TokenizerIdentity | None]], parameter: str) -> TokenizerIdentity | None:
    """The one tokenizer of a store's files, each ``(file, identity or None)``: the first hashed one, else the first
    named one, else None.

    Raises:
        ValueError: two files of different hashed tokenizers (naming both files and tokenizers).
    """
    said = [(f, t) for f, t in found if t is not None]
    hashed = [(f, t) for f, t in said if t.sha256 is not None]
    for f, t in hashed[1:]:
        if t.sha256 != hashed[0][1].sha256:
            raise InputValueError(f"the files of one corpus were written with different tokenizers: {hashed[0][0]} "
                                  f"with {hashed[0][1].describe()}, {f} with {t.describe()}; give the files of one "
                                  "tokenizer (or each as its own mixture component)", parameter=parameter)
    return hashed[0][1] if hashed else (said[0][1] if said else None)


def _is_rank_zero() -> bool:
    return all(os.environ.get(k, "0") in ("", "0") for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID"))


def _warn(message: str) -> None:
    """A warning on rank 0 only (the check runs once per corpus, or mixture component, on every rank)."""
    if _is_rank_zero():
        warnings.warn(message, UserWarning, stacklevel=5)


def check_store_tokenizer(store: TokenizerIdentity | None, run: TokenizerIdentity | None, where: str, *,
                          allow_mismatch: bool = False) -> None:
    """Refuse a run whose tokenizer differs from the one the store was written with.

    Args:
        store: the store's tokenizer (None: the store says nothing).
        run: the run's tokenizer (None: the run has no tokenizer, the store's ids are taken as they are: nothing to
            compare).
        where: the store (its description), for messages.
        allow_mismatch: the run's ``allow_tokenizer_mismatch``: a mismatch is then said once (a warning), not refused.

    Raises:
        ValueError: both identities hashed and different, ``allow_mismatch`` False (naming both and the setting).
    """
    if run is None:
        return
    if store is None:
        _warn(f"{where} does not say which tokenizer wrote it, so the run's tokenizer "
                   f"{run.describe()} cannot be checked against it; write a {SIDECAR_SUFFIX} sidecar beside it "
                   "(lit_balance.data.tokenizer_identity.write_sidecar) to have it checked")
        return
    if store.sha256 is None or run.sha256 is None:
        if store.name != run.name:
            _warn(f"{where} was written with the tokenizer {store.name!r}, which is not on this "
                       f"machine to compare with the run's {run.describe()}; the ids are taken as they are")
        return
    if store.sha256 == run.sha256:
        return
    message = (f"{where} was written with the tokenizer {store.describe()}, but the run tokenizes with "
               f"{run.describe()}: expected the same tokenizer (vocabulary, normalizer, pre-tokenizer), got another; "
               "pass tokenizer= the store's tokenizer, or allow_tokenizer_mismatch=True "
               "(--data.allow_tokenizer_mismatch) if the ids mean the same")
    if not allow_mismatch:
        raise InputValueError(message, parameter="allow_tokenizer_mismatch")
    _warn(f"{where} was written with the tokenizer {store.describe()}, the run tokenizes "
               f"with {run.describe()}: trained as allow_tokenizer_mismatch=True allows")
