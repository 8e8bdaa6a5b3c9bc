"""Reference log-probabilities for DPO, computed once and cached as a versioned stage output.

    python -m pipelines.ref_logprobs    # what dvc.yaml runs; writes data/ref_logprobs/

For every preference pair of each split (train, validation, test), the summed completion
log-probabilities of `chosen` and `rejected` under the reference model (the SFT model, which DPO
starts from; with `dpo.adapter: lora` it is the LoRA base with adapters disabled) are stored with the pair's token ids in `<split>.parquet`, keyed by the
pair id. `dpo` trains from these files and never runs the reference model, so a sweep over DPO
hyperparameters (`qllm run --set dpo.beta=0.05`, then `--set dpo.beta=0.5`) reuses this one pass:
the stage's inputs do not depend on `dpo.*`, so DVC restores it from the cache.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from pipelines.core.config import RefLogprobsParams
from pipelines.core.models import quantize
from pipelines.core.models.models import load_for_inference
from pipelines.core.outputs import atomic_dir, write_json
from pipelines.core.run import stage
from pipelines.core.training import preference_data

NAME = "ref_logprobs"
SPLITS = ("train", "validation", "test")


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


def run(root: Path, reference: Path, preferences: Path, out: Path, params: RefLogprobsParams) -> dict:
    """`meta.json` names `reference` relative to `root` (`data/models/sft`), as `dpo` loads it."""
    qconfig = quantize.from_params(params, "fp32", "ref_logprobs")  # QLoRA DPO: the SFT model in the bits DPO trains on
    model, tokenizer = load_for_inference(reference, root) if qconfig is None else quantize.load(reference, qconfig, "ref_logprobs")
    max_length = params.max_length or model.config.max_position_embeddings
    metrics: dict = {"max_length": max_length}
    started = time.perf_counter()
    tokens = 0
    with atomic_dir(out) as tmp:
        for split in SPLITS:
            frame = pd.read_parquet(preferences / f"{split}.parquet")
            pairs, dropped = preference_data.encode_pairs(
                tokenizer, frame, max_length, params.max_prompt_length, params.on_invalid, where=f"{preferences / split}.parquet: "
            )
            score(model, pairs, tokenizer.pad_token_id, params.batch_size)
            preference_data.to_frame(pairs, split).to_parquet(tmp / f"{split}.parquet", index=False)
            tokens += sum(len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
            metrics[split] = {
                "pairs_in": len(frame),
                "pairs": len(pairs),
                "dropped": dropped,
                "mean_ref_chosen_logp": round(float(np.mean([p.ref_chosen for p in pairs])), 4) if pairs else None,
                "mean_ref_rejected_logp": round(float(np.mean([p.ref_rejected for p in pairs])), 4) if pairs else None,
            }
        named = reference.relative_to(root).as_posix() if reference.is_relative_to(root) else str(reference)
        write_json(tmp / "meta.json", {"reference": named, "max_length": max_length, "max_prompt_length": params.max_prompt_length})
    seconds = time.perf_counter() - started
    return metrics | {"tokens_per_second": round(tokens / max(seconds, 1e-9)), "forward_seconds": round(seconds, 3)}


def body(ctx: stage.StageContext) -> dict:
    reference = ctx.input("models/sft")
    metrics = run(ctx.root, reference, ctx.input("preference"), ctx.output(), ctx.params)
    for split in SPLITS:
        info = metrics[split]
        dropped = {k: v for k, v in info["dropped"].items() if v}
        ctx.log.info("%s: %d of %d pairs scored under %s%s", split, info["pairs"], info["pairs_in"], reference.relative_to(ctx.root), f"; dropped {dropped}" if dropped else "")
        for reason, count in dropped.items():
            ctx.log.warning("%s: dropped %d pairs: %s", split, count, reason.replace("_", " "))
    return metrics


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
