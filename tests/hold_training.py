"""A training-loop extension for tests that must act while training runs: it holds the loop at a
known step until a stop is requested, so the test waits on that state instead of racing the clock.

    {name: "tests.hold_training:HoldAtStep", step: 20, marker: held}   # an entry of <stage>.train.extensions

When `step` steps are done (or at the first end of a step after that) it writes `marker` (the step; a relative
path is relative to the project the stage runs in) and waits until
a stop is requested (SIGTERM, a Prefect cancellation: `pipelines.core.errors.stop_requested`); the
loop then checkpoints and stops as it would anywhere else. It holds once: with `marker` present
(a resumed run) it does nothing. `limit` seconds bound the wait, so a test that never sends the
stop fails instead of hanging. A stage process imports it as `tests.hold_training` with the
repository on its PYTHONPATH, or, where a test cannot set that (a Prefect worker's flow runs), as
`hold_training` from its working directory, where `install` copies this file.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from pipelines.core.errors import stop_requested
from pipelines.core.extensions import Extension

MODULE = "hold_training"


def install(directory: Path) -> str:
    """Copy this module into `directory` (a flow run's working directory); the extension's name."""
    shutil.copy(__file__, Path(directory) / f"{MODULE}.py")
    return f"{MODULE}:HoldAtStep"


class HoldAtStep(Extension):
    name = "hold_at_step"

    def __init__(self, context, step: int, marker: str, limit: float = 600.0):
        marker = Path(marker)
        self.step, self.limit = int(step), float(limit)
        self.marker = marker if marker.is_absolute() or context.root is None else Path(context.root) / marker

    def on_step_end(self, state, metrics) -> None:
        if state.step < self.step or self.marker.exists():
            return
        self.marker.write_text(str(state.step))
        deadline = time.monotonic() + self.limit
        while stop_requested() is None and time.monotonic() < deadline:
            time.sleep(0.05)
