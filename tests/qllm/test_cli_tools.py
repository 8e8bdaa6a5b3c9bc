"""`qllm lineage`, `qllm generate` and `qllm compare` on a real tiny project after two runs.

One project per module: the tiny pipeline runs once as is (model version 1) and once with
`--set evaluate.max_new_tokens=2` (a run workspace; evaluate and register rerun: version 2), like
a user who then asks where a model came from, talks to it, and compares the two runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pipelines.core import dag
from pipelines.core.run import lineage
from qllm.cli import main
from qllm.registry import compare
from qllm.registry import lineage as registry_lineage
from qllm.serving import generation
from tests.conftest import ALWAYS_CHANGED, copy_first_pipeline, dvc_up_to_date


@pytest.fixture(scope="module")
def first_project(tmp_path_factory, first_tiny_pipeline) -> tuple[Path, dict]:
    """A tiny project after the first whole default run (a copy of the session's:
    `first_tiny_pipeline`), and that run's summary."""
    return copy_first_pipeline(first_tiny_pipeline, tmp_path_factory.mktemp("cli_tools") / "project")


@pytest.fixture(scope="module")
def project(first_project, prefect_server) -> Path:
    return first_project[0]


def reset_mlflow_uris() -> None:
    """The register stage sets MLflow's process-wide tracking and registry URIs, which MLflow
    mirrors into MLFLOW_TRACKING_URI/MLFLOW_REGISTRY_URI; `tracking.tracking_uri` honours those,
    so without a reset every later pipeline run in this process would log to this project's DB."""
    import mlflow

    mlflow.set_tracking_uri(None)
    mlflow.set_registry_uri(None)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    os.environ.pop("MLFLOW_REGISTRY_URI", None)


@pytest.fixture(scope="module")
def runs(first_project, project) -> Iterator[dict]:
    from flows.pipeline import pipeline

    reset_mlflow_uris()
    first = first_project[1]
    second = pipeline(overrides=["evaluate.max_new_tokens=2"], project_dir=str(project))
    reset_mlflow_uris()
    assert (first["model_version"], second["model_version"]) == ("1", "2")
    yield {"first": first, "second": second}
    reset_mlflow_uris()


def lock_entries(root: Path) -> dict[str, dict]:
    """`{stage: {"deps": {path: md5}, "outs": {path: md5}}}` straight from a dvc.lock file."""
    stages = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    return {
        name: {field: {e["path"]: e["md5"] for e in body.get(field, [])} for field in ("deps", "outs")}
        for name, body in stages.items()
    }


def qllm(capsys, *argv: str) -> tuple[int, str, str]:
    """Run the `qllm` command in-process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def mlflow_client(root: Path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{root / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


# ----------------------------------------------------------------------------- lineage


def test_the_copied_project_is_the_first_run_moved_here(first_project, first_tiny_pipeline):
    """The session's first tiny pipeline, copied (tests/conftest.py `copy_project`): nothing in the
    copy names the original any more, MLflow finds every run's and model's artifacts in the copy,
    DVC finds it up to date, and the run's summary names the copy."""
    from mlflow import MlflowClient

    root, summary = first_project
    original = first_tiny_pipeline / "project"
    assert not [str(p) for p in root.rglob("*") if p.is_file() and p.relative_to(root).parts[0] != ".git" and str(original).encode() in p.read_bytes()]
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("qllm").experiment_id], max_results=1000)
    assert len(runs) > 10 and all(r.info.artifact_uri.removeprefix("file://").startswith(str(root / "mlartifacts")) for r in runs)
    assert [r.info.run_id for r in runs if r.data.tags.get("qllm.kind") == "pipeline"] == [summary["mlflow_run_id"]]
    version = client.get_model_version("qllm", summary["model_version"])
    model = client.get_logged_model(version.source.removeprefix("models:/"))
    assert Path(model.artifact_location.removeprefix("file://"), "MLmodel").is_file() and model.artifact_location.startswith(f"file://{root}/")
    assert summary["workspace"] == str(root) and summary["model_version"] == "1"
    done = subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and dvc_up_to_date(done.stdout), done.stdout + done.stderr


