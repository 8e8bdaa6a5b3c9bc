"""Stop signals and a lost Prefect API through the real entry points, in real processes.

Each test copies one tiny project whose stages before `pretrain` ran once (in-process), with
pretrain held after step 20 (`tests/hold_training.py`) until a stop arrives, and acts once it is
held, so the signal lands mid-training on any machine:

- `qllm run` + SIGTERM: Prefect's engine owns SIGTERM while the flow runs; the flow hands it to
  the stages, so pretrain finishes its step, checkpoints and stops; the process exits 143 within
  seconds, the MLflow runs are KILLED, and the same command resumes (`resumed from step`);
- `qllm run` whose temporary Prefect API dies: the run stops within seconds with one clear error
  instead of retrying for minutes;
- `dvc repro` + SIGTERM to dvc (which passes no signal on to its stage): the stage learns that its
  parent died, checkpoints and stops, and the next `dvc repro` resumes.

The deployment + worker + `prefect flow-run cancel` case is in tests/flows/test_deployments.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines.core import dag
from pipelines.core.extensions import Hook
from pipelines.core.run import repro
from tests.conftest import REPO, make_project
from tests.waiting import DEADLINE, exited, until

MAX_STEPS = 30  # held after step 20 until the signal; the rerun trains the last 10
HELD = "held"
"""Written by `tests/hold_training.py` in the project when pretrain is held at step 20, until a stop."""
PRETRAIN = {"pretrain": {"train": {"max_steps": MAX_STEPS, "checkpoint_every": 50, "extensions": [
    "mlflow_metrics", {"name": "tests.hold_training:HoldAtStep", "step": 20, "marker": HELD}]}}}  # fmt: skip
"""Training waits at step 20 for the signal each test sends: the signal always meets a running pretrain."""
QLLM = str(Path(sys.executable).parent / "qllm")


def test_a_second_signal_interrupts_training_in_a_worker_thread_at_once(tmp_path):
    """As under `qllm run`: training in a worker thread, signals handled in the main thread. The
    first signal asks for a stop; the second, arriving mid-step, raises `InterruptedAtOnce` in the
    training thread without finishing that step: the newest checkpoint (step 2) stays."""
    import threading

    from pipelines.core import errors
    from pipelines.core.training import loop
    from pipelines.core.training.checkpoint import CheckpointManager
    from tests.core.training.test_loop import cfg, collate, rows, tiny_model

    in_step_3, outcome = threading.Event(), {}

    def stall(state):  # step 3 never ends on its own
        if state.step == 2:
            in_step_3.set()
            while True:
                time.sleep(0.01)

    def train():
        try:
            loop.train(tiny_model(), loop.causal_lm_loss, loop.Batches(32, 4, 0, collate(rows())),
                           cfg(checkpoint_every=1), checkpoints=CheckpointManager(tmp_path, 5), extensions=[Hook("on_gradients", stall)])  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome["error"] = exc

    thread = threading.Thread(target=train)
    thread.start()
    try:
        assert in_step_3.wait(DEADLINE)
        errors.request_stop(signal.SIGTERM)  # first: training would stop after this step...
        with pytest.raises(KeyboardInterrupt):
            errors.request_stop(signal.SIGTERM)  # ...second: at once
        thread.join(DEADLINE)
    finally:
        errors.clear_stop()
    assert not thread.is_alive()
    assert isinstance(outcome["error"], errors.InterruptedAtOnce) and "newest checkpoint stays" in str(outcome["error"])
    assert [c.step for c in CheckpointManager(tmp_path, 5).list()] == [1, 2]
    assert errors.interrupt_training() == 0  # the thread left the training loop


STAGE = """
import sys, time
from pathlib import Path
from pipelines.core import errors
errors.stop_when_parent_dies()
Path(sys.argv[1], "ready").write_text("")
give_up = time.monotonic() + float(sys.argv[2])
while errors.stop_requested() is None and time.monotonic() < give_up:
    time.sleep(0.01)
Path(sys.argv[1], "stopped").write_text(str(errors.stop_requested()))
"""
"""A stand-in for a stage under dvc: it waits for the stop that its runner's death asks for (at most argv[2] seconds)."""


@pytest.mark.parametrize("wrapper", ["none", "exec", "shell stays"])
def test_a_stage_stops_when_the_process_that_runs_it_dies_whatever_the_shell_between(tmp_path, wrapper):
    """dvc runs a stage as `$SHELL -c CMD`: bash execs CMD, dash (/bin/sh when $SHELL is unset, as
    in CI) stays between dvc and the stage; either way killing the runner stops the stage.
    `CMD; exit $?` keeps any shell in between, so the case holds whichever /bin/sh this machine has."""
    stage = f"{shlex.quote(sys.executable)} -c {shlex.quote(STAGE)} {shlex.quote(str(tmp_path))} {DEADLINE}"
    command = {"none": f"[sys.executable, '-c', {STAGE!r}, {str(tmp_path)!r}, '{DEADLINE}']",
               "exec": f"['/bin/sh', '-c', {'exec ' + stage!r}]",
               "shell stays": f"['/bin/sh', '-c', {stage + '; exit $?'!r}]"}[wrapper]  # fmt: skip
    runner = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; subprocess.Popen({command}); time.sleep(3600)"],
                              env=with_repo())  # fmt: skip
    try:
        until((tmp_path / "ready").exists, "the stage started", process=runner)
        runner.kill()  # as SIGKILL to dvc: nothing reaches the stage but its runner's death
    finally:
        runner.kill()
        runner.wait()
    until((tmp_path / "stopped").exists, "the stage stopping after its runner died")
    assert (tmp_path / "stopped").read_text() == "the parent process (dvc repro) exited"


