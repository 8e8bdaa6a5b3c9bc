"""Lineage of a registered model: the chain of stages from the model back to the raw data.

`build(root)` reads `dvc.lock`, `dvc.yaml` and `data/metrics/<stage>.json` of a project (or run
workspace) and returns, from the final stage back to the raw-data stages, every stage with the
MLflow run that produced its outputs, its params and the DVC md5 of its inputs and outputs:

    {"final_stage": "register",
     "stages": [{"stage": "register", "mlflow_run_id": "...", "upstream": ["evaluate", "dpo", ...],
                 "params": {...}, "deps": {path: md5}, "outs": {path: md5}}, ...,
                {"stage": "generate", ...}]}

The register stage logs it as the artifact `lineage.json` of its MLflow run (`log_lineage`), so a
version's lineage is what existed when it was registered, not what the workspace holds today.
Reading it back for a registered version (`qllm lineage`) is `qllm/registry/lineage.py`.

The md5s are DVC's: the same strings as in `dvc.lock` (`<md5>.dir` for directories).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipelines.core import dag
from pipelines.core.errors import QllmError

LOCK_FILE = "dvc.lock"
ARTIFACT = "lineage.json"


# ----------------------------------------------------------------------------- from a workspace


def build(root: Path | str = ".", final_stage: str = "register") -> dict[str, Any]:
    """The lineage of `final_stage`'s inputs in the workspace `root`, from `dvc.lock`.

    Every stage upstream of `final_stage` must have finished (have its `dvc.lock` entry). The final
    stage may be the one calling this (register does, while it registers), so its `dvc.lock` entry
    is not used: it may be stale or missing. Its deps are the md5s DVC records for it when it
    finishes (the upstream outputs' md5s from `dvc.lock`, other files hashed), its params come
    from `params.yaml`, and its run id and outs are left for `log_lineage` and `for_model` to
    fill in (None and `{}` here).

    Args:
        root: project or run-workspace directory (holds `dvc.yaml`, `dvc.lock`, `params.yaml`).
        final_stage: the stage whose lineage is wanted.

    Returns:
        `{"final_stage", "stages": [{"stage", "mlflow_run_id", "upstream", "params", "deps", "outs"}]}`,
        final stage first, then every stage it depends on (directly or not), raw-data stages last.
    """
    root = Path(root).resolve()
    graph = dag.stages(root)
    if final_stage not in graph:
        raise QllmError(f"unknown stage {final_stage!r}; stages are: {', '.join(graph)}")
    lock = read_lock(root / LOCK_FILE)
    chain = stage_chain(final_stage, {name: (spec.deps, spec.all_outs) for name, spec in graph.items()})
    stages = []
    for name, upstream in chain:
        if name == final_stage:
            continue
        if name not in lock:
            raise QllmError(
                f"{root / LOCK_FILE}: no entry for stage {name!r} (an input of {final_stage}); run the pipeline first"
            )
        stages.append(stage_entry(name, upstream, lock[name], _metrics_run_id(root, name)))
    final = _final_entry(root, graph[final_stage], chain[0][1], lock)
    return {"final_stage": final_stage, "stages": [final, *stages]}


def _final_entry(root: Path, spec: dag.Stage, upstream: list[str], lock: dict[str, dict]) -> dict[str, Any]:
    outs_md5 = {path: md5 for name in upstream for path, md5 in md5s(lock[name].get("outs")).items()}
    deps = {}
    for dep in spec.deps:
        if dep in outs_md5:
            deps[dep] = outs_md5[dep]
        elif (root / dep).exists():
            deps[dep] = dag.dvc_md5(root / dep)
    return {
        "stage": spec.name,
        "mlflow_run_id": None,
        "upstream": upstream,
        "params": _as_json(_params_from_yaml(root / "params.yaml", spec)),
        "deps": deps,
        "outs": {},
    }


def stage_entry(name: str, upstream: list[str], lock_entry: Mapping[str, Any], run_id: str | None) -> dict[str, Any]:
    return {
        "stage": name,
        "mlflow_run_id": run_id,
        "upstream": upstream,
        "params": _lock_params(lock_entry, name),
        "deps": md5s(lock_entry.get("deps")),
        "outs": md5s(lock_entry.get("outs")),
    }


def read_lock(path: Path) -> dict[str, dict]:
    """The `stages` mapping of a `dvc.lock` file."""
    if not path.exists():
        raise QllmError(f"{path}: not found; run the pipeline first (`qllm run`)")
    return (dag.load_yaml(path.read_text(encoding="utf-8")) or {}).get("stages") or {}


def md5s(entries: Any) -> dict[str, str]:
    return {item["path"]: item["md5"] for item in entries or () if "md5" in item}


def lock_outs(lock: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """`{output path: md5}` of every stage output in a `dvc.lock` `stages` mapping."""
    return {path: md5 for entry in lock.values() for path, md5 in md5s(entry.get("outs")).items()}


def _collapse(values: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A stage that reads exactly its own section gets that section, else the keys it lists."""
    values = dict(values)
    return dict(values[name] or {}) if list(values) == [name] else values


def _lock_params(entry: Mapping[str, Any], name: str) -> dict[str, Any]:
    return _as_json(_collapse((entry.get("params") or {}).get("params.yaml") or {}, name))


def _as_json(params: dict[str, Any]) -> dict[str, Any]:
    """Params as the lineage artifact (JSON) holds them: a YAML mapping with number keys
    (`time_step_mask_fractions: {0: 0.15}`) gets string keys, whichever file it was read from."""
    return json.loads(json.dumps(params))


def _params_from_yaml(path: Path, spec: dag.Stage) -> dict[str, Any]:
    data = dag.load_yaml(path.read_text(encoding="utf-8")) if path.exists() else {}
    values = {}
    for key in spec.params:
        node: Any = data or {}
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            values[key] = node
    return _collapse(values, spec.name)


def _metrics_run_id(root: Path, name: str) -> str | None:
    """The run that produced the stage's outputs (its metrics file is restored with them)."""
    path = root / dag.metrics_file(name)
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("mlflow_run_id")
    except (OSError, ValueError, AttributeError):
        return None


def stage_chain(final: str, graph: Mapping[str, tuple[Sequence[str], Sequence[str]]]) -> list[tuple[str, list[str]]]:
    """`[(stage, its direct upstream stages)]` for `final` and every stage it depends on.

    `graph` maps each stage to its (deps, outs) paths. Stages are ordered by their longest
    distance from `final` (ties by name), so each comes after every stage that reads its outputs
    and the order depends only on the graph (not on the file order of dvc.yaml or dvc.lock).
    """
    parents = {
        name: [
            other
            for other in graph
            if other != name and any(dag.covers(out, dep) for out in graph[other][1] for dep in deps)
        ]
        for name, (deps, _) in graph.items()
    }
    distance = {final: 0}
    todo = [final]
    while todo:
        name = todo.pop()
        for parent in parents[name]:
            if distance.get(parent, -1) < distance[name] + 1:
                if distance[name] + 1 > len(graph):
                    raise QllmError(f"the stages upstream of {final!r} form a cycle (through {parent!r})")
                distance[parent] = distance[name] + 1
                todo.append(parent)
    order = sorted(distance, key=lambda n: (distance[n], n))
    return [(name, sorted(parents[name], key=lambda n: (distance[n], n))) for name in order]


def log_lineage(tracker_or_client: Any, run_id: str, lineage: dict[str, Any]) -> None:
    """Log `lineage` as the artifact `lineage.json` of the final stage's MLflow run `run_id`.

    The final stage's run id, unknown to `build` while that stage runs, becomes `run_id`.

    Args:
        tracker_or_client: a `tracking.Tracker` (nothing is logged when it is disabled) or an
            `MlflowClient`.
        run_id: the MLflow run of the final stage (e.g. the register stage's run).
        lineage: what `build` returned.
    """
    client = getattr(tracker_or_client, "client", tracker_or_client)
    if client is None:
        return
    stages = lineage.get("stages") or []
    if stages and not stages[0].get("mlflow_run_id"):
        stages[0]["mlflow_run_id"] = run_id
    client.log_dict(run_id, lineage, ARTIFACT)
