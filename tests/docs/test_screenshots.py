"""docs/screenshots.py (`make docs-screenshots`): a real headless Chromium photographs the MLflow UI,
the Prefect UI and TensorBoard against a real tiny run, and the MLflow link lands on the runs.

The default suite checks the script's own parts: what it reads from MLflow, the pages and URLs it
visits and what it waits for on each, how it reads the compare view's grids, and its refusals. The
run in a real browser against real servers (about 70 s of CPU, imitated: a Prefect server and
worker, the MLflow UI, TensorBoard, two `qllm run`s and Chromium) is `-m slow` (`make test-all`):
what it adds is the UIs of pinned MLflow, Prefect and TensorBoard versions. Its browser is
QLLM_CHROMIUM, a Chromium on PATH, or Playwright's own build: `make test-all` provides one first
(`make browser`: the system package where apt-get runs as root, else `playwright install chromium`).
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
import sys
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.conftest import REPO, copy_first_pipeline
from tests.waiting import DEADLINE

sys.path.insert(0, str(REPO / "docs"))
import screenshots  # noqa: E402

from pipelines.core.run import tracking  # noqa: E402

SHOTS = ["mlflow-runs.png", "mlflow-compare.png", "mlflow-metrics.png", "mlflow-registry.png", "prefect-flow-run.png", "tensorboard.png"]


def _png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_runs_link_sets_the_ui_to_model_training():
    url = tracking.ui_runs_url("http://127.0.0.1:5000/", "7")
    assert url == "http://127.0.0.1:5000/#/experiments/7?workflowType=machine_learning"


def test_a_named_browser_that_does_not_exist_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("QLLM_CHROMIUM", str(tmp_path / "nochrome"))
    with pytest.raises(screenshots.QllmError, match="QLLM_CHROMIUM=.*is not a file"):
        screenshots.chromium_executable()


def test_a_directory_that_is_no_project_is_refused_before_any_server_starts(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "docs" / "screenshots.py"), "--project", str(tmp_path), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert "is not a qllm project (it has no dvc.yaml)" in done.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / ".qllm").exists()


def test_the_targets_are_the_newest_pretrain_run_the_last_two_pipeline_runs_and_the_model(tmp_path, mlflow_template_db):
    from mlflow import MlflowClient

    shutil.copy(mlflow_template_db, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(screenshots.QllmError, match=r"mlflow\.db has no pretrain run in experiment 'qllm'; run `make run` first"):
        screenshots.mlflow_targets(tmp_path)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiment = client.get_experiment_by_name("qllm").experiment_id

    def made(start: int, name: str, **tags: str) -> str:
        return client.create_run(experiment, start_time=start, run_name=name, tags=tags).info.run_id

    pipelines = [made(start, f"set {start}", **{"qllm.kind": "pipeline"}) for start in (1000, 3000, 2000)]
    pretrain = [made(start, "pretrain", **{"qllm.stage": "pretrain"}) for start in (2500, 1500)]
    made(4000, "sft", **{"qllm.stage": "sft"})
    assert screenshots.mlflow_targets(tmp_path)["model"] is None
    client.create_registered_model("qllm")
    assert screenshots.mlflow_targets(tmp_path) == {"experiment": experiment, "pretrain_run": pretrain[0], "model": "qllm",
                                                   "pipeline_runs": [(pipelines[2], "set 2000"), (pipelines[1], "set 3000")]}  # fmt: skip


def test_the_pages_their_urls_and_what_each_waits_for():
    targets = {"experiment": "7", "pretrain_run": "p0", "model": "qllm", "pipeline_runs": [("r1", "default @ 10:00"), ("r2", "dpo.beta=0.5 @ 10:05")]}
    flow_run = {"id": "f-1", "name": "clever-otter"}
    shots = {s["file"]: s for s in screenshots.shot_list(targets, "http://ui", "http://prefect", flow_run, "http://board", "dpo.beta=0.5")}
    assert sorted(shots) == sorted(SHOTS)
    assert shots["mlflow-runs.png"]["url"] == tracking.ui_runs_url("http://ui", "7")
    assert shots["mlflow-runs.png"]["wait_for"] == ["matching runs", "dpo.beta=0.5 @ 10:05"]  # the newest run is in the table
    compare = urlsplit(shots["mlflow-compare.png"]["url"].replace("#/", "", 1))
    assert compare.path == "/compare-runs"
    query = parse_qs(compare.query)
    assert json.loads(query["runs"][0]) == ["r1", "r2"] and json.loads(query["experiments"][0]) == ["7"]
    assert query["workflowType"] == ["machine_learning"]
    assert shots["mlflow-compare.png"]["wait_for"] == ["default @ 10:00", "dpo.beta=0.5 @ 10:05", "dpo.beta"]  # both runs and the param
    assert shots["mlflow-metrics.png"]["url"] == "http://ui/#/experiments/7/runs/p0/model-metrics?workflowType=machine_learning"
    assert shots["mlflow-registry.png"]["url"].startswith("http://ui/#/models/qllm?") and shots["mlflow-registry.png"]["wait_for"] == ["champion"]
    assert shots["prefect-flow-run.png"]["url"] == "http://prefect/runs/flow-run/f-1" and shots["prefect-flow-run.png"]["wait_for"] == ["clever-otter", "Completed"]
    assert shots["tensorboard.png"]["url"].startswith("http://board/?runFilter=pretrain/p0&")
    unregistered = screenshots.shot_list(targets | {"model": None}, "http://ui", "http://prefect", flow_run, "http://board", "dpo.beta=0.5")
    assert sorted(s["file"] for s in unregistered) == sorted(set(SHOTS) - {"mlflow-registry.png"})


def test_the_compare_views_grids_are_read_by_row_and_column():
    """MLflow's virtualised grids: one of metric names, one of values, cells in any order, rows by
    their `top` and runs by their `left`; a value row without a name is not a metric."""
    names = [["40px", "0px", "val/loss/dpo"], ["0px", "0px", "heldout/exact_match/sft"]]
    values = [["40px", "200px", "0.5"], ["0px", "200px", "0.1"], ["0px", "0px", "0.2"], ["40px", "0px", "0.3"], ["80px", "0px", "9"]]
    assert screenshots.grid_rows([names, values]) == {"heldout/exact_match/sft": ["0.2", "0.1"], "val/loss/dpo": ["0.3", "0.5"]}
    assert screenshots.grid_rows([names]) == {}


def shown_rounding(value: float) -> float:
    """How far the value MLflow's UI shows may be from `value`: half a unit of the last digit its
    `Utils.formatMetric` keeps (0 as is; below 0.001 four significant digits; below 10 three
    decimals; below 100 two; else one), with float64's rounding of the value and its printing."""
    size = abs(value)
    if size == 0:
        return 0.0
    if size < 1e-3:
        half = 0.5 * 10.0 ** (math.floor(math.log10(size)) - 3)
    else:
        half = 0.5 * (1e-3 if size < 10 else 1e-2 if size < 100 else 1e-1)
    return half + 4 * 2.0**-53 * size


