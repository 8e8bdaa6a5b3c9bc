"""`python -m qllm.services.tls_front` (qllm/services/tls_front.py) as the command runs, in front of small HTTP
servers of the test's own: it fronts a server that asks for credentials, and refuses one that
answers without them (it would put an open server on the network behind a padlock)."""

from __future__ import annotations

import contextlib
import http.server
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from qllm.services.local_api import free_port
from tests.certificates import self_signed

REPO = Path(__file__).resolve().parents[2]
DEADLINE = 120.0  # seconds a front may take to start or to give up (a busy machine); each wait ends as soon as its event happens


class _Handler(http.server.BaseHTTPRequestHandler):
    open = False  # answer without credentials

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        allowed = self.open or self.headers.get("Authorization") == "Bearer let-me-in"
        body = b'{"answer": "yes"}' if allowed else b'{"error": "credentials"}'
        self.send_response(200 if allowed else 401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def upstream(open_: bool, port: int | None = None, delay: float = 0.0):
    """An HTTP server on 127.0.0.1 (after `delay` seconds) that answers every GET 200 when `open_`,
    else 401 unless `Authorization: Bearer let-me-in`."""
    handler = type("Handler", (_Handler,), {"open": open_})
    port = port or free_port()
    servers: list[http.server.ThreadingHTTPServer] = []

    def serve() -> None:
        time.sleep(delay)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        servers.append(server)
        server.serve_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        deadline = time.monotonic() + DEADLINE
        while not servers and time.monotonic() < deadline:
            time.sleep(0.05)
        for server in servers:
            server.shutdown()
            server.server_close()


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


def front(tls, to: int, *extra: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "qllm.services.tls_front", "--listen", f"127.0.0.1:{port}", "--to", str(to),
                                "--cert", str(tls[0]), "--key", str(tls[1]), *extra], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    return process, port


def listening(process: subprocess.Popen, port: int) -> bool:
    """Wait until the front accepts connections (True) or exits (False)."""
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline and process.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
        time.sleep(0.05)
    return False


def stop(process: subprocess.Popen) -> tuple[str, str]:
    if process.poll() is None:
        process.terminate()
    return process.communicate(timeout=DEADLINE)


def get(url: str, trust: Path, key: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30, context=ssl.create_default_context(cafile=str(trust))) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_server_that_answers_without_credentials_is_not_fronted(tls):
    """An upstream that answers an unauthenticated request (here 200 to everything; the same for
    `qllm serve-openai` without a key) makes the front exit with code 2 before it listens, saying why."""
    with upstream(open_=True) as to:
        process, port = front(tls, to, "--probe", "/v1/models")
        assert not listening(process, port)
        _, err = stop(process)
    assert process.returncode == 2, err
    assert "answered GET /v1/models without credentials (HTTP 200)" in err and "without authentication" in err


def test_a_server_that_asks_for_credentials_is_fronted_with_tls(tls):
    """An upstream that answers 401 without credentials is fronted: over TLS, a client with the
    credentials gets its answer, one without gets the upstream's 401. The probe waits for an
    upstream that is still starting."""
    to = free_port()
    process, port = front(tls, to)
    try:
        with upstream(open_=False, port=to, delay=1.0):
            assert listening(process, port)
            assert get(f"https://127.0.0.1:{port}/v1/models", tls[0], key="let-me-in") == 200
            assert get(f"https://127.0.0.1:{port}/v1/models", tls[0]) == 401
    finally:
        stop(process)


def test_a_server_that_never_answers_is_an_error(tls):
    to = free_port()
    process, port = front(tls, to, "--wait", "1")
    assert not listening(process, port)
    _, err = stop(process)
    assert process.returncode == 2 and f"nothing answered on 127.0.0.1:{to} within 1 s" in err, err