def test_build_matches_dvc_lock_back_to_the_raw_data(runs, project):
    trail = lineage.build(project)
    lock = lock_entries(project)
    names = [s["stage"] for s in trail["stages"]]
    assert names[0] == "register" and names[-1] == "sample_data"
    assert sorted(names) == sorted(dag.order(project, "register"))  # every ancestor, once
    for entry in trail["stages"]:
        assert entry["deps"] == lock[entry["stage"]]["deps"], entry["stage"]
        if entry["stage"] != "register":  # the final stage's outs: filled in from the run's dvc.lock
            assert entry["outs"] == lock[entry["stage"]]["outs"], entry["stage"]
        assert sorted(entry["upstream"]) == sorted(dag.upstream(project, entry["stage"]))
        # Each stage comes after every stage that reads its outputs: a walk from the model back.
        assert all(names.index(up) > names.index(entry["stage"]) for up in entry["upstream"])
    register = yaml.safe_load((project / "dvc.lock").read_text())["stages"]["register"]
    assert trail["stages"][0]["params"] == register["params"]["params.yaml"]["register"]
    assert trail["stages"][0]["outs"] == {} and trail["stages"][0]["mlflow_run_id"] is None  # not known yet
    ingest = next(s for s in trail["stages"] if s["stage"] == "ingest")
    assert ingest["deps"]["data/sample"] == lock["sample_data"]["outs"]["data/sample"]  # linked to the raw data
    assert next(s for s in trail["stages"] if s["stage"] == "pretrain")["params"]["model"]["hidden_size"] == 32
    client = mlflow_client(project)
    for entry in trail["stages"][1:]:
        metrics = json.loads((project / f"data/metrics/{entry['stage']}.json").read_text())
        produced = metrics["mlflow_run_id"]
        assert entry["mlflow_run_id"] == produced
        if entry["stage"] in ALWAYS_CHANGED or metrics.get("enabled") is False:  # untracked: they run on every run, or are switched off
            assert produced is None
            continue
        assert client.get_run(produced).data.tags["qllm.stage"] == entry["stage"]


def test_build_while_the_final_stage_runs(runs, project, monkeypatch):
    """Register calls `build` before DVC has written its dvc.lock entry: its deps are then the md5s
    that dvc.lock records once it finishes, and nothing unknown is made up."""
    lock = lineage.read_lock(project / "dvc.lock")
    monkeypatch.setattr(lineage, "read_lock", lambda path: {k: v for k, v in lock.items() if k != "register"})
    final = lineage.build(project)["stages"][0]
    assert final["stage"] == "register"
    assert final["deps"] == lock_entries(project)["register"]["deps"]
    assert final["outs"] == {} and final["mlflow_run_id"] is None


def test_lineage_of_registered_versions_matches_their_dvc_lock(runs, project, capsys):
    versions = {}
    for uri, root in [("models:/qllm/1", project), ("models:/qllm/2", Path(runs["second"]["workspace"]))]:
        code, out, err = qllm(capsys, "lineage", uri, "--json", "--project-dir", str(project))
        assert code == 0, err
        trail = json.loads(out)
        assert trail["source"].startswith("lineage.json of run")  # logged by the register stage
        assert trail["stages"][-1]["stage"] == "sample_data"
        lock = lock_entries(root)
        for entry in trail["stages"]:
            assert entry["deps"] == lock[entry["stage"]]["deps"], (uri, entry["stage"])
            assert entry["outs"] == lock[entry["stage"]]["outs"], (uri, entry["stage"])
        versions[trail["version"]] = trail
    client = mlflow_client(project)
    for number, trail in versions.items():
        registered = client.get_model_version("qllm", number)
        assert trail["run_id"] == registered.run_id == trail["stages"][0]["mlflow_run_id"]
        assert trail["model_md5"] == trail["stages"][0]["deps"]["data/models/dpo"]
        assert trail["parent_run_id"] == runs["first" if number == "1" else "second"]["mlflow_run_id"]
    first = {s["stage"]: s for s in versions["1"]["stages"]}
    second = {s["stage"]: s for s in versions["2"]["stages"]}
    # Version 2 reused every upstream output (DVC run-cache): same producing runs; evaluate reran
    # (probe_device and base_model, which rerun every time, have no MLflow run: None in both).
    for name in first:
        same = name not in ("evaluate", "register")
        assert (first[name]["mlflow_run_id"] == second[name]["mlflow_run_id"]) is same, name
    assert (first["evaluate"]["params"]["max_new_tokens"], second["evaluate"]["params"]["max_new_tokens"]) == (4, 2)

    code, out, _ = qllm(capsys, "lineage", "models:/qllm/1", "--project-dir", str(project))
    assert code == 0
    assert out.startswith("models:/qllm/1")
    assert f"run {first['evaluate']['mlflow_run_id']}" in out and "sample_data  run" in out and "(raw data)" in out
    assert first["pretrain"]["outs"]["data/models/pretrain"] in out


