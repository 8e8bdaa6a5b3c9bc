"""Concurrent runs in one project: separate workspaces, one shared DVC cache, one MLflow store.

Two `qllm run`s with different overrides, started together from cold, each run in their own
workspace (`.qllm/runs/<hash>`). Every stage both need with the same inputs runs once: the first
to reach it holds a lock named by DVC's run-cache key, the other waits and restores its outputs
from the run-cache. Both exit 0, DVC finds each workspace up to date, MLflow has one pipeline run
per `qllm run` with its own stage runs, and the registry one version per run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

from pipelines.core import dag, workspace
from pipelines.core.run import repro
from tests.conftest import ALWAYS_CHANGED, REPO, dvc_up_to_date, make_project, run
from tests.waiting import DEADLINE, exited, until

# --- the lock by inputs, on a toy DAG (fast) ---------------------------------------------------------

class WaitsFor(logging.Handler):
    """`event` is set (and `then` called) once a run logs that it waits for another process's or
    thread's lock on `what` (`workspace.file_lock`), on the logger `qllm.workspace` while in use."""

    def __init__(self, what: str, then: Callable[[], object] = lambda: None) -> None:
        super().__init__()
        self.what, self.then, self.event = what, then, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if f"is using {self.what}" in message and message.endswith("waiting for it to finish"):
            self.event.set()
            self.then()

    @contextlib.contextmanager
    def installed(self) -> Iterator[WaitsFor]:
        logger = logging.getLogger("qllm.workspace")
        level = logger.level
        logger.addHandler(self)
        logger.setLevel(logging.INFO)
        try:
            yield self
        finally:
            logger.removeHandler(self)
            logger.setLevel(level)


def test_the_same_stage_in_two_workspaces_at_once_runs_once(toy):
    root = toy  # the toy DAG (tests/conftest.py)
    # Same `a`, different `b`: two workspaces that share stage `a`'s inputs.
    workspaces = [workspace.prepare(root, {"a": {"n": 2}, "b": {"m": m}}) for m in (2, 3)]
    executed: list[Path] = []
    waiting = WaitsFor("stage a with the same inputs")

    def slow_a(ws: Path, name: str, parent_run_id) -> None:
        executed.append(ws)
        # runs until the other workspace waits for this stage (a state, on any machine's speed); a
        # second run of the stage would wait here too, and fail once the deadline passes
        until(waiting.event.is_set, "the other workspace to wait for stage a's lock", state=lambda: len(executed))
        (ws / "data/a").mkdir(parents=True, exist_ok=True)
        (ws / "data/a/out.txt").write_text("x" * 2)

    outcomes = {}

    def reproduce(ws: Path) -> None:
        outcomes[ws] = repro.reproduce(ws, "a", execute=slow_a)

    threads = [threading.Thread(target=reproduce, args=(ws,)) for ws in workspaces]
    try:
        with waiting.installed():
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=DEADLINE)
        assert not any(thread.is_alive() for thread in threads)
    finally:
        for ws in workspaces:
            repro.close(ws)
    assert waiting.event.is_set() and len(executed) == 1
    assert sorted((o.status, o.reason) for o in outcomes.values()) == [("cached", "run-cache"), ("ran", "executed")]
    assert all((ws / "data/a/out.txt").read_text() == "xx" for ws in workspaces)
    for ws in workspaces:
        assert "up to date" in run([sys.executable, "-m", "dvc", "status", "a"], ws).stdout


# DVC writes a run-cache entry to a temporary it then renames; a reader loads the newest file of the
# entry's directory and deletes one it cannot parse. This writer (another process, as another
# `qllm run` is) stops with its temporary half written until the file `release` exists (the reader
# has come to the entry), or 10 minutes at most.
SLOW_RUN_CACHE_WRITER = """
import sys, time
from pathlib import Path
import dvc.utils.serialize as serialize
from pipelines.core.run import repro

ws, started, release = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
real = serialize.dump_yaml

def slow_dump(path, data, **kwargs):
    real(path, data, **kwargs)
    if "runs" in Path(path).parts:
        text = Path(path).read_text()
        with open(path, "w") as file:
            file.write(text[: len(text) // 2])
            file.flush()
            started.write_text("")
            deadline = time.monotonic() + 600
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            file.write(text[len(text) // 2 :])

def body(ws, name, parent_run_id):
    (ws / "data/a").mkdir(parents=True, exist_ok=True)
    (ws / "data/a/out.txt").write_text("xx")

serialize.dump_yaml = slow_dump
print(repro.reproduce(ws, "a", execute=body).reason)
"""


def test_a_run_cache_entry_being_written_is_not_read_by_another_workspace(toy, tmp_path):
    writer_ws, reader_ws = (workspace.prepare(toy, {"a": {"n": 2}, "b": {"m": m}}) for m in (2, 3))
    started, release = tmp_path / "writing", tmp_path / "release"
    command = [sys.executable, "-c", SLOW_RUN_CACHE_WRITER, str(writer_ws), str(started), str(release)]
    writer = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    until(started.exists, "the other process to half-write its run-cache entry", process=writer, log=lambda: writer.communicate()[1])

    def must_not_run(ws: Path, name: str, parent_run_id) -> None:
        raise AssertionError("the reader ran stage a: it should have restored the writer's outputs")

    reading = WaitsFor("DVC's run-cache", then=lambda: release.write_text(""))  # the reader has come to the half-written entry
    try:
        with reading.installed():
            outcome = repro.reproduce(reader_ws, "a", execute=must_not_run)  # while the temporary is half written
    finally:
        release.write_text("")
        out, err = writer.communicate(timeout=DEADLINE)
        repro.close(reader_ws)
    assert reading.event.is_set()  # the reader met the entry while it was being written
    assert writer.returncode == 0, err[-3000:]
    assert out.strip() == "executed"
    assert (outcome.status, outcome.reason) == ("cached", "run-cache")
    assert (reader_ws / "data/a/out.txt").read_text() == "xx"


