"""The preference data encoded for `dpo`'s method, with reference log-probabilities computed once
and cached as a versioned stage output.

    python -m pipelines.ref_logprobs    # what dvc.yaml runs; writes data/ref_logprobs/

Every preference pair of each split (train, validation, test) is rendered with the chat template
and stored with its token ids in `<split>.parquet`, keyed by the pair id. What else it holds
depends on `dpo.method` (the only `dpo` keys this stage reads, with `dpo.start`):

- `dpo` and `kto` (a reference): the summed completion log-probabilities of `chosen` and `rejected`
  under the reference, the model the policy starts from (`dpo.start`: the SFT model, or the base;
  with `dpo.adapter: lora` the LoRA base with adapters disabled). For `kto` also
  `unpaired_<split>.parquet`: each pair split into a desirable and an undesirable example (TRL's
  `unpair_preference_dataset`), followed by the records of kind `feedback`
  (`data/prepared/feedback`: KTO's own unpaired data, scored here), each with its mismatched
  prompt/completion pair for KTO's KL estimate (the prompt with the completion of the example
  before it) and that pair's reference log-probability.
- `orpo` and `simpo` (reference-free): the token ids only. No model is loaded (its tokenizer and
  config are), so the branch costs a tokenization.

`dpo` trains from these files and never runs the reference model, so a sweep over DPO
hyperparameters (`qllm run --set dpo.beta=0.05`, then `--set dpo.beta=0.5`, or another
`dpo.loss_type`) reuses this one pass: the stage's inputs do not depend on those keys, so DVC
restores it from the cache. `meta.json` names the start model and the reference (null without one).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from pipelines.core import paths
from pipelines.core.errors import QllmError
from pipelines.core.models import quantize
from pipelines.core.models.model_source import follow
from pipelines.core.models.models import load_for_inference, load_tokenizer
from pipelines.core.outputs import atomic_dir, write_json
from pipelines.core.params.preference import RefLogprobsParams
from pipelines.core.preference import preference_data
from pipelines.core.run import stage

NAME = "ref_logprobs"
SPLITS = ("train", "validation", "test")
REFERENCE_METHODS = ("dpo", "kto")
STARTS = {"sft": "models/sft", "base": "models/pretrain"}


@torch.no_grad()
def score(model, pairs: list[preference_data.Pair], pad_id: int, batch_size: int) -> None:
    """Fill `ref_chosen`/`ref_rejected` of every pair (float32, eval mode, no gradients)."""
    model.eval()
    make = preference_data.collate(pairs, pad_id)
    for start in range(0, len(pairs), batch_size):
        indices = np.arange(start, min(start + batch_size, len(pairs)))
        chosen, rejected = preference_data.sequence_logps(model, make(indices), preference_data.SCORE_CHUNK_TOKENS)
        for i, c, r in zip(indices, chosen.tolist(), rejected.tolist(), strict=True):
            pairs[i].ref_chosen, pairs[i].ref_rejected = c, r


@torch.no_grad()
def score_rows(model, rows: list[tuple[np.ndarray, int]], pad_id: int, batch_size: int) -> list[float]:
    """Summed completion log-probabilities of (ids, completion start) rows (eval mode, no gradients)."""
    model.eval()
    scores: list[float] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        input_ids, attention, completion = preference_data.right_padded([ids for ids, _ in chunk], [begin for _, begin in chunk], pad_id)
        scores += preference_data.row_logps(model, input_ids, attention, completion, preference_data.SCORE_CHUNK_TOKENS).tolist()
    return scores


def context_length(model_dir: Path) -> int:
    """The model's context length from its config alone (the reference-free branch loads no weights)."""
    from transformers import AutoConfig

    source = follow(model_dir / "merged" if (model_dir / "merged" / "config.json").exists() else model_dir)
    try:
        return int(AutoConfig.from_pretrained(str(source)).max_position_embeddings)
    except (OSError, ValueError, AttributeError) as exc:
        raise QllmError(f"{model_dir}: cannot read the context length from its config ({exc}); set ref_logprobs.max_length") from None