def test_lineage_rebuilt_from_the_pipeline_runs_dvc_lock_agrees(runs, project):
    """Versions registered without lineage.json: the chain rebuilt from the pipeline run's dvc.lock
    artifact and the stage runs' md5 tags is the one the register stage logged."""
    client = mlflow_client(project)
    logged = registry_lineage.for_model("models:/qllm/2", project)
    lock = yaml.safe_load(registry_lineage.artifact_text(client, logged["parent_run_id"], "dvc.lock"))["stages"]
    rebuilt = registry_lineage.from_lock(client, lock, "register", logged["parent_run_id"])
    keys = ("stage", "mlflow_run_id", "deps", "outs", "params")
    assert [{k: s[k] for k in keys} for s in rebuilt["stages"]] == [{k: s[k] for k in keys} for s in logged["stages"]]


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("models:/qllm@nope", "models:/qllm@nope: model 'qllm' has no alias 'nope' (aliases: @champion"),
        ("models:/qllm/99", "models:/qllm/99: model 'qllm' has no version 99 (versions: 1, 2)"),
        ("models:/other@champion", "no registered model 'other' (registered models: qllm)"),
        ("qllm@champion", "expected a registered model URI models:/NAME@ALIAS or models:/NAME/VERSION"),
    ],
)
def test_lineage_unknown_model_is_a_clear_error(runs, project, capsys, uri, message):
    code, out, err = qllm(capsys, "lineage", uri, "--project-dir", str(project))
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err


def test_commands_without_mlflow_db_say_so(tmp_path, capsys):
    for argv in (
        ["lineage", "models:/qllm@champion"],
        ["compare", "--last", "2"],
        ["generate", "--model", "models:/qllm/1", "--prompt", "hi"],
    ):
        code, _, err = qllm(capsys, *argv, "--project-dir", str(tmp_path))
        assert code == 2 and f"{tmp_path / 'mlflow.db'}: no MLflow database" in err, argv
    assert not (tmp_path / "mlflow.db").exists()  # no empty store left behind


# ----------------------------------------------------------------------------- generate


def generate(capsys, project: Path, model: str, prompt: str, *options: str) -> tuple[int, str, str]:
    return qllm(capsys, "generate", "--model", model, "--prompt", prompt, *options, "--project-dir", str(project))


@pytest.fixture
def in_project(project, monkeypatch) -> Path:
    """Run from the project, as a user does."""
    monkeypatch.chdir(project)
    return project


def test_generate_from_a_model_directory(runs, in_project, capsys):
    project = in_project
    question = "Where does Tovik live?"
    code, greedy, err = generate(capsys, project, "data/models/sft", question, "--max-new-tokens", "6")
    assert code == 0, err
    assert greedy.strip()
    assert generate(capsys, project, "data/models/sft", question, "--max-new-tokens", "6")[1] == greedy  # deterministic
    sampled = {
        seed: generate(capsys, project, "data/models/sft", question, "--temperature", "1.5", "--seed", str(seed))[1]
        for seed in (1, 2, 3)
    }
    again = generate(capsys, project, "data/models/sft", question, "--temperature", "1.5", "--seed", "1")[1]
    assert again == sampled[1]  # seeded
    assert len(set(sampled.values())) > 1  # different seeds, different samples
    model, tokenizer = generation.load(str(project / "data/models/sft"), project)
    assert generation.generate(model, tokenizer, question, max_new_tokens=6) == greedy.strip()


