"""What :class:`~lit_balance.BalancedTextDataModule` checks when it resumes: the training split a checkpoint was saved
with, the batching settings, and its training loader, whose state is the sampler's position at what training
consumed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lit_balance._fingerprint import sha256_of_int64
from lit_balance.data.fit_loop import fit_batches_consumed
from lit_balance.data.loader import BalancedDataLoader
from lit_balance.errors import InputValueError

__all__ = ["DATA_KEYS", "TrainLoader", "check_saved_data", "data_identity", "fit_batches_consumed",
           "settings_advice"]

#: Keys of the ``data`` entry of the DataModule's state: what the training split is made from.
DATA_KEYS = ("seed", "val_fraction", "max_length", "num_documents", "corpus_lengths_sha256", "tokenizer")


def settings_advice(differences: Mapping[str, tuple[Any, Any]]) -> str:
    """The message of a resume whose batching settings differ from the checkpoint's, naming where a DataModule user
    sets each one: ``accumulate_grad_batches`` is the Trainer's, the others the DataModule's."""
    diff = "; ".join(f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in differences.items())
    fixes = []
    if "accumulate_grad_batches" in differences:
        fixes.append(f"set Trainer(accumulate_grad_batches={differences['accumulate_grad_batches'][0]!r}) as when "
                     "the checkpoint was saved")
    others = {k: old for k, (old, _) in differences.items() if k != "accumulate_grad_batches"}
    if others:
        fixes.append("construct BalancedTextDataModule with the saved " + ", ".join(f"{k}={v!r}" for k, v in
                                                                                   others.items())
                     + " (keywords, or settings=BatchingSettings(...) with them)")
    return (f"cannot resume: the training batching settings differ from the checkpoint's ({diff}); "
            + " and ".join(fixes) + ", or start without ckpt_path")


class TrainLoader(BalancedDataLoader):
    """The training DataLoader of :class:`~lit_balance.BalancedTextDataModule`: a
    :class:`~lit_balance.BalancedDataLoader` whose count of consumed micro-batches is the DataModule's.

    Its :meth:`state_dict` is the sampler's position at the micro-batches training consumed: under ``Trainer.fit`` the
    fit loop's count (:func:`fit_batches_consumed`, as the DataModule's own ``state_dict`` saves it), in a plain loop
    (Fabric, torchrun) the micro-batches its iterator handed to the loop. So ``loader.state_dict()`` and
    ``loader.load_state_dict(...)`` on a fresh DataModule's loader resume exactly, as ``dm.state_dict()`` does
    (Lightning saves both, and loading both restores the same position).

    Args:
        *args, **kwargs: as :class:`~lit_balance.BalancedDataLoader`.
    """

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`.

        ``{}``, what this loader saved in checkpoints of earlier versions, is accepted under ``Trainer.fit`` only (the
        DataModule's state, restored with it, holds the position).

        Raises:
            ValueError: ``{}`` outside ``Trainer.fit`` (naming ``dm.state_dict()``); as
                :meth:`BalancedDataLoader.load_state_dict`.
        """
        if isinstance(state_dict, Mapping) and not state_dict:
            if self._batches_consumed is None or self._batches_consumed() is None:
                raise InputValueError(
                    "the training DataLoader of BalancedTextDataModule got an empty state ({}): a state of an earlier "
                    "version, whose position is in the DataModule's state; restore it with "
                    "dm.load_state_dict(state) before dm.train_dataloader() (save dm.state_dict(), or this loader's "
                    "loader.state_dict(), which now holds the position)", parameter="state_dict")
            return
        super().load_state_dict(state_dict)


def data_identity(datamodule: Any) -> dict[str, Any]:
    """What a :class:`~lit_balance.BalancedTextDataModule`'s training split is made from, as plain types: its settings
    outside the sampler's (``seed``, ``val_fraction``, ``max_length``), and its corpus and tokenizer."""
    corpus = datamodule.corpus
    return {
        "seed": int(datamodule.seed),
        "val_fraction": float(datamodule.val_fraction),
        "max_length": None if datamodule.max_length is None else int(datamodule.max_length),
        "num_documents": len(corpus),
        "corpus_lengths_sha256": sha256_of_int64(corpus.lengths),
        "tokenizer": datamodule.tokenizer.fingerprint,
    }


def check_saved_data(saved: Any, now: Mapping[str, Any]) -> None:
    """Compare a checkpoint's ``data`` entry with :func:`data_identity` of this run; raise naming every difference.

    Raises:
        ValueError: other keys; a different seed, val_fraction, max_length, corpus or tokenizer.
    """
    if not isinstance(saved, Mapping) or set(saved) != set(DATA_KEYS):
        got = sorted(saved) if isinstance(saved, Mapping) else saved
        raise InputValueError(f"BalancedTextDataModule state_dict 'data' must have keys {sorted(DATA_KEYS)}, "
                              f"got {got!r}")
    diff = [f"{k}: saved {saved[k]!r}, now {now[k]!r}" for k in ("seed", "val_fraction", "max_length")
            if saved[k] != now[k]]
    if saved["num_documents"] != now["num_documents"]:
        diff.append(f"corpus: saved {saved['num_documents']} documents, now {now['num_documents']}")
    elif saved["corpus_lengths_sha256"] != now["corpus_lengths_sha256"]:
        diff.append(f"corpus: the same number of documents ({now['num_documents']}), but their token lengths "
                    "differ")
    if saved["tokenizer"] != now["tokenizer"]:
        diff.append("tokenizer: another tokenizer (fingerprint) than the saved one")
    if diff:
        raise InputValueError(
            "cannot resume: the training split differs from the checkpoint's (" + "; ".join(diff) + "); "
            "resume with the run's own settings: the saved seed, val_fraction and max_length, on the same corpus "
            "and tokenizer (a Hydra recipe prints a resume line that keeps them), or start without ckpt_path"
        )
