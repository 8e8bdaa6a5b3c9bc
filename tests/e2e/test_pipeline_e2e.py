"""The whole pipeline on the tiny profile: Prefect runs it, DVC agrees, MLflow records it.

One project per module; the tests build on the first run (they share the module's state in the
order written), like a user running `qllm run`, then `dvc status`, then opening the MLflow UI.

Same inputs, same bytes: a clone of the project at another absolute path, run by `qllm run` in a
process of its own under another PYTHONHASHSEED (so set iteration order differs), must record the
same md5 for every stage output in dvc.lock as the first run. Otherwise DVC sees changed inputs
downstream, and a run-cache shared through a remote is never reused on another machine. The
metrics files (`cache: false`) hold wall times and MLflow run ids and are exempt.
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipelines.core import dag
from pipelines.core.run import tracking
from tests.conftest import (
    ALWAYS_CHANGED,
    draws_outside_construction,
    dvc_up_to_date,
    make_project,
    mlflow_model_server,
    post_json,
    publish_first_pipeline,
    run,
)

STAGES = list(dag.stages(Path(__file__).resolve().parents[2]))


@pytest.fixture(scope="module")
def project(tmp_path_factory, mlflow_template_db, prefect_server) -> Path:
    return make_project(tmp_path_factory.mktemp("e2e") / "project", mlflow_template_db)


@pytest.fixture(scope="module")
def first_run(project, tmp_path_factory) -> tuple[dict, list[str]]:
    """The first run's result, and the draws from torch's global generator it made outside
    `models.CONSTRUCTION` (`draws_outside_construction`). A copy of the project as it is now goes
    to the modules that only need a project after such a run (`first_tiny_pipeline`)."""
    from flows.pipeline import pipeline

    with draws_outside_construction() as draws:
        result = pipeline(project_dir=str(project))
    publish_first_pipeline(tmp_path_factory, project, result)
    return result, draws


@pytest.fixture(scope="module")
def first(first_run) -> dict:
    return first_run[0]


def stage_outs(project: Path) -> dict[str, str]:
    """`{output path: md5}` from dvc.lock for every stage output except the metrics files."""
    specs = dag.stages(project)
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    assert set(lock) == set(specs), "every stage ran and is locked"
    return {out["path"]: out["md5"] for name, body in lock.items() for out in body["outs"] if out["path"] not in specs[name].metrics}


def differing_files(a: Path, b: Path) -> list[str]:
    """Files under output `a` whose bytes differ from (or are missing in) the same output `b`."""
    if a.is_file():
        return [] if filecmp.cmp(a, b, shallow=False) else [a.name]
    names = {p.relative_to(a) for p in a.rglob("*") if p.is_file()} | {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    return sorted(str(n) for n in names if not ((a / n).is_file() and (b / n).is_file() and filecmp.cmp(a / n, b / n, shallow=False)))


def lock_outs(root: Path) -> dict[str, str]:
    stages = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    return {out["path"]: out["md5"] for body in stages.values() for out in body["outs"]}


def mlflow_client(root: Path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{root / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def test_first_run_runs_every_stage_in_dag_order(first, project):
    assert [s["name"] for s in first["stages"]] == dag.order(project) == STAGES
    assert {s["status"] for s in first["stages"]} == {"ran"}
    assert first["model_version"] == "1"
    metrics = json.loads((project / "data/metrics/evaluate.json").read_text())
    assert {"pretrain", "sft", "lora"} <= set(metrics)  # one entry per model
    for name in ("pretrain", "sft", "lora"):
        assert 0 <= metrics[name]["exact_match"] <= 1 and metrics[name]["questions"] == 8
        assert metrics[name]["val_perplexity"] < 400  # the tiny profile's vocabulary size
    lora = json.loads((project / "data/metrics/lora.json").read_text())
    assert 0 < lora["trainable_fraction"] < 0.2 and lora["steps"] == 6


def test_a_clone_elsewhere_run_apart_writes_identical_outputs(first, project, tmp_path_factory, mlflow_template_db, prefect_server):
    """The first run (in this process, through the flow) and `qllm run` in a clone at another path,
    in its own process under another hash seed: the same bytes for every stage output."""
    from prefect.settings import PREFECT_API_URL

    clone = make_project(tmp_path_factory.mktemp("elsewhere") / "clone-two", mlflow_template_db)
    hash_seed = "2" if os.environ.get("PYTHONHASHSEED") != "2" else "3"
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PREFECT_API_URL": PREFECT_API_URL.value()}
    result = subprocess.run([sys.executable, "-m", "qllm.cli", "run"], cwd=clone, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    ours, theirs = stage_outs(project), stage_outs(clone)
    assert {"data/quantum_opt", "data/models/lora", "data/models/dpo", "data/evaluate", "data/register"} <= set(ours)
    differing = {path: differing_files(project / path, clone / path) for path in ours if ours[path] != theirs.get(path)}
    assert not differing, f"outputs whose bytes depend on the directory or the process: {differing}"


def test_no_stage_draws_from_torchs_global_generator_outside_construction(first_run):
    """Stages train in threads of one process and share torch's global generator: a draw made
    outside `models.CONSTRUCTION` (where the stages draw from their own streams,
    `pipelines.core.training.randomness`) can land inside another stage's adapter initialisation,
    so that stage's output depends on the timing. The same-bytes test above catches it only when the
    timing happens to collide; this catches every such draw, wherever it falls. (Footprint's timing
    product drew there, in every training stage, until its operands came from a generator of their own.)"""
    draws = first_run[1]
    assert not draws, "draws from torch's global generator outside models.CONSTRUCTION:\n" + "\n".join(sorted(set(draws)))


def test_precision_auto_is_resolved_recorded_and_tracked(first, project):
    from pipelines.core.training import precision

    cap = precision.capability()
    assert json.loads((project / "data/device.json").read_text()) == cap.as_dict()
    for name in ("pretrain", "sft", "probe_lora", "lora", "dpo"):
        assert json.loads((project / f"data/metrics/{name}.json").read_text())["precision"] == cap.auto
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    assert {d["path"] for d in lock["pretrain"]["deps"]} >= {"data/device.json"}  # another machine kind reruns training
    client = mlflow_client(project)
    run_id = json.loads((project / "data/metrics/sft.json").read_text())["mlflow_run_id"]
    assert client.get_run(run_id).data.params["sft.train.precision"] == cap.auto


def test_another_kind_of_machine_makes_training_stale(first, project):
    """What probe_device would write on a machine where `auto` means the other precision: DVC then
    finds every training stage (and what follows) stale, and nothing before them."""
    device = project / "data/device.json"
    saved = device.read_bytes()
    mine = json.loads(saved)
    other = mine | {"bf16_native": not mine["bf16_native"], "auto": "fp32" if mine["auto"] == "bf16" else "bf16"}
    try:
        device.write_text(json.dumps(other, indent=2, sort_keys=True) + "\n")
        status = run([sys.executable, "-m", "dvc", "status"], project).stdout
        stale = {line.rstrip(":") for line in status.splitlines() if line and not line[0].isspace()}
        assert stale >= {"pretrain", "sft", "probe_lora", "lora", "dpo"}, status
        assert not stale & {"sample_data", "ingest", "prepare_data", "train_tokenizer", "tokenize"}, status
    finally:
        device.write_bytes(saved)
    assert dvc_up_to_date(run([sys.executable, "-m", "dvc", "status"], project).stdout)


def test_outputs_are_hugging_face_directories(first, project):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(project / "data/models/pretrain")
    tokenizer = AutoTokenizer.from_pretrained(project / "data/tokenizer")
    assert model.config.model_type == "llama" and model.config.vocab_size == len(tokenizer)
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert (project / "data/models/pretrain/model.safetensors").exists()


def test_rerun_is_all_cache_hits_and_dvc_agrees(first, project):
    from flows.pipeline import pipeline

    second = pipeline(project_dir=str(project))
    # probe_device and base_model always run (they read the machine and the base); their outputs
    # are the same bytes, so nothing else does
    assert [(s["name"], s["status"], s["reason"]) for s in second["stages"]] == [
        (n, "ran", "executed") if n in ALWAYS_CHANGED else (n, "cached", "up-to-date") for n in STAGES
    ]
    assert second["seconds"] < 10
    assert second["model_version"] == "1"  # register is cached: no new version
    assert dvc_up_to_date(run([sys.executable, "-m", "dvc", "status"], project).stdout)
    repro = run([sys.executable, "-m", "dvc", "repro"], project)
    assert all(f"Running stage '{n}'" in repro.stdout for n in ALWAYS_CHANGED)
    assert all(f"Stage '{n}' didn't change" in repro.stdout + repro.stderr for n in STAGES if n not in ALWAYS_CHANGED)


def test_mlflow_parent_run_with_one_child_per_stage(first, project):
    client = mlflow_client(project)
    experiment = client.get_experiment_by_name("qllm")
    assert Path(experiment.artifact_location.removeprefix("file://")) == project / "mlartifacts"
    parent = client.get_run(first["mlflow_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["qllm.kind"] == "pipeline"
    children = client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    params = yaml.safe_load((project / "params.yaml").read_text())
    switched_off = {n for n in STAGES if (params.get(n) or {}).get("enabled") is False}
    assert "multimodal" in switched_off  # the profile switches some off: their README only, and no run
    assert all(json.loads((project / dag.metrics_file(n)).read_text())["enabled"] is False for n in switched_off)
    assert sorted(r.data.tags["qllm.stage"] for r in children) == sorted(n for n in STAGES if n not in {*ALWAYS_CHANGED, *switched_off})  # untracked
    by_stage = {r.data.tags["qllm.stage"]: r for r in children}
    pretrain = by_stage["pretrain"]
    assert pretrain.data.params["pretrain.train.lr"] == "0.003" and pretrain.data.params["pretrain.model.hidden_size"] == "32"
    losses = client.get_metric_history(pretrain.info.run_id, "train/loss")
    assert [m.step for m in losses] == list(range(2, 13, 2))  # log_every 2 over 12 steps
    assert client.get_metric_history(pretrain.info.run_id, "val/loss")
    # Input datasets carry the DVC md5 as digest: MLflow and dvc.lock name the same bytes.
    outs = lock_outs(project)
    inputs = {d.dataset.name: d.dataset.digest for d in pretrain.inputs.dataset_inputs}
    assert inputs == {d: outs[d] for d in ("data/base_answers", "data/base_model.json", "data/device.json", "data/tokenized", "data/tokenizer")}
    pretrain_metrics = json.loads((project / "data/metrics/pretrain.json").read_text())
    assert pretrain_metrics["mlflow_run_id"] == pretrain.info.run_id
    # every stage records its time and peak memory, but the two that read the world on every run: their
    # metrics keep their bytes while the world does (so dvc.lock does too); a training stage's run has the loggers' output
    with_metrics = {n: json.loads((project / dag.metrics_file(n)).read_text()) for n, spec in dag.stages(project).items()
                    if dag.metrics_file(n) in spec.metrics}  # fmt: skip
    peaks = {n: m.get("peak_rss_mb") for n, m in with_metrics.items() if n not in {*ALWAYS_CHANGED, *switched_off}}
    assert all(peak is not None and peak > 10 for peak in peaks.values()), peaks  # MB; a Python process holds more
    assert all(not {"seconds", "peak_rss_mb"} & set(with_metrics[n]) for n in ALWAYS_CHANGED)
    assert "system/process_rss_megabytes" in pretrain.data.metrics and "system/cpu_utilization_percentage" in pretrain.data.metrics
    events = project / "tensorboard" / "pretrain" / pretrain.info.run_id
    assert list(events.glob("events.out.tfevents.*")) and client.list_artifacts(pretrain.info.run_id, "tensorboard")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI opens on the runs


def test_the_pipeline_run_says_what_it_ran_and_what_came_of_it(first, project):
    """The parent run's name (profile and overrides, the commit), its effective params flattened,
    the evaluation's entries per model and the registered version's gate metric, and the data
    sets by DVC md5: what MLflow's runs table and compare view show."""
    import csv

    client = mlflow_client(project)
    parent = client.get_run(first["mlflow_run_id"])
    commit = run(["git", "rev-parse", "--short", "HEAD"], project).stdout.strip()
    assert parent.info.run_name == f"default @ {commit}"
    params = yaml.safe_load((project / "params.yaml").read_text())
    logged = parent.data.params
    assert logged["dpo.beta"] == str(params["dpo"]["beta"]) and logged["pretrain.train.lr"] == str(params["pretrain"]["train"]["lr"])
    assert logged["lora.allocation"] == str(params["lora"]["allocation"]) and logged["evaluate.max_new_tokens"] == str(params["evaluate"]["max_new_tokens"])
    assert logged["train_tokenizer.vocab_size"] == str(params["train_tokenizer"]["vocab_size"]) and len(logged) > 150
    with open(project / "data/evaluate/comparison.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:  # the same floats logged and written (the CSV keeps repr's digits, MLflow float64): exact
        assert parent.data.metrics[f"heldout/exact_match/{row['model']}"] == float(row["exact_match"])
        assert parent.data.metrics[f"val/loss/{row['model']}"] == float(row["val_loss"])
        assert parent.data.metrics[f"text/bleu/{row['model']}"] == float(row["bleu"])
    registered = json.loads((project / "data/register/registered.json").read_text())
    assert parent.data.metrics[f"registered/{registered['metric']}"] == registered["value"]
    assert parent.data.metrics["registered/version"] == int(registered["version"])
    outs = lock_outs(project)
    datasets = {d.dataset.name: d.dataset.digest for d in parent.inputs.dataset_inputs}
    assert datasets == {path: outs[path] for path in ("data/sample", "data/ingested", "data/prepared", "data/tokenized")}


def test_registered_model_is_champion_with_lineage_and_loads(first, project):
    import mlflow

    client = mlflow_client(project)
    version = client.get_model_version_by_alias("qllm", "champion")
    assert str(version.version) == "1"
    tags = version.tags
    outs = lock_outs(project)
    assert tags["dvc.model_md5"] == outs["data/models/dpo"]  # register.model: dpo
    assert tags["dvc.data/prepared"] == outs["data/prepared"] and tags["dvc.data/tokenized"] == outs["data/tokenized"]
    assert tags["mlflow.parent_run_id"] == first["mlflow_run_id"]
    assert len(tags["git_commit"]) >= 40
    assert json.loads(tags["params.pretrain"])["model"]["hidden_size"] == 32
    evaluation = json.loads((project / "data/metrics/evaluate.json").read_text())
    assert float(tags["metric.exact_match"]) == evaluation["dpo"]["exact_match"]
    assert tags["gate.decision"] == "champion" and tags["gate.reason"].startswith("first model")
    registered = json.loads((project / "data/register/registered.json").read_text())
    assert registered["alias"] == "champion" and registered["promoted"] and registered["metric"] == "exact_match"
    with tracking.fluent_uris(f"sqlite:///{project / 'mlflow.db'}"):
        generator = mlflow.transformers.load_model("models:/qllm@champion")
        out = generator([{"role": "user", "content": "What is 2 plus 3?"}], max_new_tokens=3)
        assert isinstance(out[0]["generated_text"], list)  # chat in, chat out: the template is applied
        pyfunc = mlflow.pyfunc.load_model("models:/qllm/1")  # MLflow's chat task: messages in, an OpenAI chat.completion out
        answer = pyfunc.predict({"messages": [{"role": "user", "content": "Where does Tovik live?"}], "max_tokens": 4})
        assert answer[0]["object"] == "chat.completion" and answer[0]["choices"][0]["message"]["role"] == "assistant"


def test_mlflow_models_serve_answers_chat_requests_as_qllm_generate(first, project, tmp_path):
    """MLflow's own server (`mlflow models serve -m models:/qllm@champion`) on 127.0.0.1: an
    OpenAI-style chat request gets the chat-templated greedy answer `qllm generate` gives for the
    same prompt and token limit; a request without messages, or with messages of the wrong shape,
    gets a 400 saying what was expected."""
    from qllm.serving import generation

    with mlflow_model_server("models:/qllm@champion", project, tmp_path / "serve.log") as url:
        model, tokenizer = generation.load("models:/qllm@champion", project)
        for question in ("Where does Tovik live?", "What is 2 plus 3?", "Who is Mira's brother?"):
            status, body = post_json(url, json.dumps({"messages": [{"role": "user", "content": question}], "max_tokens": 8}).encode())
            assert status == 200, body
            (completion,) = body  # one chat.completion per request, OpenAI's fields
            assert completion["object"] == "chat.completion" and completion["model"].startswith("data/models/dpo")  # the stage's output, no local path
            (choice,) = completion["choices"]
            assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
            assert choice["message"]["content"].strip() == generation.generate(model, tokenizer, question, max_new_tokens=8), question
        status, body = post_json(url, json.dumps({"prompt": "Where does Tovik live?"}).encode())
        assert status == 400 and "missing inputs ['messages']" in body["message"], body
        status, body = post_json(url, json.dumps({"messages": "Where does Tovik live?"}).encode())
        assert status == 400 and "Expected data to be list" in body["message"], body
        status, body = post_json(url, b"{not json")
        assert status == 400 and "valid JSON" in body["message"], body


def test_evaluate_compares_every_model(first, project):
    evaluation = json.loads((project / "data/metrics/evaluate.json").read_text())
    models = ["pretrain", "sft", "lora", "dpo", "grpo", "merge"]
    trained = models[:-1]  # merge trains nothing: no training log
    assert sorted(m for m in evaluation if m in models) == sorted(models)
    for name in models:
        entry = evaluation[name]
        assert 0 <= entry["exact_match"] <= 1 and 0 <= entry["bleu"] <= 100 and 0 <= entry["rougeL"] <= 1
        assert 0 <= entry["preference_accuracy"] <= 1 and entry["preference_pairs"] > 0
    assert "rewards/accuracies" in evaluation["dpo"] and "rewards/accuracies" not in evaluation["sft"] and "rewards/accuracies" not in evaluation["grpo"]
    table = (project / "data/evaluate/comparison.csv").read_text().splitlines()
    assert table[0].startswith("model,exact_match,flexible_match,strict_match,bleu,rougeL,preference_accuracy") and [r.split(",")[0] for r in table[1:]] == models
    for name in ("loss_curves.png", "metrics.png"):
        assert (project / "data/evaluate/plots" / name).read_bytes().startswith(b"\x89PNG")
    log = (project / "data/models/sft/training_log.csv").read_text().splitlines()  # tiny: log_every 2, 6 steps
    assert log[0] == "step,train_loss,lr" and [row.split(",")[0] for row in log[1:]] == ["2", "4", "6"]
    # dvc plots show renders the declared plots (curves from every training stage, the PNGs)
    shown = run([sys.executable, "-m", "dvc", "plots", "show", "--json"], project).stdout
    rendered = json.loads(shown)["data"]
    assert {"train_loss", "val_loss", "data/evaluate/plots/loss_curves.png", "data/evaluate/plots/metrics.png"} <= set(rendered)
    curves = {point["filename"].split("/")[0] for point in rendered["train_loss"][0]["content"]["data"]["values"]}
    assert curves == set(trained)
    client = mlflow_client(project)
    run_id = json.loads((project / "data/metrics/evaluate.json").read_text())["mlflow_run_id"]
    artifacts = {a.path for a in client.list_artifacts(run_id)} | {a.path for a in client.list_artifacts(run_id, "plots")}
    assert {"comparison.json", "plots/loss_curves.png", "plots/metrics.png"} <= artifacts


def test_prefect_artifacts_table_and_summary(first, project):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    async def latest(key: str):  # this module's first run is the newest run so far
        async with get_client() as client:
            found = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), sort=ArtifactSort.CREATED_DESC)
            return found[0]

    import asyncio

    table = asyncio.run(latest("qllm-evaluation"))
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert table.type == "table" and [r["model"] for r in rows] == ["pretrain", "sft", "lora", "dpo", "grpo", "merge"]
    summary = asyncio.run(latest("qllm-run-summary"))
    assert summary.type == "markdown" and "| pretrain | " in summary.data and "@champion" in summary.data


