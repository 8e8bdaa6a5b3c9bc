"""llama.cpp (llama-cpp-python) loading the GGUF files the export stage writes, for the tests that
check them against transformers.

On a CPU with AMX, llama.cpp repacks q8_0 weights into its AMX buffer type, and its AMX matrix
product segfaulted the process on the first `eval` of the tiny test models (llama-cpp-python
0.3.36, Intel Xeon with AMX, 2026-12-07; upstream: ggml-org/llama.cpp#20824, open, and dspy's CI
met it on the same CPUs). There the files are loaded with the extra buffer types off, as
`llama-cli --no-repack` loads them: the same GGUF, read by llama.cpp's plain CPU kernels. Elsewhere
they load as llama.cpp's defaults have them."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest


def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    try:
        return "amx_int8" in cpuinfo.read_text().split()
    except OSError:
        return False


@contextmanager
def _without_extra_buffers():
    """llama-cpp-python builds a model's params from `llama_model_default_params()`: with
    `use_extra_bufts` off while a model loads (no repacking into AMX or other layouts)."""
    import llama_cpp.llama_cpp as binding

    default = binding.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    binding.llama_model_default_params = params
    try:
        yield
    finally:
        binding.llama_model_default_params = default


def load(path: Path | str, reason: str, **kwargs):
    """`llama_cpp.Llama` on `path` (2 threads, seed 0, quiet); a missing llama-cpp-python fails the
    test with `reason` (how to install it), never skips it."""
    try:
        import llama_cpp
    except ImportError:
        pytest.fail(reason)
    options = {"n_threads": 2, "seed": 0, "verbose": False, **kwargs}
    if not cpu_has_amx():
        return llama_cpp.Llama(model_path=str(path), **options)
    with _without_extra_buffers():
        return llama_cpp.Llama(model_path=str(path), **options)
