"""Waiting on a test's subprocess with a timeout: it finishes, or it is killed and the test fails; never a hang."""

import subprocess


def finish(proc: subprocess.Popen, timeout_s: float) -> str:
    """Wait for ``proc`` and return its output (stdout with stderr merged, text).

    Raises:
        subprocess.TimeoutExpired: ``proc`` ran past ``timeout_s`` seconds (it is killed first).
    """
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return log
