"""Preference optimisation: DPO and TRL's other DPO losses, KTO, ORPO and SimPO.

    python -m pipelines.dpo        # what dvc.yaml runs; writes data/models/dpo/

The policy starts from the model `ref_logprobs` names (`dpo.start`: the SFT model, or the base),
either with all weights trainable or with a LoRA adapter built by the LoRA stage's code
(`dpo.adapter.enabled: true`, the same `adapter` block as `lora.adapter`). Each step runs the policy once over the
concatenated chosen and rejected sequences (KTO: over its examples, and once more without
gradients over their mismatched KL pairs). The reference log-probabilities come from
`data/ref_logprobs/`, so the reference model is never run here. The losses are
`pipelines.core.preference.losses`, by `dpo.method`:

- `dpo`: `preference_loss` with `dpo.loss_type` (sigmoid, hinge, ipo, ipo_sum, robust, exo_pair,
  nca_pair, bco_pair, sppo_hard, apo_zero, apo_down, discopop), `dpo.beta`, `dpo.label_smoothing`;
- `kto`: `kto_loss` on the unpaired examples, `dpo.desirable_weight`/`dpo.undesirable_weight`;
- `simpo`: `reference_free_loss` on per-token average log-probabilities, `dpo.simpo_gamma`;
- `orpo`: the chosen answers' NLL plus `reference_free_loss`'s odds-ratio term (weight `dpo.beta`).

`dpo.sft_weight` adds that times the chosen answers' per-token NLL (dpo: RPO; simpo: CPO-SimPO).
`dpo.replay` adds `replay.weight` times the per-token NLL of the base's own answers to the general
prompts' train third (`base_answers`), `replay.fraction` of the trained tokens: each item of the
training data carries its share of them, so a step's replay follows from its items and a resumed
run replays what the uninterrupted one would (`replay_batches`; metric `replay/nll`).
Logged per step and on validation (`val/...`) with the names TRL uses: `rewards/chosen`,
`rewards/rejected`, `rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`
(plus `kl/chosen` with a reference; `kl` for KTO; `nll_loss`, `log_odds_ratio`, `log_odds_chosen`
for ORPO). After training the same metrics on the held-out split are reported as `heldout/...`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from pipelines.core.data import chat_examples
from pipelines.core.errors import QllmError
from pipelines.core.models import adapters, footprint, quantize
from pipelines.core.models.models import (
    device,
    load_for_inference,
    parameter_counts,
    save_pretrained,
    seeded,
)
from pipelines.core.outputs import read_json, write_json
from pipelines.core.params.preference import DpoParams
from pipelines.core.preference import preference_data
from pipelines.core.preference.losses import (
    kto_loss,
    kto_weight_advice,
    preference_loss,
    reference_free_loss,
    reward_metrics,
)
from pipelines.core.run import stage
from pipelines.core.training import finetune, loop
from pipelines.core.training.checkpoint import CheckpointManager

NAME = "dpo"
SECTION = "dpo.adapter"
"""Where the adapter's settings are in params (errors name their keys under it)."""
HEADLINE = ("heldout/rewards/accuracies", "heldout/rewards/margins", "heldout/kl")

Reference = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]