def test_generate_from_the_registry_is_the_registered_model(runs, in_project, capsys):
    project = in_project
    question = "What is 2 plus 3?"
    code, registered, err = generate(capsys, project, "models:/qllm/1", question, "--max-new-tokens", "6")
    assert code == 0, err
    assert registered.strip()
    # register.model is dpo: the version holds the same weights as data/models/dpo.
    assert generate(capsys, project, "data/models/dpo", question, "--max-new-tokens", "6")[1] == registered
    code, champion, _ = generate(capsys, project, "models:/qllm@champion", question, "--max-new-tokens", "6")
    assert code == 0 and champion.strip()


def test_generate_errors(runs, project, capsys):
    code, _, err = generate(capsys, project, "models:/qllm@nope", "hi")
    assert code == 2 and "models:/qllm@nope: model 'qllm' has no alias 'nope'" in err
    code, _, err = generate(capsys, project, "data/models/none", "hi")
    assert code == 2 and "data/models/none: no such model directory" in err
    code, _, err = generate(capsys, project, "data/models/sft", "hi", "--temperature", "-1")
    assert code == 2 and "temperature must be 0 (greedy) or positive (got -1.0)" in err


# ----------------------------------------------------------------------------- compare


def test_compare_last_two_pipeline_runs(runs, project, capsys):
    code, out, err = qllm(capsys, "compare", "--last", "2", "--json", "--project-dir", str(project))
    assert code == 0, err
    compared = json.loads(out)
    assert [r["run_id"] for r in compared["runs"]] == [runs["first"]["mlflow_run_id"], runs["second"]["mlflow_run_id"]]
    assert compared["params"]["evaluate.max_new_tokens"] == ["4", "2"]
    assert compared["params"]["overrides"] == ["", "evaluate.max_new_tokens=2"]
    assert "pretrain.train.lr" not in compared["params"]  # equal values are hidden by default
    assert compared["metrics"]["register/version"] == [1.0, 2.0]
    assert not any(k.startswith("pretrain/") for k in compared["metrics"])  # the same pretrain run in both

    code, out, _ = qllm(capsys, "compare", "--last", "2", "--all", "--json", "--project-dir", str(project))
    everything = json.loads(out)
    assert everything["params"]["pretrain.train.lr"] == ["0.003", "0.003"]
    lora_loss = everything["metrics"]["lora/val/loss"]  # the second run restored lora from the cache
    assert lora_loss[0] is not None and lora_loss[0] == lora_loss[1]

    code, out, _ = qllm(capsys, "compare", "--last", "2", "--project-dir", str(project))
    table = out.splitlines()
    assert table[0].split() == ["run", runs["first"]["mlflow_run_id"][:8], runs["second"]["mlflow_run_id"][:8]]
    assert "params (2 differ)" in table
    assert next(line for line in table if line.startswith("evaluate.max_new_tokens")).split() == [
        "evaluate.max_new_tokens",
        "4",
        "2",
    ]


def test_compare_stage_runs_by_id_prefix(runs, project, capsys):
    first, second = (registry_lineage.for_model(f"models:/qllm/{v}", project) for v in (1, 2))
    ids = [next(s["mlflow_run_id"] for s in trail["stages"] if s["stage"] == "evaluate") for trail in (first, second)]
    code, out, err = qllm(capsys, "compare", ids[0][:8], ids[1], "--json", "--project-dir", str(project))
    assert code == 0, err
    compared = json.loads(out)
    assert [r["kind"] for r in compared["runs"]] == ["stage evaluate", "stage evaluate"]
    assert compared["params"]["evaluate.max_new_tokens"] == ["4", "2"]
    assert set(compared["params"]) == {"evaluate.max_new_tokens"}
    runs_view = compare.load_runs(project, ids)
    assert {k for k in runs_view[0]["metrics"]} >= {"evaluate/dpo.exact_match", "evaluate/seconds"}


