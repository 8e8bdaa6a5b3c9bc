"""A registered model's lineage read back from MLflow, for `qllm lineage` and `qllm compare`.

    qllm lineage models:/qllm@champion          # or models:/qllm/3; --json for the JSON

The register stage builds the lineage (`pipelines.core.run.lineage.build`) and logs it as the
artifact `lineage.json` of its run; `for_model(uri, root)` reads it back for a registered version
and adds the version's details. Versions registered without `lineage.json` get their lineage
rebuilt from the `dvc.lock` artifact of their pipeline run and the stage runs whose `qllm.dep.*`
tags match it. `render` prints it for people.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipelines.core import dag
from pipelines.core.errors import QllmError
from pipelines.core.run import lineage, tracking

MODEL_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>\d+))$")


def open_client(root: Path | str = ".") -> Any:
    """The project's `MlflowClient`; a clear error (instead of a new empty store) when the
    project has no `mlflow.db`."""
    uri = tracking.tracking_uri(root)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        raise QllmError(
            f"{uri.removeprefix('sqlite:///')}: no MLflow database; run the pipeline first (`qllm run`) or pass --project-dir"
        )
    return tracking.client(root)


def model_version(client: Any, uri: str) -> Any:
    """The `ModelVersion` that `models:/NAME@ALIAS` or `models:/NAME/VERSION` names."""
    from mlflow.exceptions import MlflowException

    match = MODEL_URI.match(uri)
    if not match:
        raise QllmError(f"{uri!r}: expected a registered model URI models:/NAME@ALIAS or models:/NAME/VERSION")
    name = match["name"]
    try:
        registered = client.get_registered_model(name)
    except MlflowException:
        names = sorted(m.name for m in client.search_registered_models())
        raise QllmError(
            f"{uri}: no registered model {name!r} (registered models: {', '.join(names) or 'none'})"
        ) from None
    if match["alias"]:
        try:
            return client.get_model_version_by_alias(name, match["alias"])
        except MlflowException:
            aliases = ", ".join(f"@{a} (version {v})" for a, v in sorted(registered.aliases.items())) or "none"
            raise QllmError(f"{uri}: model {name!r} has no alias {match['alias']!r} (aliases: {aliases})") from None
    try:
        return client.get_model_version(name, match["version"])
    except MlflowException:
        versions = sorted(int(v.version) for v in client.search_model_versions(f"name = {tracking.filter_value(name, 'model name')}"))
        raise QllmError(
            f"{uri}: model {name!r} has no version {match['version']} (versions: {', '.join(map(str, versions)) or 'none'})"
        ) from None


def for_model(uri: str, root: Path | str = ".") -> dict[str, Any]:
    """The lineage of a registered model version, with the version's details.

    Args:
        uri: `models:/NAME@ALIAS` or `models:/NAME/VERSION`.
        root: the project (its `mlflow.db` holds the registry).

    Returns:
        `build`'s dict plus `model`, `version`, `aliases`, `run_id`, `parent_run_id`, `git_commit`,
        `model_md5`, `source` (where the chain came from) and the version's `tags`.
    """
    client = open_client(root)
    version = model_version(client, uri)
    run = client.get_run(version.run_id)
    tags = dict(version.tags)
    parent_run_id = tags.get("mlflow.parent_run_id") or run.data.tags.get("mlflow.parentRunId")
    final_stage = run.data.tags.get("qllm.stage", "register")
    artifact = tags.get("qllm.lineage", lineage.ARTIFACT)
    parent_lock = artifact_lock(client, parent_run_id)
    trail = _load_artifact(client, version.run_id, artifact)
    if trail is not None:
        source = f"{artifact} of run {version.run_id}"
        _complete_final(trail, version.run_id, parent_lock)
    elif parent_lock is not None:
        source = f"{lineage.LOCK_FILE} of pipeline run {parent_run_id} and the stage runs matching it"
        trail = from_lock(client, parent_lock, final_stage, parent_run_id)
        trail["stages"][0]["mlflow_run_id"] = version.run_id
    else:
        raise QllmError(
            f"{uri}: version {version.version} has no {artifact} artifact on run {version.run_id} and no "
            f"pipeline run with a {lineage.LOCK_FILE} artifact to rebuild its lineage from"
        )
    return {
        "model": version.name,
        "version": str(version.version),
        "aliases": sorted(version.aliases),
        "run_id": version.run_id,
        "parent_run_id": parent_run_id,
        "git_commit": tags.get("git_commit"),
        "model_md5": tags.get("dvc.model_md5"),
        "source": source,
        **trail,
        "tags": tags,
    }


def artifact_text(client: Any, run_id: str, path: str) -> str | None:
    """The text of a run's artifact, or None when the run does not have it."""
    names = {item.path for item in client.list_artifacts(run_id)}
    if path not in names:
        return None
    with tempfile.TemporaryDirectory(prefix="qllm-artifact-") as tmp:
        return Path(client.download_artifacts(run_id, path, tmp)).read_text(encoding="utf-8")


def _load_artifact(client: Any, run_id: str, path: str) -> dict[str, Any] | None:
    text = artifact_text(client, run_id, path)
    return json.loads(text) if text is not None else None


def artifact_lock(client: Any, run_id: str | None) -> dict[str, dict] | None:
    """The `dvc.lock` a pipeline run logged at its end (None when it has none)."""
    text = artifact_text(client, run_id, lineage.LOCK_FILE) if run_id else None
    return (dag.load_yaml(text) or {}).get("stages") or {} if text is not None else None


