"""Local services for deployments: a Prefect server, a `process` work pool and worker, the MLflow UI.

    python -m qllm.services.serve start     # what `make serve` runs; prints the URLs
    python -m qllm.services.serve stop      # what `make stop` runs; stops exactly what `start` started
    python -m qllm.services.serve status

Everything listens on 127.0.0.1. `start` records each process's PID, port and log file in
`.qllm/serve/services.json`; `stop` signals those PIDs only (their process groups: the worker's
flow-run subprocesses go too) and removes the record. Prefect's state lives in
`.qllm/serve/prefect` (PREFECT_HOME), so a served project does not touch the user's profile.

Then, from this directory:

    export PREFECT_API_URL=http://127.0.0.1:4200/api
    prefect --no-prompt deploy --all
    prefect deployment run 'qllm-pipeline/default' --watch

`--profile team` (`make serve PROFILE=team`) serves a team instead of a laptop: a PostgreSQL
cluster of the project's own (`qllm.services.postgres`) under both servers, an MLflow tracking server
(not the UI on the project's SQLite file) with `--serve-artifacts` and MLflow's basic-auth app, a
Prefect server asking for `PREFECT_SERVER_API_AUTH_STRING`, and a default DVC remote (a
directory, `--dvc-remote` for another URL; set in `.dvc/config.local`) unless the project has one.
The passwords are generated once and kept in `.qllm/serve/secrets.json`; what a client or worker
needs (server URLs, user and password) is written to `.qllm/serve/team.env` (both readable by
the owner only; nothing prints them): `set -a; . .qllm/serve/team.env; set +a`.
Every server binds 127.0.0.1 unless `--host` says otherwise (PostgreSQL always does): the local
profile refuses any other host, the team profile asks for TLS (`--tls-cert/--tls-key`: a TLS front
before each server, `qllm.services.tls_front`) or `--insecure` (`check_host`). Clients get an MLflow user
of their own (`CLIENT`), not the admin; each server a PostgreSQL role owning its own database only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

from pipelines.core.errors import QllmError
from pipelines.core.outputs import write_private
from pipelines.core.run.preflight import seconds
from qllm.services import postgres
from qllm.services.local_api import START_TIMEOUT_ENV, free_port, wait_http

STATE_DIR = ".qllm/serve"
RECORD = "services.json"
POOL = "qllm"
DEFAULT_PORTS = {"prefect": 4200, "mlflow": 5000, "postgres": 5433}
PROFILES = ("local", "team")
TEAM_ENV = "team.env"
"""In STATE_DIR (team profile): the settings a client or worker needs, with the credentials."""
SECRETS = "secrets.json"
"""In STATE_DIR (team profile): the generated passwords, kept across restarts."""
USER = postgres.USER
"""The team profile's administrator: MLflow's admin and PostgreSQL's superuser (its passwords stay
in `SECRETS`, never in `TEAM_ENV`), and Prefect's basic-auth user."""
CLIENT = "qllm-client"
"""The MLflow user of the team's clients and workers (`TEAM_ENV`): EDIT on the project's experiment
and registered model, READ on the rest (`default_permission`), no administration."""
MLFLOW_AUTH_CACHE_SECONDS = 60
"""How long the MLflow server trusts a username and password it has verified: its basic-auth app's
`auth_cache_ttl_seconds` (MLflow from spring 2026; 3.17.2 in the lock; older ones ignore the key).
Without it MLflow hashes the password with scrypt at every check, three checks a request: 0.36 s
of server CPU a request on an AVX2-only EPYC, nine tenths of the server's time, against 0.01-0.03 s
with it. The passwords are generated (`secrets.token_urlsafe(24)`, 192 bits): a slow hash guards
guessable ones and buys nothing here. The server runs one worker, so a password change or a
deletion through MLflow's API drops the entry at once; only a change made in the database
directly waits out these seconds."""
DATABASE_ROLES = {"mlflow": ("qllm_mlflow", ("mlflow", "mlflow_auth")), "prefect": ("qllm_prefect", ("prefect",))}
"""Each server's PostgreSQL role and the databases it owns (and may connect to: no other)."""
PASSWORDS = ("postgres", "postgres_mlflow", "postgres_prefect", "mlflow", "mlflow_client", "prefect", "mlflow_flask")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        # as the servers bind (SO_REUSEADDR): a port a stopped server left in TIME_WAIT is free
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _port(preferred: int, taken: tuple[int, ...] = ()) -> int:
    """`preferred` if it is free, else (or for 0) any free port not in `taken` (two back-to-back
    requests for a free port may be handed the same one: the first is not bound yet)."""
    if preferred and preferred not in taken and _free(preferred):
        return preferred
    port = free_port()
    while port in taken:  # the OS hands out another on the next request
        port = free_port()
    return port


