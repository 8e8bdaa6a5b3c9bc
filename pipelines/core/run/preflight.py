"""Checks that run before any stage, so a run fails in seconds instead of after an hour of training.

    from pipelines.core.run.preflight import check_tracking
    check_tracking(root)      # raises QllmError with what to do

`check_tracking` makes sure the MLflow tracking store a run will log to can be reached:

- `http(s)://` (an MLflow server, `MLFLOW_TRACKING_URI`): one GET of `<uri>/health` with a short
  timeout. No answer, or a 5xx from a proxy in front of it, is an error; any other answer (an auth
  challenge included) means the server is up, and MLflow itself reports what follows.
- `sqlite:///PATH` (the default `sqlite:///<project>/mlflow.db`) and `file:` stores: the directory
  must be writable (or creatable), and an existing database file writable.
- anything else (databricks, postgresql, ...): not checked here.

Messages never contain credentials: `user:password@` is removed from the URI first.
"""

from __future__ import annotations

import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from pipelines.core.errors import QllmError
from pipelines.core.run import tracking

PROBE_TIMEOUT_S = 5.0
PROBE_TIMEOUT_ENV = "QLLM_TRACKING_PROBE_TIMEOUT"
"""Seconds an MLflow server may take to answer the probe (default `PROBE_TIMEOUT_S`)."""


def seconds(variable: str, default: float) -> float:
    """A time limit in seconds from the environment variable `variable` (a positive number), else `default`."""
    text = os.environ.get(variable)
    if text is None or not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise QllmError(f"{variable}={text!r}: expected a positive number of seconds")
    return value


def redact(uri: str) -> str:
    """`uri` without `user:password@` (safe to print or log)."""
    parts = urllib.parse.urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def _ssl_context() -> ssl.SSLContext | None:
    """The TLS settings MLflow's own client honours (a private CA, or verification off)."""
    if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
        context = ssl.create_default_context()  # the user turned verification off for MLflow
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        return context
    cert = os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH")
    return ssl.create_default_context(cafile=cert) if cert else None


def _probe_http(uri: str, timeout: float) -> str | None:
    """None if the server answers, else why not."""
    url = redact(uri).rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=_ssl_context()):  # noqa: S310 - http(s) only
            return None
    except urllib.error.HTTPError as exc:
        # Any answer means a server is listening; 5xx is a proxy/gateway whose backend is down.
        return f"HTTP {exc.code} {exc.reason}" if exc.code >= 500 else None
    except urllib.error.URLError as exc:
        return str(exc.reason)
    except (OSError, ValueError) as exc:  # timeouts, resets, malformed host
        return str(exc) or type(exc).__name__


def _unwritable(path: Path) -> str | None:
    """None if a file can be created or written at `path`, else why not."""
    if path.exists():
        return None if os.access(path, os.W_OK) else f"{path} is not writable"
    directory = path.parent
    while not directory.exists():  # MLflow's client creates missing directories
        directory = directory.parent
    if not directory.is_dir():
        return f"{directory} is not a directory"
    return None if os.access(directory, os.W_OK | os.X_OK) else f"directory {directory} is not writable"


def check_tracking(root: Path | str = ".", timeout: float | None = None) -> str:
    """Raise `QllmError` if the MLflow tracking store of `root` cannot be used; return its URI
    (redacted).

    Args:
        root: the project (or run workspace) directory whose default store is `mlflow.db`.
        timeout: seconds to wait for an MLflow server's answer ($QLLM_TRACKING_PROBE_TIMEOUT, else 5).
    """
    timeout = seconds(PROBE_TIMEOUT_ENV, PROBE_TIMEOUT_S) if timeout is None else timeout
    uri = tracking.tracking_uri(root)
    shown = redact(uri)
    scheme = urllib.parse.urlsplit(uri).scheme.lower()
    if scheme in ("http", "https"):
        reason = _probe_http(uri, timeout)
        if reason is not None:
            raise QllmError(
                f"MLflow tracking server {shown} is unreachable ({reason}): start it "
                f"(`mlflow server --host 127.0.0.1 --port 5000 --backend-store-uri sqlite:///mlflow.db`) "
                f"or unset MLFLOW_TRACKING_URI to log to the local sqlite:///mlflow.db (a server that is up but slow to answer: "
                f"raise ${PROBE_TIMEOUT_ENV}, now {timeout:g} s)"
            )
    elif scheme == "sqlite":
        database = uri.split(":///", 1)[1] if ":///" in uri else ""
        if database and not database.startswith(":memory:"):
            reason = _unwritable(Path(database.split("?", 1)[0]).expanduser().resolve())
            if reason is not None:
                raise QllmError(f"MLflow tracking store {shown} cannot be written: {reason}; fix the permissions or point MLFLOW_TRACKING_URI elsewhere")
    elif scheme in ("file", ""):
        directory = Path(urllib.parse.urlsplit(uri).path if scheme else uri).expanduser().resolve()
        reason = _unwritable(directory / "mlruns-probe")
        if reason is not None:
            raise QllmError(f"MLflow tracking store {shown} cannot be written: {reason}; fix the permissions or point MLFLOW_TRACKING_URI elsewhere")
    return shown
