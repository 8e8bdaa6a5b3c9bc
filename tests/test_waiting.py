"""tests/waiting.py: waits that end at the state they wait for, and fail saying what they waited for."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests import waiting


def test_until_returns_the_conditions_value_as_soon_as_it_holds():
    polls = []

    def third_time() -> str | None:
        polls.append(1)
        return "ready" if len(polls) == 3 else None

    assert waiting.until(third_time, "the third poll", poll=0.001) == "ready" and len(polls) == 3


def test_until_fails_past_the_deadline_naming_what_and_the_last_state(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("bound to nothing yet\n")
    states = iter(["booting", "migrating", "migrating"] + ["migrating"] * 1000)
    with pytest.raises(pytest.fail.Exception) as failed:
        waiting.until(lambda: False, "the server to answer", state=lambda: next(states), log=log, timeout=0.05, poll=0.01)
    message = str(failed.value)
    assert message.startswith("the server to answer: not reached in 0 s") and "last state: 'migrating'" in message
    assert message.endswith("bound to nothing yet\n") and waiting.DEADLINE_ENV in message


def test_until_fails_at_once_in_a_final_state_or_when_the_process_exits():
    with pytest.raises(pytest.fail.Exception, match=r"waiting for the flow run held: the state is 'CRASHED', which it cannot leave"):
        waiting.until(lambda: False, "the flow run held", state=lambda: "CRASHED", final=("CRASHED",))
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"waiting for the marker: the process exited with code 3 first"):
        waiting.until(lambda: False, "the marker", process=process, log=lambda: "its last words")
    assert time.monotonic() - started < waiting.DEADLINE / 2  # not at the deadline: at the exit


def test_exited_gives_the_code_and_kills_one_still_running_past_the_deadline():
    code, seconds = waiting.exited(subprocess.Popen([sys.executable, "-c", "raise SystemExit(5)"]), "a quick exit")
    assert code == 5 and 0 <= seconds < waiting.DEADLINE
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with pytest.raises(pytest.fail.Exception, match=r"the sleeper stopping: the process \(pid \d+\) was still running 0 s later"):
        waiting.exited(sleeper, "the sleeper stopping", timeout=0.2)
    assert sleeper.poll() is not None  # killed, not left behind
