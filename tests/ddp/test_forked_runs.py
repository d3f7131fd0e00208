"""The forked runs of launch.py start as ``python SCRIPT`` started now would: in the caller's environment
and working directory of the moment, plus what the call adds, and nothing an earlier call or run set."""

import json
import os
from pathlib import Path

import pytest
from launch import run_script, run_scripts  # launch.py (the repository root)

pytestmark = pytest.mark.slow  # forks runs from a process that imported torch and Lightning

SCRIPT = Path(__file__).with_name("show_env.py")
CALLER, LATER, RUN = "LIT_BALANCE_TEST_CALLER", "LIT_BALANCE_TEST_LATER", "LIT_BALANCE_TEST_RUN"


def _seen(result: tuple[int, str]) -> dict:
    code, out = result
    assert code == 0, out[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_a_run_sees_the_callers_environment_of_the_call_and_nothing_an_earlier_call_set(tmp_path, monkeypatch):
    monkeypatch.setenv(CALLER, "at the first call")
    first = _seen(run_script(SCRIPT, [CALLER, LATER, RUN], 120, cwd=tmp_path, env={RUN: "this run only"}))
    assert first == {"cwd": str(tmp_path.resolve()), CALLER: "at the first call", LATER: None, RUN: "this run only"}
    monkeypatch.delenv(CALLER)
    monkeypatch.setenv(LATER, "at the second call")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "other").mkdir()
    second = _seen(run_script(SCRIPT, [CALLER, LATER, RUN], 120, cwd=tmp_path / "other"))
    assert second == {"cwd": str((tmp_path / "other").resolve()), CALLER: None, LATER: "at the second call", RUN: None}
    side_by_side = run_scripts(SCRIPT, {0: [CALLER, LATER], 1: [CALLER, LATER]}, 120)
    assert [json.loads(side_by_side[k].strip().splitlines()[-1]) for k in (0, 1)] == [
        {"cwd": str(tmp_path.resolve()), CALLER: None, LATER: "at the second call"}] * 2
    assert os.environ.get(RUN) is None
