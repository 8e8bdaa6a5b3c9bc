"""What every stage shares: its params section, its MLflow run, its input datasets, its metrics file.

A stage module is `run(...)` over paths and typed params plus a `main()` that calls
`stage.main(NAME, body)`, where `body(ctx) -> metrics` does the work. The same `main` runs under
`dvc repro` (`python -m pipelines.<name>`) and in-process under the Prefect flow.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.core import dag, workspace
from pipelines.core.errors import QllmError, stage_command, stop_when_parent_dies
from pipelines.core.outputs import atomic_dir, digest, flatten, read_json, to_plain, write_json
from pipelines.core.params import files as params_file
from pipelines.core.params.project import Params
from pipelines.core.params.training import TrainParams
from pipelines.core.run import resources, tracking

RUN_RECORD = "mlflow_run.json"
"""In a training stage's checkpoint directory: the id of the MLflow run that writes there."""


@dataclass(frozen=True)
class StageContext:
    """What a stage body gets: where it runs, its typed params, its tracker and logger, and its
    paths: those its dvc.yaml stage declares (`input`, `output`), never spelled out in the stage.

    Frozen: `params` stay what the fingerprint was computed from; a body that resolves a value
    (an absolute base model path, the quantum_opt allocation) passes a copy on instead."""

    name: str
    root: Path
    params: Any
    tracker: tracking.Tracker
    fingerprint: str = ""
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("qllm"))
    listed: dict[str, Any] = field(default_factory=dict)
    """Values of the keys of other sections the stage lists under `params` in dvc.yaml (`param`)."""

    def param(self, key: str) -> Any:
        """A params.yaml value outside the stage's section, by dotted key (`lora.allocation`): only a
        key the stage lists under `params` in dvc.yaml, so that DVC reruns the stage when it changes."""
        if key not in self.listed:
            raise QllmError(f"stage {self.name}: params key {key!r} is not listed under params in dvc.yaml (listed: {', '.join(self.spec.params)})")
        return self.listed[key]

    @property
    def spec(self) -> dag.Stage:
        return dag.stages(self.root)[self.name]

    def inputs(self) -> list[Path]:
        """Every data dependency of this stage in dvc.yaml (its `deps` but the `.py` files), in file order."""
        return [self.root / dep for dep in self._data_deps()]

    def input(self, name: str) -> Path:
        """The one data dependency in dvc.yaml that is `name` or ends with `/name`:
        `input("chat")` -> `<root>/data/prepared/chat`; `input("models/pretrain")`."""
        return self._one("input", name, self._data_deps(), "deps")

    def output(self, name: str | None = None) -> Path:
        """The one output in dvc.yaml (`outs` and `plots`, not `metrics`) that is `name` or ends
        with `/name`; with no name, the stage's only output."""
        return self._one("output", name, [*self.spec.outs, *self.spec.plots], "outs")

    def _data_deps(self) -> list[str]:
        return [dep for dep in self.spec.deps if not dep.endswith(".py")]

    def _one(self, kind: str, name: str | None, declared: list[str], key: str) -> Path:
        """Stages take their paths from dvc.yaml, so the code cannot read or write a path that DVC
        does not track: a name that matches no declared path, or several, is an error."""
        listed = f"(declared: {', '.join(declared) or 'none'})"
        if name is None:
            if len(declared) != 1:
                raise QllmError(f"stage {self.name}: which {kind}? dvc.yaml {key} has {len(declared)}, so name one {listed}")
            return self.root / declared[0]
        found = [path for path in declared if path == name or path.endswith("/" + name)]
        if not found:
            raise QllmError(f"stage {self.name}: no {kind} {name!r} in dvc.yaml {key} {listed}")
        if len(found) > 1:
            raise QllmError(f"stage {self.name}: {kind} {name!r} is ambiguous, it matches {', '.join(found)} in dvc.yaml {key} {listed}")
        return self.root / found[0]

    @property
    def checkpoint_dir(self) -> Path:
        """Resumable checkpoints of this exact stage configuration (outside the stage outputs)."""
        return workspace.checkpoint_dir(self.root, self.name, self.fingerprint)


