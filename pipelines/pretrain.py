"""Pretrain a small Llama-architecture model from scratch on the packed token sequences, or
continue pretraining a base model on them.

    python -m pipelines.pretrain       # what dvc.yaml runs; writes data/models/pretrain/

The model is built from `pretrain.model` (`LlamaConfig` + `LlamaForCausalLM`, vocabulary from the
tokenizer) and trained by the shared loop in `pipelines.core.training.loop`. Checkpoints go to
`.qllm/checkpoints/pretrain/<fingerprint>/`, outside the stage output, so a killed run resumes
and a changed stage starts afresh. The output is a `save_pretrained` directory.

With `base_model.name` set (fine-tuning mode) nothing is built:

- `pretrain.continue_base: true`: the base is loaded and trained further on the same packed rows
  (tokenized with its own tokenizer), with the same loop and `pretrain.train` settings: continued
  pretraining, so facts only the text holds reach the base before sft;
- otherwise a GGUF base is converted once into `data/models/pretrain/` (read by transformers' GGUF
  loader, dequantized to fp32: every later stage loads a plain `save_pretrained` directory in
  under a second instead of reading the file again), and a hub or directory base is only pointed
  to (`base_model.json`, which the later stages follow).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import torch

from pipelines.core.data import packed, replay
from pipelines.core.errors import QllmError
from pipelines.core.models import footprint, model_source
from pipelines.core.models.model_source import POINTER
from pipelines.core.models.models import (
    build_llama,
    check_vocabulary,
    device,
    load_causal_lm,
    load_tokenizer,
    parameter_counts,
    save_pretrained,
)
from pipelines.core.outputs import atomic_dir, read_json, write_json
from pipelines.core.params.pretraining import PretrainParams
from pipelines.core.paths import project_root
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


def run(tokenized: Path, tokenizer_dir: Path, out: Path, params: PretrainParams, checkpoint_dir: Path | None, tracker=None,
        base: Path | None = None, replay_answers: Path | None = None) -> dict:  # fmt: skip
    """Pretrain a model built from `params.model`, or continue pretraining `base` (a model
    directory or GGUF file whose tokenizer `tokenizer_dir` holds); with `params.replay.fraction`,
    the base's answers in `replay_answers` (a `base_answers` output) mixed in as text rows."""
    tokenizer = load_tokenizer(tokenizer_dir)
    meta = read_json(tokenized / "meta.json")
    train_rows, val_rows = packed.load(tokenized, "train"), packed.load(tokenized, "validation")
    replayed = {}
    if base is not None and params.replay.fraction:
        if replay_answers is None:
            raise QllmError(f"pretrain.replay.fraction={params.replay.fraction}: this run has no base model answers to replay")
        rows, replayed = replay.text_rows(tokenizer, replay_answers, params.replay.fraction, int(train_rows.size), meta["seq_len"], train_rows.dtype)
        train_rows = np.concatenate([train_rows, rows])  # the batches' seeded shuffle spreads them
        logging.getLogger(f"qllm.{NAME}").info("pretrain: replay: %d rows of the base's answers (%d tokens, %.1f%% of the trained tokens)",
                                               replayed["replay_rows"], replayed["replay_tokens"], 100 * replayed["replay_share"])  # fmt: skip
    cfg = params.train
    diffusion_objective = params.objective == "masked_diffusion"
    mask_id = diffusion.mask_token_id(tokenizer, NAME) if diffusion_objective else None
    estimates = {}
    if base is None:
        model = build_llama(params.model, tokenizer, max_positions=meta["seq_len"], seed=cfg.seed,
                            diffusion=params.diffusion if diffusion_objective else None, mask_token_id=mask_id).to(device())  # fmt: skip
    else:
        estimates = footprint.preflight(base, cfg, method="full", seq_len=meta["seq_len"], micro_batch=cfg.micro_batch_size, lora_rank=0, desc=NAME)
        model = load_causal_lm(base).to(device())
        check_vocabulary(model, tokenizer, base)
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

    def save(tmp: Path) -> None:  # a base keeps its own context length
        save_pretrained(model.cpu(), tokenizer, tmp, max_length=meta["seq_len"] if base is None else None)
        if grow.enabled and grow.save_stacks:
            progressive.save_stacks(model, grow.stacks, tmp)

    result = loop.finish(result, out, save)
    return {
        **result,
        **counts,
        **estimates,
        "continued": base is not None,
        **replayed,  # replay_rows, replay_tokens, replay_share
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


def convert_base(gguf_file: Path, tokenizer_dir: Path, out: Path) -> dict:
    """Fine-tuning mode from a GGUF file, used as it is: the file read once (dequantized to
    fp32) and written as a `save_pretrained` directory with the tokenizer `train_tokenizer` took
    from the same file, for every later stage to load."""
    tokenizer = load_tokenizer(tokenizer_dir)
    model = load_causal_lm(gguf_file)
    check_vocabulary(model, tokenizer, gguf_file)
    with atomic_dir(out) as tmp:
        save_pretrained(model, tokenizer, tmp)
    return {"trained": False, "steps": 0, "converted_from_gguf": True, **parameter_counts(model)}


def from_project(root: Path, tokenized: Path, tokenizer_dir: Path, out: Path, params: PretrainParams, checkpoint_dir: Path | None = None,
                 tracker=None, log=None, replay_answers: Path | None = None) -> dict:  # fmt: skip
    """What the stage does in project `root`, by its base model (`pipelines.base_model`): `run` on a
    model built from `params.model` (no base), `run` continuing the base (`continue_base`), or no
    training: a GGUF base converted (`convert_base`), any other base pointed to (`point_to_base`).
    `log`: a logger for what it chose (the stage's)."""
    say = log.info if log is not None else (lambda *args: None)
    record = model_source.current(root)
    if record["name"] is not None and not params.continue_base:
        if record.get("kind") == "gguf":
            say("pretrain: nothing to train; converting the GGUF base %s to a model directory (base_model.name)", record["name"])
            return convert_base(model_source.location(record, project_root(root)), tokenizer_dir, out)
        say("pretrain: nothing to train, the base model is %s (base_model.name)", record["name"])
        return point_to_base(out, record)
    base = model_source.location(record, project_root(root)) if record["name"] is not None else None
    if base is not None:
        say("pretrain: continuing to pretrain the base %s on the text (pretrain.continue_base)", record["name"])
    return run(tokenized, tokenizer_dir, out, params, checkpoint_dir, tracker, base=base, replay_answers=replay_answers)


def body(ctx: stage.StageContext) -> dict:

    metrics = from_project(ctx.root, ctx.input("tokenized"), ctx.input("tokenizer"), ctx.output(), ctx.params, ctx.checkpoint_dir, ctx.tracker, ctx.log,
                           ctx.input("base_answers"))  # fmt: skip
    if metrics.get("trained") is False:
        return metrics
    ctx.log.info(
        "%s %d parameters for %d steps: val/loss %.4f (perplexity %.2f, vocabulary %d), %d tokens/s", "continued pretraining" if metrics["continued"] else "pretrained",
        metrics["total_parameters"], metrics["steps"], metrics["val/loss"], metrics["val/perplexity"],
        metrics["vocab_size"], metrics["tokens_per_second"],
    )
    return metrics


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
