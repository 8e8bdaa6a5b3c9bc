"""QLLM Pipeline's library: one module per dvc.yaml stage (`python -m pipelines.<stage>`) and the
shared code under `core/`; see README.md ("Where things are").

Importing it runs the library's start-up step, `pipelines.core.startup.prepare()`: a kernel cache
per CPU cap, and imports without full garbage collections and with bitsandbytes deferred (1.9 s of
every training stage's start; docs/development.md, "What importing pipelines sets up").
"""

from pipelines.core import startup

startup.prepare()
