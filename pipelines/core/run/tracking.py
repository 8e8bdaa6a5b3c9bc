"""MLflow tracking for stages: one run per stage, a child of the pipeline run when there is one.

Uses `MlflowClient` with explicit run ids (no fluent "active run" state), so stages running in
Prefect's worker threads never log into each other's runs. Metrics are buffered and written in
batches: a per-step `log_metric` against SQLite would cost more than a tiny model's step.

Defaults: tracking URI `sqlite:///<project root>/mlflow.db`, artifacts under `mlartifacts/`,
experiment `qllm`. `MLFLOW_TRACKING_URI` and `MLFLOW_EXPERIMENT_NAME` override them.

Several `qllm run`s may share one SQLite store: MLflow's own sessions wait up to 20 s for another
writer (`PRAGMA busy_timeout`), and the first use of a new database is serialised by a file lock
(`client`). A run can be continued (`run(..., resume_run_id=...)`, used for stages
resumed from a checkpoint): it is set back to RUNNING and keeps its id, and metrics already logged
at a step are not logged again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipelines.core.errors import QllmError, StopRequested, stop_requested
from pipelines.core.outputs import flatten
from pipelines.core.workspace import project_root

log = logging.getLogger("qllm.tracking")

PARENT_RUN_ENV = "QLLM_PARENT_RUN_ID"
DEFAULT_EXPERIMENT = "qllm"
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
"""Marks the experiment as model training (runs, not GenAI traces). MLflow 3's UI reads its own
GenAI/model-training switch first (browser storage, GenAI in a fresh browser), so a plain link to
the experiment still opens its GenAI Overview page; `ui_runs_url` opens the runs."""

_clients: dict[str, Any] = {}
_clients_lock = threading.Lock()
_dataset_lock = threading.Lock()  # stages of one flow run side by side log the same inputs
_pins_lock = threading.Lock()  # check_pins_directly installs its check once
_fluent_lock = threading.RLock()  # MLflow's fluent URIs, active model and last logged model are process-wide


def tracking_uri(root: Path | str = ".") -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{project_root(root) / 'mlflow.db'}"


def experiment_name() -> str:
    return os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT


def client(root: Path | str = ".", uri: str | None = None) -> Any:
    """A cached `MlflowClient` (of `uri`, default the project's); the first use of a fresh SQLite
    store runs its migrations once, under a file lock so concurrent runs do not migrate the same
    database twice."""
    uri = uri or tracking_uri(root)
    with _clients_lock:
        if uri not in _clients:
            from mlflow import MlflowClient

            if uri.startswith("sqlite:///"):
                from filelock import FileLock

                db = Path(uri.removeprefix("sqlite:///"))
                db.parent.mkdir(parents=True, exist_ok=True)
                with FileLock(str(db) + ".lock"):
                    mlflow_client = MlflowClient(tracking_uri=uri, registry_uri=uri)
                    mlflow_client.search_experiments(max_results=1)  # runs migrations on a new DB
            else:
                mlflow_client = MlflowClient(tracking_uri=uri)
            _clients[uri] = mlflow_client
        return _clients[uri]


def run_status(root: Path | str, run_id: str) -> str | None:
    """The status of run `run_id` (RUNNING, FINISHED, FAILED, KILLED...), None if it does not
    exist or was deleted."""
    from mlflow.exceptions import MlflowException

    try:
        info = client(root).get_run(run_id).info
    except MlflowException:
        return None
    return info.status if info.lifecycle_stage == "active" else None


def experiment_id(root: Path | str = ".", uri: str | None = None) -> str:
    """Id of the tracking experiment (in `uri`, default the project's), created on first use
    (artifacts under `mlartifacts/`)."""
    uri = uri or tracking_uri(root)
    mlflow_client = client(root, uri)
    name = experiment_name()
    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.tags.get(EXPERIMENT_KIND_TAG) is None:  # made before the tag, or by someone else
            mlflow_client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return experiment.experiment_id
    location = None
    if uri.startswith("sqlite:"):
        location = (project_root(root) / "mlartifacts").as_uri()
    try:
        return mlflow_client.create_experiment(name, artifact_location=location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    except Exception:  # created concurrently by another run
        return mlflow_client.get_experiment_by_name(name).experiment_id


def ui_runs_url(ui_url: str, experiment: str) -> str:
    """The MLflow UI's runs table of `experiment`: `workflowType=machine_learning` sets the UI's
    GenAI/model-training switch, which otherwise opens the experiment on its GenAI Overview page in
    a fresh browser (MLflow 3.x; the UI keeps the choice afterwards)."""
    return f"{ui_url.rstrip('/')}/#/experiments/{experiment}?workflowType=machine_learning"


class Tracker:
    """Logs to one MLflow run. `Tracker(None)` logs nothing (unit tests, disabled tracking)."""

    def __init__(
        self,
        mlflow_client: Any | None,
        run_id: str | None,
        flush_seconds: float = 2.0,
        logged: Mapping[str, set[int]] | None = None,
        root: Path | None = None,
    ):
        self.client = mlflow_client
        self.run_id = run_id
        self.root = root
        """The project root the run belongs to (where `tensorboard/` goes); None for `Tracker(None)`."""
        self._buffer: list[Any] = []
        self._last_flush = time.monotonic()
        self._flush_seconds = flush_seconds
        # A continued run: the steps each metric already has (re-logged steps are skipped).
        self._logged = dict(logged or {})

    @property
    def enabled(self) -> bool:
        return self.client is not None

    def log_params(self, params: Mapping[str, Any] | Any) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Param

        flat = flatten(params)
        items = [Param(key, str(value)[:6000]) for key, value in flat.items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Buffer metrics; they are written every few seconds and when the run ends."""
        if not self.enabled:
            return
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), step or 0
        fresh = {key: value for key, value in metrics.items() if step not in self._logged.get(key, ())}
        self._buffer.extend(Metric(key, float(value), now, step) for key, value in fresh.items())
        if time.monotonic() - self._last_flush > self._flush_seconds:
            self.flush()

    def flush(self) -> None:
        if not self.enabled or not self._buffer:
            return
        buffer, self._buffer = self._buffer, []
        for start in range(0, len(buffer), 1000):
            self.client.log_batch(self.run_id, metrics=buffer[start : start + 1000])
        self._last_flush = time.monotonic()

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        if self.enabled:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_artifacts(self, path: Path | str, artifact_path: str | None = None) -> None:
        if self.enabled:
            self.client.log_artifacts(self.run_id, str(path), artifact_path)

    def log_dict(self, data: Any, artifact_file: str) -> None:
        if self.enabled:
            self.client.log_dict(self.run_id, data, artifact_file)

    def log_table(self, data: Any, artifact_file: str) -> None:
        if self.enabled:
            self.client.log_table(self.run_id, data, artifact_file)

    def log_datasets(self, datasets: list[tuple[Path | str, str, str]], context: str) -> None:
        """Record data sets, each `(path, DVC md5, name)`, with the md5 as the digest (so MLflow and
        `dvc.lock` agree), in one request: `log_inputs` takes a list, and a stage's five or so
        inputs were a round trip each to a tracking server (the team's: behind TLS and basic auth)."""
        if not self.enabled or not datasets:
            return
        from mlflow.entities import DatasetInput, InputTag

        entities = [DatasetInput(_dataset(path, digest, name)._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)])
                    for path, digest, name in datasets]  # fmt: skip
        with _dataset_lock:
            try:
                self.client.log_inputs(self.run_id, datasets=entities)
            except Exception as err:  # noqa: BLE001 - MLflow wraps the store's IntegrityError
                # The store's get-or-create of a dataset row is not atomic: a stage in another
                # process logging the same (name, digest) at the same moment wins the insert and
                # ours fails, with none of the list linked (one transaction). The row exists now,
                # so the second call links them all. SQLite and PostgreSQL (a team's server) word it apart.
                if not any(words in str(err) for words in ("UNIQUE constraint failed", "duplicate key value violates unique constraint")):
                    raise
                self.client.log_inputs(self.run_id, datasets=entities)