def test_prefect_task_graph_is_the_dvc_yaml_graph(first, project):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    parent = mlflow_client(project).get_run(first["mlflow_run_id"])
    flow_run_id = parent.data.tags["qllm.prefect_flow_run_id"]
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    names = {str(t.id): t.name for t in task_runs}
    assert sorted(names.values()) == sorted(STAGES)
    for task_run in task_runs:
        upstream = sorted(names[str(i.id)] for i in task_run.task_inputs.get("wait_for", []))
        assert upstream == sorted(dag.upstream(project, task_run.name)), task_run.name


def test_override_runs_in_a_workspace_and_reuses_upstream(first, project):
    from flows.pipeline import pipeline

    params_before = (project / "params.yaml").read_bytes()
    summary = pipeline(overrides=["evaluate.max_new_tokens=2"], project_dir=str(project))
    status = {s["name"]: (s["status"], s["reason"]) for s in summary["stages"]}
    upstream = STAGES[: STAGES.index("evaluate")]
    assert all(status[n] == ("cached", "run-cache") for n in upstream if n not in ALWAYS_CHANGED), status
    assert all(status[n] == ("ran", "executed") for n in ALWAYS_CHANGED)
    assert status["evaluate"] == ("ran", "executed") and status["register"] == ("ran", "executed")
    assert summary["workspace"].startswith(str(project / ".qllm" / "runs"))
    assert summary["model_version"] == "2"
    assert (project / "params.yaml").read_bytes() == params_before
    assert dvc_up_to_date(run([sys.executable, "-m", "dvc", "status"], project).stdout)