def _complete_final(trail: dict[str, Any], run_id: str, lock: dict[str, dict] | None) -> None:
    """Fill in what the final stage could not know while it ran: its run id, and its outputs from
    the `dvc.lock` its pipeline run logged afterwards (when that entry has the same inputs)."""
    final = trail["stages"][0]
    final["mlflow_run_id"] = final.get("mlflow_run_id") or run_id
    entry = (lock or {}).get(final["stage"])
    if entry is not None and lineage.md5s(entry.get("deps")) == final["deps"]:
        final["outs"] = lineage.md5s(entry.get("outs"))


def from_lock(client: Any, lock: dict[str, dict], final_stage: str, parent_run_id: str | None = None) -> dict[str, Any]:
    """`build`'s chain from a logged `dvc.lock` (`stages` mapping), run ids from `stage_runs`."""
    if final_stage not in lock:
        raise QllmError(f"{lineage.LOCK_FILE}: no entry for stage {final_stage!r}")
    chain = lineage.stage_chain(
        final_stage, {name: (list(lineage.md5s(e.get("deps"))), list(lineage.md5s(e.get("outs")))) for name, e in lock.items()}
    )
    runs = stage_runs(client, {name: lock[name] for name, _ in chain}, parent_run_id)
    return {
        "final_stage": final_stage,
        "stages": [lineage.stage_entry(name, upstream, lock[name], runs[name]) for name, upstream in chain],
    }


def stage_runs(
    client: Any, lock: Mapping[str, Mapping[str, Any]], parent_run_id: str | None = None
) -> dict[str, str | None]:
    """`{stage: id of the MLflow run that produced its outputs}` for the stages of a `dvc.lock`.

    A stage run records the md5 of each dependency as a `qllm.dep.<path>` tag; the producer is a
    finished run of that stage with exactly the lock's dependency md5s, preferring a child of
    `parent_run_id` (it ran in that pipeline run), then the most params equal to the lock's, then
    the latest (a stage restored from DVC's run-cache was produced by an earlier run).
    """
    from pipelines.core.outputs import flatten

    experiment = client.get_experiment_by_name(tracking.experiment_name())
    found: dict[str, str | None] = {}
    for name, entry in lock.items():
        found[name] = None
        if experiment is None:
            continue
        deps = lineage.md5s(entry.get("deps"))
        # Stage runs log their params as `<section>.<key>`: the lock's params.yaml keys, flattened.
        wanted = {k: str(v) for k, v in flatten((entry.get("params") or {}).get("params.yaml") or {}).items()}
        candidates = []
        for run in client.search_runs([experiment.experiment_id], f"tags.qllm.stage = '{name}'", max_results=1000):
            run_deps = {k.removeprefix("qllm.dep."): v for k, v in run.data.tags.items() if k.startswith("qllm.dep.")}
            if run.info.status != "FINISHED" or run_deps != deps:
                continue
            same = sum(run.data.params.get(k) == v for k, v in wanted.items())
            candidates.append(
                (run.data.tags.get("mlflow.parentRunId") == parent_run_id, same, run.info.start_time, run.info.run_id)
            )
        if candidates:
            found[name] = max(candidates)[3]
    return found


def render(lineage: dict[str, Any]) -> str:
    """The lineage as text: the version, then one block per stage (final stage first)."""
    lines = []
    if "model" in lineage:
        aliases = " ".join(f"@{a}" for a in lineage["aliases"])
        lines += [
            f"models:/{lineage['model']}/{lineage['version']}  {aliases}".rstrip(),
            f"  run {lineage['run_id']}  pipeline run {lineage.get('parent_run_id') or '-'}",
            f"  git {lineage.get('git_commit') or '-'}  model md5 {lineage.get('model_md5') or '-'}",
            f"  from {lineage['source']}",
            "",
        ]
    for entry in lineage["stages"]:
        upstream = f"  <- {', '.join(entry['upstream'])}" if entry["upstream"] else "  (raw data)"
        lines.append(f"{entry['stage']}  run {entry['mlflow_run_id'] or '-'}{upstream}")
        flat = _flat_params(entry["params"])
        if flat:
            lines += _wrapped("params", [f"{k}={v}" for k, v in flat.items()])
        code = {k: v for k, v in entry["deps"].items() if k.endswith(".py")}
        data = [("in", k, v) for k, v in entry["deps"].items() if k not in code] + [
            ("out", k, v) for k, v in entry["outs"].items()
        ]
        width = max((len(path) for _, path, _ in data), default=0)
        lines += [f"  {kind:<7} {path:<{width}}  {md5}" for kind, path, md5 in data]
        if code:
            lines += _wrapped("code", [f"{Path(k).name}@{v[:8]}" for k, v in code.items()])
    return "\n".join(lines)


def _wrapped(label: str, words: list[str], width: int = 110) -> list[str]:
    import textwrap

    return textwrap.wrap(
        " ".join(words),
        width,
        initial_indent=f"  {label:<7} ",
        subsequent_indent=" " * 10,
        break_on_hyphens=False,
        break_long_words=False,
    )


def _flat_params(params: Mapping[str, Any]) -> dict[str, str]:
    from pipelines.core.outputs import flatten

    def shown(value: Any) -> str:
        quoted = isinstance(value, (list, dict)) or (isinstance(value, str) and (" " in value or not value))
        return json.dumps(value) if quoted else str(value)

    return {k: shown(v) for k, v in flatten(dict(params)).items()}
