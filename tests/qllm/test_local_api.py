"""The temporary Prefect API of `qllm run`: two runs starting at once share one new database."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

# In a fresh interpreter: PREFECT_HOME must be set before Prefect reads its settings.
SCRIPT = """
import threading
from pathlib import Path

from filelock import FileLock, Timeout
from prefect.settings import get_current_settings

from qllm.services.local_api import START_LOCK, LocalApi

lock = Path(get_current_settings().home) / START_LOCK

# 1. The start lock is held from starting the server until it answers, then released.
api = LocalApi()
try:
    FileLock(str(lock)).acquire(timeout=0)
    print("held while starting: no")
except Timeout:
    print("held while starting: yes")
api.wait()
probe = FileLock(str(lock))
probe.acquire(timeout=0)
probe.release()
print("released once answering: yes")
api.stop()

# 2. Two servers starting together on a database neither has migrated yet.
Path(get_current_settings().home, "prefect.db").unlink()
apis, errors = [], []

def start():
    started = LocalApi()
    apis.append(started)
    try:
        started.wait()
    except Exception as exc:
        errors.append(str(exc))

threads = [threading.Thread(target=start) for _ in range(2)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
for started in apis:
    started.stop()
print("errors:", errors)
"""


def test_runs_starting_together_migrate_the_prefect_database_one_at_a_time(tmp_path):
    """Without the lock the second part failed 1 run in 3 here ("the temporary Prefect server
    exited with code 3": both servers migrating the new database), which is how
    test_two_qllm_runs_at_once_from_cold once failed."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["held while starting: yes", "released once answering: yes", "errors: []"], done.stdout + done.stderr[-3000:]


def test_a_server_that_is_slow_to_start_fails_with_the_setting_to_raise(monkeypatch):
    """The wait for a server to answer is a time limit the machine's speed decides: its error says
    which setting gives a slower machine more time, and a bad value of that setting is refused."""
    import time

    import pytest

    from pipelines.core.errors import QllmError
    from qllm.services import local_api

    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # alive, never answers
    try:
        monkeypatch.setenv(local_api.START_TIMEOUT_ENV, "0.5")
        started = time.monotonic()
        with pytest.raises(QllmError, match=r"the server did not answer on http://127\.0\.0\.1:9/health within 0\.5 s; on a slow or busy "
                                            r"machine, raise \$QLLM_SERVER_START_TIMEOUT \(seconds\)"):  # fmt: skip
            local_api.wait_http("http://127.0.0.1:9/health", process, "the server")
        assert time.monotonic() - started < 5
        monkeypatch.setenv(local_api.START_TIMEOUT_ENV, "soon")
        with pytest.raises(QllmError, match=r"QLLM_SERVER_START_TIMEOUT='soon': expected a positive number of seconds"):
            local_api.wait_http("http://127.0.0.1:9/health", process, "the server")
    finally:
        process.kill()
        process.wait()
