"""qllm/services/serve.py's own helpers, without starting servers (the servers themselves: tests/e2e/test_team.py)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qllm.services import serve


def test_the_team_profiles_secrets_file_never_holds_them_readable_by_others(tmp_path, monkeypatch):
    """A secrets file left with wider permissions (0644) is replaced by a new 0600 file: the passwords
    are written into that file only, never into the old one (opened with O_TRUNC and chmodded after)."""
    path = tmp_path / "secrets.json"
    path.write_text("{}")
    os.chmod(path, 0o644)
    seen = []
    real = os.fdopen

    def spying_fdopen(fd, *args, **kwargs):
        seen.append(stat.S_IMODE(os.fstat(fd).st_mode))
        return real(fd, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", spying_fdopen)
    serve._private(path, '{"mlflow": "s3cret"}')
    assert seen == [0o600] and stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == '{"mlflow": "s3cret"}'


def test_serving_beyond_this_host_is_refused_without_authentication_or_tls(tmp_path, capsys):
    """The local profile's Prefect API has no authentication and its worker runs flow code: it
    serves loopback only. The team profile beyond this host needs TLS, or --insecure said (with a
    warning); --insecure where it would do nothing and a certificate that does not load are refused."""
    from pipelines.core.errors import QllmError
    from tests.certificates import self_signed

    cert, key = self_signed(tmp_path / "tls")
    tls = (str(cert), str(key))
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        serve.check_host("local", host, None, False)
        serve.check_host("team", host, None, False)
        serve.check_host("team", host, tls, False)
        with pytest.raises(QllmError, match=rf"--insecure is for a --host beyond this machine; with '{host}' it would do nothing"):
            serve.check_host("team", host, None, True)
    for host in ("0.0.0.0", "::", "10.1.2.3"):
        with pytest.raises(QllmError, match=rf"--host '{host}' with the local profile would expose a Prefect API without authentication"):
            serve.check_host("local", host, None, False)
        with pytest.raises(QllmError, match=rf"--host '{host}' without TLS would send the team's passwords over the network in clear"):
            serve.check_host("team", host, None, False)
        serve.check_host("team", host, tls, False)
        capsys.readouterr()
        serve.check_host("team", host, None, True)
        assert f"warning: serve serves {host} without TLS (--insecure)" in capsys.readouterr().err
    with pytest.raises(QllmError, match="--tls-cert/--tls-key is for the team profile"):
        serve.check_host("local", "127.0.0.1", tls, False)
    with pytest.raises(QllmError, match="--insecure is for the team profile"):
        serve.check_host("local", "127.0.0.1", None, True)
    with pytest.raises(QllmError, match="with --tls-cert it would do nothing"):
        serve.check_host("team", "0.0.0.0", tls, True)
    with pytest.raises(QllmError, match="missing.pem: no such file"):
        serve.check_host("team", "0.0.0.0", (str(tmp_path / "missing.pem"), str(key)), False)
    other, _ = self_signed(tmp_path / "other")
    for pair in ((str(other), str(key)), (str(key), str(key))):  # a certificate with another's key; a key for a certificate
        with pytest.raises(QllmError, match="not a certificate and its key"):
            serve.check_host("team", "0.0.0.0", pair, False)
    # the command line: refused before anything starts, nothing recorded
    done = subprocess.run([sys.executable, "-m", "qllm.services.serve", "start", "--project-dir", str(tmp_path), "--host", "0.0.0.0"],
                          capture_output=True, text=True, cwd=serve.Path(__file__).resolve().parents[2])  # fmt: skip
    assert done.returncode != 0 and "would expose a Prefect API without authentication" in done.stderr, done.stderr
    assert not (tmp_path / serve.STATE_DIR).exists()


def test_the_served_processes_run_with_mlflows_telemetry_off(tmp_path, monkeypatch):
    """`make serve`'s services, and the flow runs its worker starts, inherit `service_env`: DVC's,
    Prefect's and MLflow's telemetry off (MLflow 3 sends usage events unless told not to, or unless
    it finds itself under a test or CI: so a process gets only the environment named here)."""
    for name in ("DVC_NO_ANALYTICS", "PREFECT_SERVER_ANALYTICS_ENABLED", "MLFLOW_DISABLE_TELEMETRY"):
        monkeypatch.delenv(name, raising=False)  # the suite's own settings (tests/conftest.py) would hide a missing one
    env = serve.service_env(tmp_path)
    assert (env["DVC_NO_ANALYTICS"], env["PREFECT_SERVER_ANALYTICS_ENABLED"]) == ("1", "false")
    verdict = "from mlflow.telemetry.utils import is_telemetry_disabled; print(is_telemetry_disabled())"
    bare = {"PATH": env["PATH"], "HOME": str(tmp_path)}
    answers = [subprocess.run([sys.executable, "-c", verdict], env=bare | extra, capture_output=True, text=True, check=True).stdout.split()[-1]
               for extra in ({"MLFLOW_DISABLE_TELEMETRY": env["MLFLOW_DISABLE_TELEMETRY"]}, {})]  # fmt: skip
    assert answers == ["True", "False"]  # off as served; on in the same bare process without it


def _sigint_disposition(pid: int, timeout: float = 60.0) -> str:
    """"ignored" or "caught" as /proc says once the Python child has set its signals up (it
    catches SIGINT when it starts with it at its default action, and keeps ignoring it otherwise)."""
    bit = 1 << (signal.SIGINT - 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
        if int(fields["SigIgn"], 16) & bit:
            return "ignored"
        if int(fields["SigCgt"], 16) & bit:
            return "caught"
        time.sleep(0.05)
    raise AssertionError(f"process {pid} set no SIGINT handling within {timeout:g} s")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the signal masks in /proc (Linux)")
def test_services_start_with_sigint_at_its_default_when_their_caller_ignores_it(tmp_path):
    """A shell ignores SIGINT in what it starts in the background (`make serve &` in a script, a CI
    step). Prefect's worker stops on SIGTERM by sending itself SIGINT: one that inherited the
    ignored SIGINT went on polling until `stop` SIGKILLed it 15 s later."""
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's background job starts
    try:
        service = serve._spawn(command, tmp_path, dict(os.environ), tmp_path / "service.log")
        plain = subprocess.Popen(command, start_new_session=True)  # the same child, started as before
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        assert [_sigint_disposition(service.pid), _sigint_disposition(plain.pid)] == ["caught", "ignored"]
    finally:
        for child in (service, plain):
            child.kill()
            child.wait()


# ----------------------------------------------------------------------------- the team profile's files and MLflow's host check


def test_the_secrets_file_is_made_owner_only_again_at_every_start(tmp_path):
    """A `secrets.json` whose mode was widened after it was written (a copy, a chmod, a restore from
    a backup) is put back to 0600 when the profile starts again, with the same passwords."""
    passwords = {name: f"password-{name}" for name in serve.PASSWORDS}
    path = tmp_path / serve.SECRETS
    path.write_text(json.dumps(passwords))
    for mode in (0o644, 0o640, 0o604):
        os.chmod(path, mode)
        assert serve._secrets(tmp_path) == passwords
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, oct(mode)
        assert json.loads(path.read_text()) == passwords


def test_team_env_survives_a_shell_with_spaces_and_quotes_in_its_values(tmp_path):
    """`team.env` is read by `set -a; . team.env; set +a` (bash): a certificate path with a space,
    and any other character a value may hold, comes back as it was written; `read_env_file`
    reads the same values."""
    odd = tmp_path / "my certs" / "it's $HOME; a `b`.pem"
    values = serve.tls_client_env(str(odd)) | {"MLFLOW_TRACKING_PASSWORD": "p@ss-word_0123", "EMPTY": ""}
    env_file = tmp_path / "team.env"
    env_file.write_text(serve.env_file_text(values))
    script = f"set -a; . {shlex.quote(str(env_file))}; set +a; " + "; ".join(f'printf "%s\\0" "${key}"' for key in values)
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={"PATH": os.environ["PATH"], "HOME": "/nowhere"})
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.split("\0")[:-1] == list(values.values())
    assert serve.read_env_file(env_file) == values


def test_mlflows_host_check_lets_the_certificates_names_through(tmp_path, monkeypatch):
    """MLflow's server refuses (403) a request whose Host header it does not know (DNS-rebinding
    protection): by default loopback and private addresses only. A client of the team's server
    behind TLS uses a name of the certificate (its hostname must match for the TLS check), so the
    server's environment allows those names, with any port; other names stay refused. Checked
    with MLflow's own middleware."""
    from flask import Flask

    from tests.certificates import self_signed

    cert, key = self_signed(tmp_path / "tls", dns=("qllm-team.test", "*.team.test"), ips=("127.0.0.1", "203.0.113.7"))
    for variable in ("MLFLOW_SERVER_ALLOWED_HOSTS", "MLFLOW_SERVER_DISABLE_SECURITY_MIDDLEWARE"):
        monkeypatch.delenv(variable, raising=False)
    for name, value in serve.mlflow_host_env("0.0.0.0", (str(cert), str(key))).items():
        monkeypatch.setenv(name, value)
    from mlflow.server.security import init_security_middleware

    app = Flask("probe")
    app.add_url_rule("/api/2.0/mlflow/experiments/search", "search", lambda: "ok")
    init_security_middleware(app)
    client = app.test_client()

    def status(host: str) -> int:
        return client.get("/api/2.0/mlflow/experiments/search", headers={"Host": host}).status_code

    for host in ("qllm-team.test:5000", "qllm-team.test", "mlflow.team.test:443", "203.0.113.7:5000", "127.0.0.1:5000", "localhost"):
        assert status(host) == 200, host
    for host in ("evil.example:5000", "qllm-team.test.evil.example", "203.0.113.8:5000"):
        assert status(host) == 403, host
    # MLflow's own defaults are kept (the variable replaces them)
    from mlflow.server.security_utils import get_default_allowed_hosts

    assert set(get_default_allowed_hosts()) <= set(serve.MLFLOW_DEFAULT_HOSTS)
    # without TLS: the host served, or for a wildcard this machine's names
    assert "server.example.com:*" in serve.mlflow_host_env("server.example.com", None)["MLFLOW_SERVER_ALLOWED_HOSTS"].split(",")
    assert f"{socket.gethostname()}:*" in serve.mlflow_host_env("0.0.0.0", None)["MLFLOW_SERVER_ALLOWED_HOSTS"].split(",")
    assert "[[]2001:db8::1]:*" in serve.mlflow_host_env("2001:db8::1", None)["MLFLOW_SERVER_ALLOWED_HOSTS"].split(",")
