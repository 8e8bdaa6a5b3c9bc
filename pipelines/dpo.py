"""Direct preference optimisation from cached reference log-probabilities.

    python -m pipelines.dpo        # what dvc.yaml runs; writes data/models/dpo/

The policy starts from the reference model of `ref_logprobs` (the SFT model), either
with all weights trainable (`dpo.adapter: none`) or with a LoRA adapter built by the LoRA stage's
code (`dpo.adapter: lora`, settings in `dpo.lora`). Each step runs the policy once over the
concatenated chosen and rejected sequences; the reference log-probabilities come from
`data/ref_logprobs/`, so the reference model is never run here. The loss is
`pipelines.core.training.losses.preference_loss` (`dpo.loss_type`, `dpo.beta`, `dpo.label_smoothing`), plus
`dpo.sft_weight` times the chosen answers' per-token NLL (RPO) when it is set.

Logged per step and on validation (`val/...`) with the names TRL uses: `rewards/chosen`,
`rewards/rejected`, `rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`,
plus `kl/chosen` (mean policy - reference log-probability of the chosen answers). After training
the same metrics on the held-out pairs (test split) are reported as `heldout/...`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from pipelines.core.config import DpoParams
from pipelines.core.errors import QllmError
from pipelines.core.models import adapters, footprint, quantize
from pipelines.core.models.models import CONSTRUCTION, device, load_for_inference, parameter_counts, save_pretrained
from pipelines.core.outputs import read_json, write_json
from pipelines.core.run import stage
from pipelines.core.training import loop, preference_data
from pipelines.core.training.checkpoint import CheckpointManager
from pipelines.core.training.losses import preference_loss, reward_metrics

NAME = "dpo"

Reference = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]


def dpo_loss(params: DpoParams, reference: Reference | None = None):
    """`loss_fn(model, batch)` for the training loop. `reference` None uses the batch's cached
    reference log-probabilities; a function computes them every step (for benchmarks)."""

    def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
        policy_chosen, policy_rejected = preference_data.sequence_logps(model, batch)
        if reference is None:
            ref_chosen, ref_rejected = batch["ref_chosen"], batch["ref_rejected"]
        else:
            with torch.no_grad():
                ref_chosen, ref_rejected = reference(batch)
        losses, chosen_rewards, rejected_rewards = preference_loss(
            policy_chosen, policy_rejected, ref_chosen, ref_rejected,
            beta=params.beta, loss_type=params.loss_type, label_smoothing=params.label_smoothing,
        )  # fmt: skip
        metrics = reward_metrics(chosen_rewards, rejected_rewards, policy_chosen, policy_rejected, ref_chosen)
        loss = losses.mean()
        if params.sft_weight:
            chosen_tokens = batch["completion_tokens"][: len(policy_chosen)].clamp(min=1)
            nll = (-policy_chosen / chosen_tokens).mean()
            metrics["nll/chosen"] = nll.item()
            loss = loss + params.sft_weight * nll
        return loss, metrics

    return loss_fn


def evaluate_pairs(model, loss_fn, pairs: list[preference_data.Pair], pad_id: int, batch_size: int, precision: str, prefix: str) -> dict[str, float]:
    """Loss and reward metrics over all `pairs` (eval mode, no gradients), as `<prefix>/...`."""
    if not pairs:
        return {}
    was_training = model.training
    model.eval()
    make = preference_data.collate(pairs, pad_id)
    totals: dict[str, float] = {}
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            indices = np.arange(start, min(start + batch_size, len(pairs)))
            batch = loop.to_device(make(indices), device())
            with loop.autocast(device(), precision):
                loss, metrics = loss_fn(model, batch)
            for key, value in {"loss": float(loss), **metrics}.items():
                totals[key] = totals.get(key, 0.0) + value * len(indices)
    model.train(was_training)
    return {f"{prefix}/{k}": v / len(pairs) for k, v in totals.items()}


def load_pairs(ref_dir: Path, split: str) -> list[preference_data.Pair]:
    path = ref_dir / f"{split}.parquet"
    return preference_data.from_frame(pd.read_parquet(path)) if path.exists() else []


def run(root: Path, ref_dir: Path, out: Path, params: DpoParams, tracker=None, checkpoint_dir: Path | None = None) -> dict:
    cfg = params.train
    reference = read_json(ref_dir / "meta.json")["reference"]  # the model the reference pass used
    qconfig = quantize.from_params(params.lora, cfg.precision, "dpo.lora") if params.adapter == "lora" else None
    train_pairs, val_pairs, heldout_pairs = (load_pairs(ref_dir, s) for s in ("train", "validation", "test"))
    if not train_pairs:
        raise QllmError(f"{ref_dir / 'train.parquet'}: no preference pairs to train on")
    method = footprint.method_for(params.adapter == "lora", params.lora.quantization)
    estimates = footprint.preflight(root / reference, cfg, method=method, seq_len=max(max(len(p.chosen_ids), len(p.rejected_ids)) for p in train_pairs),
                                    micro_batch=2 * cfg.micro_batch_size, lora_rank=params.lora.r, desc=NAME)  # chosen and rejected rows  # fmt: skip
    model, tokenizer = load_for_inference(root / reference, root) if qconfig is None else quantize.load(root / reference, qconfig, "dpo.lora")
    with CONSTRUCTION:
        torch.manual_seed(cfg.seed)
        model = quantize.for_adapters(model, qconfig, cfg.gradient_checkpointing)
        if params.adapter == "lora":
            model = adapters.wrap(params.lora, "dpo.lora")(model, tokenizer)
    counts = parameter_counts(model)
    if qconfig is not None:
        counts |= quantize.linear_weight_bytes(model)
    if tracker is not None:
        tracker.log_params({f"dpo.{k}": v for k, v in counts.items()} | {"dpo.reference": reference})

    loss_fn = dpo_loss(params)
    pad = tokenizer.pad_token_id
    batches = loop.Batches(len(train_pairs), cfg.micro_batch_size, cfg.seed, preference_data.collate(train_pairs, pad))
    val_fn = None
    if val_pairs:

        def val_fn(m: torch.nn.Module) -> dict[str, float]:
            return evaluate_pairs(m, loss_fn, val_pairs, pad, cfg.micro_batch_size, cfg.precision, "val")

    checkpoints = CheckpointManager(checkpoint_dir, cfg.keep_checkpoints) if checkpoint_dir else None
    result = loop.train(model, loss_fn, batches, cfg, val_fn=val_fn, tracker=tracker, checkpoints=checkpoints, desc=NAME)
    heldout = evaluate_pairs(model, loss_fn, heldout_pairs, pad, cfg.micro_batch_size, cfg.precision, "heldout")
    if tracker is not None and heldout:
        tracker.log_metrics(heldout, step=result["steps"])

    def save(tmp: Path) -> None:
        if params.adapter == "lora":
            quantized_base = (str(root / reference), qconfig) if qconfig is not None else None
            adapters.save(reference, params.lora.merge, quantized_base)(model if qconfig is not None else model.cpu(), tokenizer, tmp)
        else:
            save_pretrained(model.cpu(), tokenizer, tmp, max_length=model.config.max_position_embeddings)
        # how the policy was trained, so `evaluate` can report its implicit rewards β·(π − ref)
        write_json(tmp / preference_data.PREFERENCE_CONFIG, {"beta": params.beta, "loss_type": params.loss_type, "reference": reference})

    result = loop.finish(result, out, save)
    return {**result, **counts, **heldout, "reference": reference, "train_pairs": len(train_pairs), **estimates}


def body(ctx: stage.StageContext) -> dict:
    metrics = run(ctx.root, ctx.input("ref_logprobs"), ctx.output(), ctx.params, ctx.tracker, ctx.checkpoint_dir)
    ctx.log.info(
        "dpo (beta %.3g, %s): %d steps; validation rewards/accuracies %.3f; held-out rewards/accuracies %.3f, margins %.3f",
        ctx.params.beta, ctx.params.loss_type, metrics["steps"], metrics.get("val/rewards/accuracies", float("nan")),
        metrics.get("heldout/rewards/accuracies", float("nan")), metrics.get("heldout/rewards/margins", float("nan")),
    )
    return metrics


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
