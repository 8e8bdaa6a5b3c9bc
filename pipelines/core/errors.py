"""The one exception type users see without a traceback, and the stop request training honours.

A stop request is process-wide: the first SIGTERM/SIGINT (or Prefect's SIGTERM bridge, or a lost
Prefect API, through `ask_stop`) sets it, every training loop in the process (in any thread)
finishes its step, saves a checkpoint and raises, and no new stage starts. A second signal
interrupts at once (`interrupt_training`): the newest checkpoint stays.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


class QllmError(Exception):
    """An error the user can act on (bad input, bad params, missing file): printed as one clear
    message naming the file, line or key, with a non-zero exit code and no traceback."""


def stage_command(name: str, run: Callable[[str], object], argv: list[str] | None = None) -> int:
    """`python -m pipelines.<name> [--root DIR]`, what dvc.yaml runs: parse the arguments, log to
    stderr, `run(root)`; a `QllmError` is one `error:` line and exit code 1. Given no `argv` (the
    process's own command line), the process then ends without collecting (`exit_without_collecting`)."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m pipelines.{name}", description=f"Run the {name} stage.")
    parser.add_argument("--root", default=".", help="project (or run workspace) directory; default: cwd")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        run(args.root)
    except QllmError as exc:
        print(f"error: {name}: {exc}", file=sys.stderr)
        return 1
    finally:
        if argv is None:  # the process's own command line: it ends next
            exit_without_collecting()
    return 0


def exit_without_collecting() -> None:
    """Let the process that called this end without the collector's passes over what it imported.

    A stage or `qllm` process holds about 700,000 objects once torch, transformers, PEFT and MLflow
    are imported, and Python's finalization runs the cyclic collector over them while it tears the
    modules down: 2.4 s of every such process (0.6 s with torch alone; 2-core EPYC, measured in
    benchmarks/results/suite.md, eighth part). `gc.freeze()` moves them to the collector's permanent generation, so
    shutdown frees them by reference count alone (0.35 s). Everything else about the exit stays:
    atexit handlers, joins of non-daemon threads, flushes of open streams. Call it only where the
    process ends next (a command line's `main`): frozen objects are never collected afterwards."""
    gc.freeze()


class StopRequested(QllmError):
    """Work ended because a stop was requested (SIGTERM, SIGINT, a Prefect cancellation): training
    checkpointed its last finished step, or the stage did not start; a rerun continues."""


class InterruptedAtOnce(StopRequested):
    """Raised inside a training thread by a second stop signal (`interrupt_training`)."""

    def __init__(self, *args: object) -> None:  # raised by class (PyThreadState_SetAsyncExc): no arguments
        super().__init__(*(args or ("interrupted at once by a second stop signal; the newest checkpoint stays: "
                                    "rerun the same command to resume from it",)))  # fmt: skip


_stop: tuple[str, int | None] | None = None
"""(reason, signal number) once a stop was requested: every training loop in the process stops
after its current step."""

_training_threads: set[int] = set()
_lock = threading.Lock()


def request_stop(signum: int, frame=None) -> None:
    """The SIGTERM/SIGINT handler: the first signal asks running training loops to checkpoint and
    stop; a second one interrupts at once (KeyboardInterrupt here, `InterruptedAtOnce` in training
    threads). Training installs it while it runs in the main thread; `qllm run` installs it for
    the whole run, whose stages train in Prefect's task threads."""
    if _stop is not None:
        interrupt_training()
        raise KeyboardInterrupt
    ask_stop(signal.Signals(signum).name, signum)


def ask_stop(reason: str, signum: int | None = None) -> None:
    """Request the stop (without the second-signal rule): `reason` names it in every message,
    e.g. "SIGTERM" or "the Prefect API exited"."""
    global _stop
    if _stop is not None:
        return
    _stop = (reason, signum)
    logging.getLogger("qllm").warning("%s: training stops after the current step, with a checkpoint; no new stage starts", reason)


def stop_requested() -> str | None:
    """Why training was asked to stop ("SIGTERM", "SIGINT", ...), if it was."""
    return None if _stop is None else _stop[0]


def stop_signal() -> int | None:
    """The signal that asked training to stop, if a signal did."""
    return None if _stop is None else _stop[1]


def clear_stop() -> None:
    global _stop
    _stop = None


@contextmanager
def training_thread() -> Iterator[None]:
    """Mark the calling thread as running a training loop while the block runs, so that a second
    stop signal can interrupt it (`interrupt_training`) even when it is not the main thread."""
    ident = threading.get_ident()
    with _lock:
        _training_threads.add(ident)
    try:
        yield
    finally:
        with _lock:
            _training_threads.discard(ident)


def interrupt_training() -> int:
    """Raise `InterruptedAtOnce` in every training thread but the calling one, at its next Python
    instruction (as Prefect's own thread timeouts do); returns how many were interrupted. Only the
    main thread receives signals, so this is how a second signal reaches stages that train in
    worker threads. The newest checkpoint stays (each is renamed into place only when complete)."""
    with _lock:
        targets = [t for t in _training_threads if t != threading.get_ident()]
    for ident in targets:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(InterruptedAtOnce))
    return len(targets)


