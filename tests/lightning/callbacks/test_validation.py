"""Argument and batch checks of the callbacks: the error type, and a message naming the setting and the value."""

import math

import numpy as np
import pytest
import torch
from conftest import MODULE, make_trainer

from lit_balance import CostModel
from lit_balance._checks import check_number
from lit_balance.callbacks import (
    AdaptiveGradAccumulation,
    CostModelFeedback,
    PaddingRatioMonitor,
    RunSummary,
    StragglerMonitor,
)
from lit_balance.errors import InputError

NAN, INF = float("nan"), float("inf")


def _accumulation(**kwargs):
    return AdaptiveGradAccumulation(**{"target_tokens_per_step": 4096, **kwargs})


@pytest.mark.parametrize(("make", "kwargs", "error", "words"), [
    # not finite, or out of range: ValueError naming the setting, the range and the value
    (_accumulation, {"max_overshoot": NAN}, ValueError, ["max_overshoot must be a finite number >= 1", "got nan"]),
    (_accumulation, {"max_overshoot": INF}, ValueError, ["max_overshoot must be a finite number >= 1", "got inf"]),
    (_accumulation, {"target_straggler_ratio": INF}, ValueError, ["target_straggler_ratio", ">= 1", "got inf"]),
    (_accumulation, {"target_straggler_ratio": NAN}, ValueError, ["target_straggler_ratio", "got nan"]),
    (_accumulation, {"tolerance": NAN}, ValueError, ["tolerance must be a finite number in [0, 1)", "got nan"]),
    (_accumulation, {"tolerance": -0.1}, ValueError, ["tolerance", "got -0.1"]),
    (_accumulation, {"lookahead": 0}, ValueError, ["lookahead must be >= 1", "got 0"]),
    (_accumulation, {"max_accumulate_grad_batches": -2}, ValueError, ["max_accumulate_grad_batches", "got -2"]),
    (StragglerMonitor, {"warn_ratio": NAN}, ValueError, ["warn_ratio must be a finite number >= 1", "got nan"]),
    (StragglerMonitor, {"warn_ratio": INF}, ValueError, ["warn_ratio", "got inf"]),
    (StragglerMonitor, {"warn_after": 0}, ValueError, ["warn_after must be >= 1", "got 0"]),
    (CostModelFeedback, {"smoothing": NAN}, ValueError, ["smoothing must be a finite number in [0, 1)", "got nan"]),
    (CostModelFeedback, {"speed_tolerance": INF}, ValueError, ["speed_tolerance", "got inf"]),
    (CostModelFeedback, {"min_samples": 2}, ValueError, ["min_samples must be >= 3", "got 2"]),
    # bools, strings and floats where numbers or ints are wanted: TypeError naming what arrived
    (_accumulation, {"target_straggler_ratio": True}, TypeError, ["target_straggler_ratio", "got True of type bool"]),
    (_accumulation, {"tolerance": np.bool_(False)}, TypeError, ["tolerance must be a real number", "type bool"]),
    (_accumulation, {"max_overshoot": "2"}, TypeError, ["max_overshoot must be a real number", "'2' of type str"]),
    (_accumulation, {"target_tokens_per_step": True}, TypeError, ["target_tokens_per_step must be an int"]),
    (StragglerMonitor, {"log_every_n_micro_batches": 5.0}, TypeError,
     ["log_every_n_micro_batches must be an int", "got 5.0 of type float"]),
    (StragglerMonitor, {"warn_ratio": True}, TypeError, ["warn_ratio must be a real number", "got True"]),
    (CostModelFeedback, {"min_samples": 8.0}, TypeError, ["min_samples must be an int", "of type float"]),
    (CostModelFeedback, {"smoothing": "0.5"}, TypeError, ["smoothing must be a real number", "'0.5' of type str"]),
    (PaddingRatioMonitor, {"log_every_n_micro_batches": np.float64(2)}, TypeError,
     ["log_every_n_micro_batches must be an int"]),
    # objects that would only fail at the first batch
    (StragglerMonitor, {"cost_model": {"linear": 1}}, TypeError,
     ["cost_model must be a lit_balance.CostModel or None", "{'linear': 1} of type dict"]),
    (StragglerMonitor, {"clock": 5}, TypeError, ["clock must be callable", "got 5 of type int"]),
    (PaddingRatioMonitor, {"clock": None}, TypeError, ["clock must be callable", "got None"]),
    # non-bools are not silently truthy
    (CostModelFeedback, {"fit_speeds": "no"}, TypeError, ["fit_speeds must be True or False", "got 'no'"]),
    (RunSummary, {"print_table": "no"}, TypeError, ["print_table must be True or False", "got 'no'"]),
    (StragglerMonitor, {"synchronize": "no"}, TypeError, ["synchronize must be True or False", "got 'no'"]),
    (StragglerMonitor, {"synchronize": 1}, TypeError, ["synchronize must be True or False", "got 1"]),
])
def test_bad_arguments_raise_at_construction(make, kwargs, error, words):
    with pytest.raises(error) as info:
        make(**kwargs)
    other = TypeError if error is ValueError else ValueError  # exactly one of the two, and marked as rejected input
    assert isinstance(info.value, InputError) and not isinstance(info.value, other)
    assert info.value.parameter == next(iter(kwargs))
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(("make", "kwargs", "expected"), [
    (StragglerMonitor,
     {"log_every_n_micro_batches": np.int64(5), "warn_after": np.int32(2), "warn_ratio": np.float32(1.5)},
     {"log_every_n_micro_batches": 5, "warn_after": 2, "warn_ratio": 1.5}),
    (StragglerMonitor, {"synchronize": np.bool_(False)}, {"synchronize": False}),
    (CostModelFeedback, {"min_samples": np.int64(8), "smoothing": np.float32(0.5), "speed_tolerance": np.float64(0.1),
                         "fit_speeds": np.bool_(True)},
     {"min_samples": 8, "smoothing": 0.5, "speed_tolerance": 0.1, "fit_speeds": True}),
    (CostModelFeedback, {"smoothing": 0}, {"smoothing": 0.0}),
    (_accumulation, {"target_tokens_per_step": np.int64(4096), "tolerance": np.float32(0.25),
                     "max_accumulate_grad_batches": np.int16(8), "lookahead": np.uint8(4),
                     "target_straggler_ratio": np.float64(1.1), "max_overshoot": np.int64(3)},
     {"target_tokens_per_step": 4096, "tolerance": 0.25, "max_accumulate_grad_batches": 8, "lookahead": 4,
      "target_straggler_ratio": 1.1, "max_overshoot": 3.0}),
    (_accumulation, {}, {"target_straggler_ratio": None, "max_overshoot": 2.0, "tolerance": 0.25}),
    (PaddingRatioMonitor, {"log_every_n_micro_batches": np.int64(3)}, {"log_every_n_micro_batches": 3}),
    (PaddingRatioMonitor, {}, {"log_every_n_micro_batches": None}),
    (RunSummary, {"print_table": np.bool_(False)}, {"print_table": False}),
])
def test_numpy_scalars_are_accepted_and_stored_as_python_numbers(make, kwargs, expected):
    cb = make(**kwargs)
    for name, value in expected.items():
        stored = getattr(cb, name)
        assert stored == value and type(stored) is type(value), (name, stored)