def _dataset(path: Path | str, digest: str, name: str) -> Any:
    """An MLflow dataset of the file or directory `path`, named `name`, with `digest`."""
    import warnings

    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    with warnings.catch_warnings():  # "can be interpreted in multiple ways": both are local files
        warnings.simplefilter("ignore", UserWarning)
        dataset_source = resolve_dataset_source(str(Path(path).resolve()))
    return MetaDataset(dataset_source, name=name, digest=digest)


@contextmanager
def run(
    name: str,
    root: Path | str = ".",
    tags: Mapping[str, Any] | None = None,
    parent_run_id: str | None = None,
    resume_run_id: str | None = None,
) -> Iterator[Tracker]:
    """Start an MLflow run (child of `parent_run_id` or `$QLLM_PARENT_RUN_ID`), yield its tracker,
    and end it FINISHED, or FAILED if the block raises (KILLED if a stop request ended it:
    `pipelines.core.errors`).

    With `resume_run_id`, continue that run instead (a stage resumed from its checkpoint): it is
    set back to RUNNING, moved under the current parent run, tagged `qllm.resumes` (how many
    times), and its tracker skips metric steps the run already has, so the history continues at
    the resumed step without duplicates.
    """
    mlflow_client = client(root)
    all_tags = {"mlflow.runName": name, **(tags or {})}
    parent = parent_run_id or os.environ.get(PARENT_RUN_ENV)
    if parent:
        all_tags["mlflow.parentRunId"] = parent
    if resume_run_id:
        tracker = _continue(mlflow_client, resume_run_id, all_tags)
    else:
        created = mlflow_client.create_run(experiment_id(root), tags={k: str(v) for k, v in all_tags.items()}, run_name=name)
        tracker = Tracker(mlflow_client, created.info.run_id)
    tracker.root = project_root(root)
    with _open_lock:
        _open[tracker.run_id] = (mlflow_client, name, "qllm.stage" in all_tags)
    try:
        yield tracker
    except BaseException as exc:
        tracker.flush()
        mlflow_client.set_terminated(tracker.run_id, _failed_status(exc))
        raise
    finally:
        with _open_lock:
            _open.pop(tracker.run_id, None)
    tracker.flush()
    mlflow_client.set_terminated(tracker.run_id, "FINISHED")