SHELLS = frozenset({"sh", "dash", "bash", "zsh", "ksh", "mksh", "ash", "fish", "busybox"})
"""Shells dvc may run a stage's command with (`$SHELL -c CMD`, or `/bin/sh -c CMD` without $SHELL)."""


def stop_when_parent_dies(reason: str = "the parent process (dvc repro) exited") -> None:
    """Ask for a stop (`ask_stop(reason)`) when the parent process dies (Linux: PR_SET_PDEATHSIG),
    so that a stage run by `dvc repro` checkpoints and stops when dvc is killed: dvc passes no
    SIGTERM on to its stage (Ctrl-C reaches both through the terminal's process group).

    dvc runs the command through a shell (`$SHELL -c CMD`, `/bin/sh -c CMD` when $SHELL is unset).
    bash and zsh exec a single command, so dvc is the parent; dash (Debian's /bin/sh) does not,
    and the shell, which outlives dvc, is. When the parent is such a shell, the shell's parent is
    watched as well (`watch_exit`).

    The kernel sends the parent-death signal again each time the orphan is handed to another
    thread of the dying parent, so it is SIGUSR1 with an idempotent handler, not SIGTERM (whose
    second delivery would interrupt the checkpoint). Call from the main thread. Elsewhere: nothing.
    """
    if sys.platform != "linux":
        return
    signal.signal(signal.SIGUSR1, lambda signum, frame: ask_stop(reason, signal.SIGTERM))
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGUSR1)  # 1 = PR_SET_PDEATHSIG
    parent = os.getppid()
    if _is_shell_wrapper(parent):
        watch_exit(_parent_of(parent), lambda: os.kill(os.getpid(), signal.SIGUSR1))


def _is_shell_wrapper(pid: int) -> bool:
    """Whether process `pid` is a shell running one command string (`sh -c CMD`)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    except OSError:
        return False
    return len(argv) >= 3 and argv[-2] == b"-c" and os.path.basename(argv[0].decode(errors="replace")).lstrip("-") in SHELLS


def _parent_of(pid: int) -> int:
    """The parent of process `pid` (from /proc: the command may contain spaces and parentheses)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def watch_exit(pid: int, then: Callable[[], None], poll: float = 1.0) -> threading.Thread:
    """Call `then()` from a daemon thread when process `pid` exits: at once through a pidfd
    (Linux 5.3+), else by polling /proc every `poll` seconds (an unreaped process counts as exited)."""

    def exited() -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        return state[state.rindex(")") + 2] in "ZX"

    def wait() -> None:
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            while not exited():
                time.sleep(poll)
        else:
            try:
                select.select([fd], [], [])
            finally:
                os.close(fd)
        then()

    thread = threading.Thread(target=wait, name=f"watch-exit-{pid}", daemon=True)
    thread.start()
    return thread
