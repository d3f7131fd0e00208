"""TransformerLM rejects bad sizes and rates at construction, naming the argument and the value."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lit_balance import TransformerLM

SMALL = {"vocab_size": 16, "d_model": 8, "num_heads": 2, "num_layers": 1, "dim_feedforward": 16}


@pytest.mark.parametrize(("name", "value", "error", "words"), [
    ("d_model", "abc", TypeError, ["d_model must be an int", "'abc'", "str"]),
    ("num_heads", 2.0, TypeError, ["num_heads must be an int", "2.0", "float"]),
    ("num_heads", 2.5, TypeError, ["num_heads must be an int", "2.5", "float"]),
    ("vocab_size", 2.5, TypeError, ["vocab_size must be an int", "2.5"]),
    ("vocab_size", True, TypeError, ["vocab_size must be an int", "True", "bool"]),
    ("num_layers", 0, ValueError, ["num_layers must be >= 1", "got 0"]),
    ("dim_feedforward", -4, ValueError, ["dim_feedforward must be >= 1", "got -4"]),
    ("num_heads", 3, ValueError, ["d_model (8) must be divisible by num_heads (3)"]),
    ("lr", math.nan, ValueError, ["lr must be a finite number", "nan"]),
    ("lr", -1, ValueError, ["lr must be a finite number >= 0", "-1"]),
    ("lr", math.inf, ValueError, ["lr must be a finite number", "inf"]),
    ("lr", "1e-3", TypeError, ["lr must be a real number", "'1e-3'", "str"]),
    ("weight_decay", -1, ValueError, ["weight_decay must be a finite number >= 0", "-1"]),
    ("dropout", 1.5, ValueError, ["dropout must be a finite number in [0.0, 1.0]", "1.5"]),
    ("dropout", True, TypeError, ["dropout", "True", "bool"]),
])
def test_bad_arguments_raise_at_construction(name, value, error, words):
    with pytest.raises(error) as excinfo:
        TransformerLM(**{**SMALL, name: value})
    message = str(excinfo.value)
    for word in words:
        assert word in message, message


def test_valid_arguments_keep_their_values():
    model = TransformerLM(vocab_size=np.int64(16), d_model=8, num_heads=np.int32(2), num_layers=1, dim_feedforward=16,
                          dropout=0, lr=np.float32(0.5), weight_decay=0)
    assert dict(model.hparams) == {"vocab_size": 16, "d_model": 8, "num_heads": 2, "num_layers": 1,
                                   "dim_feedforward": 16, "dropout": 0.0, "lr": 0.5, "weight_decay": 0.0}
    assert type(model.hparams.vocab_size) is int and type(model.hparams.lr) is float
    assert model.configure_optimizers().defaults["lr"] == 0.5
