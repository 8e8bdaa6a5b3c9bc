"""What the benchmarks share: the machine line, the per-seed loop and the mean ± sd summary.

A benchmark prints the machine it ran on before anything else (`cpu`: the CPU's name and its bf16
kind; `cpu_name`; `machine_line`: the name, torch and its threads), runs its arms once per seed
(`per_seed`: each seed in a fresh scratch directory, each row printed as a JSON line as it comes and
appended to the `--jsonl` file; `record` for one row), and summarises over seeds as the mean and
the sample standard deviation (`mean_sd`, `sd`): the spread, not the best run. `REPO` is this
checkout (its params.yaml, profiles and data).

Nothing here imports torch or the pipeline at import time: `tools/`, the test suite's conftest
and the light benchmarks import it too.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
"""The checkout the benchmarks belong to."""


def cpuinfo() -> list[str]:
    """The lines of /proc/cpuinfo; none where there is no such file (not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _field(lines: list[str], key: str) -> str | None:
    """The value of the first `key : value` line (the first processor's)."""
    return next((line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() == key), None)


def cpu_name() -> str:
    """The CPU's model name: /proc/cpuinfo's `model name`, else lscpu's (ARM), else what `platform` knows."""
    name = _field(cpuinfo(), "model name")
    if name is None:
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        except OSError:
            out = ""
        name = _field(out.splitlines(), "Model name")
    return name or platform.processor() or "unknown CPU"


def cpu_flags() -> set[str]:
    """The instruction-set flags of /proc/cpuinfo (empty where it is missing)."""
    return set((_field(cpuinfo(), "flags") or "").split())


def cpu_kind(flags: set[str] | None = None) -> str:
    """The CPU's bf16 kind, which decides `precision: auto` and most timings: AMX, AVX512-BF16, AVX2 only or no AVX2."""
    flags = cpu_flags() if flags is None else flags
    return "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else "AVX2 only" if "avx2" in flags else "no AVX2"


def cpu() -> str:
    """The machine line: `<model name>, <kind>` (`AMD EPYC 7B13, AVX2 only`); the test suite's
    recorded times carry it too (tests/conftest.py, tools.suite_time)."""
    return f"{cpu_name()}, {cpu_kind()}"


def machine_line() -> str:
    """`<model name>, torch <version>, <n> threads`: the first line of an in-process timing."""
    import torch

    return f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads"


def record(row: dict, jsonl: Path | None = None) -> dict:
    """Print `row` as one JSON line (flushed: a long run cut short keeps what it printed) and append
    it to `jsonl` if given; `row`."""
    line = json.dumps(row)
    print(line, flush=True)
    if jsonl is not None:
        with Path(jsonl).open("a", encoding="utf-8") as handle:
            handle.write(line + "\n")
    return row


def per_seed(seeds: Iterable[int], run: Callable[[int, Path], dict], *, jsonl: Path | None = None, extra: dict | None = None) -> list[dict]:
    """`run(seed, scratch)` for every seed, each in a fresh temporary directory removed after; each
    row, with `extra`'s keys added, recorded (`record`) as it comes; the rows."""
    rows = []
    for seed in seeds:
        with tempfile.TemporaryDirectory() as scratch:
            row = run(seed, Path(scratch)) | (extra or {})
        rows.append(record(row, jsonl))
    return rows


def sd(values: Iterable[float]) -> float:
    """The sample standard deviation; 0 for fewer than two values."""
    values = list(values)
    return statistics.stdev(values) if len(values) > 1 else 0.0


def mean_sd(values: Sequence[float] | Iterable[float], spec: str = ".4f", sd_spec: str | None = None, *, scale: float = 1.0,
            with_range: bool = False) -> str:  # fmt: skip
    """`<mean> +- <sd>` over seeds, each formatted by `spec` (the sd by `sd_spec` if given) after
    multiplying by `scale` (100: percent); `with_range` adds `[<min>, <max>]`."""
    values = list(values)
    text = f"{format(scale * statistics.mean(values), spec)} +- {format(scale * sd(values), sd_spec or spec)}"
    if with_range:
        text += f" [{format(scale * min(values), spec)}, {format(scale * max(values), spec)}]"
    return text