def run(root: Path, start: Path, preferences: Path, out: Path, params: RefLogprobsParams, method: str = "dpo", feedback: Path | None = None) -> dict:
    """`meta.json` names `start` relative to `root` (`data/models/sft`), as `dpo` loads it.
    `feedback`: the prepared feedback records (KTO's own unpaired data), used by method kto."""
    if method in REFERENCE_METHODS:
        qconfig = quantize.from_params(params, "fp32", "ref_logprobs")  # QLoRA DPO: the SFT model in the bits DPO trains on
        model, tokenizer = load_for_inference(start, root) if qconfig is None else quantize.load(start, qconfig, "ref_logprobs")
        max_length = params.max_length or model.config.max_position_embeddings
    else:
        model, tokenizer = None, load_tokenizer(start / "merged" if (start / "merged" / "config.json").exists() else start)
        max_length = params.max_length or context_length(start)
    metrics: dict = {"max_length": max_length, "method": method}
    started = time.perf_counter()
    tokens = 0
    with atomic_dir(out) as tmp:
        for split in SPLITS:
            frame = pd.read_parquet(preferences / f"{split}.parquet")
            pairs, dropped = preference_data.encode_pairs(
                tokenizer, frame, max_length, params.max_prompt_length, params.on_invalid, where=f"{preferences / split}.parquet: "
            )
            info: dict = {"pairs_in": len(frame), "pairs": len(pairs), "dropped": dropped}
            if model is not None:
                score(model, pairs, tokenizer.pad_token_id, params.batch_size)
                tokens += sum(len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
                info["mean_ref_chosen_logp"] = round(float(np.mean([p.ref_chosen for p in pairs])), 4) if pairs else None
                info["mean_ref_rejected_logp"] = round(float(np.mean([p.ref_rejected for p in pairs])), 4) if pairs else None
            preference_data.to_frame(pairs, split).to_parquet(tmp / f"{split}.parquet", index=False)
            if method == "kto":
                records, dropped_feedback = preference_data.encode_feedback(
                    tokenizer, pd.read_parquet(feedback / f"{split}.parquet"), max_length, params.max_prompt_length, params.on_invalid,
                    where=f"{feedback / split}.parquet: ",
                ) if feedback is not None and (feedback / f"{split}.parquet").exists() else ([], {})  # fmt: skip
                for record, ref in zip(records, score_rows(model, [(r.ids, r.prompt_length) for r in records], tokenizer.pad_token_id, params.batch_size), strict=True):
                    record.ref = ref
                examples = preference_data.unpair(pairs, records)
                kl = score_rows(model, [(e.kl_ids, e.prompt_length) for e in examples], tokenizer.pad_token_id, params.batch_size)
                for example, value in zip(examples, kl, strict=True):
                    example.ref_kl = value
                tokens += sum(len(e.kl_ids) for e in examples) + sum(len(r.ids) for r in records)
                info |= {"feedback_in": len(records) + sum(dropped_feedback.values()), "feedback": len(records), "feedback_dropped": dropped_feedback}
                preference_data.examples_to_frame(examples, split).to_parquet(tmp / f"unpaired_{split}.parquet", index=False)
                info["desirable"] = sum(e.desirable for e in examples)
                info["undesirable"] = len(examples) - info["desirable"]
                info["mean_ref_kl_logp"] = round(float(np.mean([e.ref_kl for e in examples])), 4) if examples else None
            metrics[split] = info
        named = paths.named(start, root)
        write_json(tmp / "meta.json", {"method": method, "start": named, "reference": named if model is not None else None,
                                       "max_length": max_length, "max_prompt_length": params.max_prompt_length})  # fmt: skip
    seconds = time.perf_counter() - started
    metrics["forward_seconds"] = round(seconds, 3)
    if model is not None:
        metrics["tokens_per_second"] = round(tokens / max(seconds, 1e-9))
    return metrics


def body(ctx: stage.StageContext) -> dict:
    method = ctx.param("dpo.method")
    start = ctx.input(STARTS[ctx.param("dpo.start")])
    metrics = run(ctx.root, start, ctx.input("preference"), ctx.output(), ctx.params, method, ctx.input("feedback"))
    scored = f"scored under {start.relative_to(ctx.root)}" if method in REFERENCE_METHODS else f"encoded (dpo.method {method} needs no reference)"
    for split in SPLITS:
        info = metrics[split]
        dropped = {k: v for k, v in info["dropped"].items() if v}
        ctx.log.info("%s: %d of %d pairs %s%s", split, info["pairs"], info["pairs_in"], scored, f"; dropped {dropped}" if dropped else "")
        for reason, count in dropped.items():
            ctx.log.warning("%s: dropped %d pairs: %s", split, count, reason.replace("_", " "))
    return metrics


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
