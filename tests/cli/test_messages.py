"""Which process prints an error that every rank of a run meets: exactly one rank, and any process outside the run."""

import os
import tempfile

import pytest

from lit_balance.cli import messages


@pytest.fixture
def run_env(monkeypatch):
    run = "test" + os.urandom(6).hex()
    monkeypatch.setenv(messages.RUN_ID_ENV, run)
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(messages, "_marked_pid", None)
    marker = os.path.join(tempfile.gettempdir(), f"lit_balance_error_{run}")
    yield marker
    if os.path.exists(marker):
        os.remove(marker)


def test_a_process_that_only_inherited_a_runs_id_reports_its_error(run_env):
    with open(run_env, "w") as handle:  # another process of that run already reported
        handle.write("1")
    assert messages._first_report()


def test_of_the_ranks_of_one_run_the_first_reports_and_the_others_do_not(run_env, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert messages._first_report()  # the first rank to meet the error creates the marker with its pid
    assert messages._first_report()  # and reports its later errors too
    with open(run_env, "w") as handle:  # another rank's marker
        handle.write("1")
    assert not messages._first_report()


def test_the_launching_process_is_a_rank_of_the_run_it_marked(run_env, monkeypatch):
    messages.mark_run()
    with open(os.path.join(tempfile.gettempdir(), f"lit_balance_error_{os.environ[messages.RUN_ID_ENV]}"), "w") as h:
        h.write("1")  # a rank it started reported first
    try:
        assert not messages._first_report()
    finally:
        os.remove(h.name)