def test_a_cost_model_and_a_clock_are_kept():
    cost, clock = CostModel(linear=2.0), (lambda: 1.0)
    monitor = StragglerMonitor(cost_model=cost, clock=clock)
    assert monitor.cost_model is cost and monitor.clock is clock
    assert StragglerMonitor().cost_model is None


def test_check_number_bounds_and_infinity():
    assert check_number("x", np.float16(0.5), 0, 1, "hint", low_open=True, high_open=True) == 0.5
    with pytest.raises(ValueError, match=r"x must be a finite number in \(0, 1\), got 0; set x"):
        check_number("x", 0, 0, 1, "set x", low_open=True, high_open=True)
    with pytest.raises(ValueError, match=r"x must be a finite number > 0, got inf"):
        check_number("x", INF, 0, None, "hint", low_open=True)
    assert math.isinf(check_number("x", INF, 0, None, "hint", allow_inf=True))
    with pytest.raises(ValueError, match=r"x must be a number <= 2, got nan"):
        check_number("x", NAN, None, 2, "hint", allow_inf=True)
    with pytest.raises(TypeError, match=r"x must be a real number, got \(1\+1j\) of type complex"):
        check_number("x", 1 + 1j, None, None, "hint")


# -- training batches without lit_balance's keys ---------------------------------------------------------------
FOREIGN = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long)}
NO_IDS = {"num_real_tokens": 5, "num_padded_tokens": 8}