# --- two real `qllm run`s ---------------------------------------------------------------------------------


def qllm_run(project: Path, tmp: Path, tag: str, *args: str) -> tuple[subprocess.Popen, Path, Path]:
    summary, output = tmp / f"{tag}.json", tmp / f"{tag}.log"
    with open(output, "wb") as log:
        command = [sys.executable, "-m", "qllm.cli", "run", "--params", "params/tiny.yaml", *args, "--summary-json", str(summary)]
        process = subprocess.Popen(command, cwd=project, stdout=log, stderr=subprocess.STDOUT)
    return process, summary, output


def test_two_qllm_runs_at_once_from_cold(tmp_path, mlflow_template_db, monkeypatch):
    from mlflow import MlflowClient

    project = make_project(tmp_path / "project", mlflow_template_db)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))  # a fresh Prefect database: both APIs create it
    started = [qllm_run(project, tmp_path, f"run{n}", "--set", f"evaluate.max_new_tokens={n}") for n in (1, 2)]
    codes = [exited(process, f"qllm run {tag}", log=output)[0] for (process, _, output), tag in zip(started, ("run1", "run2"), strict=True)]  # both finish before any assert
    results = []
    for code, (_, summary, output) in zip(codes, started, strict=True):
        text = output.read_text(errors="replace")
        assert code == 0, text[-4000:]
        assert "database is locked" not in text and "Traceback" not in text, text[-4000:]
        results.append(json.loads(summary.read_text()))

    # Separate workspaces; every shared stage ran in exactly one of them and was restored from
    # the run-cache in the other; evaluate and register (whose params differ) ran in both.
    wss = [Path(r["workspace"]) for r in results]
    assert len(set(wss)) == 2 and all(ws.parent == project / ".qllm/runs" for ws in wss)
    statuses = {s["name"]: [] for s in results[0]["stages"]}
    for result in results:
        for stage in result["stages"]:
            statuses[stage["name"]].append((stage["status"], stage["reason"]))
    assert list(statuses) == dag.order(project)
    for name, pair in statuses.items():
        expected = [("ran", "executed")] * 2 if name in (*ALWAYS_CHANGED, "evaluate", "register") else [("cached", "run-cache"), ("ran", "executed")]
        assert sorted(pair) == expected, (name, pair)

    # Each workspace is consistent: outputs match its dvc.lock, shared outputs are the same bytes.
    checks = [subprocess.Popen([sys.executable, "-m", "dvc", "status"], cwd=ws, stdout=subprocess.PIPE, text=True) for ws in wss]
    assert all(dvc_up_to_date(check.communicate(timeout=DEADLINE)[0]) for check in checks)
    locks = [yaml.safe_load((ws / "dvc.lock").read_text())["stages"] for ws in wss]
    for name in statuses:
        if name not in ("evaluate", "register"):
            # probe_device and base_model ran in both: their outputs are the same bytes, their metrics files (timing) are not
            outs = [[o for o in lock[name]["outs"] if not o["path"].startswith("data/metrics/")] for lock in locks]
            assert outs[0] == outs[1], name

    # MLflow: two pipeline runs, each the parent of the stage runs it executed; no duplicates.
    uri = f"sqlite:///{project / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiment = client.get_experiment_by_name("qllm")
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    parents = {r.info.run_id: r for r in runs if r.data.tags.get("qllm.kind") == "pipeline"}
    assert sorted(parents) == sorted(r["mlflow_run_id"] for r in results)
    for result in results:
        assert parents[result["mlflow_run_id"]].info.status == "FINISHED"
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == result["mlflow_run_id"]]
        metrics = {n: Path(result["workspace"]) / dag.metrics_file(n) for n in statuses}
        switched_off = {n for n, path in metrics.items() if path.exists() and json.loads(path.read_text()).get("enabled") is False}
        ran = sorted(s["name"] for s in result["stages"] if s["status"] == "ran" and s["name"] not in {*ALWAYS_CHANGED, *switched_off})
        assert sorted(r.data.tags["qllm.stage"] for r in children) == ran
        assert {r.info.status for r in children} == {"FINISHED"}
    # parents + one run per shared stage (the always-changed and switched-off ones have none) + evaluate/register twice
    assert len(runs) == 2 + len(statuses) - len(ALWAYS_CHANGED) - len(switched_off) + 2

    # The registry: one version per run, each with the alias its gate decided.
    versions = sorted(r["model_version"] for r in results)
    assert versions == ["1", "2"]
    for ws, result in zip(wss, results, strict=True):
        registered = json.loads((ws / "data/register/registered.json").read_text())
        assert registered["version"] == result["model_version"]
        assert client.get_model_version("qllm", registered["version"]).tags["gate.decision"] == registered["alias"]
    for alias in {json.loads((ws / "data/register/registered.json").read_text())["alias"] for ws in wss}:
        assert str(client.get_model_version_by_alias("qllm", alias).version) in versions