def placeholder(ctx: StageContext, text: str) -> None:
    """The stage's only output as a README saying why nothing else was made (a stage its params
    switch off): DVC still tracks an output, the same bytes on every run, so what depends on it
    stays cached."""
    with atomic_dir(ctx.output()) as tmp:
        (tmp / "README.md").write_text(text, encoding="utf-8")


def switched_off(ctx: StageContext, text: str) -> dict[str, Any]:
    """For a stage its `enabled: false` switches off: the README `placeholder`, a log line, and
    the metrics that say so."""
    placeholder(ctx, text)
    ctx.log.info("%s: disabled (%s.enabled is false): wrote only a README", ctx.name, ctx.name)
    return {"enabled": False}


def dependency_digests(root: Path, spec: dag.Stage) -> dict[str, str]:
    """DVC md5 of every dependency that exists (code and data), keyed by its dvc.yaml path."""
    return {dep: dag.dvc_md5(root / dep) for dep in spec.deps if (root / dep).exists()}


def execute(name: str, body: Callable[[StageContext], dict[str, Any]], root: Path | str = ".", parent_run_id: str | None = None) -> dict[str, Any]:
    """Run one stage: validate params, open its MLflow run, call `body`, write its metrics JSON.

    The fingerprint (params section + DVC md5 of every dependency) names the checkpoint directory,
    so a rerun of the same stage resumes and a changed stage starts afresh. A training stage holds
    its checkpoint directory while it runs (`workspace.checkpoint_lock`) and records its MLflow run
    id there (`mlflow_run.json`): rerun after a crash or a kill, with a checkpoint to resume from
    and that run not FINISHED, it continues the same MLflow run instead of starting a second one.

    Distributed (`pipelines.core.training.distributed`): with `train.nproc > 1` and not yet under torchrun, the
    stage relaunches itself under torchrun and waits, then returns the metrics its rank 0 wrote.
    Under torchrun, every rank runs `body`; rank 0 alone holds the checkpoint lock, opens the MLflow
    run and writes the metrics file (the other ranks get a tracker that logs nothing).

    The stages that read the world (probe_device, base_model) have their own, lighter contract:
    `pipelines.core.data.world`.
    """
    root = Path(root).resolve()
    params, listed = stage_params(name, root)
    if _trains(params) and (params.train.nproc > 1 or "WORLD_SIZE" in os.environ):  # see pipelines.core.training.distributed
        return _execute_distributed(name, body, root, params, listed, parent_run_id)
    return _execute(name, body, root, params, listed, parent_run_id)


def _distributed():
    from pipelines.core.training import distributed  # torch: only for training stages

    return distributed


def fingerprint(name: str, params: Any, digests: dict[str, str], listed: dict[str, Any] | None = None) -> str:
    """What names a stage's checkpoints: its params section (and the other keys it lists) and the
    DVC md5 of every dependency."""
    return digest({"stage": name, "params": to_plain(params), "deps": digests, **({"listed": listed} if listed else {})})


def listed_params(params: Params, spec: dag.Stage) -> dict[str, Any]:
    """The values of the dotted keys of other sections that `spec` lists under `params`."""
    values = {}
    for key in spec.params:
        if key != spec.name:
            node = params
            for part in key.split("."):
                node = getattr(node, part)
            values[key] = to_plain(node) if hasattr(node, "model_dump") else node  # a section: plain JSON
    return values