TINY_MODULES = 4 * (32 + 32) + 3 * (32 + 64)  # tiny profile, one layer: q/k/v/o 32->32, gate/up 32->64, down 64->32


def test_the_in_loop_qubo_allocates_lora_ranks_while_it_trains(first, project):
    """The default `lora.allocation: qubo_in_loop`: no static probe or solve (their outputs say so),
    the QUBO re-solved inside lora's loop, the adapter within the budget, evaluated and registered."""
    for name in ("probe_lora", "quantum_opt"):
        assert [p.name for p in (project / "data" / name).iterdir()] == ["README.md"]
        assert "`lora.allocation` is not `quantum_opt`" in (project / "data" / name / "README.md").read_text()
        assert json.loads((project / f"data/metrics/{name}.json").read_text())["used"] is False
    lora = json.loads((project / "data/metrics/lora.json").read_text())
    budget = 4 * TINY_MODULES  # lora.adapter.r 4 on every module: the budget of the tiny profile's in-loop allocation
    assert 0 < lora["allocation/active_parameters"] <= budget and 1 <= lora["allocation/modules_with_rank"] <= 7
    client = mlflow_client(project)
    energy = client.get_metric_history(lora["mlflow_run_id"], "qubo/energy")
    # tinit 1, every 1, the last re-allocation at max_steps 6 - tfinal 2: steps 1..4 (0-based), logged 1-based
    assert sorted(m.step for m in energy) == [2, 3, 4, 5]
    assert {m.value for m in client.get_metric_history(lora["mlflow_run_id"], "qubo/feasible")} == {1.0}
    (gap,) = client.get_metric_history(lora["mlflow_run_id"], "qubo/gap_to_milp")  # the last solve's, against the MILP reference
    (bound,) = client.get_metric_history(lora["mlflow_run_id"], "qubo/gap_to_bound")
    assert gap.step == bound.step == 5 and gap.value >= -1e-9 and 0 <= bound.value <= 0.01  # tiny: proven near-optimal
    adapter = json.loads((project / "data/models/lora/adapter_config.json").read_text())
    assert adapter["peft_type"] == "ADALORA" and adapter["init_r"] == 6 and adapter["base_model_name_or_path"] == "data/models/pretrain"
    assert (project / "data/models/lora/merged/model.safetensors").exists()
    assert 0 <= json.loads((project / "data/metrics/evaluate.json").read_text())["lora"]["exact_match"] <= 1


