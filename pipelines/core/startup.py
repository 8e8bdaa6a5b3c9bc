"""The start-up step every process that uses the library runs first: `prepare()`, called by
`pipelines/__init__.py`, so before any stage, `qllm` command or flow run imports torch.

What it does, and why it cannot wait until later (docs/development.md, "What importing pipelines
sets up"; measured 2026-12-07 on a 2-core AMD EPYC with AVX512-BF16, importing a training stage's
modules with PEFT and MLflow: 5.7 s with it, 7.7 s without, 5 runs each, the same under the AVX2 cap):

- `inductor_cache_dir`: a TorchInductor kernel cache per CPU cap (torch fixes the directory on
  first use);
- `imports_without_full_collections`: no full garbage-collector passes while modules import;
- `DEFERRED`: bitsandbytes runs when first used, not when PEFT imports it.

Each is a `sys.meta_path` finder or an environment variable, installed once per process.
"""

import gc
import getpass
import importlib.abc
import importlib.machinery
import logging
import os
import re
import sys
import tempfile
import threading
import types
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




class ImportsWithoutFullCollections:
    """A `sys.meta_path` finder: while a module found on the file system is executed (and every
    import beneath it), the collector makes no full (generation 2) passes; the thresholds come back
    when the outermost such import ends.

    Importing torch, transformers' models, PEFT and MLflow creates about 600,000 objects, and the
    full passes that growth triggers walk every object made so far: 1.1 s of the 6.4 s of CPU those
    imports take (8 full passes; 2-core EPYC, capped to AVX2), in every stage process, `qllm`
    command and flow run. The young generations are still collected; objects promoted meanwhile wait
    for the next full pass after the import, as any long-lived object does. Only file loaders, which
    serve one module each, are wrapped; the others (built-in, frozen, lazy) go on as they are."""

    _lock = threading.Lock()
    _depth = 0
    _thresholds: tuple[int, ...] = ()
    _RAISED = 1 << 30
    _LOADERS = (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader, importlib.machinery.ExtensionFileLoader)

    def find_spec(self, name, path=None, target=None):
        after = sys.meta_path[sys.meta_path.index(self) + 1 :] if self in sys.meta_path else []
        for finder in after:  # the ones before this finder have answered None already
            if hasattr(finder, "find_spec") and (spec := finder.find_spec(name, path, target)) is not None:
                if isinstance(spec.loader, self._LOADERS):
                    spec.loader.exec_module = self._without_full_collections(spec.loader.exec_module)
                    if name in DEFERRED:
                        spec.loader = DeferredLoader(spec.loader)
                return spec
        return None

    @classmethod
    def _without_full_collections(cls, exec_module):
        def execute(module) -> None:
            with cls._lock:
                cls._depth += 1
                if cls._depth == 1:
                    cls._thresholds = gc.get_threshold()
                    gc.set_threshold(*cls._thresholds[:2], cls._RAISED)
            try:
                exec_module(module)
            finally:
                with cls._lock:
                    cls._depth -= 1
                    if cls._depth == 0 and (now := gc.get_threshold())[2] == cls._RAISED:  # unless a module set its own
                        gc.set_threshold(*now[:2], cls._thresholds[2])

        return execute


DEFERRED = frozenset({"bitsandbytes"})
"""Modules whose code runs when first used rather than when first imported. PEFT imports bitsandbytes
whenever it is installed (`peft.helpers`), and bitsandbytes wraps its CPU kernels in `torch.compile`
as it is imported, which imports TorchInductor: 1.1 s of CPU (2-core EPYC, capped to AVX2) in every
process that imports PEFT. QLoRA, the 8-bit optimizers and PEFT's LoRA and AdaLoRA layers (which ask
it for its 4-bit layer) use it; loading, evaluating, exporting, registering or serving a model
(merged weights) does not."""


class DeferredModule(types.ModuleType):
    """A module not yet executed: the first attribute other than its identity (`__name__`,
    `__spec__`, `__loader__`, `__package__`, which the import system reads on every `import` of it;
    `__file__` and `__cached__`, which scans of `sys.modules` such as `inspect.getmodule` read)
    executes it, once, under a lock, and it becomes a plain module. `importlib.util.LazyLoader`'s
    idea; Python 3.11's has no lock, and runs the module on `import` statements' `__spec__` reads.
    `__path__` is not identity: importing a submodule runs the package first, as without deferral."""

    _lock = threading.RLock()
    _IDENTITY = frozenset({"__name__", "__spec__", "__loader__", "__package__", "__file__", "__cached__", "__class__", "__dict__"})

    def __getattribute__(self, attr):
        get = object.__getattribute__
        if attr not in DeferredModule._IDENTITY:
            state = get(self, "__dict__")
            with DeferredModule._lock:
                if get(self, "__class__") is DeferredModule and not state.get("__qllm_executing__"):
                    state["__qllm_executing__"] = True
                    try:
                        get(self, "__spec__").loader.exec_module(self)
                        object.__setattr__(self, "__class__", types.ModuleType)
                    finally:
                        state.pop("__qllm_executing__", None)
        return get(self, attr)


class DeferredLoader(importlib.abc.Loader):
    """Loads a module as a `DeferredModule`: its code runs on first use (see `DeferredModule`)."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        module.__spec__.loader = self.loader
        module.__loader__ = self.loader
        module.__class__ = DeferredModule


def imports_without_full_collections() -> None:
    """Put `ImportsWithoutFullCollections` first on `sys.meta_path` (once). Called when `pipelines`
    is imported, which every stage process, `qllm` command and flow run does before torch."""
    if not any(isinstance(finder, ImportsWithoutFullCollections) for finder in sys.meta_path):
        sys.meta_path.insert(0, ImportsWithoutFullCollections())


def prepare() -> None:
    """The start-up step (idempotent): the kernel cache, then the import finder."""
    inductor_cache_dir()
    imports_without_full_collections()