def service_env(root: Path, prefect_url: str | None = None, client: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the served processes (and `prefect deploy`/`deployment run`) use;
    `client`: the team profile's client settings (`team_env`)."""
    env = {
        **os.environ,
        "PREFECT_HOME": str(root / STATE_DIR / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "DVC_NO_ANALYTICS": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "HF_HUB_OFFLINE": "1",
        "PREFECT_LOGGING_EXTRA_LOGGERS": "qllm",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    if prefect_url:
        env["PREFECT_API_URL"] = prefect_url
    return env | (client or {})


def _private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner only: a new 0600 file renamed over it
    (`outputs.write_private`), so an existing file with wider permissions never holds it."""
    write_private(path, text)


def _secrets(state: Path) -> dict[str, str]:
    """The team profile's passwords (`PASSWORDS`): generated on its first start, then read back;
    one a newer version needs is added to an older file. At every start the file is made
    owner-only again (0600, yours) if its mode or owner changed since, with a warning: whoever
    could read it meanwhile may hold the passwords."""
    path = state / SECRETS
    known = json.loads(path.read_text()) if path.exists() else {}
    made = known | {name: secrets.token_urlsafe(24) for name in PASSWORDS if name not in known}
    info = path.stat() if path.exists() else None
    exposed = info is not None and (stat.S_IMODE(info.st_mode) != 0o600 or info.st_uid != os.getuid())
    if exposed:
        print(f"warning: {path} had mode {stat.S_IMODE(info.st_mode):04o} (owner uid {info.st_uid}); made 0600 and yours again. "
              "Whoever could read it meanwhile may hold the team's passwords", file=sys.stderr)  # fmt: skip
    if made != known or exposed:
        _private(path, json.dumps(made, indent=2) + "\n")
    return made


def postgres_dir(root: Path) -> Path:
    """The team profile's PostgreSQL cluster: in the project's state directory, or, run as root
    (the cluster then belongs to the `postgres` user, who cannot enter root's home), in
    /var/lib/qllm under a name made from the project's path."""
    if os.geteuid() == 0:
        return Path("/var/lib/qllm") / f"postgres-{hashlib.sha256(str(root).encode()).hexdigest()[:12]}"
    return root / STATE_DIR / "postgres"


def team_env(mlflow_url: str, prefect_url: str, passwords: dict[str, str]) -> dict[str, str]:
    """What a client or worker of the team servers sets (`.qllm/serve/team.env`): MLflow's client
    user (`CLIENT`, not the admin) and Prefect's auth string."""
    return {
        "MLFLOW_TRACKING_URI": mlflow_url,
        "MLFLOW_TRACKING_USERNAME": CLIENT,
        "MLFLOW_TRACKING_PASSWORD": passwords["mlflow_client"],
        "PREFECT_API_URL": prefect_url,
        "PREFECT_API_AUTH_STRING": f"{USER}:{passwords['prefect']}",
    }


def _mlflow_admin(url: str, password: str, method: str, path: str, body: dict | None = None, version: str = "2.0") -> dict:
    """One REST call to the MLflow server as its admin; the answer, or `{"error_code": ...}` for an
    error MLflow names (an existing user or experiment: the caller decides)."""
    import base64
    import urllib.error
    import urllib.parse
    import urllib.request

    data = json.dumps(body).encode() if body is not None and method != "GET" else None
    query = f"?{urllib.parse.urlencode(body)}" if body is not None and method == "GET" else ""
    request = urllib.request.Request(f"{url}/api/{version}/mlflow/{path}{query}", data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              "Authorization": "Basic " + base64.b64encode(f"{USER}:{password}".encode()).decode()})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        answer = exc.read()
        try:
            parsed = json.loads(answer or b"{}")
        except ValueError:
            parsed = {}
        if parsed.get("error_code") in ("RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST"):
            return parsed
        raise QllmError(f"MLflow server {method} {path}: HTTP {exc.code} {answer[:300]!r}") from None


def grant_client(url: str, passwords: dict[str, str], experiment: str, model_name: str) -> None:
    """Least privilege for the team's clients and workers: the MLflow user `CLIENT` (made, or its
    password set again), with EDIT on `experiment` and on the registered model `model_name` (both
    made by the admin when missing): what runs, stages and `register` need (create runs and model
    versions, log, tag, set aliases), nothing that deletes, grants or administers."""
    from pipelines.core.run import tracking

    password = passwords["mlflow"]
    user = {"username": CLIENT, "password": passwords["mlflow_client"]}
    if _mlflow_admin(url, password, "POST", "users/create", user).get("error_code") == "RESOURCE_ALREADY_EXISTS":
        _mlflow_admin(url, password, "PATCH", "users/update-password", user)
    found = _mlflow_admin(url, password, "GET", "experiments/get-by-name", {"experiment_name": experiment})
    if "experiment" in found:
        experiment_id = found["experiment"]["experiment_id"]
    else:
        tags = [{"key": tracking.EXPERIMENT_KIND_TAG, "value": tracking.EXPERIMENT_KIND}]
        experiment_id = _mlflow_admin(url, password, "POST", "experiments/create", {"name": experiment, "tags": tags})["experiment_id"]
    _mlflow_admin(url, password, "POST", "registered-models/create", {"name": model_name})
    for resource_type, resource_id in (("experiment", experiment_id), ("registered_model", model_name)):
        _mlflow_admin(url, password, "POST", "users/permissions/grant",
                      {"username": CLIENT, "resource_type": resource_type, "resource_id": resource_id, "permission": "EDIT"}, version="3.0")  # fmt: skip


def _model_name(root: Path) -> str:
    """`register.model_name` of the project's params (validated as a run loads them)."""
    from pipelines.core.params import files as params_file

    return params_file.load(root)[0].register.model_name


def worker_command(limit: int | None = None, name: str | None = None, queues: list[str] | None = None) -> list[str]:
    """A process worker on the pool (`limit`: flow runs it takes at once; `name`: Prefect's label
    `prefect.worker.name` on each flow run it takes; `queues`: the pool's work queues it serves,
    default all, e.g. `["default"]` for a worker that takes pipeline runs but no sweep's own run).
    Run it in the checkout its flows run in."""
    return [str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", POOL, "--type", "process",
            *(["--limit", str(limit)] if limit else []), *(["--name", name] if name else []),
            *[arg for queue in queues or [] for arg in ("--work-queue", queue)]]  # fmt: skip


def env_file_text(values: dict[str, str]) -> str:
    """`team.env`'s text: `KEY=VALUE` lines a shell reads with `set -a; . team.env; set +a`, each
    value quoted for the shell (`shlex.quote`), so a path with a space or a quote comes back whole."""
    return "# `make serve PROFILE=team`: what a client or worker of these servers sets (set -a; . THIS; set +a)\n" + "".join(
        f"{key}={shlex.quote(value)}\n" for key, value in values.items())


def read_env_file(path: Path) -> dict[str, str]:
    """The values of `team.env` (`env_file_text`'s lines, comments skipped), unquoted as the shell reads them."""
    values = {}
    for line in Path(path).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, quoted = line.partition("=")
            values[key] = "".join(shlex.split(quoted))
    return values


MLFLOW_DEFAULT_HOSTS = ("localhost", "127.0.0.1", "[::1]", "0.0.0.0", "localhost:*", "127.0.0.1:*", "[[]::1]:*", "0.0.0.0:*",
                        "192.168.*", "10.*", *(f"172.{i}.*" for i in range(16, 32)), "fc00:*", "fd00:*")  # fmt: skip
"""The Host headers MLflow 3's server accepts by default (`mlflow.server.security_utils.
get_default_allowed_hosts`: loopback and private addresses, any port): setting
`MLFLOW_SERVER_ALLOWED_HOSTS` replaces them, so `mlflow_host_env` keeps them (tests/qllm/test_serve.py
compares the two)."""


def certificate_names(cert: str) -> list[str]:
    """The DNS names and addresses a PEM certificate (its first: the server's own) is valid for:
    its subjectAltName, else its common name."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    try:
        loaded = x509.load_pem_x509_certificate(Path(cert).read_bytes())
    except (OSError, ValueError) as exc:
        raise QllmError(f"--tls-cert {cert}: not a PEM certificate ({exc})") from None
    try:
        alternative = loaded.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return [*alternative.get_values_for_type(x509.DNSName), *(str(ip) for ip in alternative.get_values_for_type(x509.IPAddress))]
    except x509.ExtensionNotFound:
        return [str(attribute.value) for attribute in loaded.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]


def mlflow_host_env(host: str, tls: tuple[str, str] | None) -> dict[str, str]:
    """`MLFLOW_SERVER_ALLOWED_HOSTS` for the team's MLflow server: MLflow's default Host headers
    (`MLFLOW_DEFAULT_HOSTS`) and the names its clients use, with any port: behind TLS the
    certificate's names (a client's TLS check accepts no other), else `host` (for a wildcard, this
    machine's names). MLflow answers 403 to any other Host header (its DNS-rebinding protection);
    a front relays the client's header as it came."""
    names = certificate_names(tls[0]) if tls else [host] if host not in WILDCARDS else [socket.gethostname(), socket.getfqdn()]
    patterns = list(MLFLOW_DEFAULT_HOSTS)
    for name in names:
        shown = f"[{name.strip('[]')}]" if ":" in name else name  # an IPv6 address, as a Host header writes it
        patterns += [shown, f"{shown.replace('[', '[[]', 1)}:*"]  # fnmatch patterns: `[` opens a class
    return {"MLFLOW_SERVER_ALLOWED_HOSTS": ",".join(dict.fromkeys(patterns))}


def _default_dvc_remote(root: Path, url: str, env: dict[str, str]) -> str:
    """The project's default DVC remote, made (`team`, in .dvc/config.local) if it has none."""
    dvc = str(Path(sys.executable).parent / "dvc")
    current = subprocess.run([dvc, "remote", "default"], cwd=root, env=env, capture_output=True, text=True)
    if current.returncode == 0 and current.stdout.strip():
        return f"{current.stdout.strip()} (the project's own)"
    added = subprocess.run([dvc, "remote", "add", "--local", "-d", "team", url], cwd=root, env=env, capture_output=True, text=True)
    if added.returncode != 0:
        raise QllmError(f"could not add the DVC remote {url!r}: {added.stdout}{added.stderr}")
    return f"team -> {url} (default, in .dvc/config.local)"


def _without(env: dict[str, str], prefix: str) -> dict[str, str]:
    """`env` without the variables starting with `prefix` (a server does not need a client's credentials)."""
    return {key: value for key, value in env.items() if not key.startswith(prefix)}


TLS_PROBES = {"prefect": "/api/admin/version", "mlflow": "/api/2.0/mlflow/experiments/search"}
"""What each server's TLS front asks without credentials before it listens (`qllm.services.tls_front
--probe`): paths the servers answer 401 unless authenticated (their health checks answer anyone)."""

WILDCARDS = ("0.0.0.0", "::", "")
"""Hosts that bind every address of the machine."""


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) reaches this machine only."""
    import ipaddress

    if host in WILDCARDS:
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:
            found = {info[4][0] for info in socket.getaddrinfo(host, None)}
        except OSError:
            return False
        return bool(found) and all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in found)


def check_host(profile: str, host: str, tls: tuple[str, str] | None, insecure: bool) -> None:
    """Refuse what would expose a server unsafely: the local profile beyond this host (an
    unauthenticated Prefect API whose worker runs flow code: anyone reaching the port runs code
    here); the team profile beyond this host without TLS (its passwords would cross the network
    in clear) unless `insecure` (`check_tls`); options that would do nothing."""
    if profile not in PROFILES:
        raise QllmError(f"serve: unknown profile {profile!r}; one of {', '.join(PROFILES)}")
    if profile == "local":
        if tls or insecure:
            raise QllmError(f"serve: {'--tls-cert/--tls-key' if tls else '--insecure'} is for the team profile (--profile team); "
                            "the local profile serves this host only")  # fmt: skip
        if not is_loopback(host):
            raise QllmError(f"serve: --host {host!r} with the local profile would expose a Prefect API without authentication whose worker "
                            "runs flow code: anyone who reaches the port could run code on this machine. Serve 127.0.0.1 and reach it "
                            "through an SSH tunnel (ssh -L 4200:127.0.0.1:4200 ...), or use --profile team (authentication, TLS)")  # fmt: skip
    check_tls("serve", host, tls, insecure, "the team's passwords")


def check_tls(command: str, host: str, tls: tuple[str, str] | None, insecure: bool, secret: str) -> None:
    """The rule every server here follows for TLS (the team profile, `qllm serve-openai`): a host
    beyond this machine is served over TLS (`tls`: cert and key PEM files, loaded here so a bad pair
    is refused before anything starts), or without it only when `insecure` says so, with a warning
    (`secret`, what would cross the network in clear, names the risk); `--insecure` where it would
    do nothing (with TLS, or on loopback) is refused."""
    if tls and insecure:
        raise QllmError(f"{command}: --insecure is for serving without TLS; with --tls-cert it would do nothing")
    if insecure and is_loopback(host):
        raise QllmError(f"{command}: --insecure is for a --host beyond this machine; with {host!r} it would do nothing")
    if not is_loopback(host) and not tls and not insecure:
        raise QllmError(f"{command}: --host {host!r} without TLS would send {secret} over the network in clear: give "
                        "--tls-cert CERT.pem --tls-key KEY.pem (docs/deployments.md), or --insecure on a network you trust")  # fmt: skip
    if insecure:
        print(f"warning: {command} serves {host} without TLS (--insecure): {secret} cross the network in clear", file=sys.stderr)
    for path in tls or ():
        if not Path(path).is_file():
            raise QllmError(f"{command}: --tls-cert/--tls-key {path}: no such file")
    if tls:
        import ssl

        from qllm.services.tls_front import server_context

        try:
            server_context(*tls)
        except (OSError, ssl.SSLError) as exc:
            raise QllmError(f"{command}: --tls-cert {tls[0]} / --tls-key {tls[1]}: not a certificate and its key ({exc})") from None


def tls_client_env(cert: str) -> dict[str, str]:
    """What a client verifies the TLS fronts with: the certificate itself (self-signed; for one a
    CA your clients trust already signed, drop these)."""
    path = str(Path(cert).resolve())
    return {"PREFECT_API_SSL_CERT_FILE": path, "MLFLOW_TRACKING_SERVER_CERT_PATH": path}


def wait_port(host: str, port: int, process: subprocess.Popen, what: str, timeout: float | None = None, hint: str = "") -> None:
    """Return once `host:port` accepts a TCP connection; a clear error if `process` exits first.
    `timeout`: $QLLM_SERVER_START_TIMEOUT or 120 s, as `local_api.wait_http`."""
    timeout = seconds(START_TIMEOUT_ENV, 120.0) if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise QllmError(f"{what} exited with code {process.returncode}{hint}")
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise QllmError(f"{what} did not listen on {host}:{port} within {timeout:g} s{hint}")


def _sigint_at_default() -> None:
    """In a service's child before exec: SIGINT back to its default action.

    A shell ignores SIGINT in the commands it starts in the background (`make serve &` in a script,
    a CI step), and every child inherits that; Python then keeps ignoring it instead of raising
    KeyboardInterrupt. Prefect's worker stops on SIGTERM by sending itself SIGINT, so a worker
    that ignored it went on polling until `stop` SIGKILLed it 15 s later, without its graceful
    shutdown. The services run in their own session, out of reach of the terminal's Ctrl-C, so a
    SIGINT reaches them only on purpose."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _spawn(command: list[str], root: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:  # the child keeps its own handle
        return subprocess.Popen(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_sigint_at_default)  # fmt: skip


def start(root: Path, prefect_port: int = DEFAULT_PORTS["prefect"], mlflow_port: int = DEFAULT_PORTS["mlflow"], timeout: float | None = None,
          profile: str = "local", host: str = "127.0.0.1", postgres_port: int = DEFAULT_PORTS["postgres"], dvc_remote: str | None = None,
          worker_limit: int | None = None, tls: tuple[str, str] | None = None, insecure: bool = False) -> dict:  # fmt: skip
    """Start the services of `profile` (refuses if a recorded set is still running); returns the
    record. `worker_limit`: flow runs the worker takes at once (None: no limit). `tls`: (cert,
    key) PEM files: the team servers listen on 127.0.0.1 only, behind a TLS front each
    (`qllm.services.tls_front`) on `host` and their ports. `check_host` says which hosts are allowed."""
    root = root.resolve()
    state = root / STATE_DIR
    check_host(profile, host, tls, insecure)
    if (state / RECORD).exists():
        running = {name: s["pid"] for name, s in read_record(root)["services"].items() if _alive(s["pid"])}
        if running:
            raise QllmError(f"services already running ({', '.join(f'{n} pid {p}' for n, p in running.items())}); run `make stop` first")
    prefect_port = _port(prefect_port)
    mlflow_port = _port(mlflow_port, taken=(prefect_port,))
    local = host if host not in WILDCARDS else "127.0.0.1"  # what clients on this host call
    scheme = "https" if tls else "http"
    prefect_url, mlflow_url = f"{scheme}://{local}:{prefect_port}/api", f"{scheme}://{local}:{mlflow_port}"
    # Behind TLS the servers listen on loopback ports of their own; the fronts take the named ones.
    bind, inner = host, {"prefect": prefect_port, "mlflow": mlflow_port}
    if tls:
        bind, inner = "127.0.0.1", {"prefect": _port(0, taken=(prefect_port, mlflow_port))}
        inner["mlflow"] = _port(0, taken=(prefect_port, mlflow_port, inner["prefect"]))
    inner_prefect, inner_mlflow = f"http://127.0.0.1:{inner['prefect']}/api", f"http://127.0.0.1:{inner['mlflow']}"
    if not tls:
        inner_prefect, inner_mlflow = prefect_url, mlflow_url
    bin_dir = Path(sys.executable).parent
    services: dict[str, dict] = {}
    record: dict = {"profile": profile, "prefect_api_url": prefect_url, "services": services}
    prefect_env: dict[str, str] = {}  # each server's own settings: neither sees the other's database URL
    # MLflow 3's job runner (huey consumers: GenAI scorers, prompt optimisation, trace rollups) is off
    # unless the environment asks for it: the pipeline submits no jobs, and the runner is a process
    # tree of its own (six processes, each importing MLflow: 6-7 s of CPU apiece on an AVX2-only EPYC)
    mlflow_env: dict[str, str] = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": os.environ.get("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")}
    # One uvicorn worker: `mlflow ui` would otherwise start four (uvicorn's multiprocess supervisor,
    # each worker a process importing MLflow's server: about 10 s of CPU apiece on a 2-core EPYC,
    # and a few hundred MB each) for one user's browser on one SQLite file. Concurrent requests
    # still overlap: the Flask app runs in the worker's thread pool.
    mlflow_server = [str(bin_dir / "mlflow"), "ui", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--workers", "1"]
    client = None
    try:
        if profile == "team":
            passwords = _secrets(state)
            client = team_env(mlflow_url, prefect_url, passwords) | (tls_client_env(tls[0]) if tls else {})
            cluster = postgres.Cluster(postgres_dir(root), _port(postgres_port, taken=(prefect_port, mlflow_port, *inner.values())), passwords["postgres"])
            cluster.init()
            log = state / "postgres.log"
            process = _spawn(cluster.command(), cluster.data.parent, service_env(root), log)  # a directory its user may enter
            services["postgres"] = {"pid": process.pid, "port": cluster.port, "data": str(cluster.data), "log": str(log), "signal": "SIGINT"}
            cluster.wait(process, timeout or 60.0, log)
            for database in ("mlflow", "mlflow_auth", "prefect"):
                cluster.create_database(database)
            mlflow_role, prefect_role = DATABASE_ROLES["mlflow"][0], DATABASE_ROLES["prefect"][0]
            for server, (role, databases) in DATABASE_ROLES.items():
                cluster.own(role, passwords[f"postgres_{server}"], databases)
            mlflow_db = {"user": mlflow_role, "password": passwords["postgres_mlflow"]}
            auth = state / "mlflow-auth.ini"
            _private(auth, "[mlflow]\ndefault_permission = READ\n"
                           f"database_uri = {cluster.url('mlflow_auth', **mlflow_db)}\nadmin_username = {USER}\nadmin_password = {passwords['mlflow']}\n"
                           "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                           f"auth_cache_ttl_seconds = {MLFLOW_AUTH_CACHE_SECONDS}\n")  # fmt: skip
            prefect_env = {"PREFECT_API_DATABASE_CONNECTION_URL": cluster.url("prefect", driver="asyncpg", user=prefect_role,
                                                                              password=passwords["postgres_prefect"]),
                           "PREFECT_SERVER_API_AUTH_STRING": client["PREFECT_API_AUTH_STRING"]}  # fmt: skip
            mlflow_env |= {"MLFLOW_AUTH_CONFIG_PATH": str(auth), "MLFLOW_FLASK_SERVER_SECRET_KEY": passwords["mlflow_flask"],  # the auth app's CSRF key
                          "MLFLOW_BACKEND_STORE_URI": cluster.url("mlflow", **mlflow_db)} | mlflow_host_env(host, tls)  # in the environment: a command line shows in `ps`
            mlflow_server = [str(bin_dir / "mlflow"), "server", "--serve-artifacts", "--artifacts-destination", str(state / "mlartifacts"),
                             "--app-name", "basic-auth", "--workers", "1"]  # fmt: skip
        env = service_env(root, prefect_url, client)
        # The two servers boot side by side (each takes seconds); the worker needs the Prefect one first.
        log = state / "prefect-server.log"
        server = _spawn([str(bin_dir / "prefect"), "server", "start", "--host", bind, "--port", str(inner["prefect"])], root,
                        env | prefect_env | {"PREFECT_SERVER_API_HOST": bind}, log)  # fmt: skip
        services["prefect-server"] = {"pid": server.pid, "url": prefect_url.removesuffix("/api"), "port": inner["prefect"], "log": str(log)}
        name = "mlflow-server" if profile == "team" else "mlflow-ui"
        ui_log = state / f"{name}.log"
        ui = _spawn([*mlflow_server, "--host", bind, "--port", str(inner["mlflow"])], root, _without(env, "MLFLOW_TRACKING_") | mlflow_env, ui_log)
        services[name] = {"pid": ui.pid, "url": mlflow_url, "port": inner["mlflow"], "log": str(ui_log)}
        fronts: dict[str, tuple[subprocess.Popen, int, Path]] = {}
        if tls:  # each front waits for its server, checks that it asks for credentials (`--probe`), then listens
            wait = seconds(START_TIMEOUT_ENV, 120.0) if timeout is None else timeout
            for server_name, port in (("prefect", prefect_port), ("mlflow", mlflow_port)):
                front_log = state / f"{server_name}-tls.log"
                front = _spawn([sys.executable, "-m", "qllm.services.tls_front", "--listen", f"{host}:{port}", "--to", str(inner[server_name]),
                                "--cert", tls[0], "--key", tls[1], "--probe", TLS_PROBES[server_name], "--wait", f"{wait:g}"],
                               root, service_env(root), front_log)  # fmt: skip
                services[f"{server_name}-tls"] = {"pid": front.pid, "port": port, "log": str(front_log)}
                fronts[server_name] = (front, port, front_log)

        def front_listens(server_name: str) -> None:
            """Once a server answers, its TLS front (if any) listens: it found the server asking for credentials."""
            if server_name in fronts:
                front, port, front_log = fronts[server_name]
                wait_port(local, port, front, f"the TLS front of {server_name}", timeout, hint=f"; see {front_log}")

        wait_http(f"{inner_prefect}/health", server, "the Prefect server", timeout, hint=f"; see {log}")
        front_listens("prefect")
        created = subprocess.run([str(bin_dir / "prefect"), "work-pool", "create", POOL, "--type", "process", "--overwrite"],
                                 cwd=root, env=env, capture_output=True, text=True)  # fmt: skip
        if created.returncode != 0:
            raise QllmError(f"could not create work pool {POOL!r}: {created.stdout}{created.stderr}")
        log = state / "prefect-worker.log"
        worker = _spawn(worker_command(worker_limit), root, env, log)
        services["prefect-worker"] = {"pid": worker.pid, "pool": POOL, "log": str(log)}
        wait_http(f"{inner_mlflow}/health", ui, f"the MLflow {'server' if profile == 'team' else 'UI'}", timeout, hint=f"; see {ui_log}")
        front_listens("mlflow")
        if profile == "team":
            from pipelines.core.run import tracking

            grant_client(inner_mlflow, passwords, tracking.experiment_name(), _model_name(root))
            record["dvc_remote"] = _default_dvc_remote(root, dvc_remote or str(state / "dvc-remote"), env)
            record["env_file"] = str(state / TEAM_ENV)
            _private(state / TEAM_ENV, env_file_text(client))
    except BaseException:
        stop_processes(services)  # nothing is left running, so no record: `make stop` must not kill reused PIDs
        raise
    state.mkdir(parents=True, exist_ok=True)
    (state / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return read_record(root)


def read_record(root: Path) -> dict:
    path = root / STATE_DIR / RECORD
    if not path.exists():
        return {"services": {}}
    return json.loads(path.read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (our own exited child not yet reaped) is not running
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, IndexError):
        return True


def stop_processes(services: dict[str, dict], timeout: float = 15.0) -> list[str]:
    """Stop each `{name: {"pid": ...}}` (its process group: started with a new session), last
    first: its `signal` (default SIGTERM), SIGKILL after `timeout` seconds; the names stopped."""
    stopped = []
    for name, service in reversed(list(services.items())):  # worker before server
        pid = service["pid"]
        if not _alive(pid):
            continue
        try:
            os.killpg(pid, getattr(signal, service.get("signal", "SIGTERM")))  # started with a new session: its group is its pid
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
            deadline = time.monotonic() + 5.0  # gone before this returns, even on a busy machine
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        stopped.append(f"{name} (pid {pid})")
    return stopped


def stop(root: Path, timeout: float = 15.0) -> list[str]:
    """Stop the recorded services (only those PIDs) and forget them; returns what was stopped.
    `timeout`: the seconds each may take to stop on its signal before it is SIGKILLed."""
    root = root.resolve()
    stopped = stop_processes(read_record(root)["services"], timeout)
    (root / STATE_DIR / RECORD).unlink(missing_ok=True)
    return stopped


def runs_link(root: Path, ui_url: str) -> str:
    """The served UI's link to the project experiment's runs (the experiment is made if new, so the
    link works before the first run)."""
    from pipelines.core.run import tracking

    root = root.resolve()
    return tracking.ui_runs_url(ui_url, tracking.experiment_id(root, uri=f"sqlite:///{root / 'mlflow.db'}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qllm.services.serve", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["start", "stop", "status"])
    parser.add_argument("--project-dir", default=".", type=Path)
    parser.add_argument("--prefect-port", type=int, default=DEFAULT_PORTS["prefect"])
    parser.add_argument("--mlflow-port", type=int, default=DEFAULT_PORTS["mlflow"])
    parser.add_argument("--profile", choices=PROFILES, default="local",
                        help="local: Prefect + worker + the MLflow UI on mlflow.db; team: PostgreSQL, MLflow server with basic auth, "
                             "Prefect with an auth string, a DVC remote")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="the address the Prefect and MLflow servers bind (default 127.0.0.1: this host only)")
    parser.add_argument("--postgres-port", type=int, default=DEFAULT_PORTS["postgres"], help="team profile: PostgreSQL's port (127.0.0.1)")
    parser.add_argument("--worker-limit", type=int, help="flow runs the worker takes at once (default: no limit)")
    parser.add_argument("--tls-cert", help="team profile: PEM certificate of a TLS front before each server (the servers then listen on 127.0.0.1 only)")
    parser.add_argument("--tls-key", help="team profile: the PEM private key of --tls-cert")
    parser.add_argument("--insecure", action="store_true", help="team profile: serve a non-loopback --host without TLS (a network you trust)")
    parser.add_argument("--dvc-remote", help="team profile: the DVC remote's URL when the project has no default one (default .qllm/serve/dvc-remote)")
    args = parser.parse_args(argv)
    try:
        if args.action == "start":
            if bool(args.tls_cert) != bool(args.tls_key):
                raise QllmError("serve: --tls-cert and --tls-key go together")
            tls = (args.tls_cert, args.tls_key) if args.tls_cert else None
            record = start(args.project_dir, args.prefect_port, args.mlflow_port, profile=args.profile, host=args.host,
                           postgres_port=args.postgres_port, dvc_remote=args.dvc_remote, worker_limit=args.worker_limit, tls=tls,
                           insecure=args.insecure)  # fmt: skip
            services = record["services"]
            print(f"Prefect UI/API  {services['prefect-server']['url']}   (export PREFECT_API_URL={record['prefect_api_url']})")
            print(f"Prefect worker  pool {POOL!r} (process), pid {services['prefect-worker']['pid']}")
            if args.profile == "team":
                print(f"MLflow server   {services['mlflow-server']['url']}   (basic auth: clients {CLIENT!r}, admin {USER!r}; artifacts proxied)")
                print(f"PostgreSQL      127.0.0.1:{services['postgres']['port']}   (data {services['postgres']['data']})")
                print(f"DVC remote      {record['dvc_remote']}")
                print(f"credentials     {record['env_file']} (owner-only): set -a; . {record['env_file']}; set +a")
            else:
                print(f"MLflow UI       {services['mlflow-ui']['url']}   (the runs: {runs_link(args.project_dir, services['mlflow-ui']['url'])})")
            print(f"logs and PIDs   {args.project_dir / STATE_DIR}; stop with `make stop`")
        elif args.action == "stop":
            stopped = stop(args.project_dir)
            print("stopped " + ", ".join(stopped) if stopped else "nothing was running")
        else:
            for name, service in read_record(args.project_dir.resolve())["services"].items():
                print(f"{name:<15} pid {service['pid']:<8} {'running' if _alive(service['pid']) else 'stopped'}  {service.get('url', '')}")
    except QllmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
