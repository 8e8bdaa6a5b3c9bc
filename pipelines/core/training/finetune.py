"""Instruction tuning on chat records: the one code path behind `sft` and `lora`.

Load the base model and tokenizer, render and mask the chats (`pipelines.core.data.chat_examples`), pack them,
wrap the model (`sft`: as is; `lora`: PEFT adapters), train with the shared loop, save. The two
stages differ only in the `wrap` and `save` functions they pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from pipelines.core.data import chat_examples, replay
from pipelines.core.data.chat_template import parse_messages
from pipelines.core.errors import QllmError
from pipelines.core.models import footprint, quantize
from pipelines.core.models.model_source import follow
from pipelines.core.models.models import (
    context_length,
    device,
    load_model_and_tokenizer,
    load_tokenizer,
    parameter_counts,
    seeded,
)
from pipelines.core.params.finetuning import FinetuneParams, QuantizationParams
from pipelines.core.training import chunked_loss, loop, objectives, progressive
from pipelines.core.training.checkpoint import CheckpointManager

log = logging.getLogger("qllm.finetune")

Wrap = Callable[[torch.nn.Module, Any], torch.nn.Module]  # (model, tokenizer) -> model to train
Save = Callable[[torch.nn.Module, Any, Path], None]


def resolve_base(ctx, tracked: Path):
    """The stage's params with a relative `base_model` path made absolute (the stage may run in a
    run workspace); warns when it is not `tracked`, the base model directory dvc.yaml lists as the
    stage's dependency (`ctx.input("models/pretrain")`). `ctx.params` itself stays as loaded (its
    fingerprint names the checkpoints)."""
    base = ctx.params.base_model
    if ctx.root / base != tracked:
        ctx.log.warning("%s.base_model=%s is not a dependency in dvc.yaml: DVC will not notice when it changes", ctx.name, base)
    if (ctx.root / base).exists():
        return ctx.params.model_copy(update={"base_model": str(ctx.root / base)})
    return ctx.params


def conversations(chat_dir: Path, split: str) -> list[list[dict]]:
    frame = pd.read_parquet(chat_dir / f"{split}.parquet", columns=["messages"])
    return [parse_messages(m) for m in frame["messages"]]


def build_rows(tokenizer, chat_dir: Path, params: FinetuneParams, max_len: int, replay_answers: Path | None = None,
               desc: str = "finetune") -> tuple[list, list, dict[str, float]]:  # fmt: skip
    """Training and validation rows plus the encoding counts (truncated, dropped, tokens). With
    `params.replay.fraction` (sft, lora), the base's answers in `replay_answers` (a `base_answers`
    output) mixed into the training rows (`pipelines.core.data.replay`)."""
    metrics: dict[str, float] = {}
    rows = {}
    for split in ("train", "validation"):
        examples, stats = chat_examples.encode(tokenizer, conversations(chat_dir, split), max_len, params.loss_on, params.overflow)
        metrics |= stats.as_metrics(f"data/{split}_")
        fraction = getattr(getattr(params, "replay", None), "fraction", 0.0)
        if split == "train" and fraction:
            if replay_answers is None:
                raise QllmError(f"{desc}.replay.fraction={fraction}: this run has no base model answers to replay")
            replayed, counts = replay_examples(tokenizer, replay_answers, fraction, stats.target_tokens, max_len, f"{desc}.replay.fraction",
                                               params.loss_on)  # fmt: skip
            metrics |= {f"data/{k}": v for k, v in counts.items()}
            log.info("%s: replay: %d of the base's answers (%d trained tokens, %.1f%% of the trained tokens)", desc, counts["replay_examples"],
                     counts["replay_target_tokens"], 100 * counts["replay_share"])  # fmt: skip
            examples = _interleaved(examples, replayed)
        if stats.truncated or stats.dropped_too_long or stats.dropped_no_target:
            log.warning(
                "%s: %d examples longer than %d tokens were %s, %d had no trained token left and were dropped",
                split, stats.truncated + stats.dropped_too_long, max_len,
                "truncated" if params.overflow == "truncate" else "dropped", stats.dropped_no_target,
            )
        rows[split] = chat_examples.pack(examples, max_len) if params.packing else chat_examples.unpacked(examples)
        metrics[f"data/{split}_rows"] = len(rows[split])
    if not rows["train"]:
        raise QllmError(f"{chat_dir / 'train.parquet'}: no chat example left to train on")
    return rows["train"], rows["validation"], metrics


def _interleaved(task: list, replayed: list) -> list:
    """Replay examples spread evenly among the task's, each at its share of the way through
    (packing keeps the order of examples of equal length; without packing, the rows' order)."""
    keyed = [((i + 0.5) / len(task), 0, i, e) for i, e in enumerate(task)] + [((j + 0.5) / len(replayed), 1, j, e) for j, e in enumerate(replayed)]
    return [e for *_, e in sorted(keyed, key=lambda k: k[:3])]


def replay_examples(tokenizer, directory: Path, fraction: float, task_tokens: int, max_len: int, key: str = "replay.fraction",
             loss_on: str = "assistant") -> tuple[list[chat_examples.Example], dict[str, float]]:  # fmt: skip
    """Replay examples making up `fraction` of the trained tokens beside `task_tokens` of the task's,
    and their counts. `key` names the setting in errors."""
    reference = replay.read(directory)
    if reference is None:
        raise QllmError(f"{key}={fraction}: replay mixes in the base model's own answers, and {directory} holds none "
                        "(no base model: base_model.name is null); set it to 0, or fine-tune a base model")  # fmt: skip
    chats = replay.conversations(reference[0])
    encoded, _ = chat_examples.encode(tokenizer, chats, max_len, loss_on, "truncate")
    encoded = [e for e in encoded if (e.labels != chat_examples.IGNORE).any()]
    if not encoded:
        raise QllmError(f"{key}: none of the base's answers to the train third of the general prompts has a token to train on ({directory})")
    wanted = fraction / (1.0 - fraction) * task_tokens
    chosen, trained = [], 0
    while trained < wanted:
        example = encoded[len(chosen) % len(encoded)]
        chosen.append(example)
        trained += int((example.labels != chat_examples.IGNORE).sum())
    share = trained / (trained + task_tokens) if trained + task_tokens else 0.0
    return chosen, {"replay_examples": len(chosen), "replay_target_tokens": trained, "replay_share": round(share, 4)}


def preflight(params: FinetuneParams, quantization: QuantizationParams | None, desc: str, probe: bool = False, seq_len: int = 0,
              lora_rank: int = 0) -> dict[str, float]:  # fmt: skip
    """Before the base loads: what the stage will need (`footprint.preflight`) for micro-batches of
    rows of `seq_len` tokens (0: `max_seq_len`, else the model's context). `probe`: probe_lora at a
    frozen base (gradients recorded, no optimizer). `lora_rank`: the rank adapters train at (the
    largest, counted on every module)."""
    method = footprint.method_for(quantization is not None, getattr(quantization, "quantization", "none"), probe)
    try:
        base = follow(params.base_model)
    except (OSError, ValueError) as exc:
        log.info("%s: no memory estimate for this base (%s)", desc, exc)
        return {}
    return footprint.preflight(base, params.train, method=method, seq_len=seq_len or params.max_seq_len, micro_batch=params.train.micro_batch_size,
                               lora_rank=lora_rank, desc=desc)  # fmt: skip


def rows_and_estimate(params: FinetuneParams, chat_dir: Path, quantization: QuantizationParams | None, desc: str,
                      probe: bool = False, lora_rank: int = 0, replay_answers: Path | None = None) -> tuple[list, list, dict[str, float], dict[str, float]]:  # fmt: skip
    """(train rows, validation rows, their counts, the stage's estimate), before the model loads:
    the rows are built with the base's tokenizer (`max_seq_len`, else the model's context), and
    the estimate is for micro-batches of the longest of them, the shape training will have (not the
    context: SmolLM2's 8,192 tokens a row would be estimated at 350 GB for rows of 40)."""
    tokenizer = load_tokenizer(params.base_model)
    max_len = params.max_seq_len or context_length(params.base_model)
    train_rows, val_rows, metrics = build_rows(tokenizer, chat_dir, params, max_len, replay_answers, desc)
    longest = max(len(row.input_ids) for row in train_rows)
    return train_rows, val_rows, metrics, preflight(params, quantization, desc, probe, seq_len=longest, lora_rank=lora_rank)


def run(
    chat_dir: Path,
    out: Path,
    params: FinetuneParams,
    *,
    wrap: Wrap,
    save: Save,
    tracker=None,
    checkpoint_dir: Path | None = None,
    desc: str = "finetune",
    quantization: QuantizationParams | None = None,
    quantization_section: str = "",
    extensions: Callable[[torch.nn.Module, Any], list] | None = None,
    lora_rank: int = 0,
    replay_answers: Path | None = None,
) -> dict[str, Any]:
    """Fine-tune `params.base_model` on `chat_dir/{train,validation}.parquet`; save to `out`.
    `quantization`: a quantized, frozen base (QLoRA), as the section `quantization_section` asks.
    `extensions(model, tracker)`: loop extensions for the wrapped model (e.g. rank allocation).
    `lora_rank`: the largest rank the adapters train at, for the memory estimate. `replay_answers`:
    the run's `base_answers` output, what `params.replay` mixes in."""
    cfg = params.train
    qconfig = quantize.from_params(quantization, cfg.precision, quantization_section or desc)
    train_rows, val_rows, metrics, estimates = rows_and_estimate(params, chat_dir, quantization, desc, lora_rank=lora_rank, replay_answers=replay_answers)
    model, tokenizer = load_model_and_tokenizer(params.base_model) if qconfig is None else quantize.load(params.base_model, qconfig, desc)
    with seeded(cfg.seed):  # adapter initialisation is random: make it a function of the seed
        model = wrap(quantize.for_adapters(model, qconfig, cfg.gradient_checkpointing), tokenizer)
    counts = parameter_counts(model)
    if qconfig is not None:
        counts |= quantize.linear_weight_bytes(model) | {"quantization": quantization.quantization,  # the base the adapter fits
                                                         "embedding_dtype": quantize.embedding_dtype(model)}  # fmt: skip
    counts["trainable_fraction"] = round(counts["trainable_parameters"] / counts["total_parameters"], 6)
    log.info("%s: %d of %d parameters trainable (%.2f%%)", desc, counts["trainable_parameters"], counts["total_parameters"], 100 * counts["trainable_fraction"])
    if tracker is not None:
        tracker.log_params({f"{desc}.{k}": v for k, v in counts.items()})

    collate_train = chat_examples.collate(train_rows, tokenizer.pad_token_id, params.packing)
    batches = loop.Batches(len(train_rows), cfg.micro_batch_size, cfg.seed, collate_train)
    loss_fn = objectives.chat_objective(model)  # the chat loss, or the masked-diffusion objective on answer tokens
    loss_fn = chunked_loss.for_loop(loss_fn, model, cfg, desc)
    val_fn = None
    if val_rows:
        collate_val = chat_examples.collate(val_rows, tokenizer.pad_token_id, params.packing)
        n_val = len(val_rows) if not cfg.eval_batches else min(len(val_rows), cfg.eval_batches * cfg.micro_batch_size)
        val_batches = [collate_val(np.arange(i, min(i + cfg.micro_batch_size, n_val))) for i in range(0, n_val, cfg.micro_batch_size)]

        def val_fn(m: torch.nn.Module) -> dict[str, float]:
            return {"val/loss": loop.mean_loss(m, val_loss, val_batches, device(), cfg.precision)}

        val_loss = loss_fn if cfg.loss_chunk_tokens else chat_examples.chat_loss
        if not cfg.loss_chunk_tokens and loss_fn is not chat_examples.chat_loss:  # masked diffusion: the NELBO bound of the answers
            val_fn = objectives.nelbo_fn(loss_fn, val_batches, cfg.precision)

    checkpoints = CheckpointManager(checkpoint_dir, cfg.keep_checkpoints) if checkpoint_dir else None
    grow = getattr(params, "progressive", None)  # sft's; adapters (lora) train on a frozen base
    growth = progressive.Growth(grow, cfg, model, desc, trained=True) if grow is not None and grow.enabled else None  # the base: stack 1
    result = loop.train(model, loss_fn, batches, cfg, val_fn=val_fn, tracker=tracker, checkpoints=checkpoints,
                            extensions=extensions(model, tracker) if extensions else (), schedule=growth, desc=desc)  # fmt: skip
    if growth is not None:
        model.requires_grad_(True)  # a growth phase may have left layers frozen

    def save_all(tmp: Path) -> None:
        save(model.cpu(), tokenizer, tmp)
        if growth is not None and grow.save_stacks:
            progressive.save_stacks(model, grow.stacks, tmp)

    result = loop.finish(result, out, save_all)
    return {**result, **counts, **metrics, **estimates}
