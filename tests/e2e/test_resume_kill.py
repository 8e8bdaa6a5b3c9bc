"""SIGKILL in the middle of a stage, then rerun: training resumes exactly, outputs stay atomic.

Real `kill -9` of real stage processes (`python -m pipelines.pretrain`; a `qllm run --force
sample_data`-style stage run), in throwaway copies of one tiny project whose stages up to `tokenize`
ran once. The reruns and the reference runs are in-process, as `qllm run` runs stages:

- pretrain killed after a checkpoint past step 10 resumes from its newest checkpoint (`resumed
  from step S` in its log) and saves weights **bitwise equal** to an uninterrupted run (CPU, fp32
  master weights with bf16 autocast: the kernels are deterministic for a fixed thread count, so
  no tolerance is needed); its MLflow run is continued (same id, FINISHED), not duplicated, and
  its `train/loss` history has every logged step exactly once;
- a stage killed after writing its output but before the rename leaves no output that looks
  finished, `dvc status` reports the stage changed, and the rerun cleans the leftover and writes
  outputs identical (DVC md5) to a clean run.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipelines.core import dag
from pipelines.core.run import repro
from tests.conftest import REPO, make_project, run
from tests.waiting import exited, until

UPSTREAM = ["sample_data", "ingest", "prepare_data", "base_model", "train_tokenizer", "tokenize", "probe_device", "base_answers"]
MAX_STEPS = 40
HELD = "held"
PRETRAIN = {"pretrain": {"train": {"max_steps": MAX_STEPS, "checkpoint_every": 5, "keep_checkpoints": 3, "extensions": [
    "mlflow_metrics", {"name": "tests.hold_training:HoldAtStep", "step": 12, "marker": HELD}]}}}  # fmt: skip
"""The kill lands while pretrain is held after step 12 (`tests/hold_training.py`), its newest checkpoint
at step 10, on any machine; a run that finds the marker `held` in its project does not hold."""
MODEL = "data/models/pretrain"


@pytest.fixture(scope="module")
def base(tmp_path_factory, mlflow_template_db) -> Path:
    """A tiny project with every stage up to `tokenize` run (in-process) and recorded in dvc.lock."""
    root = make_project(tmp_path_factory.mktemp("resume") / "base", mlflow_template_db, PRETRAIN)
    try:
        for name in UPSTREAM:
            repro.reproduce(root, name)
    finally:
        repro.close(root)
    return root


def reproduce(root: Path, name: str, **kwargs) -> repro.StageOutcome:
    try:
        return repro.reproduce(root, name, **kwargs)
    finally:
        repro.close(root)


def copy_project(base: Path, dest: Path) -> Path:
    shutil.copytree(base, dest, symlinks=True)
    return dest


def stage_process(root: Path, *args: str, stderr) -> subprocess.Popen:
    env = os.environ | {"PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}  # tests.hold_training
    return subprocess.Popen([sys.executable, *args], cwd=root, stdout=subprocess.DEVNULL, stderr=stderr, env=env)


def kill9(process: subprocess.Popen) -> None:
    os.kill(process.pid, signal.SIGKILL)
    assert exited(process, "the stage process after SIGKILL")[0] == -signal.SIGKILL


def checkpoint_steps(root: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in root.glob(".qllm/checkpoints/pretrain/*/step-*") if p.name[5:].isdigit())


def safetensors(root: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(root / MODEL / "model.safetensors"))


def mlflow_client(root: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")


def pretrain_runs(root: Path) -> list:
    client = mlflow_client(root)
    experiment = client.get_experiment_by_name("qllm")
    return client.search_runs([experiment.experiment_id], "tags.qllm.stage = 'pretrain'")


def test_kill9_mid_training_resumes_exactly_and_continues_its_mlflow_run(base, tmp_path, caplog):
    killed, reference = copy_project(base, tmp_path / "killed"), copy_project(base, tmp_path / "reference")

    with open(tmp_path / "killed.log", "wb") as log:
        process = stage_process(killed, "-m", "pipelines.pretrain", stderr=log)
        until((killed / HELD).exists, "pretrain held after step 12", process=process, log=tmp_path / "killed.log")
        kill9(process)
    killed_at_ms = int(time.time() * 1000)
    at_kill = checkpoint_steps(killed)
    assert at_kill and max(at_kill) == 10, at_kill
    assert not (killed / MODEL).exists()  # nothing that looks like a finished model
    (interrupted,) = pretrain_runs(killed)
    assert interrupted.info.status == "RUNNING"  # SIGKILL: nobody could end the run

    # The rerun, in-process as under `qllm run`: DVC sees the stage changed and runs it again.
    with caplog.at_level(logging.INFO, logger="qllm"):
        assert reproduce(killed, "pretrain").status == "ran"
    match = re.search(r"pretrain: resumed from step (\d+)", caplog.text)
    assert match, caplog.text[-3000:]
    resumed_from = int(match.group(1))
    assert resumed_from == max(at_kill)  # the newest checkpoint (each is renamed into place complete)
    (reference / HELD).write_text("not held")
    assert reproduce(reference, "pretrain").status == "ran"  # the uninterrupted run

    # Exact resume: every weight bitwise equal, and the whole output directory (weights, config,
    # tokenizer, loss curves restored from the checkpoint) has the same DVC md5.
    got, expected = safetensors(killed), safetensors(reference)
    assert got.keys() == expected.keys()
    assert all(got[k].dtype == expected[k].dtype and bool((got[k] == expected[k]).all()) for k in got), "weights differ after resume"
    assert dag.dvc_md5(killed / MODEL) == dag.dvc_md5(reference / MODEL)

    # One MLflow run, continued: same id, FINISHED, one `train/loss` per logged step (log_every 2),
    # logged partly before the kill and partly after it, with the uninterrupted run's values.
    (continued,) = pretrain_runs(killed)
    assert continued.info.run_id == interrupted.info.run_id
    assert continued.info.status == "FINISHED" and continued.data.tags["qllm.resumes"] == "1"
    history = mlflow_client(killed).get_metric_history(continued.info.run_id, "train/loss")
    steps = [m.step for m in history]
    assert sorted(steps) == list(range(2, MAX_STEPS + 1, 2))  # complete and no step twice
    before = {m.step for m in history if m.timestamp < killed_at_ms}
    after = set(steps) - before
    # Metrics are flushed before each checkpoint is written, so every step up to the checkpoint
    # was in MLflow at the kill; the resumed run logged the rest, skipping steps already there.
    assert {s for s in steps if s <= resumed_from} <= before
    assert after and min(after) > resumed_from
    (uninterrupted,) = pretrain_runs(reference)
    reference_history = mlflow_client(reference).get_metric_history(uninterrupted.info.run_id, "train/loss")
    assert {m.step: m.value for m in history} == {m.step: m.value for m in reference_history}


GRPO = {"max_steps": 10, "checkpoint_every": 4, "keep_checkpoints": 3, "log_every": 1, "extensions": [
    "mlflow_metrics", {"name": "tests.hold_training:HoldAtStep", "step": 6, "marker": "grpo-held"}]}  # fmt: skip


def grpo_ready(root: Path) -> None:
    """pretrain (not held: its marker written) and sft run in `root`; grpo set to be held after step 6."""
    (root / HELD).write_text("not held")
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["grpo"]["train"] |= GRPO
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for name in ("pretrain", "sft"):
        assert reproduce(root, name).status == "ran"


def test_kill9_mid_grpo_resumes_with_the_samplers_generator(base, tmp_path, caplog):
    """GRPO samples its completions from torch's generator as it trains: a run killed after step 6
    (its newest checkpoint at step 4) resumes from step 4, samples what the uninterrupted run
    sampled, and saves the same weights, bit for bit."""
    killed = copy_project(base, tmp_path / "killed")
    grpo_ready(killed)
    reference = copy_project(killed, tmp_path / "reference")
    with open(tmp_path / "killed.log", "wb") as log:
        process = stage_process(killed, "-m", "pipelines.grpo", stderr=log)
        until((killed / "grpo-held").exists, "grpo held after step 6", process=process, log=tmp_path / "killed.log")
        kill9(process)
    steps = sorted(int(p.name[5:]) for p in killed.glob(".qllm/checkpoints/grpo/*/step-*"))
    assert steps == [4] and not (killed / "data/models/grpo").exists()
    with caplog.at_level(logging.INFO, logger="qllm"):
        assert reproduce(killed, "grpo").status == "ran"
    assert "grpo: resumed from step 4" in caplog.text
    (reference / "grpo-held").write_text("not held")
    assert reproduce(reference, "grpo").status == "ran"
    got, expected = (load_grpo(r) for r in (killed, reference))
    assert got.keys() == expected.keys() and all(torch_equal(got[k], expected[k]) for k in got), "weights differ after resume"
    assert dag.dvc_md5(killed / "data/models/grpo") == dag.dvc_md5(reference / "data/models/grpo")
    # the rewards it logged after the resume are the uninterrupted run's (the same samples)
    client, reference_client = mlflow_client(killed), mlflow_client(reference)
    (run,) = client.search_runs([client.get_experiment_by_name("qllm").experiment_id], "tags.qllm.stage = 'grpo'")
    (uninterrupted,) = reference_client.search_runs([reference_client.get_experiment_by_name("qllm").experiment_id], "tags.qllm.stage = 'grpo'")
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "completions/mean_length")}
    assert set(range(1, 11)) <= set(history)  # every step (and the stage summary at 0)
    assert history == {m.step: m.value for m in reference_client.get_metric_history(uninterrupted.info.run_id, "completions/mean_length")}


def load_grpo(root: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(root / "data/models/grpo/model.safetensors"))


def torch_equal(a, b) -> bool:
    return a.dtype == b.dtype and bool((a == b).all())


PAUSED_STAGE = """\
import contextlib, sys, time
from pathlib import Path