def _nll(policy_chosen: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """The chosen answers' NLL per token over the batch (TRL's cross-entropy on them)."""
    return -policy_chosen.sum() / chosen_tokens.sum().clamp(min=1)


def dpo_loss(params: DpoParams, reference: Reference | None = None):
    """`loss_fn(model, batch)` for the training loop, for `params.method`. `reference` None uses the
    batch's cached reference log-probabilities; a function computes them every step (benchmarks)."""
    if params.method == "kto":
        return _kto_loss(params)

    def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
        policy_chosen, policy_rejected = preference_data.sequence_logps(model, batch)
        tokens = batch["completion_tokens"].to(policy_chosen.device).float()
        chosen_tokens, rejected_tokens = tokens[: len(policy_chosen)], tokens[len(policy_chosen) :]
        if params.method == "dpo":
            if reference is None:
                ref_chosen, ref_rejected = batch["ref_chosen"], batch["ref_rejected"]
            else:
                with torch.no_grad():
                    ref_chosen, ref_rejected = reference(batch)
            losses, chosen_rewards, rejected_rewards = preference_loss(
                policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=params.beta, loss_type=params.dpo_loss_type,
                label_smoothing=params.label_smoothing, chosen_tokens=chosen_tokens, rejected_tokens=rejected_tokens,
                discopop_tau=params.discopop_tau,
            )  # fmt: skip
            metrics = reward_metrics(chosen_rewards, rejected_rewards, policy_chosen, policy_rejected, ref_chosen)
            loss = losses.mean()
        else:  # reference-free: per-token averages
            chosen_avg, rejected_avg = policy_chosen / chosen_tokens.clamp(min=1), policy_rejected / rejected_tokens.clamp(min=1)
            losses, chosen_rewards, rejected_rewards, extra = reference_free_loss(
                params.method, chosen_avg, rejected_avg, beta=params.beta, gamma=params.simpo_gamma, label_smoothing=params.label_smoothing
            )
            metrics = reward_metrics(chosen_rewards, rejected_rewards, chosen_avg, rejected_avg, None) | extra
            loss = losses.mean()
        weight = 1.0 if params.method == "orpo" else params.sft_weight
        if weight:
            nll = _nll(policy_chosen, chosen_tokens)
            metrics["nll_loss" if params.method == "orpo" else "nll/chosen"] = nll.item()
            loss = loss + weight * nll
        return loss, metrics

    return loss_fn


def with_replay(loss_fn, weight: float):
    """`loss_fn` plus `weight` times the per-token NLL of the batch's replay rows (`replay_batches`),
    where it has any; logged as `replay/nll`."""

    def replayed(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
        rows = {k.removeprefix("replay_"): batch[k] for k in ("replay_input_ids", "replay_attention_mask", "replay_labels") if k in batch}
        loss, metrics = loss_fn(model, {k: v for k, v in batch.items() if not k.startswith("replay_")})
        if rows:
            nll = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"], labels=rows["labels"], use_cache=False).loss
            metrics = {**metrics, "replay/nll": nll.item()}
            loss = loss + weight * nll
        return loss, metrics

    return replayed


def trained_tokens(item) -> int:
    """The tokens a preference item's loss is computed on: both answers of a pair, a KTO example's completion."""
    if isinstance(item, preference_data.Pair):
        return len(item.chosen_ids) + len(item.rejected_ids) - 2 * item.prompt_length
    return len(item.ids) - item.prompt_length


def replay_batches(make: Callable[[np.ndarray], dict], items: list, replayed: list[chat_examples.Example], pad_id: int) -> Callable[[np.ndarray], dict]:
    """`make` with the replay examples added: example j goes with item floor((j + 1/2) N / M) of
    the N items (M examples, spread evenly), and a batch of items carries theirs as right-padded
    `replay_input_ids`, `replay_attention_mask` and `replay_labels` rows (-100 where no loss)."""
    owned: dict[int, list[int]] = {}
    for j in range(len(replayed)):
        owned.setdefault(int((j + 0.5) * len(items) / len(replayed)), []).append(j)

    def batch(indices: np.ndarray) -> dict:
        out = make(indices)
        rows = [replayed[j] for i in np.sort(indices) for j in owned.get(int(i), [])]
        if rows:
            ids, attention, _ = preference_data.right_padded([r.input_ids for r in rows], [0] * len(rows), pad_id)
            labels = torch.full_like(ids, chat_examples.IGNORE)
            for k, r in enumerate(rows):
                labels[k, : len(r.labels)] = torch.from_numpy(r.labels)
            out |= {"replay_input_ids": ids, "replay_attention_mask": attention, "replay_labels": labels}
            if "num_tokens" in out:  # what throughput counts
                out["num_tokens"] += int(attention.sum())
        return out

    return batch


def _kto_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The examples' completion log-probabilities, and their KL rows' without gradients: each
    prompt run once for both where the model allows it (`preference_data.shares_prompt`)."""
    if not preference_data.shares_prompt(model):
        logps = preference_data.row_logps(model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
        with torch.no_grad():
            return logps, preference_data.row_logps(model, batch["kl_input_ids"], batch["kl_attention_mask"], batch["kl_completion_mask"])
    prompt_mask = batch["prompt_mask"]
    first, cache = preference_data.prompt_cache(model, batch["prompt_ids"], prompt_mask)
    logps = preference_data.continuation_logps(model, first, cache, prompt_mask, batch["completion_ids"], batch["completion_only_mask"])
    cache.crop(-batch["completion_ids"].shape[1])  # back to the prompts (transformers: a negative count removes that many)
    with torch.no_grad():
        kl_logps = preference_data.continuation_logps(model, first.detach(), cache, prompt_mask, batch["kl_completion_ids"], batch["kl_completion_only_mask"])
    return logps, kl_logps


def _kto_loss(params: DpoParams):
    def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
        logps, kl_logps = _kto_logps(model, batch)
        device = logps.device
        return kto_loss(logps, batch["desirable"].to(device), batch["ref"].to(device), kl_logps, batch["ref_kl"].to(device), beta=params.beta,
                        desirable_weight=params.desirable_weight, undesirable_weight=params.undesirable_weight)  # fmt: skip

    return loss_fn


def evaluate_pairs(model, loss_fn, items: list, make: Callable[[np.ndarray], dict], batch_size: int, precision: str, prefix: str) -> dict[str, float]:
    """Loss and metrics over all `items` (pairs or KTO examples, batched by `make`; eval mode, no
    gradients), as `<prefix>/...`: each a mean over the items of the batches that log it."""
    if not items:
        return {}
    was_training = model.training
    model.eval()
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    with torch.no_grad():
        for start in range(0, len(items), batch_size):
            indices = np.arange(start, min(start + batch_size, len(items)))
            batch = loop.to_device(make(indices), device())
            with loop.autocast(device(), precision):
                loss, metrics = loss_fn(model, batch)
            for key, value in {"loss": float(loss), **metrics}.items():
                totals[key] = totals.get(key, 0.0) + value * len(indices)
                counts[key] = counts.get(key, 0) + len(indices)
    model.train(was_training)
    return {f"{prefix}/{k}": v / counts[k] for k, v in totals.items()}


def load_pairs(ref_dir: Path, split: str) -> list[preference_data.Pair]:
    path = ref_dir / f"{split}.parquet"
    return preference_data.from_frame(pd.read_parquet(path)) if path.exists() else []


def load_examples(ref_dir: Path, split: str) -> list[preference_data.Example]:
    path = ref_dir / f"unpaired_{split}.parquet"
    return preference_data.examples_from_frame(pd.read_parquet(path)) if path.exists() else []


def _data(ref_dir: Path, params: DpoParams, meta: dict) -> tuple[dict[str, list], int]:
    """Per split the items (pairs, or KTO examples) `ref_logprobs` encoded; and the longest row
    (read before the model loads: the memory estimate needs it)."""
    if meta.get("method", "dpo") != params.method:  # the DAG lists dpo.method for ref_logprobs: only a hand-made directory gets here
        raise QllmError(f"{ref_dir / 'meta.json'}: encoded for method {meta.get('method', 'dpo')!r}, but dpo.method is {params.method!r}; rerun ref_logprobs")
    load = load_examples if params.method == "kto" else load_pairs
    data = {split: load(ref_dir, split) for split in ("train", "validation", "test")}
    train = data["train"]
    if not train:
        raise QllmError(f"{ref_dir / ('unpaired_train.parquet' if params.method == 'kto' else 'train.parquet')}: no preference data to train on")
    longest = max(max(len(e.ids), len(e.kl_ids)) for e in train) if params.method == "kto" else max(max(len(p.chosen_ids), len(p.rejected_ids)) for p in train)
    return data, longest


def run(root: Path, ref_dir: Path, out: Path, params: DpoParams, tracker=None, checkpoint_dir: Path | None = None, log=None,
        replay_answers: Path | None = None) -> dict:  # fmt: skip
    """Train the policy (`params`) on `ref_dir`'s items; with `params.replay.fraction`, the base's
    answers in `replay_answers` (a `base_answers` output) as the replay NLL term."""
    cfg = params.train
    meta = read_json(ref_dir / "meta.json")
    start = meta.get("start", meta["reference"])  # the model the policy starts from (and the reference pass used, if any)
    adapter = params.adapter
    qconfig = quantize.from_params(adapter.base_quantization, cfg.precision, SECTION) if adapter.enabled else None
    data, longest = _data(ref_dir, params, meta)
    if params.method == "kto":
        train = data["train"]
        desirable = sum(e.desirable for e in train)
        advice = kto_weight_advice(desirable, len(train) - desirable, params.desirable_weight, params.undesirable_weight)
        if advice and log is not None:
            log.warning("dpo.method kto: %s", advice)
    method = footprint.method_for(adapter.enabled, adapter.quantization)
    lora_rank = max([adapter.r, *adapter.rank_pattern.values()]) if adapter.enabled else 0
    estimates = footprint.preflight(root / start, cfg, method=method, seq_len=longest, micro_batch=2 * cfg.micro_batch_size, lora_rank=lora_rank,
                                    desc=NAME)  # two rows an item: chosen and rejected, or an example and its KL pair  # fmt: skip
    model, tokenizer = load_for_inference(root / start, root) if qconfig is None else quantize.load(root / start, qconfig, SECTION)
    with seeded(cfg.seed):
        model = quantize.for_adapters(model, qconfig, cfg.gradient_checkpointing)
        if adapter.enabled:
            model = adapters.wrap(adapter, SECTION)(model, tokenizer)
    counts = parameter_counts(model)
    if qconfig is not None:
        counts |= quantize.linear_weight_bytes(model)
    if tracker is not None:
        tracker.log_params({f"dpo.{k}": v for k, v in counts.items()} | {"dpo.reference": meta["reference"], "dpo.start_model": start})

    loss_fn = dpo_loss(params)
    collate = preference_data.collate_examples if params.method == "kto" else preference_data.collate
    (train, make_train), (val, make_val), (heldout, make_heldout) = ((data[s], collate(data[s], tokenizer.pad_token_id)) for s in ("train", "validation", "test"))
    replayed = {}
    if params.replay.fraction:
        if replay_answers is None:
            raise QllmError(f"dpo.replay.fraction={params.replay.fraction}: this run has no base model answers to replay")
        examples, replayed = finetune.replay_examples(tokenizer, replay_answers, params.replay.fraction, sum(map(trained_tokens, train)),
                                                      model.config.max_position_embeddings, "dpo.replay.fraction")  # fmt: skip
        make_train = replay_batches(make_train, train, examples, tokenizer.pad_token_id)
        loss_fn = with_replay(loss_fn, params.replay.weight)
        if log is not None:
            log.info("dpo: replay: %d of the base's answers (%d trained tokens, %.1f%% of the trained tokens), weight %g", replayed["replay_examples"],
                     replayed["replay_target_tokens"], 100 * replayed["replay_share"], params.replay.weight)  # fmt: skip
    batches = loop.Batches(len(train), cfg.micro_batch_size, cfg.seed, make_train)
    val_fn = None
    if val:

        def val_fn(m: torch.nn.Module) -> dict[str, float]:
            return evaluate_pairs(m, loss_fn, val, make_val, cfg.micro_batch_size, cfg.precision, "val")

    checkpoints = CheckpointManager(checkpoint_dir, cfg.keep_checkpoints) if checkpoint_dir else None
    result = loop.train(model, loss_fn, batches, cfg, val_fn=val_fn, tracker=tracker, checkpoints=checkpoints, desc=NAME)
    heldout_metrics = evaluate_pairs(model, loss_fn, heldout, make_heldout, cfg.micro_batch_size, cfg.precision, "heldout")
    if tracker is not None and heldout_metrics:
        tracker.log_metrics(heldout_metrics, step=result["steps"])

    def save(tmp: Path) -> None:
        if adapter.enabled:
            quantized_base = (str(root / start), qconfig) if qconfig is not None else None
            adapters.save(start, adapter.merge, quantized_base)(model if qconfig is not None else model.cpu(), tokenizer, tmp)
        else:
            save_pretrained(model.cpu(), tokenizer, tmp, max_length=model.config.max_position_embeddings)
        # how the policy was trained, so `evaluate` can report its implicit rewards β·(π − ref)
        write_json(tmp / preference_data.PREFERENCE_CONFIG, preference_config(params, meta["reference"]))

    result = loop.finish(result, out, save)
    sizes = {"train_examples": len(train)} if params.method == "kto" else {"train_pairs": len(train)}
    return {**result, **counts, **heldout_metrics, "reference": meta["reference"], "start": start, **sizes, **replayed, **estimates}


def preference_config(params: DpoParams, reference: str | None) -> dict:
    """What `preference_data.PREFERENCE_CONFIG` records of how the policy was trained: the method,
    its beta and reference, and only the settings the method read (`evaluate` reports the implicit
    rewards β·(π − ref) from it)."""
    read = {"dpo": {"loss_type": params.dpo_loss_type, "label_smoothing": params.label_smoothing, "sft_weight": params.sft_weight},
            "kto": {"desirable_weight": params.desirable_weight, "undesirable_weight": params.undesirable_weight},
            "orpo": {}, "simpo": {"simpo_gamma": params.simpo_gamma, "label_smoothing": params.label_smoothing, "sft_weight": params.sft_weight}}  # fmt: skip
    return {"method": params.method, "beta": params.beta, **read[params.method], "reference": reference}


def body(ctx: stage.StageContext) -> dict:
    metrics = run(ctx.root, ctx.input("ref_logprobs"), ctx.output(), ctx.params, ctx.tracker, ctx.checkpoint_dir, ctx.log, ctx.input("base_answers"))
    p = ctx.params
    what = {"dpo": f"dpo {p.dpo_loss_type}", "kto": "kto", "orpo": "orpo", "simpo": f"simpo gamma {p.simpo_gamma:g}"}[p.method]
    heldout = ", ".join(f"{k.removeprefix('heldout/')} {v:.3f}" for k, v in metrics.items() if k in HEADLINE) or "no held-out data"
    ctx.log.info("%s (beta %.3g, from %s): %d steps; held-out %s", what, p.beta, metrics["start"], metrics["steps"], heldout)
    return metrics


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
