"""The stage graph, read from `dvc.yaml` (the one place it is defined), and DVC-compatible hashes.

Everything else derives from here: the Prefect flow's tasks and their order, `--until`, run
workspaces. No Prefect import (flows and tasks build on this module, not the other way round).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipelines.core import dvc_api
from pipelines.core.errors import QllmError

DVC_FILE = "dvc.yaml"
METRICS_DIR = "data/metrics"
"""Every stage writes its metrics to `METRICS_DIR/<stage>.json` (its `dvc.yaml` `metrics` entry)."""


MODELS_MODULE = "pipelines/core/models/models.py"
"""A stage that lists it among its deps loads models (torch, transformers)."""


def metrics_file(name: str) -> str:
    """The metrics file of stage `name`, relative to the workspace."""
    return f"{METRICS_DIR}/{name}.json"


class DagError(QllmError, ValueError):
    """`dvc.yaml` is malformed or a stage name is unknown."""


@dataclass(frozen=True)
class Stage:
    """One `dvc.yaml` stage: what it runs, reads and writes."""

    name: str
    cmd: str
    deps: tuple[str, ...]
    params: tuple[str, ...]
    outs: tuple[str, ...]
    metrics: tuple[str, ...]
    plots: tuple[str, ...]
    always_changed: bool = False
    """Runs on every `dvc repro` (a stage that reads the world outside the repository)."""

    @property
    def module(self) -> str:
        """The `pipelines` module the stage runs (`python -m pipelines.<name>`)."""
        prefix = "python -m "
        if not self.cmd.startswith(prefix):
            raise DagError(f"{DVC_FILE}: stage {self.name}: cmd must be 'python -m pipelines.<stage>', got {self.cmd!r}")
        return self.cmd[len(prefix) :].split()[0]

    @property
    def all_outs(self) -> tuple[str, ...]:
        return self.outs + self.metrics + self.plots


def _paths(entries: Iterable, stage: str, field: str) -> tuple[str, ...]:
    paths = []
    for entry in entries or ():
        if isinstance(entry, str):
            paths.append(entry)
        elif isinstance(entry, dict) and len(entry) == 1:
            paths.append(next(iter(entry)))
        else:
            raise DagError(f"{DVC_FILE}: stage {stage}: unexpected {field} entry {entry!r}")
    return tuple(paths)


def _params(entries: Iterable, stage: str) -> tuple[str, ...]:
    keys: list[str] = []
    for entry in entries or ():
        if isinstance(entry, str):
            keys.append(entry)
        elif isinstance(entry, dict):
            for file, file_keys in entry.items():
                if file != "params.yaml":
                    raise DagError(f"{DVC_FILE}: stage {stage}: params must come from params.yaml, not {file}")
                keys.extend(file_keys or ())
        else:
            raise DagError(f"{DVC_FILE}: stage {stage}: unexpected params entry {entry!r}")
    return tuple(keys)


FAST_YAML = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""PyYAML's safe loader on libyaml where it is built in, else the pure-Python one: the same values."""


def load_yaml(text: str) -> Any:
    """`yaml.safe_load(text)`, on libyaml where PyYAML has it: 14 ms instead of 99 ms for the tiny
    profile's 60 kB dvc.lock (4 ms instead of 25 ms for params.yaml), the same values. For the files
    the pipeline and DVC write and validate (dvc.yaml, dvc.lock, params.yaml once loaded), read by
    every run, stage and lineage; users' files go through `params_file.read_yaml`, whose errors
    name the line in the pure-Python loader's words."""
    return yaml.load(text, Loader=FAST_YAML)


@functools.lru_cache(maxsize=8)
def _load(path: Path, mtime_ns: int) -> dict[str, Stage]:
    data = load_yaml(path.read_text(encoding="utf-8")) or {}
    stages = data.get("stages")
    if not isinstance(stages, dict) or not stages:
        raise DagError(f"{path}: expected a non-empty 'stages' mapping")
    out = {}
    for name, body in stages.items():
        if not isinstance(body, dict) or "cmd" not in body:
            raise DagError(f"{path}: stage {name}: expected a mapping with 'cmd'")
        out[name] = Stage(
            name=name,
            cmd=body["cmd"],
            deps=_paths(body.get("deps"), name, "deps"),
            params=_params(body.get("params"), name),
            outs=_paths(body.get("outs"), name, "outs"),
            metrics=_paths(body.get("metrics"), name, "metrics"),
            plots=_paths(body.get("plots"), name, "plots"),
            always_changed=bool(body.get("always_changed", False)),
        )
    return out


def stages(root: Path | str = ".") -> dict[str, Stage]:
    """All stages of `<root>/dvc.yaml`, in file order."""
    path = (Path(root) / DVC_FILE).resolve()
    if not path.exists():
        raise DagError(f"{path}: not found (run from the project root)")
    return _load(path, path.stat().st_mtime_ns)


def covers(out: str, dep: str) -> bool:
    """Whether the output path `out` (a file or directory) provides the dependency path `dep`."""
    return dep == out or dep.startswith(out.rstrip("/") + "/")


def upstream(root: Path | str, name: str) -> list[str]:
    """Stages whose outputs `name` depends on (direct parents)."""
    graph = stages(root)
    stage = graph[name]
    return [
        other.name
        for other in graph.values()
        if other.name != name and any(covers(out, dep) for out in other.all_outs for dep in stage.deps)
    ]


def downstream(root: Path | str, name: str) -> set[str]:
    """Every stage that depends, directly or not, on the outputs of `name`."""
    graph = stages(root)
    if name not in graph:
        raise DagError(f"unknown stage {name!r}; stages are: {', '.join(graph)}")
    children: dict[str, list[str]] = {n: [] for n in graph}
    for child in graph:
        for parent in upstream(root, child):
            children[parent].append(child)
    found, todo = set(), list(children[name])
    while todo:
        child = todo.pop()
        if child not in found:
            found.add(child)
            todo.extend(children[child])
    return found


def order(root: Path | str = ".", until: str | list[str] | None = None) -> list[str]:
    """Stages in a topological order (file order among independent ones), optionally only
    `until` (a stage, or several, as `dvc repro A B` takes targets) and their ancestors."""
    graph = stages(root)
    targets = [until] if isinstance(until, str) else list(until or [])
    for target in targets:
        if target not in graph:
            raise DagError(f"unknown stage {target!r}; stages are: {', '.join(graph)}")
    parents = {name: upstream(root, name) for name in graph}
    wanted = set(graph)
    if targets:
        wanted, todo = set(), list(targets)
        while todo:
            name = todo.pop()
            if name not in wanted:
                wanted.add(name)
                todo.extend(parents[name])
    done: list[str] = []
    while len(done) < len(wanted):
        ready = [n for n in graph if n in wanted and n not in done and all(p in done for p in parents[n] if p in wanted)]
        if not ready:
            raise DagError(f"{DVC_FILE}: the stages {sorted(wanted - set(done))} form a cycle")
        done.append(ready[0])
    return done


def source_paths(root: Path | str = ".") -> list[str]:
    """Dependencies that no stage produces: code and raw data, the inputs of the whole DAG."""
    graph = stages(root)
    produced = [out for stage in graph.values() for out in stage.all_outs]
    paths = {dep for stage in graph.values() for dep in stage.deps if not any(covers(out, dep) for out in produced)}
    return sorted(paths)


def dvc_md5(path: Path | str) -> str:
    """The md5 DVC records for a file or directory (`dvc_api.md5`)."""
    return dvc_api.md5(path)
