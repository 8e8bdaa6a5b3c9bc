"""The metric loggers of the training loop, as extensions (`train.extensions`, on by default).

- `mlflow_metrics`: the metrics the loop reports (training every `log_every` steps, validation
  after each evaluation) to the stage's MLflow run, buffered and flushed before each checkpoint.
- `tensorboard`: the same metrics as TensorBoard event files, one directory per stage run:
  `tensorboard/<stage>/<MLflow run id>` under the project root (`tensorboard --logdir tensorboard`
  shows every stage's curves side by side); at the end the directory is also logged to the MLflow
  run (artifact path `tensorboard`). A resumed run writes on in the same directory and purges the
  events past its checkpoint, so its curves have no doubled steps.
- `system_metrics`: MLflow's system metrics (`system/cpu_utilization_percentage`,
  `system/system_memory_usage_megabytes`, disk, network, and per-GPU utilisation and memory where
  `nvidia-ml-py` finds an NVIDIA GPU) plus this process's resident memory
  (`system/process_rss_megabytes`), sampled by a thread. The interval starts at `interval` seconds
  and doubles after each sample up to `max_interval`, so a stage of seconds gets a few points and a
  stage of hours one a minute, not thousands.

Loggers log on rank 0 only (the other ranks' tracker is None) and log nothing when the stage has no
MLflow run (a direct `loop.train` call without a tracker, unless `tensorboard.log_dir` is set).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from pipelines.core.extensions import Extension, ExtensionContext

log = logging.getLogger("qllm.loggers")

TENSORBOARD_DIR = "tensorboard"
"""Under the project root: `<stage>/<run id>` per stage run."""


def _tracking(context: ExtensionContext) -> Any:
    """The stage's tracker if it logs somewhere, else None (any object with `log_metrics` and
    `flush` serves, e.g. a test's recorder)."""
    tracker = context.tracker
    return tracker if tracker is not None and getattr(tracker, "enabled", True) else None


def _mlflow_run(context: ExtensionContext) -> Any:
    """The stage's tracker if it is an MLflow run (`pipelines.core.run.tracking.Tracker`), else None."""
    tracker = _tracking(context)
    return tracker if getattr(tracker, "client", None) is not None and getattr(tracker, "run_id", None) else None


class MlflowMetrics(Extension):
    name = "mlflow_metrics"

    def __init__(self, context: ExtensionContext) -> None:
        self.tracker = _tracking(context)

    def on_log(self, state, metrics: dict[str, float], step: int) -> None:
        if self.tracker is not None:
            self.tracker.log_metrics(metrics, step=step)

    def on_save(self, state, best: bool) -> None:
        if self.tracker is not None:
            self.tracker.flush()  # the run's metrics reach the checkpoint's step before it is written

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.flush()


class TensorBoard(Extension):
    name = "tensorboard"

    def __init__(self, context: ExtensionContext, log_dir: str | None = None) -> None:
        self.tracker = _mlflow_run(context)
        self.writer = None
        if log_dir is not None:  # relative to the project root
            self.directory: Path | None = (context.root or Path.cwd()) / log_dir / context.stage
        elif self.tracker is not None and context.root is not None:
            self.directory = context.root / TENSORBOARD_DIR / context.stage / self.tracker.run_id
        else:
            self.directory = None

    def on_train_begin(self, state) -> None:
        if self.directory is None:
            return
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run drops the events a previous attempt wrote past its checkpoint
        self.writer = SummaryWriter(str(self.directory), purge_step=state.step + 1 if state.step else None, flush_secs=30)

    def on_log(self, state, metrics: dict[str, float], step: int) -> None:
        if self.writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)

    def on_save(self, state, best: bool) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is None:
            return
        self.writer.close()
        self.writer = None
        if self.tracker is not None:
            self.tracker.log_artifacts(self.directory, TENSORBOARD_DIR)


class SystemMetrics(Extension):
    name = "system_metrics"

    def __init__(self, context: ExtensionContext, interval: float = 1.0, max_interval: float = 60.0) -> None:
        if not 0 < interval <= max_interval:
            raise ValueError(f"expected 0 < interval <= max_interval, got interval {interval}, max_interval {max_interval}")
        self.tracker = _mlflow_run(context)
        self.interval, self.max_interval = float(interval), float(max_interval)
        self.monitor = None

    def on_train_begin(self, state) -> None:
        if self.tracker is None:
            return
        self.monitor = _monitor(self.tracker, self.interval, self.max_interval)
        self.monitor.start()

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.finish()
            self.monitor = None


def _monitor(tracker, interval: float, max_interval: float):
    """MLflow's `SystemMetricsMonitor` on the tracker's run, with a doubling interval and this
    process's resident memory; it continues the step count of a resumed run."""
    import psutil
    from mlflow.system_metrics.metrics.base_metrics_monitor import BaseMetricsMonitor
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    class ProcessMemory(BaseMetricsMonitor):
        def __init__(self) -> None:
            super().__init__()
            self.process = psutil.Process()

        def collect_metrics(self) -> None:
            self._metrics["process_rss_megabytes"].append(self.process.memory_info().rss / 2**20)

        def aggregate_metrics(self) -> dict[str, float]:
            return {key: round(sum(values) / len(values), 1) for key, values in self._metrics.items() if values}

    class Monitor(SystemMetricsMonitor):
        samples = 0

        def collect_metrics(self):  # the loop waits `sampling_interval` after each sample
            metrics = super().collect_metrics()
            if self.samples:
                self.sampling_interval = min(self.sampling_interval * 2, max_interval)
            self.samples += 1
            return metrics

        def finish(self):
            super().finish()
            # the loop drops the samples of its last, unfinished interval (all of a stage shorter than
            # `interval`): publish them, so that every run has at least one point
            if any(monitor.metrics for monitor in self.monitors):
                self.publish_metrics(self.aggregate_metrics())
                self.mlflow_logger.flush()

    monitor = Monitor(tracker.run_id, sampling_interval=interval, resume_logging=True, tracking_uri=tracker.client.tracking_uri)
    monitor.monitors.append(ProcessMemory())
    return monitor
