"""Register the trained model in the MLflow model registry.

    python -m pipelines.register      # what dvc.yaml runs; writes data/register/registered.json

Logs the model of stage `register.model` (a LoRA adapter merged into its base) with its tokenizer
as an `mlflow.transformers` text-generation model, so
`mlflow.transformers.load_model("models:/qllm@champion")` returns a working pipeline (and
`mlflow.pyfunc.load_model` works too), registers it under `register.model_name`, tags the version
with its lineage (git commit, DVC md5 of every data set and of the model as in `dvc.lock`, all
params, parent MLflow run, Prefect flow run) and points `register.alias` at it.
"""

from __future__ import annotations

import json
import os
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import yaml

from pipelines import dag, stage, tracking
from pipelines.config import RegisterParams
from pipelines.models import load_for_inference
from pipelines.outputs import atomic_dir, read_json, write_json
from pipelines.workspace import project_root

NAME = "register"
MODELS = "data/models"
EVAL_METRICS = "data/metrics/evaluate.json"
OUT = "data/register"
RUNTIME_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "accelerate")


def git_commit(root: Path) -> str:
    """HEAD of the project's git repository, `-dirty` when tracked files changed; else `unknown`."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def dvc_lock_outs(root: Path) -> dict[str, str]:
    """`{output path: md5}` of every stage output recorded in `dvc.lock`."""
    lock = root / "dvc.lock"
    if not lock.exists():
        return {}
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    return {out["path"]: out["md5"] for body in stages.values() for out in body.get("outs", []) if "md5" in out}


def pip_requirements() -> list[str]:
    """Pinned runtime requirements (MLflow's own inference would import torchvision)."""
    pins = []
    for package in RUNTIME_PACKAGES:
        try:
            pins.append(f"{package}=={version(package).split('+')[0]}")
        except PackageNotFoundError:
            continue
    return pins


def lineage_tags(root: Path, model_dir: Path, parent_run_id: str | None) -> dict[str, str]:
    """Version tags: git commit, DVC md5s (data sets and model), params, parent run, Prefect run."""
    tags = {"git_commit": git_commit(project_root(root)), "dvc.model_md5": dag.dvc_md5(model_dir)}
    for path, md5 in sorted(dvc_lock_outs(root).items()):
        if path.startswith("data/metrics/"):
            continue
        tags[f"dvc.{path}"] = md5
    tags["params"] = json.dumps(yaml.safe_load((root / "params.yaml").read_text()), sort_keys=True)[:5000]
    if parent_run_id:
        tags["mlflow.parent_run_id"] = parent_run_id
    if os.environ.get(tracking.PREFECT_RUN_ENV):
        tags["prefect.flow_run_id"] = os.environ[tracking.PREFECT_RUN_ENV]
    return tags


def run(root: Path, model_dir: Path, out: Path, params: RegisterParams, run_id: str, parent_run_id: str | None) -> dict:
    import mlflow

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # model-card lookups must not reach for the hub
    uri = tracking.tracking_uri(root)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    model, tokenizer = load_for_inference(model_dir, root)
    with mlflow.start_run(run_id=run_id):
        info = mlflow.transformers.log_model(
            transformers_model={"model": model, "tokenizer": tokenizer},
            name="model",
            task="text-generation",
            pip_requirements=pip_requirements(),
            registered_model_name=params.model_name,
        )
    client = tracking.client(root)
    model_version = str(info.registered_model_version)
    for key, value in lineage_tags(root, model_dir, parent_run_id).items():
        client.set_model_version_tag(params.model_name, model_version, key, value)
    client.set_registered_model_alias(params.model_name, params.alias, model_version)
    record = {
        "stage": params.model,
        "model_name": params.model_name,
        "version": model_version,
        "alias": params.alias,
        "model_uri": f"models:/{params.model_name}/{model_version}",
        "run_id": run_id,
    }
    with atomic_dir(out) as tmp:
        write_json(tmp / "registered.json", record)
    return record


def _body(ctx: stage.StageContext) -> dict:
    evaluation = read_json(ctx.path(EVAL_METRICS))
    parent = ctx.tracker.client.get_run(ctx.tracker.run_id).data.tags.get("mlflow.parentRunId") if ctx.tracker.enabled else None
    record = run(ctx.root, ctx.path(MODELS) / ctx.params.model, ctx.path(OUT), ctx.params, ctx.tracker.run_id, parent)
    exact_match = evaluation.get(ctx.params.model, {}).get("exact_match", float("nan"))
    ctx.log.info(
        "registered %s version %s (%s model) as @%s (exact match %.1f%%)",
        record["model_name"], record["version"], ctx.params.model, record["alias"], 100 * exact_match,
    )
    return {"version": int(record["version"])}


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, _body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