@pytest.fixture(scope="module")
def base(tmp_path_factory, mlflow_template_db) -> Path:
    """A tiny project (pretrain: 30 steps, held after 20) with every stage before pretrain run and in dvc.lock."""
    root = make_project(tmp_path_factory.mktemp("stop") / "base", mlflow_template_db, PRETRAIN)
    try:
        for name in [name for name in dag.order(root, "pretrain") if name != "pretrain"]:
            repro.reproduce(root, name)
    finally:
        repro.close(root)
    return root


def with_repo() -> dict[str, str]:
    """The environment with this repository on PYTHONPATH: stages import `tests.hold_training`."""
    return os.environ | {"PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def start(root: Path, command: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(command, cwd=root, stdout=out, stderr=subprocess.STDOUT, env=with_repo())


def wait_until_held(process: subprocess.Popen, root: Path, log: Path) -> None:
    """Until pretrain is held at step 20 (a state)."""
    until((root / HELD).exists, "pretrain held after step 20", process=process, log=log)


def children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def checkpoint_steps(root: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in root.glob(".qllm/checkpoints/pretrain/*/step-*") if p.name[5:].isdigit())


def run_statuses(root: Path) -> dict[str, str]:
    """The newest MLflow run's status per stage, and the pipeline's under "pipeline"."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("qllm").experiment_id], order_by=["attributes.start_time ASC"])
    return {run.data.tags.get("qllm.stage", run.data.tags.get("qllm.kind")): run.info.status for run in runs}


def test_sigterm_to_qllm_run_checkpoints_stops_and_the_rerun_resumes(base, tmp_path):
    root = shutil.copytree(base, tmp_path / "project", symlinks=True)
    log = tmp_path / "run.log"
    process = start(root, [QLLM, "run", "--until", "pretrain"], log)
    wait_until_held(process, root, log)
    process.send_signal(signal.SIGTERM)
    returncode, seconds = exited(process, "qllm run stopping on SIGTERM", log=log)  # held until the stop: it exits only if the stop works
    text = log.read_text()
    assert returncode == 128 + signal.SIGTERM, text[-3000:]
    stopped = re.search(r"pretrain: SIGTERM at step (\d+): checkpoint saved in", text)
    assert stopped and int(stopped.group(1)) == int((root / HELD).read_text()) == 20, text[-3000:]  # the step it was held after
    assert "error: stopped by SIGTERM" in text
    assert max(checkpoint_steps(root)) == int(stopped.group(1))  # the step in progress finished and was saved
    assert not (root / "data/models/pretrain").exists()
    statuses = run_statuses(root)
    assert statuses["pretrain"] == "KILLED" and statuses["pipeline"] == "KILLED", statuses

    rerun = subprocess.run([QLLM, "run", "--until", "pretrain"], cwd=root, capture_output=True, text=True, timeout=DEADLINE, env=with_repo())
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-3000:]
    assert f"pretrain: resumed from step {stopped.group(1)}" in rerun.stderr, rerun.stderr[-3000:]
    assert run_statuses(root)["pretrain"] == "FINISHED" and (root / "data/models/pretrain").exists()
    print(f"exited {seconds:.1f}s after SIGTERM")


def test_qllm_run_ends_with_a_clear_error_when_its_prefect_api_dies(base, tmp_path):
    root = shutil.copytree(base, tmp_path / "project", symlinks=True)
    log = tmp_path / "run.log"
    process = start(root, [QLLM, "run", "--until", "pretrain"], log)
    wait_until_held(process, root, log)
    (api,) = [pid for pid in children(process.pid) if "uvicorn" in Path(f"/proc/{pid}/cmdline").read_text()]
    os.kill(api, signal.SIGKILL)
    returncode, seconds = exited(process, "qllm run after its Prefect API died", log=log)
    text = log.read_text()
    assert returncode == 1, text[-3000:]
    assert f"error: the temporary Prefect API (pid {api}) exited with code -9 during the run, so the run stopped" in text, text[-3000:]
    assert re.search(r"pretrain: the Prefect API exited at step \d+: checkpoint saved in", text), text[-3000:]
    assert checkpoint_steps(root) and run_statuses(root)["pretrain"] == "KILLED"
    assert run_statuses(root)["pipeline"] in ("KILLED", "FAILED")
    print(f"exited {seconds:.1f}s after the API died")


@pytest.mark.slow  # about a minute: dvc repro twice
def test_sigterm_to_dvc_repro_stops_its_stage_with_a_checkpoint(base, tmp_path):
    root = shutil.copytree(base, tmp_path / "project", symlinks=True)
    log = tmp_path / "repro.log"
    dvc = [sys.executable, "-m", "dvc", "repro", "pretrain"]
    process = start(root, dvc, log)
    wait_until_held(process, root, log)
    stage = children(process.pid)  # the stage command (`$SHELL -c` execs it)
    process.send_signal(signal.SIGTERM)  # to dvc only, as `kill PID` does
    exited(process, "dvc repro stopping on SIGTERM", log=log)
    until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in stage), "the stage process ending after its parent dvc repro",
          state=lambda: [pid for pid in stage if Path(f"/proc/{pid}").exists()], log=log)  # fmt: skip
    text = log.read_text()
    stopped = re.search(r"pretrain: the parent process \(dvc repro\) exited at step (\d+): checkpoint saved in", text)
    assert stopped, text[-3000:]
    assert max(checkpoint_steps(root)) == int(stopped.group(1))

    rerun = subprocess.run(dvc, cwd=root, capture_output=True, text=True, timeout=DEADLINE, env=with_repo())
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-3000:]
    assert f"pretrain: resumed from step {stopped.group(1)}" in rerun.stdout + rerun.stderr
