"""How the data stages spread their batches over processes: local workers or a Dask cluster.

    from pipelines.core import parallel
    with parallel.Pool() as pool:
        for result in pool.map(work, batches):     # results in the order of `batches`
            ...

`work` must be a module-level function (it is pickled to the workers) and its result depends on
its argument only, so a stage's outputs are the same bytes whatever runs it: one process, N local
processes or a cluster. At most `window` batches are in flight at once (default: twice the
workers), so memory stays bounded however long `batches` is.

Settings are environment variables, not params: they change how a stage computes, never what it
writes, so changing them must not make DVC rerun a stage.

- `QLLM_DATA_WORKERS`: worker processes (default: the cores this process may use). 1 runs
  everything in the stage's own process; so does any map over a single batch.
- `QLLM_DATA_ENGINE`: `local` (default: `concurrent.futures` processes, started by forkserver so a
  multi-threaded parent is never forked) or `dask`: a `distributed.Client` to the scheduler at
  `QLLM_DASK_ADDRESS` (e.g. `tcp://10.0.0.5:8786`), else Dask's own `scheduler-address` setting
  (`DASK_SCHEDULER_ADDRESS`), else a `LocalCluster` of `QLLM_DATA_WORKERS` processes on
  127.0.0.1 that lives as long as the pool. Cluster workers need this project importable
  (`pip install -e .` in their environment) and receive the batches themselves, so they need no
  access to the project's files.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pipelines.core.errors import QllmError

WORKERS_ENV = "QLLM_DATA_WORKERS"
ENGINE_ENV = "QLLM_DATA_ENGINE"
ADDRESS_ENV = "QLLM_DASK_ADDRESS"
ENGINES = ("local", "dask")


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def workers_setting() -> int:
    raw = os.environ.get(WORKERS_ENV, "").strip()
    if not raw:
        return available_cores()
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise QllmError(f"${WORKERS_ENV}={raw!r}: expected a whole number of worker processes >= 1")
    return value


def engine_setting() -> str:
    value = os.environ.get(ENGINE_ENV, "").strip().lower() or "local"
    if value not in ENGINES:
        raise QllmError(f"${ENGINE_ENV}={value!r}: expected one of {', '.join(ENGINES)}")
    return value


class Pool:
    """Ordered, bounded parallel map over local processes or a Dask cluster (module docstring)."""

    def __init__(self, workers: int | None = None, engine: str | None = None, window: int | None = None):
        self.workers = workers or workers_setting()
        self.engine = engine or engine_setting()
        self.window = window or 2 * self.workers
        self._executor = None
        self._client = None
        self._cluster = None

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None

    @property
    def description(self) -> str:
        if self.engine == "dask":
            address = os.environ.get(ADDRESS_ENV) or _dask_config_address()
            return f"dask ({address or f'local cluster of {self.workers} processes on 127.0.0.1'})"
        return "1 process" if self.workers == 1 else f"{self.workers} local processes"

    def _submit_fn(self) -> Callable[..., Any]:
        if self.engine == "dask":
            if self._client is None:
                self._client = self._connect()
            return lambda fn, item: self._client.submit(fn, item, pure=False)
        if self._executor is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            context = multiprocessing.get_context("forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn")
            self._executor = ProcessPoolExecutor(max_workers=self.workers, mp_context=context)
        return self._executor.submit

    def _connect(self):
        try:
            from distributed import Client, LocalCluster
        except ImportError:
            raise QllmError(f"${ENGINE_ENV}=dask needs Dask's scheduler: pip install -e '.[dask]'") from None
        address = os.environ.get(ADDRESS_ENV) or _dask_config_address()
        if address:
            try:
                return Client(address, timeout=30)
            except OSError as exc:
                raise QllmError(f"cannot reach the Dask scheduler at {address} (${ADDRESS_ENV}): {exc}") from None
        self._cluster = LocalCluster(n_workers=self.workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                                     dashboard_address=None, silence_logs=logging.ERROR)  # fmt: skip
        return Client(self._cluster)

    # -- the map ---------------------------------------------------------------------------

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any], serial: bool = False) -> Iterator[Any]:
        """`fn(item)` for every item, yielded in the order of `items`. Runs in this process when
        there is one worker or one item, or with `serial` (work too small to pay for starting
        workers); an exception in a worker is raised here, as is."""
        items = iter(items)
        first = next(items, _END)
        if first is _END:
            return
        second = next(items, _END)
        if serial or second is _END or (self.workers == 1 and self.engine == "local"):
            yield fn(first)
            if second is not _END:
                yield fn(second)
                for item in items:
                    yield fn(item)
            return
        submit = self._submit_fn()
        pending: deque = deque()
        for item in _chain(first, second, items):
            pending.append(submit(fn, item))
            if len(pending) >= self.window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


_END = object()


def _chain(first: Any, second: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield second
    yield from rest


def _dask_config_address() -> str | None:
    try:
        import dask
    except ImportError:
        return None
    return dask.config.get("scheduler-address", None)
