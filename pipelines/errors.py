"""The one exception type users see without a traceback, and the stop request training honours."""

from __future__ import annotations

import logging
import signal


class QllmError(Exception):
    """An error the user can act on (bad input, bad params, missing file): printed as one clear
    message naming the file, line or key, with a non-zero exit code and no traceback."""


_stop_signal: int | None = None
"""Set by `request_stop`: every training loop in the process stops after its current step."""


def request_stop(signum: int, frame=None) -> None:
    """A SIGTERM/SIGINT handler: ask running training loops to checkpoint and stop (a second signal
    interrupts at once). Training installs it while it runs in the main thread; `qllm run`
    installs it for the whole run, whose stages train in Prefect's task threads."""
    global _stop_signal
    if _stop_signal is not None:
        raise KeyboardInterrupt
    _stop_signal = signum
    logging.getLogger("qllm").warning("%s received: training stops after the current step, with a checkpoint", signal.Signals(signum).name)


def stop_requested() -> int | None:
    """The signal that asked training to stop, if any."""
    return _stop_signal


def clear_stop() -> None:
    global _stop_signal
    _stop_signal = None
