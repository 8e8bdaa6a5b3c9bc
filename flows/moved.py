"""The modules that left `flows/` in 0.2 (issue 79), under their old names for one release.

`import flows.serve`, `from flows import generation` and `python -m flows.lm_eval_task` still work,
each with a DeprecationWarning naming the new place (a FutureWarning, shown by
default, when run as a command): a deployment, a plug-in or a script written
before the move goes on running. Each old file is three lines that call `forward`; they go in the
release after.
"""

from __future__ import annotations

import importlib
import runpy
import sys
import warnings
from importlib.machinery import ModuleSpec

MOVED = {
    "flows.cli": "qllm.cli",
    "flows.generation": "qllm.serving.generation",
    "flows.openai_api": "qllm.serving.openai_api",
    "flows.lineage": "qllm.registry.lineage",
    "flows.compare": "qllm.registry.compare",
    "flows.serve": "qllm.services.serve",
    "flows.local_api": "qllm.services.local_api",
    "flows.postgres": "qllm.services.postgres",
    "flows.tls_front": "qllm.services.tls_front",
    "flows.preflight": "pipelines.core.run.preflight",
    "flows.lm_eval_task": "pipelines.core.evaluation.lm_eval",
}
"""Old name -> the module it is now."""


def forward(name: str, spec: ModuleSpec) -> None:
    """Make the old module `spec.name` the new one: imported, `sys.modules` holds the new module
    under the old name too; run as `python -m`, the new module runs as `__main__`."""
    old = spec.name
    new = MOVED[old]
    message = f"{old} moved to {new}; the old name goes in the next release"
    if name == "__main__":  # a command someone typed: a warning shown by default
        warnings.warn(message, FutureWarning, stacklevel=2)
        runpy.run_module(new, run_name="__main__", alter_sys=True)
        return
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
