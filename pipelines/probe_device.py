"""Record what this machine trains with, so DVC reruns training where `precision: auto` would differ.

    python -m pipelines.probe_device   # what dvc.yaml runs (always: `always_changed: true`); writes data/device.json

`precision: auto` (the default of every training stage) resolves per machine: bf16 where the device
has bf16 matrix units, fp32 on other CPUs, fp16 on older CUDA devices (`pipelines.core.precision`). A
stage trained in bf16 is not the stage another machine would train in fp32, so the resolution has
to be part of what DVC calls "the same inputs", or a `dvc pull`/run-cache hit would hand one
machine's result to a machine that would have computed something else.

DVC's idiom for state outside the repository is a stage with `always_changed: true` whose output
the dependent stages list as a dependency: it runs on every `dvc repro`/`qllm run` (tens of
milliseconds), and when its output has the same bytes as last time nothing downstream is stale.
The output holds only what changes the numbers (device kind, whether bf16 is native, what `auto`
means here), not the CPU model or a timing, so two machines of the same kind share their caches.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.core import stage
from pipelines.core.outputs import write_json

NAME = "probe_device"
TRACKED = False
"""No MLflow run: the stage runs on every pipeline run and `dvc repro` and trains nothing; what it
finds is in every training stage's params (`<stage>.train.precision`) and metrics (`precision`)."""


def run(out: Path) -> dict:
    from pipelines.core import precision  # torch: imported when the stage runs, not when it is listed

    cap = precision.capability().as_dict()
    write_json(out, cap)
    return cap


def body(ctx: stage.StageContext) -> dict:
    cap = run(ctx.output())
    ctx.log.info("device %s, native bf16: %s -> precision auto is %s", cap["device"], "yes" if cap["bf16_native"] else "no", cap["auto"])
    return cap


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv, tracked=TRACKED)


if __name__ == "__main__":
    raise SystemExit(main())
