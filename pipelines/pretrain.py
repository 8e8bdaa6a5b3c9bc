"""Pretrain a small Llama-architecture model from scratch on the packed token sequences.

    python -m pipelines.pretrain       # what dvc.yaml runs; writes data/models/pretrain/

The model is built from `pretrain.model` (`LlamaConfig` + `LlamaForCausalLM`, vocabulary from the
tokenizer) and trained by the shared loop in `pipelines.core.training.loop`. Checkpoints go to
`.qllm/checkpoints/pretrain/<fingerprint>/`, outside the stage output, so a killed run resumes
and a changed stage starts afresh. The output is a `save_pretrained` directory.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from pipelines.core.config import PretrainParams
from pipelines.core.data import packed
from pipelines.core.models import model_source
from pipelines.core.models.model_source import POINTER
from pipelines.core.models.models import build_llama, device, load_tokenizer, parameter_counts, save_pretrained
from pipelines.core.outputs import atomic_dir, read_json, write_json
from pipelines.core.run import stage
from pipelines.core.training import chunked_loss, curriculum, diffusion, loop, objectives, progressive
from pipelines.core.training.checkpoint import CheckpointManager
from pipelines.core.training.memory import MemoryUsage

NAME = "pretrain"


def validation_fn(rows: np.ndarray, batch_size: int, max_batches: int, precision: str):
    """Mean loss and perplexity over the first `max_batches` validation batches (0: all)."""
    batches = packed.fixed_batches(rows, batch_size, max_batches)

    def evaluate(model: torch.nn.Module) -> dict[str, float]:
        loss = loop.mean_loss(model, loop.causal_lm_loss, batches, next(model.parameters()).device, precision)
        return {"val/loss": loss, "val/perplexity": math.exp(min(loss, 50.0))}

    return evaluate


def run(tokenized: Path, tokenizer_dir: Path, out: Path, params: PretrainParams, checkpoint_dir: Path | None, tracker=None) -> dict:
    tokenizer = load_tokenizer(tokenizer_dir)
    meta = read_json(tokenized / "meta.json")
    train_rows, val_rows = packed.load(tokenized, "train"), packed.load(tokenized, "validation")
    cfg = params.train
    diffusion_objective = params.objective == "masked_diffusion"
    mask_id = diffusion.mask_token_id(tokenizer, NAME) if diffusion_objective else None
    model = build_llama(params.model, tokenizer, max_positions=meta["seq_len"], seed=cfg.seed,
                        diffusion=params.diffusion if diffusion_objective else None, mask_token_id=mask_id).to(device())  # fmt: skip
    counts = parameter_counts(model)
    if tracker is not None:
        tracker.log_params({"model.parameters": counts["total_parameters"], "model.vocab_size": len(tokenizer)})
    batches = loop.Batches(len(train_rows), cfg.micro_batch_size, cfg.seed, packed.collate(train_rows))
    batches = curriculum.wrap(batches, cfg, full_length=meta["seq_len"])
    checkpoints = CheckpointManager(checkpoint_dir, cfg.keep_checkpoints) if checkpoint_dir else None
    grow = params.progressive
    growth = progressive.Growth(grow, cfg, model, NAME) if grow.enabled else None  # the model starts as its first stack
    extensions = []
    if params.model.memory.enabled:

        extensions.append(MemoryUsage(model))
    loss_fn, val_fn = loop.causal_lm_loss, validation_fn(val_rows, cfg.micro_batch_size, cfg.eval_batches, cfg.precision)
    if diffusion_objective:
        objective = diffusion.Objective(params.diffusion, model.config.mask_token_id)
        loss_fn = objective
        val_fn = objectives.nelbo_fn(objective, packed.fixed_batches(val_rows, cfg.micro_batch_size, cfg.eval_batches), cfg.precision)
    loss_fn = chunked_loss.for_loop(loss_fn, model, cfg, NAME)  # the head a chunk at a time (train.loss_chunk_tokens)
    result = loop.train(
        model,
        loss_fn,
        batches,
        cfg,
        val_fn=val_fn,
        tracker=tracker,
        checkpoints=checkpoints,
        extensions=extensions,
        schedule=growth,
        desc=NAME,
    )
    model.requires_grad_(True)  # a growth phase may have left layers frozen

    def save(tmp: Path) -> None:
        save_pretrained(model.cpu(), tokenizer, tmp, max_length=meta["seq_len"])
        if grow.enabled and grow.save_stacks:
            progressive.save_stacks(model, grow.stacks, tmp)

    result = loop.finish(result, out, save)
    return {
        **result,
        **counts,
        "objective": params.objective,
        "vocab_size": len(tokenizer),
        "epochs": round(result["tokens"] / max(1, train_rows.size), 3),
    }


def point_to_base(out: Path, record: dict) -> dict:
    """Fine-tuning mode: no model is trained; the output is a pointer to the base model
    (`pipelines.base_model`) that the later stages load through."""

    with atomic_dir(out) as tmp:
        write_json(tmp / POINTER, record)
    return {"trained": False, "steps": 0}


def body(ctx: stage.StageContext) -> dict:

    record = model_source.current(ctx.root)
    if record["name"] is not None:
        ctx.log.info("pretrain: nothing to train, the base model is %s (base_model.name)", record["name"])
        return point_to_base(ctx.output(), record)
    metrics = run(ctx.input("tokenized"), ctx.input("tokenizer"), ctx.output(), ctx.params, ctx.checkpoint_dir, ctx.tracker)
    ctx.log.info(
        "pretrained %d parameters for %d steps: val/loss %.4f (perplexity %.2f, vocabulary %d), %d tokens/s",
        metrics["total_parameters"], metrics["steps"], metrics["val/loss"], metrics["val/perplexity"],
        metrics["vocab_size"], metrics["tokens_per_second"],
    )
    return metrics


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
