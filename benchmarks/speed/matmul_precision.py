"""bf16 vs fp32 matrix-product speed on this machine, and what `precision: auto` picks here.

    python -m benchmarks.speed.matmul_precision [--size 1024] [--threads 1] [--repeats 5]

Prints the CPU, its bf16-relevant flags, GFLOP/s of a `size`x`size` product in fp32 and bf16
(best of `repeats`, after one warm-up product; the same command measures both, so the ratio is
fair on a noisy machine), their ratio, and `auto`'s choice. On an AMX or AVX512-BF16 machine,
`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python -m benchmarks.speed.matmul_precision` imitates
an AVX2-only CPU (bf16 drops to about 1 GFLOP/s and `auto` to fp32).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import cpu_name
from pipelines.core.training import precision


def gflops(size: int, dtype: torch.dtype, repeats: int) -> float:
    a = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(dtype)
    a @ a
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    flags = {name: bool(getattr(torch.cpu, f"_is_{name}_supported", lambda: False)()) for name in ("amx_tile", "avx512_bf16", "avx512", "avx2")}
    print(f"cpu: {cpu_name()}; torch {torch.__version__}, ATen capability {torch.backends.cpu.get_cpu_capability()}; flags {flags}")
    fp32 = gflops(args.size, torch.float32, args.repeats)
    bf16 = gflops(args.size, torch.bfloat16, args.repeats)
    cap = precision.capability()
    print(f"{args.size}x{args.size} matmul, {args.threads} thread(s): fp32 {fp32:.1f} GFLOP/s, bf16 {bf16:.1f} GFLOP/s, "
          f"bf16/fp32 {bf16 / fp32:.3f}x; precision auto -> {cap.auto} (native bf16: {cap.bf16_native})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