@pytest.mark.slow  # the real browser, servers and runs; the script's parts are checked above
@pytest.mark.timeout(2 * DEADLINE + 600)  # a bound for a broken run: its setup may make the session's first tiny pipeline, then the script's runs
def test_screenshots_of_a_real_tiny_run(tmp_path, first_tiny_pipeline):
    # a project where the tiny pipeline has run (as after `make run`): the script's own first `qllm
    # run` finds every stage up to date, its second (`--set dpo.beta=0.5`) reruns dpo onwards
    project, _ = copy_first_pipeline(first_tiny_pipeline, tmp_path / "project")
    out = tmp_path / "images"
    done = subprocess.run([sys.executable, str(REPO / "docs" / "screenshots.py"), "--project", str(project), "--out", str(out)],
                          capture_output=True, text=True, timeout=2 * DEADLINE)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    for name in SHOTS:
        assert _png_size(out / name) == (screenshots.VIEWPORT["width"], screenshots.VIEWPORT["height"])
        assert (out / name).stat().st_size > 20_000, f"{name} looks blank"
    taken = {shot["file"]: shot for shot in json.loads((out / "screenshots.json").read_text())}
    assert sorted(taken) == sorted(SHOTS)
    # the runs link lands on the runs table (model-training face), not the GenAI overview
    assert "/runs?" in taken["mlflow-runs.png"]["url"] and "workflowType=machine_learning" in taken["mlflow-runs.png"]["url"]
    assert "overview" not in taken["mlflow-runs.png"]["url"]
    assert taken["mlflow-registry.png"]["found"] == ["champion"]
    assert "/runs/flow-run/" in taken["prefect-flow-run.png"]["url"]
    # the compare view, read as a user reads it: the two pipeline runs by name, the param that differs
    # with both values, and each model's held-out exact match as MLflow's store holds it
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("qllm").experiment_id
    first, second = client.search_runs([experiment], "tags.`qllm.kind` = 'pipeline'", order_by=["attributes.start_time DESC"], max_results=2)[::-1]
    assert second.info.run_name.startswith("dpo.beta=0.5 @ ") and first.info.run_name.split(" @ ")[0] == "default"
    text = taken["mlflow-compare.png"]["text"]
    assert first.info.run_name in text and second.info.run_name in text
    beta = [line.split("\t") for line in text.splitlines() if line.startswith("dpo.beta\t")]  # the params table, diff only
    assert beta == [["dpo.beta", first.data.params["dpo.beta"], "0.5"]] and first.data.params["dpo.beta"] != "0.5", beta
    shown = screenshots.grid_rows(taken["mlflow-compare.png"]["grids"])  # the metrics table's first rows: name -> value per run
    models = [line.split(",")[0] for line in (project / "data/evaluate/comparison.csv").read_text().splitlines()[1:]]
    assert {f"heldout/exact_match/{model}" for model in models} <= set(shown), shown  # each model's exact match, in view
    for name, values in shown.items():
        stored = [run.data.metrics[name] for run in (first, second)]
        assert all(abs(float(v) - s) <= shown_rounding(s) for v, s in zip(values, stored, strict=True)), (name, values, stored)
    runs_table = taken["mlflow-runs.png"]["text"]  # the new names and the ticked metric columns
    assert second.info.run_name in runs_table and "heldout/exact_match/dpo" in runs_table
    # everything the script started is stopped again
    assert not (project / ".qllm" / "serve" / "services.json").exists()
