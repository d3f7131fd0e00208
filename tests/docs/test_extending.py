"""docs/extending.md: every python block runs as written (the cost model and source examples are also checked in
tests/plan/test_cost_protocol.py and tests/data/test_custom_source.py)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def _blocks() -> dict[str, str]:
    """``{section title: its python block}`` of the page."""
    out = {}
    for section in PAGE.read_text(encoding="utf-8").split("\n## ")[1:]:
        title, body = section.split("\n", 1)
        found = re.findall(r"```python\n(.*?)```", body, re.S)
        if found:
            out[title.strip()] = "\n".join(found)
    return out


def test_every_extension_point_has_a_section_with_an_example():
    assert set(_blocks()) == {"A cost model", "An input source", "A planner", "The data-parallel world"}


@pytest.mark.parametrize("title", ["A planner", "The data-parallel world"])
def test_the_example_runs(title, capsys, monkeypatch):
    module = types.ModuleType("extending_example")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(_blocks()[title], str(PAGE), "exec"), module.__dict__)
    out = capsys.readouterr().out
    if title == "A planner":
        lines = out.splitlines()
        assert [line.split(":")[0] for line in lines] == ["padded", "packed"]
        assert "padding ratio 0.0000" in lines[1] and "tokens" in lines[1]
    else:
        assert out.split() == ["0", "1"]
