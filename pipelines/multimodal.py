"""The optional multimodal stage: a LLaVA-style image-chat model on the pipeline's language model.

    python -m pipelines.multimodal     # what dvc.yaml runs; writes data/models/multimodal/
    qllm run --params params/multimodal.yaml             # digit images + this stage, end to end
    qllm generate data/models/multimodal --image digit.png "Which digit is this?"

With `multimodal.enabled: false` (the default) it writes only a README: no model is loaded, no
cost. Enabled, it builds `LlavaForConditionalGeneration` around `multimodal.base_model` (the SFT
model) with a SigLIP vision tower from config (`pipelines.core.models.vision`), encodes the prepared
`image_chat` records (train and validation; the held-out ones are evaluate's), and trains with the
shared loop in LLaVA's two phases: alignment (projector and tower; language model frozen) for
`alignment_steps`, then instruction tuning. Checkpoints, exact resume, stop signals and MLflow
are the loop's. The output is a Hugging Face model directory plus processor:

    from transformers import AutoModelForImageTextToText, AutoProcessor
    model = AutoModelForImageTextToText.from_pretrained("data/models/multimodal")
    processor = AutoProcessor.from_pretrained("data/models/multimodal")
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipelines.core.errors import QllmError
from pipelines.core.params.finetuning import MultimodalParams
from pipelines.core.run import stage
from pipelines.core.training.phases import Phase, phase_at

if TYPE_CHECKING:  # torch only when the stage is enabled
    import torch

NAME = "multimodal"

DISABLED_README = """\
# Multimodal stage disabled