from pipelines.core import outputs
from pipelines.core.run import repro

real_atomic_dir = outputs.atomic_dir


@contextlib.contextmanager
def paused_before_rename(path):
    with real_atomic_dir(path) as tmp:
        yield tmp
        # the stage ran without torch, transformers or PEFT (a data stage: no `warm_imports`)
        Path(sys.argv[2] + ".imported").write_text(" ".join(m for m in ("torch", "transformers", "peft") if m in sys.modules))
        Path(sys.argv[2]).write_text(str(tmp))  # every file is written; only the rename is left
        time.sleep(600)


outputs.atomic_dir = paused_before_rename  # before the stage module binds it
repro.reproduce(Path.cwd(), sys.argv[1], force=True)  # what `qllm run --force STAGE` does
"""


def test_kill9_before_the_rename_leaves_no_finished_looking_output(base, tmp_path):
    root = copy_project(base, tmp_path / "project")
    (expected_md5,) = [o["md5"] for o in yaml.safe_load((base / "dvc.lock").read_text())["stages"]["sample_data"]["outs"] if o["path"] == "data/sample"]
    (tmp_path / "paused_stage.py").write_text(PAUSED_STAGE)
    marker = tmp_path / "paused"

    with open(tmp_path / "killed.log", "wb") as log:
        process = stage_process(root, str(tmp_path / "paused_stage.py"), "sample_data", str(marker), stderr=log)
        until(marker.exists, "the stage to finish writing", process=process, log=tmp_path / "killed.log")
        kill9(process)

    assert Path(f"{marker}.imported").read_text() == ""  # sample_data imported none of torch, transformers, PEFT
    leftover = Path(marker.read_text())
    assert leftover.parent == root / "data" and leftover.name.startswith(".tmp-sample-")
    assert (leftover / "world.json").exists()  # killed with the new output fully written...
    assert not (root / "data/sample").exists()  # ...yet nothing at the output path looks finished
    status = run([sys.executable, "-m", "dvc", "status", "sample_data"], root).stdout
    assert "changed outs" in status and "deleted:" in status and "data/sample" in status, status
    assert ".tmp-" not in status  # DVC never sees the leftover

    # The rerun (forced: the run-cache would restore the output without running the stage).
    assert reproduce(root, "sample_data", force=True).status == "ran"
    assert not leftover.exists() and not list((root / "data").glob(".tmp-*"))
    assert dag.dvc_md5(root / "data/sample") == expected_md5  # identical to the clean run in `base`
    assert "up to date" in run([sys.executable, "-m", "dvc", "status", "sample_data"], root).stdout




def test_the_next_write_removes_what_a_killed_atomic_file_left(tmp_path):
    from pipelines.core.outputs import write_json

    (tmp_path / ".tmp-metrics.json-abc123").write_text('{"half": ')  # a killed write of metrics.json
    (tmp_path / ".tmp-other.json-def456").write_text("{}")  # another file's temporary: not ours to remove
    write_json(tmp_path / "metrics.json", {"ok": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-other.json-def456", "metrics.json"]

def test_a_rerun_continues_its_unfinished_run_only_when_a_checkpoint_exists(base, tmp_path):
    from pipelines.core.run import stage

    root = copy_project(base, tmp_path / "project")
    seen: list[str] = []

    def body(crash: bool, checkpoint: bool):
        def run_stage(ctx: stage.StageContext) -> dict:
            seen.append(ctx.tracker.run_id)
            ctx.tracker.log_metrics({"train/loss": float(len(seen))}, step=1)
            if checkpoint:
                (ctx.checkpoint_dir / "step-00000001").mkdir(parents=True, exist_ok=True)
            if crash:
                raise RuntimeError("crash")
            return {}

        return run_stage

    for crash, checkpoint in [(True, False), (True, True), (False, False), (False, False)]:
        if crash:
            with pytest.raises(RuntimeError, match="crash"):
                stage.execute("pretrain", body(crash, checkpoint), root)
        else:
            stage.execute("pretrain", body(crash, checkpoint), root)
    # 1: crashed before any checkpoint; 2: a new run (nothing to resume), crashed after one;
    # 3: continues run 2 (FAILED, checkpoint present); 4: run 2 is FINISHED, so a new run.
    first, second, continued, fourth = seen
    assert len({first, second, fourth}) == 3 and continued == second
    client = mlflow_client(root)
    assert [client.get_run(r).info.status for r in (first, second, fourth)] == ["FAILED", "FINISHED", "FINISHED"]
    assert client.get_run(second).data.tags["qllm.resumes"] == "1"
    # Step 1 was logged by the crashed attempt; the continuation did not log it again.
    assert [(m.step, m.value) for m in client.get_metric_history(second, "train/loss")] == [(1, 2.0)]