def test_the_in_loop_adapter_registers_as_the_merged_model(first, project):
    """`register.model: lora` with the in-loop (AdaLoRA-format) adapter: the registered model is
    the adapter merged into its base, the same weights as `data/models/lora/merged/`."""
    import mlflow
    import torch
    from transformers import AutoModelForCausalLM

    from flows.pipeline import pipeline

    summary = pipeline(overrides=["register.model=lora"], project_dir=str(project))
    assert [s["name"] for s in summary["stages"] if s["status"] == "ran"] == ["base_model", "probe_device", "export", "register"]
    ws = Path(summary["workspace"])
    version = json.loads((ws / "data/register/registered.json").read_text())["version"]
    assert mlflow_client(project).get_model_version("qllm", str(version)).tags["dvc.model_md5"] == lock_outs(ws)["data/models/lora"]
    merged = AutoModelForCausalLM.from_pretrained(project / "data/models/lora/merged").state_dict()
    with tracking.fluent_uris(f"sqlite:///{project / 'mlflow.db'}"):
        registered = mlflow.transformers.load_model(f"models:/qllm/{version}").model.state_dict()
    # the merged weights saved again by MLflow and read back: exact
    assert registered.keys() == merged.keys() and all(torch.equal(registered[k].float(), merged[k].float()) for k in merged)
    base = AutoModelForCausalLM.from_pretrained(project / "data/models/pretrain").state_dict()
    assert any(not torch.equal(merged[k], base[k]) for k in merged if k.endswith("_proj.weight"))  # the adapter is in there