def _execute_distributed(name: str, body: Callable[[StageContext], dict[str, Any]], root: Path, params: Any, listed: dict[str, Any],
                         parent_run_id: str | None) -> dict[str, Any]:  # fmt: skip
    distributed = _distributed()
    if not distributed.under_launcher():
        distributed.launch(dag.stages(root)[name].module, root, params.train.nproc, {tracking.PARENT_RUN_ENV: parent_run_id} if parent_run_id else None)
        metrics_file = root / dag.metrics_file(name)
        return read_json(metrics_file) if metrics_file.exists() else {}
    distributed.setup()
    if distributed.is_main():
        return _execute(name, body, root, params, listed, parent_run_id)
    # other ranks: the same body (they train), no lock, no MLflow run, no metrics file
    spec = dag.stages(root)[name]
    ctx = StageContext(name=name, root=root, params=params, tracker=tracking.Tracker(None, None), fingerprint=fingerprint(name, params, dependency_digests(root, spec), listed),
                       log=logging.getLogger(f"qllm.{name}"), listed=listed)  # fmt: skip
    return body(ctx) or {}


def _execute(
    name: str, body: Callable[[StageContext], dict[str, Any]], root: Path, params: Any, listed: dict[str, Any], parent_run_id: str | None
) -> dict[str, Any]:
    log = logging.getLogger(f"qllm.{name}")
    started = time.perf_counter()
    spec = dag.stages(root)[name]
    digests = dependency_digests(root, spec)
    key = fingerprint(name, params, digests, listed)
    tags = {"qllm.stage": name, "qllm.fingerprint": key}
    if getattr(params, "enabled", True) is False:  # switched off: its README only, and no MLflow run to say so
        ctx = StageContext(name=name, root=root, params=params, tracker=tracking.Tracker(None, None), fingerprint=key, log=log, listed=listed)
        metrics = {**(body(ctx) or {}), "seconds": round(time.perf_counter() - started, 3), "mlflow_run_id": None}
        if dag.metrics_file(name) in ctx.spec.metrics:
            write_json(root / dag.metrics_file(name), metrics)
        return metrics
    with contextlib.ExitStack() as stack:
        checkpoints = workspace.checkpoint_dir(root, name, key) if _trains(params) else None
        resume_run_id = None
        if checkpoints is not None:
            stack.enter_context(workspace.checkpoint_lock(checkpoints))
            resume_run_id = _unfinished_run(root, checkpoints)
        tracker = stack.enter_context(tracking.run(name, root, tags=tags, parent_run_id=parent_run_id, resume_run_id=resume_run_id))
        if checkpoints is not None:
            write_json(checkpoints / RUN_RECORD, {"run_id": tracker.run_id, "store": _store_id(root)})
        tracker.log_params({name: params, **listed})
        tracker.log_datasets([(dep, md5, dep) for dep, md5 in digests.items() if not dep.endswith(".py")], context="input")
        tracker.set_tags({f"qllm.dep.{dep}": md5 for dep, md5 in digests.items()})
        ctx = StageContext(name=name, root=root, params=params, tracker=tracker, fingerprint=key, log=log, listed=listed)
        with resources.PeakMemory() as peak:
            metrics = body(ctx) or {}
        metrics = {**metrics, **({"precision": params.train.precision} if _trains(params) else {}),
                   "seconds": round(time.perf_counter() - started, 3), **peak.metrics()}
        tracker.log_metrics({k: v for k, v in flatten(metrics).items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        metrics_file = dag.metrics_file(name)
        if metrics_file in ctx.spec.metrics:
            write_json(root / metrics_file, {**metrics, "mlflow_run_id": tracker.run_id})
            tracker.log_artifact(root / metrics_file)
    return metrics


def stage_params(name: str, root: Path) -> tuple[Any, dict[str, Any]]:
    """The stage's validated params section, `precision: auto` resolved for a training stage, and
    the values of the other keys it lists (`listed_params`)."""
    everything, _ = params_file.load(root)
    params, listed = getattr(everything, name), listed_params(everything, dag.stages(root)[name])
    return (resolve_precision(name, params) if _trains(params) else params), listed


def execute_untracked(name: str, body: Callable[[StageContext], dict[str, Any]], root: Path | str = ".") -> dict[str, Any]:
    """Run one stage's body with no MLflow run and no DVC hashing: the stage code alone, on a
    machine that has neither (the device check's core, `tools.gpu_check core`). Params are
    validated and `precision: auto` resolved as in `execute`; the metrics file is written, with
    `mlflow_run_id` null. The fingerprint covers the params only, so checkpoints are not for
    resuming here (the core runs with `checkpoint_every: 0`)."""
    root = Path(root).resolve()
    params, listed = stage_params(name, root)
    started = time.perf_counter()
    ctx = StageContext(name=name, root=root, params=params, tracker=tracking.Tracker(None, None), fingerprint=fingerprint(name, params, {}, listed),
                       log=logging.getLogger(f"qllm.{name}"), listed=listed)  # fmt: skip
    with resources.PeakMemory() as peak:
        metrics = body(ctx) or {}
    metrics = {**metrics, **({"precision": params.train.precision} if _trains(params) else {}),
               "seconds": round(time.perf_counter() - started, 3), **peak.metrics(), "mlflow_run_id": None}  # fmt: skip
    if dag.metrics_file(name) in ctx.spec.metrics:
        write_json(root / dag.metrics_file(name), metrics)
    return metrics


def resolve_precision(name: str, params: Any) -> Any:
    """`train.precision: auto` -> the precision this device trains in (`pipelines.core.training.precision`); an
    explicit one is kept (bf16 on a CPU that emulates it warns once). The stage then runs, logs and
    fingerprints the resolved value, and its metrics file records it as `precision`."""
    from pipelines.core.training import precision  # torch: only for training stages

    requested = params.train.precision
    resolved = precision.resolve(requested, name)
    if requested == "auto":
        cap = precision.capability()
        logging.getLogger(f"qllm.{name}").info(
            "precision auto -> %s (%s, native bf16: %s)", resolved, cap.device, "yes" if cap.bf16_native else "no"
        )
    return params.model_copy(update={"train": params.train.model_copy(update={"precision": resolved})})


def _trains(params: Any) -> bool:
    """A stage with a `train` section runs the shared training loop (and may checkpoint)."""
    return isinstance(getattr(params, "train", None), TrainParams)


def _store_id(root: Path) -> str:
    """Names the tracking store without writing its URI (it may hold credentials) to disk."""
    return digest({"tracking_uri": tracking.tracking_uri(root)})[:16]


def _unfinished_run(root: Path, checkpoints: Path) -> str | None:
    """The MLflow run to continue: the one recorded in `checkpoints`, if a checkpoint exists to
    resume from and that run is still in the same store, not deleted and not FINISHED (a killed
    run stays RUNNING, a crashed one is FAILED)."""
    record = checkpoints / RUN_RECORD
    if not record.exists() or not any(path.is_dir() for path in checkpoints.glob("step-*")):
        return None
    try:
        saved = read_json(record)
        run_id = saved["run_id"]
    except (ValueError, KeyError, TypeError):
        return None
    if saved.get("store") != _store_id(root):  # MLFLOW_TRACKING_URI changed since
        return None
    status = tracking.run_status(root, run_id)
    return run_id if status is not None and status != "FINISHED" else None


def main(name: str, body: Callable[[StageContext], dict[str, Any]], argv: list[str] | None = None) -> int:
    """Command-line entry of a stage (`python -m pipelines.<name> [--root DIR]`).

    Under `dvc repro` (which sets DVC_STAGE) the stage also stops, with a checkpoint, when dvc is
    killed: dvc passes no SIGTERM on to the command it runs (`pipelines.core.errors.stop_when_parent_dies`).
    """
    if os.environ.get("DVC_STAGE"):
        stop_when_parent_dies()
    return stage_command(name, lambda root: execute(name, body, root), argv)
