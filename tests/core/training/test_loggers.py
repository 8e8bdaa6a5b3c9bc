"""Extensions named in params (`train.extensions`) and the loggers built on them: MLflow metrics,
TensorBoard event files, MLflow system metrics."""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest
from pydantic import ValidationError

from pipelines.core import extensions
from pipelines.core.errors import QllmError
from pipelines.core.params.training import DEFAULT_EXTENSIONS, TrainParams
from pipelines.core.run import tracking
from pipelines.core.training import loop
from pipelines.core.training.checkpoint import CheckpointManager
from tests.core.test_extensions import batches, val_fn
from tests.core.training.test_loop import cfg, tiny_model


class Counter(extensions.Extension):
    """A user extension named in params as `tests.core.training.test_loggers:Counter`, with a setting."""

    name = "counter"
    built: list[Counter] = []

    def __init__(self, context, every: int = 1):
        self.context, self.every, self.seen = context, every, []
        Counter.built.append(self)

    def on_step_end(self, state, metrics):
        if state.step % self.every == 0:
            self.seen.append(state.step)


def scalars(directory, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


@pytest.fixture()
def store(tmp_path, monkeypatch, mlflow_template_db):
    shutil.copy2(mlflow_template_db, tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return tmp_path


def test_params_name_extensions_with_settings_and_bad_entries_say_what_is_wrong():
    assert TrainParams().extensions == list(DEFAULT_EXTENSIONS) == ["mlflow_metrics", "tensorboard", "system_metrics"]
    with pytest.raises(ValidationError, match=r"unknown extension 'tensorbord'; built in: mlflow_metrics, tensorboard, system_metrics"):
        TrainParams(extensions=["tensorbord"])
    with pytest.raises(ValidationError, match=r"entry 1 \(system_metrics\): unknown setting\(s\) period; accepted: interval, max_interval"):
        TrainParams(extensions=["mlflow_metrics", {"name": "system_metrics", "period": 5}])
    with pytest.raises(ValidationError, match=r"cannot import extension 'no_such_package.mod:Thing' \(ModuleNotFoundError"):
        TrainParams(extensions=["no_such_package.mod:Thing"])
    with pytest.raises(ValidationError, match=r"'tests.core.training.test_loggers:scalars' is not a subclass of pipelines.core.extensions.Extension"):
        TrainParams(extensions=["tests.core.training.test_loggers:scalars"])
    with pytest.raises(ValidationError, match=r"an extension is listed twice"):
        TrainParams(extensions=["tensorboard", {"name": "tensorboard", "log_dir": "tb"}])
    with pytest.raises(ValidationError, match=r"expected an extension name or a mapping with 'name'"):
        TrainParams(extensions=[{"interval": 1}])
    with pytest.raises(QllmError, match=r"sft.train.extensions\[0\] \(system_metrics\): expected 0 < interval <= max_interval"):
        extensions.build([{"name": "system_metrics", "interval": 5, "max_interval": 1}], extensions.ExtensionContext("sft"), "sft.train.extensions")


def test_a_user_extension_named_in_params_runs_with_its_settings():
    Counter.built.clear()
    loop.train(tiny_model(), loop.causal_lm_loss, batches(), cfg(extensions=[{"name": "tests.core.training.test_loggers:Counter", "every": 2}]))
    [counter] = Counter.built
    assert counter.seen == [2, 4, 6] and counter.context.stage == "train" and counter.context.tracker is None


def test_loggers_write_the_same_curves_to_mlflow_and_tensorboard_and_sample_system_metrics(store):
    params = cfg(max_steps=8, log_every=2, eval_every=4, extensions=["mlflow_metrics", "tensorboard", {"name": "system_metrics", "interval": 0.05}])
    with tracking.run("pretrain", store) as tracker:
        loop.train(tiny_model(), loop.causal_lm_loss, batches(), params, val_fn=val_fn, tracker=tracker, desc="pretrain")
    client = tracking.client(store)
    history = {m.step: m.value for m in client.get_metric_history(tracker.run_id, "train/loss")}
    assert sorted(history) == [2, 4, 6, 8]
    events = store / "tensorboard" / "pretrain" / tracker.run_id
    # TensorBoard keeps a scalar in fp32: MLflow's float64 value rounded once, exactly
    assert scalars(events, "train/loss") == [(step, float(np.float32(history[step]))) for step in (2, 4, 6, 8)]
    assert [step for step, _ in scalars(events, "val/loss")] == [4, 8]
    metrics = client.get_run(tracker.run_id).data.metrics
    assert metrics["system/process_rss_megabytes"] > 10 and "system/cpu_utilization_percentage" in metrics
    assert [a.path for a in client.list_artifacts(tracker.run_id, "tensorboard")]  # the event files, also in MLflow


def test_no_loggers_log_nothing(store):
    with tracking.run("pretrain", store) as tracker:
        loop.train(tiny_model(), loop.causal_lm_loss, batches(), cfg(extensions=[]), tracker=tracker, desc="pretrain")
    assert tracking.client(store).get_run(tracker.run_id).data.metrics == {}
    assert not (store / "tensorboard").exists()


def test_a_resumed_run_continues_its_tensorboard_curves_without_doubled_steps(store):
    """Killed after step 5 with a checkpoint at step 3: the rerun continues the same MLflow run and
    event directory, and the steps 4-5 the dead run wrote are purged, not doubled."""

    def die(state, metrics):
        if state.step == 5:
            raise KeyboardInterrupt  # as a kill: no checkpoint at 5

    params = cfg(extensions=["mlflow_metrics", "tensorboard"])
    checkpoints = CheckpointManager(store / "ckpt", 2)
    with pytest.raises(KeyboardInterrupt), tracking.run("pretrain", store) as tracker:
        loop.train(tiny_model(), loop.causal_lm_loss, batches(), params, tracker=tracker, checkpoints=checkpoints,
                       extensions=[extensions.Hook("on_step_end", die)], desc="pretrain")  # fmt: skip
    with tracking.run("pretrain", store, resume_run_id=tracker.run_id) as resumed:
        loop.train(tiny_model(), loop.causal_lm_loss, batches(), params, tracker=resumed, checkpoints=checkpoints, desc="pretrain")
    events = store / "tensorboard" / "pretrain" / tracker.run_id
    assert [step for step, _ in scalars(events, "train/loss")] == [1, 2, 3, 4, 5, 6]
    # MLflow keeps the dead run's steps 4-5 beside the rerun's: the latest logged value of each step is
    # the one TensorBoard kept, in fp32 as above, exactly
    history = sorted(tracking.client(store).get_metric_history(tracker.run_id, "train/loss"), key=lambda m: (m.step, m.timestamp))
    mlflow_steps = {m.step: m.value for m in history}
    assert dict(scalars(events, "train/loss")) == {step: float(np.float32(value)) for step, value in mlflow_steps.items()}


def test_the_experiment_opens_on_its_training_runs(store):
    client = tracking.client(store)
    experiment = client.get_experiment(tracking.experiment_id(store))
    assert experiment.tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"


def test_peak_memory_measures_what_the_block_allocated():
    import psutil

    from pipelines.core.run.resources import PeakMemory, _high_water_mark

    rss = psutil.Process().memory_info().rss
    size = max(0, (_high_water_mark() or rss) - rss) + 200 * 2**20  # past the process's high-water mark
    with PeakMemory() as peak:
        block = np.ones(size, dtype=np.uint8)  # touched: resident
        del block
    assert peak.metrics()["peak_rss_mb"] >= (rss + size) / 2**20 * 0.95
    with PeakMemory(interval=0.01) as small:  # below the high-water mark: the sampled peak
        held = np.ones(50 * 2**20, dtype=np.uint8)
        time.sleep(0.1)
        del held
    assert rss / 2**20 * 0.9 <= small.metrics()["peak_rss_mb"] < peak.metrics()["peak_rss_mb"]
    # anonymous memory (Linux): the 50 MB block counts, a file mapped and read does not
    import mmap
    import tempfile

    with tempfile.TemporaryFile() as handle:
        handle.write(b"x" * (100 * 2**20))
        handle.flush()
        with PeakMemory(interval=0.01) as mapped:
            view = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            assert view[:: 4096].count(b"x") == 100 * 2**20 // 4096  # every page read: resident, as file cache
            time.sleep(0.1)
            view.close()
    assert small.peak_anonymous >= 50 * 2**20 and mapped.peak_anonymous < mapped.peak_rss
