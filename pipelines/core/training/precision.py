"""Training precision for the device at hand: `precision: auto` and the check of an explicit bf16.

`auto` resolves, once per process, to

| device | resolved |
|---|---|
| CUDA with native bf16 (Ampere and newer) | `bf16` |
| older CUDA | `fp16` (autocast + loss scaling) |
| CPU with bf16 matrix units (AMX-BF16 or AVX512-BF16) that oneDNN uses | `bf16` |
| any other CPU (AVX2-only, AVX-512 without BF16), Apple MPS | `fp32` |

On a CPU the instruction-set flags (`torch.cpu._is_amx_tile_supported`, `_is_avx512_bf16_supported`)
must be present *and* oneDNN must be allowed to use them (`ONEDNN_MAX_CPU_ISA` can cap it below
bf16; `torch.ops.mkldnn._is_mkldnn_bf16_supported` then says no). The choice reads flags only, so
it is the same on every run of a machine: a timed probe was tried and dropped, since on a busy
2-core machine a 256x256 bf16 product measured anywhere from 0.5x to 60x the fp32 one.

An explicit `bf16` on a CPU without native support is honoured, with one warning that gives the
slowdown measured on the spot.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import asdict, dataclass

import torch

log = logging.getLogger("qllm.precision")

PRECISIONS = ("auto", "bf16", "fp16", "fp32")


@dataclass(frozen=True)
class DeviceCapability:
    """What decides `auto`, as written to the `probe_device` stage output and logged."""

    device: str
    """`cpu`, `cuda` or `mps`."""
    bf16_native: bool
    """The device computes bf16 matrix products in hardware (CPU: AMX/AVX512-BF16 used by oneDNN)."""
    auto: str
    """What `precision: auto` resolves to here."""

    def as_dict(self) -> dict:
        return asdict(self)


def _cpu_bf16_flags() -> bool:
    """AMX-BF16 or AVX512-BF16 present, and oneDNN allowed to use them."""
    cpu = torch.cpu
    flags = any(getattr(cpu, name, lambda: False)() for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    if not flags:
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: no fast bf16 path
        return False


@functools.lru_cache(maxsize=1)
def cpu_bf16_slowdown(size: int = 256, repeats: int = 3) -> float:
    """Time of a bf16 `size`x`size` matrix product over the fp32 one on this CPU (best of `repeats`);
    < 1 means bf16 is faster. Only for the warning about emulated bf16: it varies with the load. It runs with the process's thread count as it is: changing that
    process-wide setting would slow stages training in other threads meanwhile."""
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(dtype)
        a @ a  # first call: kernel selection, allocation
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - start)
        times[dtype] = best
    return times[torch.bfloat16] / max(times[torch.float32], 1e-9)


def _device_type() -> str:
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


@functools.lru_cache(maxsize=1)
def capability() -> DeviceCapability:
    """The training device and what `auto` means on it (computed once per process)."""
    kind = _device_type()
    if kind == "cuda":
        native = bool(torch.cuda.is_bf16_supported(including_emulation=False))
        return DeviceCapability(kind, native, "bf16" if native else "fp16")
    if kind == "mps":
        return DeviceCapability(kind, False, "fp32")
    native = _cpu_bf16_flags()
    return DeviceCapability(kind, native, "bf16" if native else "fp32")


_warned: set[str] = set()


def resolve(requested: str, desc: str = "train") -> str:
    """The precision to train with for `requested` (`auto` or an explicit one) on this device."""
    if requested not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {requested!r}")
    cap = capability()
    if requested == "auto":
        return cap.auto
    if requested == "bf16" and cap.device == "cpu" and not cap.bf16_native and "bf16" not in _warned:
        _warned.add("bf16")
        log.warning(
            "%s: precision bf16 on a CPU without bf16 matrix units (no AMX/AVX512-BF16 in use): bf16 is emulated, "
            "a bf16 matrix product took %.0fx as long as fp32 here; precision auto would choose fp32",
            desc, cpu_bf16_slowdown(),
        )  # fmt: skip
    return requested
