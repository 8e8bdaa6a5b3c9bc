"""Supervised fine-tuning of all weights on chat data (completion-only loss, packed rows).

    python -m pipelines.sft        # what dvc.yaml runs; writes data/models/sft/

Starts from `sft.base_model` (default: the pretrained model) and runs the shared procedure in
`pipelines.core.training.finetune`; the output is a `save_pretrained` directory.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.core.models.models import save_pretrained
from pipelines.core.params.finetuning import SftParams
from pipelines.core.run import stage
from pipelines.core.training import finetune

NAME = "sft"


def run(chat_dir: Path, out: Path, params: SftParams, tracker=None, checkpoint_dir: Path | None = None, replay_answers: Path | None = None) -> dict:
    def save(model, tokenizer, directory: Path) -> None:
        save_pretrained(model, tokenizer, directory, max_length=model.config.max_position_embeddings)

    return finetune.run(chat_dir, out, params, wrap=lambda model, tokenizer: model, save=save, tracker=tracker, checkpoint_dir=checkpoint_dir, desc=NAME,
                        replay_answers=replay_answers)  # fmt: skip


def body(ctx: stage.StageContext) -> dict:
    params = finetune.resolve_base(ctx, ctx.input("models/pretrain"))
    metrics = run(ctx.input("chat"), ctx.output(), params, ctx.tracker, ctx.checkpoint_dir, ctx.input("base_answers"))
    ctx.log.info(
        "sft: %d steps, val/loss %.4f, %d train rows from %d examples (%d truncated), %d tokens/s",
        metrics["steps"], metrics.get("val/loss", float("nan")), metrics["data/train_rows"],
        metrics["data/train_examples"], metrics["data/train_truncated"], metrics["tokens_per_second"],
    )
    return metrics


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
