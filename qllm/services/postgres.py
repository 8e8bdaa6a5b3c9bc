"""A PostgreSQL cluster of the project's own, for the team servers (`make serve PROFILE=team`).

    cluster = Cluster(data_dir, port, password)
    cluster.init()                       # initdb, once (password auth for the user `qllm`)
    process = cluster.start(log)         # the `postgres` server, on 127.0.0.1 only, TCP only
    cluster.wait(process)
    cluster.create_database("mlflow")
    cluster.url("mlflow")                # postgresql+psycopg://qllm:...@127.0.0.1:PORT/mlflow

The server binaries come from the system's packages (Debian: `apt-get install postgresql`, which
puts them in /usr/lib/postgresql/<version>/bin). PostgreSQL refuses to run as root: run as root,
the cluster belongs to the `postgres` system user and its commands run through `runuser`. It
listens on 127.0.0.1 only, over TCP only (no Unix socket), and asks for the password
(scram-sha-256): the servers that use it run on the same host.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

from pipelines.core.errors import QllmError

USER = "qllm"
"""The cluster's superuser: `qllm.services.serve` administers the cluster as it; the servers connect as
roles of their own (`Cluster.own`)."""


def bin_dir() -> Path:
    """Where PostgreSQL's server programs are (`initdb`, `postgres`)."""
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    if not candidates:
        raise QllmError("PostgreSQL's server is not installed (Debian/Ubuntu: apt-get install postgresql; macOS: brew install postgresql)")
    return Path(candidates[-1]).parent


def _as_postgres() -> list[str]:
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


class Cluster:
    """One data directory served on `port` (see the module docstring). `password` None: trust
    authentication (for a throwaway cluster in the tests)."""

    def __init__(self, data: Path, port: int, password: str | None) -> None:
        self.data, self.port, self.password = Path(data), port, password

    def init(self) -> bool:
        """Create the cluster unless it exists; whether it was created."""
        if (self.data / "PG_VERSION").exists():
            return False
        self.data.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="qllm-initdb-") as scratch:
            command = [str(bin_dir() / "initdb"), "-D", str(self.data), "-U", USER, "--no-instructions", "-E", "UTF8"]
            if self.password is None:
                command += ["-A", "trust"]
            else:
                pwfile = Path(scratch) / "pw"
                pwfile.write_text(self.password + "\n")
                command += ["-A", "scram-sha-256", "--pwfile", str(pwfile)]
            if os.geteuid() == 0:  # the postgres user owns the cluster and reads the password file
                for path in (scratch, pwfile if self.password is not None else None):
                    if path is not None:
                        shutil.chown(path, "postgres")
                self.data.mkdir(exist_ok=True)
                shutil.chown(self.data, "postgres")
            done = subprocess.run([*_as_postgres(), *command], capture_output=True, text=True)
        if done.returncode != 0:
            raise QllmError(f"initdb {self.data} failed: {done.stdout}{done.stderr}")
        return True

    def command(self) -> list[str]:
        """The server process (foreground: its PID is the server's; SIGINT stops it fast)."""
        return [*_as_postgres(), str(bin_dir() / "postgres"), "-D", str(self.data), "-p", str(self.port),
                "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories="]  # fmt: skip

    def url(self, database: str, driver: str = "psycopg", user: str = USER, password: str | None = None) -> str:
        """SQLAlchemy's URL of `database` (`driver`: psycopg for MLflow, asyncpg for Prefect), as
        `user` (default the cluster's superuser, with its password)."""
        password = self.password if user == USER else password
        secret = f":{quote(password, safe='')}" if password is not None else ""
        return f"postgresql+{driver}://{user}{secret}@127.0.0.1:{self.port}/{database}"

    def _connect(self, database: str = "postgres"):
        import psycopg

        return psycopg.connect(host="127.0.0.1", port=self.port, user=USER, password=self.password, dbname=database, autocommit=True, connect_timeout=5)

    def wait(self, process: subprocess.Popen, timeout: float = 60.0, log: Path | None = None) -> None:
        """Until the server accepts connections (QllmError if it exits or `timeout` passes)."""
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise QllmError(f"PostgreSQL exited with code {process.returncode}" + (f"; see {log}" if log else ""))
            try:
                with self._connect():
                    return
            except psycopg.OperationalError as exc:
                if "password authentication failed" in str(exc):
                    raise QllmError(f"PostgreSQL in {self.data} refuses the password it was given: the cluster was made with another "
                                    "one (its password file lost?); restore that file, or remove the cluster directory to start afresh") from None
                if time.monotonic() > deadline:
                    raise QllmError(f"PostgreSQL did not accept connections on 127.0.0.1:{self.port} within {timeout:.0f} s: {exc}") from None
                time.sleep(0.2)

    def create_database(self, name: str) -> bool:
        """Create database `name` unless it exists; whether it was created."""
        from psycopg import sql

        with self._connect() as connection:
            if connection.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
                return False
            connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            return True

    def own(self, role: str, password: str, databases: tuple[str, ...]) -> None:
        """`role` logs in with `password` (set again each time: the secrets file holds the truth),
        owns `databases` and what is in their `public` schema (tables an older version made as
        the superuser included), and may connect to them only: not a superuser, no role or
        database creation, every database of the cluster closed to PUBLIC; so a server's role
        reads its own data and nothing else."""
        from psycopg import sql

        with self._connect() as connection:
            exists = connection.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
            verb = "ALTER" if exists else "CREATE"  # INHERIT: a database's owner acts as pg_database_owner, who owns `public`
            connection.execute(sql.SQL(verb + " ROLE {} WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE INHERIT PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(password)))  # fmt: skip
            for database in databases:
                connection.execute(sql.SQL("ALTER DATABASE {} OWNER TO {}").format(sql.Identifier(database), sql.Identifier(role)))
            for (database,) in connection.execute("SELECT datname FROM pg_database WHERE NOT datistemplate").fetchall():
                connection.execute(sql.SQL("REVOKE ALL ON DATABASE {} FROM PUBLIC").format(sql.Identifier(database)))
        for database in databases:
            with self._connect(database) as connection:
                owned = connection.execute(
                    "SELECT CASE c.relkind WHEN 'S' THEN 'SEQUENCE' WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW' ELSE 'TABLE' END, c.relname"
                    " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace JOIN pg_roles r ON r.oid = c.relowner"
                    " WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm', 'S') AND r.rolname <> %s"
                    " AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.objid = c.oid AND c.relkind = 'S' AND d.deptype IN ('a', 'i'))"
                    " UNION ALL SELECT 'TYPE', t.typname FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace JOIN pg_roles r ON r.oid = t.typowner"
                    " WHERE n.nspname = 'public' AND t.typtype IN ('e', 'd') AND r.rolname <> %s", (role, role)).fetchall()  # fmt: skip
                for kind, name in owned:
                    connection.execute(sql.SQL(f"ALTER {kind} {{}} OWNER TO {{}}").format(sql.Identifier("public", name), sql.Identifier(role)))
