"""QLLM Pipeline: one module per stage (`python -m pipelines.<stage>`), see README.md."""

import getpass
import logging
import os
import re
import tempfile
from collections.abc import MutableMapping

# bitsandbytes (imported by PEFT whenever it is installed) tries, on AVX512-BF16 CPUs, to fetch an
# optional inference kernel from the Hugging Face hub with the `kernels` package, and warns on
# every import when it cannot. The kernel only serves bitsandbytes' repacked CPU inference layout,
# which QLoRA here keeps off (`pipelines.core.models.quantize.keep_standard_layout`): the warning is noise.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


CPU_CAP_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def inductor_cache_dir(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Give `torch.compile` a kernel cache of its own for each CPU cap in the environment.

    TorchInductor's CPU kernels depend on the instruction set it picks, which `ATEN_CPU_CAPABILITY`
    caps (`.ci/run` imitates an AVX2-only machine that way), but its cache in the temporary
    directory is shared by every cap: kernels built under one and loaded under another trained to
    NaN or crashed the process (`corrupted size vs. prev_size`, torch 2.13). With a cap set and no
    `TORCHINDUCTOR_CACHE_DIR` of the user's, the cache goes to a directory of torch's default named
    after the cap; uncapped, nothing changes. This runs when `pipelines` is imported because torch
    fixes the directory on its first use (importing transformers' models does). Returns the
    directory chosen, or None."""
    caps = [f"{name.lower()}-{environ[name].lower()}" for name in CPU_CAP_VARIABLES if environ.get(name)]
    if not caps or environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return None
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    default = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))  # torch's own
    environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(default, "_".join(caps))
    return environ["TORCHINDUCTOR_CACHE_DIR"]


inductor_cache_dir()