def _padding(trainer, batch):
    cb = PaddingRatioMonitor(log_every_n_micro_batches=1, clock=lambda: 0.0)
    cb.on_train_epoch_start(trainer, MODULE)
    cb.on_train_batch_end(trainer, MODULE, None, batch, 0)


def _summary(trainer, batch):
    cb = RunSummary(print_table=False)
    cb.on_train_start(trainer, MODULE)
    cb.on_train_batch_end(trainer, MODULE, None, batch, 0)


def _straggler(trainer, batch):
    cb = StragglerMonitor(clock=lambda: 0.0)
    cb.on_train_epoch_start(trainer, MODULE)
    cb.on_train_batch_start(trainer, MODULE, batch, 0)


def _adaptive(trainer, batch):
    cb = AdaptiveGradAccumulation(target_tokens_per_step=64)
    cb.on_train_batch_end(trainer, MODULE, None, batch, 0)


@pytest.mark.parametrize(("run", "batch", "owner", "needs", "missing", "has"), [
    (_padding, FOREIGN, "PaddingRatioMonitor", "['num_real_tokens', 'num_padded_tokens']",
     "missing ['num_real_tokens', 'num_padded_tokens']", "['input_ids', 'labels']"),
    (_summary, FOREIGN, "RunSummary", "['num_real_tokens', 'num_padded_tokens']",
     "missing ['num_real_tokens', 'num_padded_tokens']", "['input_ids', 'labels']"),
    (_straggler, NO_IDS, "StragglerMonitor", "['input_ids', 'num_real_tokens']", "missing ['input_ids']",
     "['num_padded_tokens', 'num_real_tokens']"),
    (_straggler, FOREIGN, "StragglerMonitor", "['input_ids', 'num_real_tokens']", "missing ['num_real_tokens']",
     "['input_ids', 'labels']"),
    (_adaptive, FOREIGN, "AdaptiveGradAccumulation", "['num_real_tokens']", "missing ['num_real_tokens']",
     "['input_ids', 'labels']"),
])
def test_a_batch_without_the_keys_names_them(run, batch, owner, needs, missing, has):
    trainer, _ = make_trainer()
    with pytest.raises(KeyError) as info:
        run(trainer, batch)
    message = str(info.value)
    for word in (owner, f"needs the training batch keys {needs}", missing, f"the batch has keys {has}",
                 "lit_balance.PadCollator"):
        assert word in message, word


@pytest.mark.parametrize("run", [_padding, _summary, _straggler])
def test_a_batch_that_is_not_a_dict_is_named(run):
    trainer, _ = make_trainer()
    with pytest.raises(TypeError, match=r"needs dict training batches with keys \[.*\], got a tuple; collate with "
                                        r"lit_balance\.PadCollator"):
        run(trainer, (torch.zeros(2, 4), torch.zeros(2, 4)))
