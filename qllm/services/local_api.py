"""A private, temporary Prefect API for one `qllm run` when no Prefect server is configured.

This is what Prefect's own ephemeral mode does (`prefect.server.api.server.SubprocessASGIServer`:
the same uvicorn command and environment), minus importing the whole server package into this
process first — that import alone costs well over a second, and on a no-change run start-up is
nearly all the time there is. The server boots in its subprocess while this process imports and
checks what it needs; it listens on 127.0.0.1 only and is stopped when the run ends.

The server migrates the Prefect database (PREFECT_HOME) as it starts. Two `qllm run`s starting at
once on a new database would migrate it together, and one server dies ("Online migration expected
to match one row"); so a file lock in PREFECT_HOME is held from starting the server until it
answers, and a second run's server starts once the first one's has migrated.

If the server dies during the run, Prefect's client would retry each call with back-off for
minutes; `LocalApi.watch` notices within half a second, so `qllm run` can end with a clear error.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pipelines.core.errors import QllmError
from pipelines.core.run.preflight import seconds

START_TIMEOUT_ENV = "QLLM_SERVER_START_TIMEOUT"
"""Seconds a server this project starts (the temporary Prefect API, `make serve`'s services) may take
to answer: 120 by default; a slow or busy machine may need more."""


def wait_http(url: str, process: subprocess.Popen, what: str, timeout: float | None = None, poll: float = 0.2, hint: str = "") -> None:
    """Return once `url` answers 200; a clear error if `process` exits first or time runs out
    (`hint`, e.g. "; see server.log", is appended to either). `timeout`: $QLLM_SERVER_START_TIMEOUT or 120 s."""
    timeout = seconds(START_TIMEOUT_ENV, 120.0) if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise QllmError(f"{what} exited with code {process.returncode}{hint}")
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError), urllib.request.urlopen(url, timeout=1) as response:
            if response.status == 200:
                return
        time.sleep(poll)
    raise QllmError(f"{what} did not answer on {url} within {timeout:g} s{hint}; on a slow or busy machine, "
                    f"raise ${START_TIMEOUT_ENV} (seconds)")


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the `qllm run` that started it dies, even by
    SIGKILL, so no orphaned API server is left listening (Linux: PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


START_LOCK = ".qllm-api-start.lock"  # in PREFECT_HOME, held while a run's API starts and migrates


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalApi:
    """A uvicorn subprocess serving the Prefect API; `url` is ready once `wait()` returns."""

    def __init__(self) -> None:
        import prefect
        from prefect.settings import get_current_settings

        from pipelines.core.workspace import file_lock

        self._starting = contextlib.ExitStack()  # released by wait() once the server answers
        self._unwatched = threading.Event()
        home = Path(get_current_settings().home).expanduser()
        self._starting.enter_context(file_lock(home / START_LOCK, f"the Prefect database in {home} (another run's API is starting)"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        env = {
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # no telemetry from a run's private API (offline: an ERROR line a few minutes in); yours wins
            **os.environ,
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
            **get_current_settings().to_environment_variables(exclude_unset=True),
        }
        command = [
            sys.executable, "-m", "uvicorn", "--app-dir", str(Path(prefect.__file__).parent.parent),
            "--factory", "prefect.server.api.server:create_app",
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on",
        ]  # fmt: skip
        try:
            # Its own session: Ctrl-C (SIGINT to the terminal's process group) or a SIGTERM to the run's
            # group must reach the run, which stops its stages and still needs the API to report that;
            # the server goes when the run stops it or dies (PR_SET_PDEATHSIG, Linux only: elsewhere it
            # stays in the group, so that it cannot outlive a killed run).
            self.process = subprocess.Popen(command, env=env, start_new_session=sys.platform == "linux",
                                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)  # fmt: skip
        except BaseException:
            self._starting.close()
            raise

    def wait(self, timeout: float | None = None) -> None:
        try:
            wait_http(f"{self.url}/health", self.process, "the temporary Prefect server", timeout, poll=0.05)
        finally:
            self._starting.close()

    def watch(self, on_exit: Callable[[int, int], None], poll: float = 0.5) -> None:
        """Call `on_exit(returncode, pid)`, in a daemon thread, if the server exits before
        `unwatch()` or `stop()`."""

        def check() -> None:
            while not self._unwatched.wait(poll):
                if self.process.poll() is not None:
                    on_exit(self.process.returncode, self.process.pid)
                    return

        threading.Thread(target=check, name="qllm-api-watch", daemon=True).start()

    def unwatch(self) -> None:
        self._unwatched.set()

    def stop(self) -> None:
        self.unwatch()
        self._starting.close()  # never waited for (the run failed before its flow started)
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def drain_prefect_workers(timeout: float = 10.0) -> None:
    """Send buffered logs and events now, while the API still answers (as prefect_test_harness does)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(RuntimeError):  # never started in this process
            worker.drain_all(timeout=timeout)


@contextmanager
def prefect_api() -> Iterator[LocalApi | None]:
    """Start a temporary API unless a Prefect server is configured (PREFECT_API_URL, profile).

    Yields the started `LocalApi` (call `wait()` before the flow runs, inside
    `temporary_settings`) or None when the configured server is used.
    """
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        yield None
        return
    api = LocalApi()
    try:
        yield api
    finally:
        drain_prefect_workers()
        api.stop()