_open: dict[str, tuple[Any, str, bool]] = {}
"""Runs of this process that `run` has started and not ended yet: run id -> (client, name, a stage's)."""
_open_lock = threading.Lock()


def _failed_status(exc: BaseException) -> str:
    """KILLED for a run a stop request ended (a stop signal's exception, or Prefect's termination
    signal while a stop is requested), FAILED for any other error."""
    stopped = isinstance(exc, (StopRequested, KeyboardInterrupt))
    return "KILLED" if stopped or (stop_requested() is not None and not isinstance(exc, Exception)) else "FAILED"


def open_runs(stages_only: bool = False) -> dict[str, str]:
    """The MLflow runs this process has open (`stages_only`: the stages', not a pipeline's or a
    sweep's): run id -> run name."""
    with _open_lock:
        return {run_id: name for run_id, (_, name, stage) in _open.items() if stage or not stages_only}


def end_open_runs(status: str = "FAILED") -> list[str]:
    """End every run this process still has open with `status` (the process is about to exit
    without unwinding them, e.g. its Prefect API is gone); returns their ids."""
    with _open_lock:
        runs = list(_open.items())
        _open.clear()
    for run_id, (mlflow_client, _, _) in runs:
        mlflow_client.set_terminated(run_id, status)
    return [run_id for run_id, _ in runs]


def _continue(mlflow_client: Any, run_id: str, tags: dict[str, Any]) -> Tracker:
    """Reopen run `run_id` (see `run`) and return a tracker that logs no step twice."""
    existing = mlflow_client.get_run(run_id)
    old_tags = existing.data.tags
    tags = {**tags, "qllm.resumes": int(old_tags.get("qllm.resumes", 0)) + 1}
    old_parent = old_tags.get("mlflow.parentRunId")
    if old_parent and old_parent != tags.get("mlflow.parentRunId"):
        tags["qllm.previous_parent_run_id"] = old_parent
    logged = {key: {m.step for m in mlflow_client.get_metric_history(run_id, key)} for key in existing.data.metrics}
    mlflow_client.update_run(run_id, status="RUNNING")
    tracker = Tracker(mlflow_client, run_id, logged=logged)
    tracker.set_tags(tags)
    log.info("continuing MLflow run %s (%s); it was %s", run_id, tags.get("mlflow.runName"), existing.info.status)
    return tracker


