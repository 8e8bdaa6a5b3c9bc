"""Record what this machine trains with, so DVC reruns training where `precision: auto` would differ.

    python -m pipelines.probe_device   # what dvc.yaml runs (always: `always_changed: true`); writes data/device.json

`precision: auto` (the default of every training stage) resolves per machine: bf16 where the device
has bf16 matrix units, fp32 on other CPUs, fp16 on older CUDA devices (`pipelines.core.training.precision`). A
stage trained in bf16 is not the stage another machine would train in fp32, so the resolution has
to be part of what DVC calls "the same inputs", or a `dvc pull`/run-cache hit would hand one
machine's result to a machine that would have computed something else.

DVC's idiom for state outside the repository is a stage with `always_changed: true` whose output
the dependent stages list as a dependency: it runs on every `dvc repro`/`qllm run` (tens of
milliseconds), and when its output has the same bytes as last time nothing downstream is stale.
The output holds only what changes the numbers (device kind, whether bf16 is native, what `auto`
means here), not the CPU model or a timing, so two machines of the same kind share their caches.

Asking torch costs its import (about a second, most of a no-change `qllm run` or `dvc repro`), so the
answer is remembered in `.qllm/device-probe.json` under a key made of everything it depends on that
can be read without torch: the torch version, the CPU's flags (`/proc/cpuinfo`), the accelerator
device nodes and the NVIDIA driver version, and the variables that cap or hide devices
(`CUDA_VISIBLE_DEVICES`, `ONEDNN_MAX_CPU_ISA`, ...). Any of them changing asks torch again; where
they cannot be read (no `/proc/cpuinfo`: macOS, Windows) torch is asked every time.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

from pipelines.core.data import world
from pipelines.core.outputs import read_json, write_json
from pipelines.core.paths import project_root

NAME = "probe_device"
"""A stage that reads the world (`pipelines.core.data.world`): no MLflow run; what it finds is in every
training stage's params (`<stage>.train.precision`) and metrics (`precision`)."""


CACHE = ".qllm/device-probe.json"
"""In the project root: the last answer and the key it holds for (see the module docstring)."""
ENVIRONMENT = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
"""Variables that change what torch finds: hidden devices, capped CPU instruction sets."""
DEVICE_NODES = ("/dev/nvidia*", "/dev/kfd", "/dev/dxg")
"""NVIDIA, ROCm and WSL GPU device nodes: a GPU torch could use has one of these."""


def environment_key(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """A digest of everything `precision.capability()` depends on that is readable without torch,
    or None where the CPU's flags cannot be read (then there is no cache)."""
    from importlib import metadata

    try:
        flags = sorted({flag for line in cpuinfo.read_text().splitlines() if line.startswith(("flags", "Features")) for flag in line.split(":", 1)[1].split()})
    except OSError:
        return None
    driver = Path("/proc/driver/nvidia/version")
    key = {
        "torch": metadata.version("torch"),
        "machine": platform.machine(),
        "cpu_flags": flags,
        "device_nodes": sorted(node for pattern in DEVICE_NODES for node in glob.glob(pattern)),
        "nvidia_driver": driver.read_text() if driver.exists() else None,
        "environment": {name: os.environ[name] for name in ENVIRONMENT if name in os.environ},
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def capability(cache: Path | None) -> tuple[dict[str, Any], bool]:
    """(`precision.capability()` as a dict, whether it came from `cache`)."""
    key = environment_key() if cache is not None else None
    if key is not None and cache.exists():
        try:
            record = read_json(cache)
        except (OSError, ValueError):  # unreadable: ask torch and write it anew
            record = {}
        if record.get("key") == key:
            return record["capability"], True
    from pipelines.core.training import precision  # torch

    cap = precision.capability().as_dict()
    if key is not None:
        write_json(cache, {"key": key, "capability": cap})
    return cap, False


def run(out: Path, cache: Path | None = None) -> tuple[dict[str, Any], bool]:
    """Write what this machine trains with to `out`; (it, whether `cache` knew it)."""
    cap, cached = capability(cache)
    write_json(out, cap)
    return cap, cached


def body(ctx: world.Context) -> dict:
    cap, cached = run(ctx.output(), project_root(ctx.root) / CACHE)
    ctx.log.info("device %s, native bf16: %s -> precision auto is %s%s", cap["device"], "yes" if cap["bf16_native"] else "no", cap["auto"],
                 " (known for this machine: torch not asked)" if cached else "")  # fmt: skip
    return cap


def main(argv: list[str] | None = None) -> int:
    return world.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
