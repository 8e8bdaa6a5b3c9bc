"""The peak memory of a stage, for its metrics file: resident memory, and CUDA memory where used.

    with PeakMemory() as peak:
        ...                                   # the stage body
    peak.metrics()  # {"peak_rss_mb": 812.4} (+ "peak_cuda_allocated_mb" on a CUDA device)

Resident memory: Linux keeps the process's high-water mark (`VmHWM` in /proc/self/status). If it
rose during the block, the block set it: that value is exact. If it did not (an earlier stage of
the same process went higher), the peak is the largest of the samples a thread takes every
`interval` seconds (psutil, any OS). A stage run alone (`dvc repro`, `python -m pipelines.<stage>`)
is its own process; stages that `qllm run` runs side by side share one, and each reports the
process's peak while it ran. CUDA: `torch.cuda.max_memory_allocated` over the block, on every
device, if torch is already imported and a CUDA device is there.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import psutil

_STATUS = Path("/proc/self/status")


def _status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status (`VmHWM`, `RssAnon`) in bytes (Linux), else None."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _high_water_mark() -> int | None:
    """VmHWM in bytes (Linux), else None."""
    return _status_bytes("VmHWM")


def _cuda():
    """`torch.cuda` if torch is imported (a stage that never imported it used no CUDA memory) and a
    CUDA device is there. Another thread may be importing torch right now: then it is not yet ours."""
    try:
        cuda = sys.modules["torch"].cuda
        return cuda if cuda.is_available() else None
    except (KeyError, AttributeError):
        return None


class PeakMemory:
    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.process = psutil.Process()
        self.sampled = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="qllm-peak-memory", daemon=True)
        self._hwm_before: int | None = None
        self.peak_rss = 0
        self.peak_cuda: int | None = None
        self.peak_anonymous = 0
        """The largest sampled `RssAnon` (Linux): resident memory less the file pages mapped (a
        memory-mapped checkpoint's), which the kernel can drop; what decides whether a job fits."""

    def _sample(self) -> None:
        while True:
            self.sampled = max(self.sampled, self.process.memory_info().rss)
            self.peak_anonymous = max(self.peak_anonymous, _status_bytes("RssAnon") or 0)
            if self._done.wait(self.interval):
                return

    def __enter__(self) -> PeakMemory:
        self._hwm_before = _high_water_mark()
        if (cuda := _cuda()) is not None and cuda.is_initialized():  # else its counters start with it
            for device in range(cuda.device_count()):
                cuda.reset_peak_memory_stats(device)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.sampled = max(self.sampled, self.process.memory_info().rss)
        self.peak_anonymous = max(self.peak_anonymous, _status_bytes("RssAnon") or 0)
        hwm = _high_water_mark()
        self.peak_rss = hwm if hwm is not None and self._hwm_before is not None and hwm > self._hwm_before else self.sampled
        if (cuda := _cuda()) is not None and cuda.is_initialized():
            self.peak_cuda = max(cuda.max_memory_allocated(device) for device in range(cuda.device_count()))

    def metrics(self) -> dict[str, float]:
        out = {"peak_rss_mb": round(self.peak_rss / 2**20, 1)}
        if self.peak_cuda is not None:
            out["peak_cuda_allocated_mb"] = round(self.peak_cuda / 2**20, 1)
        return out
