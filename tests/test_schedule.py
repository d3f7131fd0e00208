"""Schedule: values between points, the errors of bad points, the saved form, and the check of a resume's edits."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance.schedule import Schedule

_positions = st.lists(st.integers(0, 10_000), min_size=1, max_size=4, unique=True).map(sorted)
_values = st.floats(0, 1e6, allow_nan=False)


@st.composite
def schedules(draw, mapping=None):
    at = draw(_positions)
    keys = draw(st.sampled_from([None, ("a",), ("a", "b", "c")])) if mapping is None else mapping
    if keys is None:
        points = [(p, draw(_values)) for p in at]
    else:
        points = [(p, {k: draw(_values) for k in keys}) for p in at]
    return Schedule(points, unit=draw(st.sampled_from(["steps", "tokens"])),
                    interpolation=draw(st.sampled_from(["constant", "linear"])), name="s")


def _reference(points, interpolation, x):
    """The value at x, written the plain way."""
    if x <= points[0][0]:
        return points[0][1]
    for (a, va), (b, vb) in zip(points, points[1:]):
        if a <= x < b:
            return va if interpolation == "constant" else va + (vb - va) * (x - a) / (b - a)
    return points[-1][1]


@settings(max_examples=200, deadline=None)
@given(at=_positions, data=st.data(), interpolation=st.sampled_from(["constant", "linear"]))
def test_value_at_is_the_points_held_or_interpolated(at, data, interpolation):
    points = [(p, data.draw(_values)) for p in at]
    s = Schedule(points, interpolation=interpolation)
    for x in sorted({0, *at, *(p + 1 for p in at), *(max(p - 1, 0) for p in at), at[-1] + 1000}):
        assert math.isclose(s.value_at(x), _reference(points, interpolation, x), rel_tol=1e-12, abs_tol=1e-9)
    for p, v in points:  # every point holds at its own position
        assert s.value_at(p) == v
    lo, hi = min(v for _, v in points), max(v for _, v in points)
    x = data.draw(st.floats(0, at[-1] + 10, allow_nan=False))
    assert lo - 1e-9 <= s.value_at(x) <= hi + 1e-9


@settings(max_examples=100, deadline=None)
@given(s=schedules())
def test_saved_form_round_trips_with_its_fingerprint(s):
    state = s.to_dict()
    back = Schedule.from_dict(state)
    assert back == s and back.fingerprint == s.fingerprint
    assert Schedule.of({k: state[k] for k in ("points", "unit", "interpolation")}, name="s") == s
    for x in (*s.positions, s.positions[-1] + 7):
        assert back.value_at(x) == s.value_at(x)


@settings(max_examples=100, deadline=None)
@given(s=schedules(mapping=("a", "b")), data=st.data())
def test_fingerprint_changes_with_any_point(s, data):
    points = s.points_as_given()
    i = data.draw(st.integers(0, len(points) - 1))
    at, value = points[i]
    value = dict(value, b=value["b"] + 1.0)
    edited = Schedule(points[:i] + [(at, value)] + points[i + 1:], s.unit, s.interpolation, s.name)
    assert edited.fingerprint != s.fingerprint


@settings(max_examples=200, deadline=None)
@given(s=schedules(), data=st.data())
def test_an_edit_of_the_future_passes_and_one_of_the_past_is_named(s, data):
    """Edit one point's value; the comparison before a resume position finds a difference exactly when some step
    before it changes its value, and names the first such step."""
    points = s.points_as_given()
    i = data.draw(st.integers(0, len(points) - 1))
    at, value = points[i]
    bump = data.draw(st.floats(1.0, 100.0))
    new_value = {k: v + bump for k, v in value.items()} if isinstance(value, dict) else value + bump
    edited = Schedule(points[:i] + [(at, new_value)] + points[i + 1:], s.unit, s.interpolation, s.name)
    before = data.draw(st.integers(0, points[-1][0] + 5))
    changed = [x for x in range(before) if s.value_at(x) != edited.value_at(x)]
    found = s.first_difference(edited, before)
    if not changed:
        assert found is None
        s.check_unchanged_before(edited, before)
    else:
        assert found is not None and f"is at {changed[0]} {s.unit}:" in found
        with pytest.raises(ValueError, match=f"Only points at or after {before} {s.unit}"):
            s.check_unchanged_before(edited, before)
    assert s.first_difference(s, before) is None


def test_points_after_the_resume_step_may_change_and_a_past_edit_names_its_point():
    saved = Schedule([(0, {"web": 0.6, "code": 0.4}), (900, {"web": 0.3, "code": 0.7})], name="weights_schedule")
    future = Schedule([(0, {"web": 0.6, "code": 0.4}), (800, {"web": 0.5, "code": 0.5})], name="weights_schedule")
    saved.check_unchanged_before(future, 800)  # steps 0..799 keep their weights
    with pytest.raises(ValueError) as err:
        saved.check_unchanged_before(future, 801)
    text = str(err.value)
    assert "weights_schedule" in text and "at 800 steps" in text and "point (800, {'web': 0.5, 'code': 0.5})" in text
    assert "point (0, {'web': 0.6, 'code': 0.4})" in text
    # linear: moving a later point changes the steps between the earlier point and the resume step
    ramp = Schedule([(0, 1.0), (100, 2.0)], interpolation="linear", name="tokens_per_step")
    moved = Schedule([(0, 1.0), (100, 3.0)], interpolation="linear", name="tokens_per_step")
    assert "is at 1 steps" in ramp.first_difference(moved, 50)
    assert ramp.first_difference(moved, 1) is None


@pytest.mark.parametrize("points, kwargs, kind, words", [
    ([], {}, ValueError, "at least one point"),
    ([(10, 1.0), (5, 2.0)], {}, ValueError, "point 1 is at 5 steps, not after point 0 at 10"),
    ([(5, 1.0), (5, 2.0)], {}, ValueError, "point 1 is at 5 steps, not after point 0 at 5"),
    ([(0, -1.0)], {}, ValueError, "must be finite and >= 0, got -1.0"),
    ([(0, float("nan"))], {}, ValueError, "must be finite and >= 0, got nan"),
    ([(0, 1.0), (3, float("inf"))], {}, ValueError, "at point 1 .3 steps. must be finite"),
    ([(0, {"a": 1.0}), (3, {"a": -0.5})], {}, ValueError, "of 'a' at point 1 .3 steps. must be finite and >= 0"),
    ([(0, {"a": 1.0}), (3, {"b": 1.0})], {}, ValueError, "point 0 names \\['a'\\], point 1 .at 3. names \\['b'\\]"),
    ([(0, {"a": 1.0}), (3, 1.0)], {}, TypeError, "point 1 .at 3. is a number but point 0 is a mapping"),
    ([(0, 1.0), (3, {"a": 1.0})], {}, TypeError, "point 0 is a number but a later point is a mapping"),
    ([(-1, 1.0)], {}, ValueError, "point 0 must be at an int >= 0"),
    ([(1.5, 1.0)], {}, ValueError, "point 0 must be at an int >= 0"),
    ([("x", 1.0)], {}, TypeError, "point 0 must be at an int >= 0"),
    ([(0, "1")], {}, TypeError, "must be a number, got '1'"),
    ([(0, 1.0, 2.0)], {}, TypeError, "point 0 must be a pair"),
    ("0:1", {}, TypeError, "points must be a list"),
    ([(0, 1.0)], {"unit": "samples"}, ValueError, "unit must be one of \\['steps', 'tokens'\\], got 'samples'"),
    ([(0, 1.0)], {"interpolation": "cosine"}, ValueError, "interpolation must be one of"),
])
def test_bad_points_are_refused_naming_the_setting(points, kwargs, kind, words):
    with pytest.raises(kind, match=words) as err:
        Schedule(points, name="weights_schedule", **kwargs)
    assert str(err.value).startswith("weights_schedule:") and err.value.parameter == "weights_schedule"


def test_config_forms():
    assert Schedule.of(0.5, name="x").value_at(123) == 0.5
    assert Schedule.of({"a": 1, "b": 3}, name="w").value_at(7) == {"a": 1.0, "b": 3.0}
    s = Schedule.of({"points": {"0": 1, "1e3": 2}, "unit": "tokens", "interpolation": "linear"}, name="t")
    assert s.unit == "tokens" and s.positions == (0, 1000) and s.value_at(500) == 1.5
    assert Schedule.of([[0, 1], [10, 2]], name="t").value_at(10) == 2.0
    with pytest.raises(ValueError, match="also \\['step'\\]"):
        Schedule.of({"points": [[0, 1]], "step": 3}, name="t")
    with pytest.raises(ValueError, match="a saved schedule is a mapping"):
        Schedule.from_dict({"points": [[0, 1]]})
    with pytest.raises(ValueError, match="value_at needs a position >= 0"):
        Schedule.of(1.0).value_at(-1)