@contextmanager
def fluent_uris(uri: str) -> Iterator[None]:
    """Point MLflow's fluent API (`mlflow.start_run`, `mlflow.transformers.log_model`) at `uri`
    for the block, then put back what was there: `mlflow.set_tracking_uri` also exports
    MLFLOW_TRACKING_URI/MLFLOW_REGISTRY_URI, which would send every later run in this process
    (another project's included) to this store.

    One block at a time in a process: those URIs (and MLflow's last logged model) are global, so
    a sweep's two registers in threads would otherwise log into each other's store or reset it
    mid-`log_model` ("Run with id=... not found"). Re-entrant for one thread."""
    import mlflow

    with _fluent_lock:
        saved = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
        try:
            yield
        finally:
            mlflow.set_tracking_uri(saved["MLFLOW_TRACKING_URI"])
            mlflow.set_registry_uri(saved["MLFLOW_REGISTRY_URI"])
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def check_pins_directly() -> None:
    """Have MLflow check a logged model's pins against this environment by reading each pinned
    distribution's version, instead of mapping every installed distribution's files to its modules.

    `log_model` warns when a model's pip requirements do not match the installed packages
    (`mlflow.utils.environment.warn_dependency_requirement_mismatches`). To find each package's
    version it first maps every module of the environment to its distribution
    (`importlib.metadata.packages_distributions`: a `stat` of every file of every installed
    distribution, 0.8 s of CPU in each process that registers a model, capped to AVX2, in this
    project's environment of 339 distributions). The pins `register` writes are `name==version`,
    read from this environment: their versions come from `importlib.metadata.version` here in
    microseconds. Requirements of any other form (extras, markers, ranges, URLs), a pin whose
    distribution is not found, or one that does not match, go to MLflow's own check, which warns
    as before. Installed once per process; idempotent; MLflow versions without that function
    keep their own check."""
    import mlflow.utils.environment as environment

    with _pins_lock:
        original = getattr(environment, "warn_dependency_requirement_mismatches", None)
        if original is None or getattr(original, "_qllm_direct", False):
            return

        def warn_dependency_requirement_mismatches(model_requirements: list[str]) -> None:
            if not all(_pin_matches(requirement) for requirement in model_requirements):
                original(model_requirements)

        warn_dependency_requirement_mismatches._qllm_direct = True  # type: ignore[attr-defined]
        warn_dependency_requirement_mismatches.__wrapped__ = original  # type: ignore[attr-defined]
        environment.warn_dependency_requirement_mismatches = warn_dependency_requirement_mismatches


def _pin_matches(requirement: str) -> bool:
    """True when `requirement` is a plain `name==version` pin that the installed distribution
    `name` satisfies (a local version label such as `+cpu` ignored, as PEP 440 says)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import InvalidRequirement, Requirement

    try:
        parsed = Requirement(requirement)
    except InvalidRequirement:
        return False
    specifiers = list(parsed.specifier)
    if parsed.extras or parsed.marker or parsed.url or len(specifiers) != 1 or specifiers[0].operator != "==":
        return False
    try:
        return parsed.specifier.contains(version(parsed.name), prereleases=True)
    except PackageNotFoundError:
        return False


def filter_value(value: str, what: str = "value") -> str:
    """`value` quoted for an MLflow search filter (`name = 'qllm'`): in single quotes, or in double
    quotes when it holds a single quote. MLflow's filter grammar has no escape, so a value holding
    both kinds (or a control character) cannot be searched for: a `QllmError` naming `what`."""
    if any(ord(c) < 32 for c in value) or ("'" in value and '"' in value):
        raise QllmError(f"{what} {value!r}: MLflow's search filters cannot express a value with both quote kinds or control characters")
    return f'"{value}"' if "'" in value else f"'{value}'"
