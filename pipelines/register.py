"""Register the trained model in the MLflow model registry, behind a champion/challenger gate.

    python -m pipelines.register      # what dvc.yaml runs; writes data/register/registered.json

Logs the model of stage `register.model` (a LoRA adapter merged into its base) with its tokenizer
as an `mlflow.transformers` text-generation model with MLflow's chat task (`llm/v1/chat`), so
`mlflow.transformers.load_model("models:/qllm@champion")` returns a working pipeline,
`mlflow.pyfunc.load_model` a model answering OpenAI-style chat requests with the tokenizer's chat
template applied, and `mlflow models serve -m models:/qllm@champion` serves those requests over
HTTP; and registers it under `register.model_name`. The multimodal
model (`register.model: multimodal`) is logged as a pyfunc over its directory
(`pipelines.core.models.image_chat_pyfunc`: `predict` takes image bytes and questions).

The gate: the new version takes alias `register.alias` (champion) only if its `register.metric`
in data/metrics/evaluate.json (default held-out exact match) is at least the champion's plus
`register.margin` (`mode: min`: at most, minus the margin) and its metrics meet every bound of
`register.require` (e.g. `retention_loss` at most 0.15 beside the facts: several metrics at once);
otherwise it gets `register.challenger_alias` and the reason is logged and tagged. The first version
is champion if it meets `register.require`. `register.model: merge` registers the merge the `merge`
stage chose on the validation split.

Version tags: git commit, DVC md5 of every data set and of the model (as in dvc.lock), the params
of every stage (`params.<stage>`), the evaluation metrics (`metric.<name>`), the gate's decision,
the parent MLflow run and the Prefect flow run when Prefect runs it. With the export stage on and
exporting this model, its GGUF files and Modelfile are logged in the version's run under `gguf/`
and the version is tagged `qllm.gguf.<type>` / `qllm.ollama_modelfile` with their artifact paths:

    mlflow artifacts download -r <the version's run id> -a gguf/qllm-q8_0.gguf
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from pipelines.core import dag, workspace
from pipelines.core.errors import QllmError
from pipelines.core.models import model_source
from pipelines.core.models.models import load_for_inference
from pipelines.core.outputs import atomic_dir, read_json, write_json
from pipelines.core.params.release import RegisterParams
from pipelines.core.run import lineage, stage, tracking
from pipelines.core.workspace import project_root

NAME = "register"
GGUF_ARTIFACTS = "gguf"
"""Where the version's run keeps the export stage's GGUF files and Modelfile (`qllm.gguf.<type>` tags name them)."""
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
    return lineage.lock_outs(lineage.read_lock(lock)) if lock.exists() else {}


def pip_requirements() -> list[str]:
    """Pinned runtime requirements (MLflow's own inference would import torchvision)."""
    pins = []
    for package in RUNTIME_PACKAGES:
        try:
            pins.append(f"{package}=={version(package).split('+')[0]}")
        except PackageNotFoundError:
            continue
    return pins


def lineage_tags(root: Path, model_dir: Path, parent_run_id: str | None, prefect_flow_run_id: str | None = None) -> dict[str, str]:
    """Version tags: git commit, DVC md5s (data sets and model), params, parent run, Prefect run."""
    tags = {"git_commit": git_commit(project_root(root)), "dvc.model_md5": dag.dvc_md5(model_dir)}
    for path, md5 in sorted(dvc_lock_outs(root).items()):
        if path.startswith(dag.METRICS_DIR + "/"):
            continue
        tags[f"dvc.{path}"] = md5
    for section, values in (dag.load_yaml((root / "params.yaml").read_text()) or {}).items():
        tags[f"params.{section}"] = json.dumps(values, sort_keys=True)

    record = model_source.current(root)
    tags["qllm.base_model"] = model_source.display_name(record) if record["name"] is not None else "pretrained here"
    if record.get("md5"):
        tags["qllm.base_model.md5"] = record["md5"]
    if parent_run_id:
        tags["mlflow.parent_run_id"] = parent_run_id
    if prefect_flow_run_id:
        tags["prefect.flow_run_id"] = prefect_flow_run_id
    return tags


@dataclass(frozen=True)
class Decision:
    """What the gate decided for a new version."""

    alias: str
    promoted: bool
    reason: str
    champion_version: str | None = None
    champion_value: float | None = None


def unmet(params: RegisterParams, metrics: dict[str, float] | None) -> list[str]:
    """The bounds of `params.require` that `metrics` do not meet, each as `retention_loss 0.2100 does not meet retention_loss <= 0.15`."""
    if not params.require:
        return []
    if metrics is None:
        raise ValueError("register.require is set: the gate needs the version's metrics")
    return [f"{bound.metric} {metrics[bound.metric]:.4f} does not meet {bound.describe()}" for bound in params.require if not bound.met_by(metrics[bound.metric])]


def gate(client, params: RegisterParams, value: float, metrics: dict[str, float] | None = None) -> Decision:
    """Champion or challenger for a new version whose `params.metric` is `value`, against the
    version that holds `params.alias` now (its `metric.<name>` tag); a version whose `metrics` miss
    a bound of `params.require` is the challenger whatever the champion's value."""
    decision = _against_champion(client, params, value)
    missed = unmet(params, metrics)
    if not missed:
        return decision
    return Decision(params.challenger_alias, False, f"register.require: {'; '.join(missed)} (against the champion: {decision.reason})",
                    decision.champion_version, decision.champion_value)  # fmt: skip


def _against_champion(client, params: RegisterParams, value: float) -> Decision:
    from mlflow.exceptions import MlflowException

    name, metric = params.model_name, params.metric
    try:
        champion = client.get_model_version_by_alias(name, params.alias)
    except MlflowException:
        return Decision(params.alias, True, f"first model: no version of {name!r} holds @{params.alias}")
    recorded = champion.tags.get(f"metric.{metric}")
    if recorded is None:
        return Decision(params.alias, True, f"champion version {champion.version} has no {metric} recorded", str(champion.version))
    current = float(recorded)
    if params.mode == "max":
        needed, passed, word = current + params.margin, value >= current + params.margin, ">="
    else:
        needed, passed, word = current - params.margin, value <= current - params.margin, "<="
    comparison = f"{metric} {value:.4f} {word if passed else 'not ' + word} {needed:.4f} (champion version {champion.version}: {current:.4f}, margin {params.margin})"
    return Decision(params.alias if passed else params.challenger_alias, passed, comparison, str(champion.version), current)


def promote(client, params: RegisterParams, version: str, value: float, metrics: dict[str, float] | None = None) -> Decision:
    """Gate `version` (its `metric.<name>` tag already set), record the decision on it, and set the
    aliases. Registrations on other machines may run at the same moment (a shared MLflow server):
    each tags the champion its gate compared against (`gate.champion`) before any alias moves, then
    `settle`s, so `@champion` ends on the best of the versions promoted against the same champion
    (or a better one that arrived since), never on a worse one that happened to write last."""
    decision = gate(client, params, value, metrics)
    for key, tag in (("gate.decision", decision.alias), ("gate.reason", decision.reason), ("gate.champion", decision.champion_version or "none")):
        client.set_model_version_tag(params.model_name, version, key, tag)
    if decision.promoted:
        settle(client, params, decision.champion_version or "none")
    else:
        client.set_registered_model_alias(params.model_name, decision.alias, version)
    return decision


def settle(client, params: RegisterParams, against: str, rounds: int = 10) -> str | None:
    """Point `params.alias` at the best of the versions promoted against champion `against` (their
    `gate.champion` tag) and the version that holds the alias now (which another registration may
    have moved to a better one meanwhile), reading back until the registry agrees; that version.
    Ties go to the later version, as the gate's `>=` does."""
    name, metric, sign = params.model_name, params.metric, 1.0 if params.mode == "max" else -1.0
    best = None
    for _ in range(rounds):
        holder = _alias_version(client, name, params.alias)
        candidates = [v for v in client.search_model_versions(f"name = {tracking.filter_value(name, 'register.model_name')}") if f"metric.{metric}" in v.tags
                      and ((v.tags.get("gate.decision") == params.alias and v.tags.get("gate.champion") == against) or str(v.version) == holder)]  # fmt: skip
        if not candidates:
            return holder
        best = max(candidates, key=lambda v: (sign * float(v.tags[f"metric.{metric}"]), int(v.version)))
        if holder == str(best.version):
            return holder
        client.set_registered_model_alias(name, params.alias, best.version)
    return str(best.version) if best is not None else None


def _alias_version(client, name: str, alias: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def model_metrics(evaluation: dict, params: RegisterParams, where: str) -> dict[str, float]:
    """The numeric evaluation metrics of the registered stage's model; the gate's metric and every
    metric `register.require` bounds must be among them."""
    entry = evaluation.get(params.model)
    if entry is None:
        raise QllmError(f"{where}: no entry for model {params.model!r} (add it to evaluate.models to register it)")
    numeric = {k: float(v) for k, v in entry.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    keys = [("register.metric", params.metric)] + [(f"register.require.{i}.metric", bound.metric) for i, bound in enumerate(params.require)]
    for key, metric in keys:
        if metric not in numeric or not math.isfinite(numeric[metric]):
            raise QllmError(f"{key}: {metric!r} is not a finite number in {where}[{params.model!r}]; "
                            f"available: {', '.join(sorted(numeric))}")  # fmt: skip
    return numeric


def log_chat_model(root: Path, model_dir: Path):
    """Log the language model in `model_dir` (an adapter merged into its base) with its tokenizer
    to the active MLflow run as `model`, with MLflow's chat task; its `ModelInfo`."""
    import mlflow

    model, tokenizer = load_for_inference(model_dir, root)
    # what the chat task names as `model` in its answers (and MLmodel as the source): the stage's
    # output as the project names it, not this machine's absolute path (nor a hub id MLflow would look up)
    model.name_or_path = model.config._name_or_path = model_dir.relative_to(root).as_posix() if model_dir.is_relative_to(root) else model_dir.name
    return mlflow.transformers.log_model(
        transformers_model={"model": model, "tokenizer": tokenizer},
        name="model",
        task="llm/v1/chat",  # messages in, the chat template applied, an OpenAI chat.completion out (pyfunc and `mlflow models serve`)
        pip_requirements=pip_requirements(),
    )


def exported_files(export_dir: Path | None, stage_name: str) -> tuple[list[Path], dict[str, str]]:
    """The export stage's GGUF files and Modelfile when they are of `stage_name`'s model (else
    none), and the version tags that name them (`qllm.gguf.<type>`: the artifact path)."""
    record_path = export_dir / "export.json" if export_dir is not None else None
    if record_path is None or not record_path.exists():
        return [], {}
    record = read_json(record_path)
    if record.get("stage") != stage_name:
        return [], {}
    files = [export_dir / entry["file"] for entry in record["files"]]
    tags = {f"qllm.gguf.{entry['type']}": f"{GGUF_ARTIFACTS}/{entry['file']}" for entry in record["files"]}
    if record.get("modelfile"):
        files.append(export_dir / record["modelfile"])
        tags["qllm.ollama_modelfile"] = f"{GGUF_ARTIFACTS}/{record['modelfile']}"
    return files, tags


def run(root: Path, model_dir: Path, out: Path, params: RegisterParams, run_id: str, parent_run_id: str | None, metrics: dict[str, float],
        prefect_flow_run_id: str | None = None, export_dir: Path | None = None) -> dict:  # fmt: skip
    import mlflow

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # model-card lookups must not reach for the hub
    client = tracking.client(root)
    gguf_files, gguf_tags = exported_files(export_dir, params.model)
    tags = {
        **lineage_tags(root, model_dir, parent_run_id, prefect_flow_run_id),
        **{f"metric.{k}": repr(v) for k, v in metrics.items()},
        "qllm.stage": params.model,
        "qllm.lineage": lineage.ARTIFACT,
        "gate.metric": params.metric,
        **({"gate.require": "; ".join(bound.describe() for bound in params.require)} if params.require else {}),
        **gguf_tags,
    }
    tracking.check_pins_directly()  # the pins below are this environment's: no scan of every installed file
    with tracking.fluent_uris(tracking.tracking_uri(root)), mlflow.start_run(run_id=run_id):
        if params.model == "multimodal":  # no image-text-to-text task in mlflow.transformers: a pyfunc over the directory
            from pipelines.core.models.image_chat_pyfunc import ImageChatModel, signature

            info = mlflow.pyfunc.log_model(
                name="model",
                python_model=ImageChatModel(),
                signature=signature(),
                artifacts={"model": str(model_dir)},
                pip_requirements=[*pip_requirements(), f"pillow=={version('pillow')}"],
            )
        else:
            info = log_chat_model(root, model_dir)
        for path in gguf_files:  # the export stage's files of this model, beside it in the version's run
            mlflow.log_artifact(str(path), artifact_path=GGUF_ARTIFACTS)
        trail = lineage.build(root)
        lineage.log_lineage(client, run_id, trail)
        # the version with every tag in one request, the metric tags the next gate reads among them
        # (a tag at a time cost two round trips each: about a minute a version through the team's
        # TLS front and basic auth, tests/e2e/test_team.py)
        model_version = str(mlflow.register_model(info.model_uri, params.model_name, tags=tags).version)
    value = metrics[params.metric]
    # gate and alias as one step: two runs registering at once must not both beat the same champion
    # (the lock: runs of this project on this machine; `promote`'s settling: runs anywhere)
    with workspace.project_lock(root, f"registry-{params.model_name}", f"the registry entry {params.model_name!r}"):
        decision = promote(client, params, model_version, value, metrics)
    record = {
        "stage": params.model,
        "model_name": params.model_name,
        "version": model_version,
        "alias": decision.alias,
        "promoted": decision.promoted,
        "reason": decision.reason,
        "metric": params.metric,
        "value": value,
        "require": [{"bound": bound.describe(), "value": metrics[bound.metric], "met": bound.met_by(metrics[bound.metric])} for bound in params.require],
        "previous_champion": decision.champion_version,
        "model_uri": f"models:/{params.model_name}/{model_version}",
    }  # no MLflow run id: a DVC output holds no per-run identifier (the version knows its run)
    with atomic_dir(out) as tmp:
        write_json(tmp / "registered.json", record)
    return record


def body(ctx: stage.StageContext) -> dict:
    evaluation = ctx.input("metrics/evaluate.json")
    metrics = model_metrics(read_json(evaluation), ctx.params, str(evaluation.relative_to(ctx.root)))
    parent, flow_run_id = None, None
    if ctx.tracker.enabled:
        parent = ctx.tracker.client.get_run(ctx.tracker.run_id).data.tags.get("mlflow.parentRunId")
        if parent:  # the pipeline run started by Prefect records its flow run id
            flow_run_id = ctx.tracker.client.get_run(parent).data.tags.get("qllm.prefect_flow_run_id")
    record = run(ctx.root, ctx.input(f"models/{ctx.params.model}"), ctx.output(), ctx.params, ctx.tracker.run_id, parent, metrics, flow_run_id,
                 export_dir=ctx.input("export"))  # fmt: skip
    ctx.tracker.set_tags({"gate.decision": record["alias"], "gate.reason": record["reason"]})
    log = ctx.log.info if record["promoted"] else ctx.log.warning
    log("registered %s version %s (%s model) as @%s: %s", record["model_name"], record["version"], ctx.params.model, record["alias"], record["reason"])
    return {"version": int(record["version"]), "promoted": int(record["promoted"]), f"gate/{ctx.params.metric}": record["value"]}


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