@pytest.fixture(scope="module")
def static(first, project) -> dict:
    """The static allocation: probe_lora's scores, quantum_opt's QUBO, lora on its modules and ranks."""
    from flows.pipeline import pipeline

    return pipeline(overrides=["lora.allocation=quantum_opt"], project_dir=str(project))


def test_static_quantum_allocation_drives_lora(static):
    ran = [s["name"] for s in static["stages"] if s["status"] == "ran"]
    assert ran == ["base_model", "probe_device", "probe_lora", "quantum_opt", "lora", "merge", "export", "evaluate", "register"]
    ws = Path(static["workspace"])
    allocation = json.loads((ws / "data/quantum_opt/allocation.json").read_text())
    metrics = json.loads((ws / "data/metrics/quantum_opt.json").read_text())
    scores = json.loads((ws / "data/probe_lora/scores.json").read_text())
    assert len(allocation["ranks"]) == len(scores["values"]) == 7  # 1 layer (tiny profile) x 7 projections
    budget = sum(8 * (s["d_in"] + s["d_out"]) for s in scores["modules"].values())  # rank 8 everywhere
    assert budget == 8 * TINY_MODULES
    assert allocation["feasible"] and allocation["cost"] <= budget == metrics["budget"] and metrics["used"] is True
    assert metrics["solver"] == "sa" and metrics["objective"] >= metrics["greedy_objective"] - 1e-9
    assert metrics["gap_to_milp"] <= 0.01 and 0 <= metrics["gap_to_bound"] <= 0.01  # the tiny instance: sa within 1 % of the MILP and the optimum
    adapter = json.loads((ws / "data/models/lora/adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA"
    assert adapter["rank_pattern"] == allocation["rank_pattern"] and sorted(adapter["target_modules"]) == allocation["target_modules"]
    assert {m: adapter["alpha_pattern"][m] / r for m, r in adapter["rank_pattern"].items()} == \
        dict.fromkeys(adapter["rank_pattern"], adapter["lora_alpha"] / adapter["r"])  # fmt: skip


def test_changing_the_solver_reruns_from_quantum_opt(static, project):
    from flows.pipeline import pipeline

    summary = pipeline(overrides=["lora.allocation=quantum_opt", "quantum_opt.solver=milp"], project_dir=str(project))
    status = {s["name"]: (s["status"], s["reason"]) for s in summary["stages"]}
    ran = [n for n, (st, _) in status.items() if st == "ran"]
    assert ran[:4] == ["base_model", "probe_device", "quantum_opt", "lora"], status
    # Outputs are byte-stable: when MILP picks the allocation sa picked, lora trains the same adapter,
    # bytes and all, and DVC finds evaluate and register up to date; otherwise they rerun.
    lock = lambda root: {o["path"]: o["md5"] for o in yaml.safe_load((root / "dvc.lock").read_text())["stages"]["lora"]["outs"]}  # noqa: E731
    same_adapter = lock(Path(summary["workspace"]))["data/models/lora"] == lock(Path(static["workspace"]))["data/models/lora"]
    assert ran[4:] == ([] if same_adapter else ["merge", "export", "evaluate", "register"]), status
    assert status["probe_lora"] == ("cached", "run-cache")
    metrics = json.loads((Path(summary["workspace"]) / "data/metrics/quantum_opt.json").read_text())
    assert metrics["solver"] == "milp" and metrics["gap_to_milp"] == 0.0
    # With the default (in-loop) allocation the static solve is not used: quantum_opt reruns for its
    # changed params, writes the same placeholder, and lora stays cached.
    summary = pipeline(overrides=["quantum_opt.solver=milp"], project_dir=str(project))
    assert [s["name"] for s in summary["stages"] if s["status"] == "ran"] == ["base_model", "probe_device", "quantum_opt"]


def test_uniform_lora_rank_retrains_lora_and_downstream(static, project):
    from flows.pipeline import pipeline

    summary = pipeline(overrides=["lora.allocation=uniform", "lora.adapter.r=2"], project_dir=str(project))
    status = {s["name"]: s["status"] for s in summary["stages"]}
    # probe_lora and quantum_opt list lora.allocation, so they rerun, writing the same placeholder: no static allocation either
    assert [n for n, st in status.items() if st == "ran"] == ["base_model", "probe_device", "probe_lora", "quantum_opt", "lora", "merge", "export", "evaluate", "register"]
    ws, static_ws = Path(summary["workspace"]), Path(static["workspace"])
    assert lock_outs(ws)["data/quantum_opt"] == lock_outs(project)["data/quantum_opt"]
    trainable = json.loads((ws / "data/metrics/lora.json").read_text())["trainable_parameters"]
    quantum = json.loads((static_ws / "data/metrics/lora.json").read_text())["trainable_parameters"]
    cost = json.loads((static_ws / "data/quantum_opt/allocation.json").read_text())["cost"]
    assert trainable - quantum == 2 * TINY_MODULES - cost  # rank 2 everywhere vs the allocation; same trainable tokens


def test_until_stops_after_the_stage(first, project):
    from flows.pipeline import pipeline

    summary = pipeline(until="tokenize", overrides=["tokenize.seq_len=32"], project_dir=str(project))
    assert [s["name"] for s in summary["stages"]] == STAGES[: STAGES.index("tokenize") + 1]
    assert summary["stages"][-1]["status"] == "ran" and summary["model_version"] is None


def test_qlora_in_the_sample_pipeline_retrains_lora_and_what_follows(first, project):
    from flows.pipeline import pipeline

    # QLoRA trains plain LoRA adapters on the quantized base (the in-training allocations' SVD form does not sit on one)
    summary = pipeline(overrides=["lora.allocation=uniform", "lora.adapter.quantization=nf4"], project_dir=str(project))
    status = {s["name"]: s["status"] for s in summary["stages"]}
    static = ("probe_lora", "quantum_opt")  # their placeholders: run for the changed lora.allocation, or from the run-cache
    assert [n for n, st in status.items() if st == "ran" and n not in static] == ["base_model", "probe_device", "lora", "merge", "export", "evaluate", "register"], status
    ws = Path(summary["workspace"])
    assert all(lock_outs(ws)[f"data/{n}"] == lock_outs(project)[f"data/{n}"] for n in static)
    lora_metrics = json.loads((ws / "data/metrics/lora.json").read_text())
    assert lora_metrics["linear_weight_bytes"] > 0 and lora_metrics["steps"] == 6
    assert "quantization_config" not in json.loads((ws / "data/models/lora/merged/config.json").read_text())  # merged: a plain model
    assert 0 <= json.loads((ws / "data/metrics/evaluate.json").read_text())["lora"]["exact_match"] <= 1


def cli(project: Path, *args: str) -> subprocess.CompletedProcess:
    from prefect.settings import PREFECT_API_URL

    env = {**__import__("os").environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    return subprocess.run([sys.executable, "-m", "qllm.cli", *args], cwd=project, capture_output=True, text=True, env=env)


def test_cli_prints_one_line_per_stage_and_writes_the_summary(first, project, tmp_path):
    def pipeline_runs() -> int:
        client = mlflow_client(project)
        return len(client.search_runs([client.get_experiment_by_name("qllm").experiment_id], "tags.`qllm.kind` = 'pipeline'"))

    before = pipeline_runs()
    expected = [(n, "ran" if n in ALWAYS_CHANGED else "cached") for n in STAGES]
    for record in (False, True):
        started = time.perf_counter()
        result = cli(project, "run", *(["--record"] if record else []), "--summary-json", str(tmp_path / "summary.json"))
        seconds = time.perf_counter() - started
        assert result.returncode == 0, result.stderr
        lines = [line.split() for line in result.stdout.splitlines() if line.split() and line.split()[0] in STAGES]
        assert [(name, status) for name, status, _ in lines] == expected
        assert all(float(seconds) >= 0 for _, _, seconds in lines)
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert [(s["name"], s["status"]) for s in summary["stages"]] == [(name, status) for name, status, _ in lines]
        assert summary["model_version"] == "1"
        if not record:  # every stage up to date: checked without Prefect or MLflow, nothing recorded
            assert summary["mlflow_run_id"] is None and "every stage is up to date" in result.stdout
            assert pipeline_runs() == before and seconds < 5, seconds
    assert len(summary["mlflow_run_id"]) == 32 and pipeline_runs() == before + 1  # --record: the full flow


def test_no_change_check_stops_at_the_first_stale_stage(first, project):
    from pipelines.core.run import repro

    lock = project / "dvc.lock"
    recorded = lock.read_bytes()
    outcomes = repro.unchanged(project, STAGES)
    assert [(o.name, o.status, o.reason) for o in outcomes] == [
        (n, "ran", "executed") if n in ALWAYS_CHANGED else (n, "cached", "up-to-date") for n in STAGES
    ]
    assert lock.read_bytes() == recorded  # the world stages found what dvc.lock says: it is not rewritten
    # Another machine's answer (the probe's cache, under this machine's key, says the other precision):
    # dvc.lock records the new data/device.json and the training stages are stale.
    cache = project / ".qllm/device-probe.json"
    saved_cache = cache.read_bytes()
    probe = json.loads(saved_cache)
    mine = probe["capability"]
    probe["capability"] = mine | {"bf16_native": not mine["bf16_native"], "auto": "fp32" if mine["auto"] == "bf16" else "bf16"}
    try:
        cache.write_text(json.dumps(probe))
        assert repro.unchanged(project, STAGES) is None
        locked = yaml.safe_load(lock.read_text())["stages"]["probe_device"]["outs"]
        assert {o["path"]: o["md5"] for o in locked}["data/device.json"] == dag.dvc_md5(project / "data/device.json")
        assert json.loads((project / "data/device.json").read_text())["auto"] != mine["auto"]
    finally:
        cache.write_bytes(saved_cache)
        assert repro.unchanged(project, STAGES) is not None  # this machine again: every stage up to date
        repro.close(project)
    params = project / "params.yaml"
    saved = params.read_bytes()
    try:
        data = yaml.safe_load(saved)
        data["evaluate"]["max_new_tokens"] += 1
        params.write_text(yaml.safe_dump(data, sort_keys=False))
        assert repro.unchanged(project, STAGES) is None
        assert [o.name for o in repro.unchanged(project, dag.order(project, "dpo"))] == dag.order(project, "dpo")
    finally:
        params.write_bytes(saved)
        repro.close(project)
    assert dvc_up_to_date(run([sys.executable, "-m", "dvc", "status"], project).stdout)


def test_bad_params_fail_before_any_stage(first, project):
    result = cli(project, "run", "--set", "pretrain.train.lr=-1")
    assert result.returncode == 2
    assert "pretrain.train.lr: Input should be greater than 0 (got -1)" in result.stderr
    result = cli(project, "run", "--set", "pretrain.train.lrr=1")
    assert result.returncode == 2 and "pretrain.train.lrr: unknown key" in result.stderr
    result = cli(project, "run", "--until", "nope")
    assert result.returncode == 2 and "unknown stage 'nope'" in result.stderr


def test_malformed_source_fails_cleanly_without_outputs(tmp_path, mlflow_template_db, prefect_server, capsys):
    from qllm.cli import main

    project = make_project(tmp_path / "bad", mlflow_template_db)
    (project / "data/sources/broken.jsonl").write_text('{"text": "fine"}\n{"text": "oops",}\n')
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["ingest"]["sources"].append({"path": "data/sources/broken.jsonl", "kind": "text"})
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    capsys.readouterr()
    code = main(["run", "--until", "ingest", "--project-dir", str(project)])  # `qllm run` in this process (its exit code: `main`'s)
    assert code == 1
    assert "data/sources/broken.jsonl:2: invalid JSON" in capsys.readouterr().err
    assert not (project / "data/ingested").exists()
    assert not list((project / "data").glob(".tmp-*"))
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    assert "sample_data" in lock and "ingest" not in lock  # nothing recorded as finished


def test_dvc_exp_run_reruns_only_evaluate_and_register(first, project):
    run(["git", "add", "-A"], project)
    run(["git", "commit", "-qm", "pipeline outputs locked"], project)
    result = run([sys.executable, "-m", "dvc", "exp", "run", "-S", "evaluate.max_new_tokens=8"], project, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    ran = [n for n in STAGES if f"Running stage '{n}'" in output]
    assert ran == ["base_model", "probe_device", "evaluate", "register"], output


def test_sweep_runs_each_override_set_sharing_upstream_and_the_reference_pass(first, project):
    """A DPO beta sweep: the shared stages come up to date once, and each set's run reruns only DPO
    and what follows it, its reference pass (and everything before it) from DVC's run-cache."""
    from flows.sweep import shared_stages, sweep

    assert shared_stages(project, [["dpo.beta=0.1"]]) == [n for n in STAGES if n not in ("dpo", "merge", "export", "evaluate", "register")]
    summaries = sweep(sweep=[["dpo.beta=0.11"], ["dpo.beta=0.12"]], project_dir=str(project))
    assert len(summaries) == 2 and summaries[0]["workspace"] != summaries[1]["workspace"]
    client, commit = mlflow_client(project), run(["git", "rev-parse", "--short", "HEAD"], project).stdout.strip()
    experiment = client.get_experiment_by_name("qllm").experiment_id
    (own,) = client.search_runs([experiment], "tags.`qllm.kind` = 'sweep'", order_by=["attributes.start_time DESC"], max_results=1)
    assert own.info.run_name == f"sweep dpo.beta=0.11|0.12 @ {commit}" and own.data.tags["qllm.swept"] == "dpo.beta"
    assert own.data.params["sets"] == "dpo.beta=0.11 | dpo.beta=0.12"
    nested = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{own.info.run_id}'")
    sets = {r.info.run_name for r in nested if not r.data.params["until"]}
    assert sets == {f"dpo.beta=0.11 @ {commit}", f"dpo.beta=0.12 @ {commit}"}
    # the shared stages came up to date in one run (its independent branches at once), not one run per branch
    (shared,) = [r for r in nested if r.data.params["until"]]
    assert sorted(shared.data.params["until"].split(", ")) == ["grpo", "lora", "multimodal", "ref_logprobs"], shared.data.params["until"]
    assert {r.info.run_id for r in nested} >= {s["mlflow_run_id"] for s in summaries}
    assert all(client.get_run(s["mlflow_run_id"]).data.params["dpo.beta"] in ("0.11", "0.12") for s in summaries)
    for summary in summaries:
        status = {s["name"]: (s["status"], s["reason"]) for s in summary["stages"]}
        assert [n for n, (st, _) in status.items() if st == "ran"] == ["base_model", "probe_device", "dpo", "merge", "export", "evaluate", "register"], status
        assert status["ref_logprobs"] == status["sft"] == status["pretrain"] == ("cached", "run-cache")
        dpo_metrics = json.loads((Path(summary["workspace"]) / "data/metrics/dpo.json").read_text())
        assert dpo_metrics["steps"] == 4 and "heldout/rewards/accuracies" in dpo_metrics


def test_from_stage_reruns_only_downstream(first, project):
    from flows.pipeline import pipeline

    summary = pipeline(from_stage="evaluate", force=["evaluate", "register"], project_dir=str(project))
    status = {s["name"]: s["status"] for s in summary["stages"]}
    assert [n for n, st in status.items() if st == "ran"] == ["base_model", "probe_device", "evaluate", "register"]
    assert all(status[n] == "cached" for n in STAGES if n not in (*ALWAYS_CHANGED, "evaluate", "register"))


def test_from_stage_refuses_to_train_what_is_not_cached_upstream(first, project):
    """`from_stage` reuses the stages before it and never trains them: with a pretrain lr no run
    has used, pretrain is neither up to date nor in the run-cache, so the run fails there with the
    reason, and nothing from pretrain on runs (the deployment `qllm-pipeline/from-stage` passes
    `from_stage`: tests/flows/test_deployments.py)."""
    from flows.pipeline import pipeline
    from pipelines.core.errors import QllmError

    client = mlflow_client(project)
    experiment = client.get_experiment_by_name("qllm").experiment_id
    runs_before = {r.info.run_id for r in client.search_runs([experiment])}
    with pytest.raises(QllmError, match=r"stage 'pretrain' is not up to date and has no DVC run-cache entry for these inputs; a run with from_stage only reuses upstream outputs"):
        pipeline(from_stage="dpo", overrides=["pretrain.train.lr=0.0123"], project_dir=str(project))
    new = [r for r in client.search_runs([experiment]) if r.info.run_id not in runs_before]
    (parent,) = [r for r in new if r.data.tags.get("qllm.kind") == "pipeline"]
    status = {name: parent.data.tags[f"qllm.stage.{name}"] for name in STAGES}
    after = dag.downstream(project, "pretrain")
    expected = {name: "failed" if name == "pretrain" else "not run" if name in after else "ran" if name in ALWAYS_CHANGED else "cached" for name in STAGES}
    assert status == expected  # the stages before pretrain restored or up to date; those reading the machine ran, as every run's do
    assert not [r.data.tags["qllm.stage"] for r in new if r.data.tags.get("qllm.stage") in {"pretrain", *after}]  # none of them began
    (ws,) = [w for w in (project / ".qllm/runs").iterdir() if "0.0123" in (w / "params.yaml").read_text()]
    assert not (ws / "data/models/pretrain").exists()


def test_export_writes_gguf_of_the_registered_model_and_register_attaches_it(first, project):
    """`qllm run --params params/export.yaml`: export (off by default: a README) writes the dpo
    model, the one register registers, as f16 and q8_0 GGUF with a Modelfile; its tensors are the
    model's; register reruns (its data/export dependency changed) and the new version's run carries
    the files, named by the version's tags; nothing else reruns."""
    import gguf
    import mlflow
    import numpy as np

    from flows.pipeline import pipeline
    from pipelines.core.models.models import load_for_inference
    from pipelines.core.outputs import read_json

    assert (project / "data/export/README.md").read_text().startswith("# Export stage disabled")
    assert sorted(p.name for p in (project / "data/export").iterdir()) == ["README.md"]
    summary = pipeline(params_files=["params/export.yaml"], project_dir=str(project))
    assert [s["name"] for s in summary["stages"] if s["status"] == "ran"] == ["base_model", "probe_device", "export", "register"]
    ws = Path(summary["workspace"])
    record = read_json(ws / "data/export/export.json")
    assert record["stage"] == "dpo" and record["source"] == "data/models/dpo" and record["stop"] == ["<|im_end|>", "<|endoftext|>"]
    assert [(f["file"], f["type"]) for f in record["files"]] == [("qllm-f16.gguf", "f16"), ("qllm-q8_0.gguf", "q8_0")]
    f16 = ws / "data/export/qllm-f16.gguf"
    model, tokenizer = load_for_inference(ws / "data/models/dpo", ws)
    read = gguf.GGUFReader(f16)
    embedding = {t.name: t for t in read.tensors}["token_embd.weight"]
    assert np.array_equal(np.asarray(embedding.data), model.get_input_embeddings().weight.detach().half().numpy())
    assert read.fields["tokenizer.chat_template"].contents() == tokenizer.chat_template
    for path in (ws / "data/export").iterdir():
        assert str(project).encode() not in path.read_bytes(), path  # the same bytes in any checkout
    modelfile = (ws / "data/export/Modelfile").read_text()
    assert modelfile.startswith("FROM ./qllm-q8_0.gguf\n") and 'SYSTEM """Answer with one word or number."""' in modelfile
    assert 'PARAMETER stop "<|im_end|>"' in modelfile and "PARAMETER temperature 0" in modelfile
    metrics = read_json(ws / "data/metrics/export.json")
    assert metrics["files"] == 2 and metrics["q8_0_mb"] < metrics["f16_mb"]

    client = mlflow_client(project)
    version = client.get_model_version("qllm", str(summary["model_version"]))
    assert version.tags["qllm.gguf.q8_0"] == "gguf/qllm-q8_0.gguf" and version.tags["qllm.ollama_modelfile"] == "gguf/Modelfile"
    with tracking.fluent_uris(f"sqlite:///{project / 'mlflow.db'}"):
        local = mlflow.artifacts.download_artifacts(run_id=version.run_id, artifact_path=version.tags["qllm.gguf.f16"])
    assert Path(local).read_bytes() == f16.read_bytes()
    assert dvc_up_to_date(run([sys.executable, "-m", "dvc", "status"], ws).stdout)


def test_qllm_export_writes_a_registered_version_and_refuses_to_overwrite_a_foreign_directory(first, project, capsys):
    """`qllm export --model models:/qllm@champion --out DIR`: the champion's GGUF and Modelfile
    from the registry; a directory that holds something else is refused and left as it was, and
    a type that does not exist is named."""
    import shutil

    import gguf
    import numpy as np

    from qllm import cli
    from qllm.serving import generation

    try:
        assert cli.main(["export", "--model", "models:/qllm@champion", "--out", "exported", "--type", "f16", "--project-dir", str(project)]) == 0
        assert sorted(p.name for p in (project / "exported").iterdir()) == ["Modelfile", "README.md", "export.json", "qllm-f16.gguf"]
        assert "exported/qllm-f16.gguf  f16" in capsys.readouterr().out
        model, _ = generation.load("models:/qllm@champion", project)
        embedding = {t.name: t for t in gguf.GGUFReader(project / "exported/qllm-f16.gguf").tensors}["token_embd.weight"]
        assert np.array_equal(np.asarray(embedding.data), model.get_input_embeddings().weight.detach().half().numpy())
        (project / "notes").mkdir()
        (project / "notes/keep.txt").write_text("mine")
        assert cli.main(["export", "--model", "models:/qllm@champion", "--out", "notes", "--project-dir", str(project)]) == 2
        assert "notes: exists and is not an export's output" in capsys.readouterr().err and (project / "notes/keep.txt").read_text() == "mine"
        assert cli.main(["export", "--model", "models:/qllm@champion", "--out", "exported", "--type", "q3", "--project-dir", str(project)]) == 2
        assert "--type/--modelfile-type" in capsys.readouterr().err and (project / "exported/qllm-f16.gguf").exists()
    finally:
        shutil.rmtree(project / "exported", ignore_errors=True)
        shutil.rmtree(project / "notes", ignore_errors=True)
