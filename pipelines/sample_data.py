"""Generate the built-in synthetic sample data set.

    python -m pipelines.sample_data          # what dvc.yaml runs; writes data/sample/

Writes `pretrain.txt`, `chat_{train,heldout}.jsonl`, `preference_{train,heldout}.jsonl` and
`world.json` (see `pipelines/core/data/sample_world.py`), or with `sample_data.corpus: real_text` the same files
from real text that ships in packages (`pipelines/core/data/real_text.py`). With `sample_data.enabled: false` it writes only a
README, so the stage stays in the graph while `ingest` reads your own data. With
`sample_data.images.enabled` it also writes real digit images with questions about them
(`images/`, `image_chat_{train,heldout}.jsonl`: `pipelines/core/data/digits.py`) for the multimodal stage.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.core.data import digits, real_text, sample_world
from pipelines.core.errors import QllmError
from pipelines.core.outputs import atomic_dir
from pipelines.core.params.data import SampleDataParams
from pipelines.core.run import stage

NAME = "sample_data"
IMPORTS_TRANSFORMERS = False  # the runner does not import torch, transformers and PEFT for it (repro.run_in_process)

DISABLED_README = """\
# Sample data disabled

`sample_data.enabled` is false in params.yaml, so the built-in synthetic sample was not written.
Point `ingest.sources` at your own data (see data/sources/README.md).
"""


def run(out: Path, params: SampleDataParams) -> dict[str, int]:
    """Replace `out` with the sample files (or only a README when the sample is disabled).

    Args:
        out: output directory; replaced atomically, never left half-written.
        params: the `generate` params section.

    Returns:
        The sample counts (`sample_world.COUNT_KEYS`; all zero when disabled).
    """
    with atomic_dir(out) as tmp:
        if not params.enabled:
            (tmp / "README.md").write_text(DISABLED_README, encoding="utf-8")
            counts = dict.fromkeys(sample_world.COUNT_KEYS, 0)
        else:
            try:
                if params.corpus == "real_text":
                    counts = real_text.write_sample(tmp, params.seed)
                else:
                    counts = sample_world.write_sample(tmp, params)
            except sample_world.WorldError as exc:
                raise QllmError(f"params.yaml: {NAME}: {exc}") from None
        if params.enabled and params.images.enabled:
            counts |= digits.write_images(tmp, params.images, params.seed)
    return counts


def body(ctx: stage.StageContext) -> dict:
    out = ctx.output()
    counts = run(out, ctx.params)
    ctx.log.info("wrote %s: %s", out.relative_to(ctx.root), ", ".join(f"{key}={value}" for key, value in counts.items()))
    return counts


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