def test_compare_errors(runs, project, capsys):
    unknown = "0123456789abcdef0123456789abcdef"
    code, _, err = qllm(capsys, "compare", unknown, runs["first"]["mlflow_run_id"], "--project-dir", str(project))
    assert code == 2 and f"unknown MLflow run id {unknown!r}" in err
    code, _, err = qllm(capsys, "compare", "0123abcd", "--last", "2", "--project-dir", str(project))
    assert code == 2 and "give run ids or --last N (not both)" in err
    code, _, err = qllm(capsys, "compare", "--last", "1", "--project-dir", str(project))
    assert code == 2 and "need at least two runs" in err


# ----------------------------------------------------------------------------- paths


@pytest.fixture
def decoy(tmp_path, monkeypatch) -> Path:
    """The current directory: another directory holding a decoy at every relative path the tests
    below name, each one unusable, so a command that looked here instead of in --project-dir fails."""
    here = tmp_path / "elsewhere"
    for model in ("data/models/sft", "data/models/lora"):
        (here / model / "merged").mkdir(parents=True)
        (here / model / "config.json").write_text("{}")  # not a model
        (here / model / "merged/config.json").write_text("{}")
    (here / "mlflow.db").write_text("not a database")
    (here / "params").mkdir()
    (here / "params/extra.yaml").write_text("evaluate: {max_new_tokens: -5}\n")  # invalid
    monkeypatch.chdir(here)
    return here


def test_every_command_resolves_relative_paths_against_the_project_not_the_current_directory(runs, project, decoy, capsys):
    """`--project-dir DIR` runs as if started in DIR (like `git -C`): `qllm run --params/--summary-json`,
    `qllm generate --model`, `qllm lineage`, `qllm compare` and the lm-eval helper, typed in a
    directory that holds a decoy at each of their relative paths."""
    import shlex
    import subprocess
    import sys

    at = ("--project-dir", str(project))
    (project / "params").mkdir(exist_ok=True)
    (project / "params/extra.yaml").write_text("evaluate: {max_new_tokens: 2}\n")  # the second run's effective params
    code, out, err = qllm(capsys, "run", "--params", "params/extra.yaml", "--summary-json", "summary.json", *at)
    assert code == 0, err
    summary = json.loads((project / "summary.json").read_text())
    assert not (decoy / "summary.json").exists() and summary["model_version"] == "2"  # nothing stale: the second run's workspace
    assert {s["status"] for s in summary["stages"]} == {"cached", "ran"} and all(
        s["status"] == "cached" for s in summary["stages"] if s["name"] not in ALWAYS_CHANGED
    )
    code, answer, err = generate(capsys, project, "data/models/sft", "Where does Tovik live?", "--max-new-tokens", "6")
    assert code == 0, err
    model, tokenizer = generation.load(str(project / "data/models/sft"), project)
    assert answer.strip() == generation.generate(model, tokenizer, "Where does Tovik live?", max_new_tokens=6)
    code, out, err = qllm(capsys, "lineage", "models:/qllm/1", "--json", *at)
    assert code == 0 and json.loads(out)["version"] == "1", err
    code, out, err = qllm(capsys, "compare", "--last", "2", "--json", *at)
    assert code == 0 and json.loads(out)["params"]["evaluate.max_new_tokens"] == ["4", "2"], err
    code, _, err = generate(capsys, project, "data/models/none", "hi")
    assert code == 2 and f"data/models/none: no such model directory in {project}" in err
    # the lm-eval helper: data/models/sft has no merged/ in the project (the decoy has one)
    printed = subprocess.run([sys.executable, "-m", "pipelines.core.evaluation.lm_eval", "data/models/sft", "data/models/lora", "--root", str(project)],
                             capture_output=True, text=True, check=True).stdout.splitlines()  # fmt: skip
    for line, expected in zip(printed, ("pretrained=data/models/sft", "pretrained=data/models/lora/merged"), strict=True):
        cd, command = line.split(" && ")
        assert shlex.split(cd) == ["cd", str(project)]
        argv = shlex.split(command)
        assert argv[argv.index("--model_args") + 1] == expected

