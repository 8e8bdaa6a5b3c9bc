"""Waits in tests for a state, never for a time.

A test that waits on a server, a worker, a flow run or a process polls what it waits for and goes
on the moment it is there. The deadline only bounds a broken run, so it is generous: `DEADLINE`
seconds for one awaited thing ($QLLM_TEST_DEADLINE, default 600: what takes seconds on a quiet
2-core machine takes minutes beside other jobs, and pytest's own limit per test is 900 s). A wait
that fails says what it waited for, for how long, and the last state it saw; a wait on a process
fails at once when the process exits first, with its exit code and its log's tail.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

DEADLINE_ENV = "QLLM_TEST_DEADLINE"
DEADLINE = float(os.environ.get(DEADLINE_ENV) or 600.0)
"""Seconds one awaited thing may take before the test fails (a bound for a broken run, not a timing)."""
TAIL = 3000
T = TypeVar("T")


Log = Path | Callable[[], str] | None
"""A process's output file, or a function giving the text that tells what happened (a failure ends with its tail)."""


def tail(log: Log) -> str:
    """The end of `log`, as a failure message ends with it."""
    if callable(log):
        return "\n" + log()[-TAIL:]
    if log is None or not Path(log).exists():
        return ""
    return "\n" + Path(log).read_text(errors="replace")[-TAIL:]


def until(condition: Callable[[], T], what: str, *, state: Callable[[], object] | None = None, final: tuple = (),
          process: subprocess.Popen | None = None, log: Log = None, timeout: float | None = None, poll: float = 0.05) -> T:  # fmt: skip
    """Poll `condition` until it returns something true, and return that. Fails naming `what`, the
    seconds waited and the last `state()` seen once `timeout` (default `DEADLINE`) has passed; at
    once when `state()` is one of `final` (a state the awaited one can no longer follow) or when
    `process` exits first. `log`'s tail ends the message. A process still running at the deadline
    is killed, so nothing is left behind."""
    timeout = DEADLINE if timeout is None else timeout
    started = time.monotonic()
    last: object = None
    while True:
        found = condition()
        if found:
            return found
        if state is not None:
            last = state()
            if last in final:
                pytest.fail(f"waiting for {what}: the state is {last!r}, which it cannot leave{tail(log)}")
        if process is not None and process.poll() is not None:
            pytest.fail(f"waiting for {what}: the process exited with code {process.returncode} first"
                        f"{'' if state is None else f' (last state: {last!r})'}{tail(log)}")  # fmt: skip
        waited = time.monotonic() - started
        if waited > timeout:
            if process is not None:
                process.kill()
            pytest.fail(f"{what}: not reached in {waited:.0f} s (${DEADLINE_ENV} raises the bound){'' if state is None else f'; last state: {last!r}'}"
                        f"{tail(log)}")  # fmt: skip
        time.sleep(poll)


def exited(process: subprocess.Popen, what: str, *, log: Log = None, timeout: float | None = None) -> tuple[int, float]:
    """Wait for `process` to exit: its exit code and the seconds it took. Past `timeout` (default
    `DEADLINE`) the process is killed and the test fails naming `what` and the log's tail."""
    timeout = DEADLINE if timeout is None else timeout
    started = time.monotonic()
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"{what}: the process (pid {process.pid}) was still running {timeout:.0f} s later (${DEADLINE_ENV} raises the bound){tail(log)}")
    return code, time.monotonic() - started