`multimodal.enabled` is false, so no image-chat model was trained. To train one on the sample
digit images: `qllm run --params params/multimodal.yaml` (docs/multimodal.md).
"""


class Phases:
    """LLaVA's two phases as the shared loop's schedule (`pipelines.core.training.phases`): alignment for
    `alignment_steps`, then instruction tuning, each with a fresh optimizer over what trains and
    the learning rate re-warmed over `train.warmup_steps` and scaled by `instruction_lr / train.lr`."""

    changes_model = True

    def __init__(self, params: MultimodalParams, model: torch.nn.Module) -> None:
        cfg = params.train
        layers = model.config.text_config.num_hidden_layers
        self.params, self.rewarm = params, cfg.warmup_steps
        self.instruction_factor = params.instruction_lr / cfg.lr
        steps = min(params.alignment_steps, cfg.max_steps)
        phases = []
        if steps > 0:
            phases.append(Phase(0, "alignment", 0, layers, language_model=False))
        if steps < cfg.max_steps:
            phases.append(Phase(len(phases), "instruction tuning", steps, layers, language_model=params.language_model == "full"))
        self.phases = phases
        self.current = 0

    def phase_at(self, step: int) -> Phase:
        return phase_at(self.phases, step)

    def lr_factor(self, phase: Phase, steps_into_phase: int) -> float:
        if phase.name == "alignment":
            return 1.0
        ramp = 1.0 if phase.index == 0 or self.rewarm == 0 else min(1.0, (steps_into_phase + 1) / self.rewarm)
        return self.instruction_factor * ramp

    def enter(self, model: torch.nn.Module, phase: Phase) -> None:
        inner = model.model
        inner.multi_modal_projector.requires_grad_(True)
        inner.vision_tower.requires_grad_(self.params.vision_tower == "trainable")
        inner.language_model.requires_grad_(phase.language_model)
        model.lm_head.requires_grad_(phase.language_model)
        self.current = phase.index

    def metrics(self) -> dict[str, float]:
        return {"train/phase": float(self.current)}

    def close(self) -> None:
        """Nothing to release."""


def run(image_dir: Path, out: Path, params: MultimodalParams, tracker=None, checkpoint_dir: Path | None = None,
        base_for_users: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Train the image-chat model on `image_dir/{train,validation}.parquet`; save it to `out`.
    `base_for_users`: how the saved config names its language model (default: `params.base_model`;
    the stage passes the path as params.yaml writes it, so no absolute path reaches the output)."""

    from pipelines.core.models import vision
    from pipelines.core.models.models import (
        CONSTRUCTION,
        configure_generation,
        device,
        forget_load_options,
        load_model_and_tokenizer,
        parameter_counts,
    )
    from pipelines.core.training import loop
    from pipelines.core.training.checkpoint import CheckpointManager

    cfg = params.train
    with CONSTRUCTION:
        language_model, tokenizer = load_model_and_tokenizer(params.base_model)
        model, processor = vision.build(language_model, tokenizer, params.vision, params.projector_act, cfg.seed)
    del language_model
    per_image = vision.image_tokens(model.config)
    max_len = params.max_seq_len or model.config.text_config.max_position_embeddings
    data, metrics = vision.build_rows(processor, image_dir, max_len, per_image)
    metrics["image_tokens"] = per_image
    if not data["train"].rows:
        raise QllmError(f"{Path(image_dir) / 'train.parquet'}: no image chat left to train on (dropped as longer than {max_len} tokens: "
                        f"{data['train'].stats.dropped_too_long}); raise multimodal.max_seq_len or add image_chat sources")  # fmt: skip
    pad = tokenizer.pad_token_id
    batches = loop.Batches(len(data["train"].rows), cfg.micro_batch_size, cfg.seed, vision.collate(data["train"], pad))
    val_fn = None
    if data["validation"].rows:
        n_val = len(data["validation"].rows) if not cfg.eval_batches else min(len(data["validation"].rows), cfg.eval_batches * cfg.micro_batch_size)
        collate_val = vision.collate(data["validation"], pad)
        val_batches = [collate_val(np.arange(i, min(i + cfg.micro_batch_size, n_val))) for i in range(0, n_val, cfg.micro_batch_size)]

        def val_fn(m: torch.nn.Module) -> dict[str, float]:
            return {"val/loss": loop.mean_loss(m, vision.image_chat_loss, val_batches, device(), cfg.precision)}

    phases = Phases(params, model)
    counts = parameter_counts(model)
    if tracker is not None:
        tracker.log_params({f"{NAME}.{k}": v for k, v in counts.items()} | {f"{NAME}.image_tokens": per_image})
    checkpoints = CheckpointManager(checkpoint_dir, cfg.keep_checkpoints) if checkpoint_dir else None
    result = loop.train(model, vision.image_chat_loss, batches, cfg, val_fn=val_fn, tracker=tracker, checkpoints=checkpoints,
                            schedule=phases, desc=NAME)  # fmt: skip
    model.requires_grad_(True)

    def save(tmp: Path) -> None:
        model.config.text_config._name_or_path = params.base_model if base_for_users is None else base_for_users
        configure_generation(model, tokenizer)
        model.cpu().save_pretrained(tmp, safe_serialization=True)
        forget_load_options(processor.tokenizer)
        processor.save_pretrained(tmp)

    result = loop.finish(result, out, save)
    return {**result, **counts, **metrics}


def body(ctx: stage.StageContext) -> dict[str, Any]:
    params = ctx.params
    if not params.enabled:
        return stage.switched_off(ctx, DISABLED_README)
    base = ctx.root / params.base_model
    if base.exists():
        params = params.model_copy(update={"base_model": str(base)})
    if base != ctx.input("models/sft"):
        ctx.log.warning("multimodal.base_model=%s is not a dependency in dvc.yaml: DVC will not notice when it changes", ctx.params.base_model)
    metrics = run(ctx.input("image_chat"), ctx.output(), params, ctx.tracker, ctx.checkpoint_dir, base_for_users=ctx.params.base_model)
    ctx.log.info("multimodal: %d steps, val/loss %.4f, %d train chats (%d image tokens each image)", metrics["steps"],
                 metrics.get("val/loss", float("nan")), metrics["data/train_examples"], metrics["image_tokens"])  # fmt: skip
    return {"enabled": True, **metrics}


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
