"""Masked diffusion vs causal pretraining at equal training compute, then the same SFT: the NELBO
perplexity bound beside the causal perplexity, and held-out exact match through iterative-unmasking
generation beside greedy decoding.

    python -m benchmarks.quality.masked_diffusion --project <run> [--seeds 0,1,2] [--unmask-steps 16] [--skip-sft]

Reads a finished `qllm run --until tokenize` of the project (`data/tokenized`, `data/tokenizer`,
`data/prepared/chat`; nothing is written there). Per seed and objective, in this process: pretrain
params.yaml's `pretrain` model for its `max_steps` (the same steps, batch and tokens for both
objectives: the forward and backward cost per token is the same model's, so training FLOPs are
equal; the mask token is added to the tokenizer for both), then `sft` with params.yaml's `sft`
settings from that model (the masked-diffusion model fine-tunes on answer tokens only), then
answer the held-out questions (causal: greedy; masked diffusion: `--unmask-steps` steps of
low-confidence remasking over `evaluate.max_new_tokens` masks) and score exact match.

Both validation numbers are per token on the same validation rows: the causal model's perplexity
(T-1 next-token predictions a row) and exp of the masked-diffusion NELBO bound (T tokens a row,
`pretrain.diffusion.val_samples` time steps per row, fixed seed).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import mean_sd
from pipelines import pretrain, sft
from pipelines.core.data import packed
from pipelines.core.evaluation import heldout, scores
from pipelines.core.models.models import build_llama, load_for_inference, load_tokenizer, save_pretrained
from pipelines.core.outputs import read_json
from pipelines.core.params import files as params_file
from pipelines.core.training import diffusion, loop, objectives, precision
from pipelines.train_tokenizer import add_mask_token


def one_run(root: Path, params, objective: str, seed: int, unmask_steps: int, skip_sft: bool, scratch: Path) -> dict:
    tokenizer = load_tokenizer(root / "data/tokenizer")
    add_mask_token(tokenizer)
    meta = read_json(root / "data/tokenized/meta.json")
    train_rows, val_rows = packed.load(root / "data/tokenized", "train"), packed.load(root / "data/tokenized", "validation")
    cfg = params.pretrain.train.model_copy(update={"seed": seed, "checkpoint_every": 0, "extensions": [],
                                                   "precision": precision.resolve(params.pretrain.train.precision)})  # fmt: skip
    masked = objective == "masked_diffusion"
    settings = params.pretrain.diffusion.model_copy(update={"unmask_steps": unmask_steps})
    model = build_llama(params.pretrain.model, tokenizer, max_positions=meta["seq_len"], seed=seed,
                        diffusion=settings if masked else None, mask_token_id=tokenizer.mask_token_id)  # fmt: skip
    val_batches = packed.fixed_batches(val_rows, cfg.micro_batch_size, cfg.eval_batches)
    if masked:
        loss_fn = diffusion.Objective(settings, tokenizer.mask_token_id)
        val_fn = objectives.nelbo_fn(loss_fn, val_batches, cfg.precision)
    else:
        loss_fn, val_fn = loop.causal_lm_loss, pretrain.validation_fn(val_rows, cfg.micro_batch_size, cfg.eval_batches, cfg.precision)
    batches = loop.Batches(len(train_rows), cfg.micro_batch_size, cfg.seed, packed.collate(train_rows))
    started = time.perf_counter()
    result = loop.train(model, loss_fn, batches, cfg, val_fn=val_fn, desc=f"pretrain {objective}")
    out = {"val_loss": result["val/loss"], "perplexity": math.exp(result["val/loss"]), "pretrain_seconds": time.perf_counter() - started}
    if skip_sft:
        return out
    base = scratch / f"{objective}-{seed}-pretrain"
    save_pretrained(model, tokenizer, base, max_length=meta["seq_len"])
    sft_params = params.sft.model_copy(update={"base_model": str(base), "train": params.sft.train.model_copy(
        update={"seed": seed, "checkpoint_every": 0, "extensions": [], "precision": cfg.precision})})  # fmt: skip
    started = time.perf_counter()
    sft.run(root / "data/prepared/chat", scratch / f"{objective}-{seed}-sft", sft_params)
    out["sft_seconds"] = time.perf_counter() - started
    tuned, tuned_tokenizer = load_for_inference(scratch / f"{objective}-{seed}-sft")
    questions = heldout.heldout_questions(root / "data/prepared/chat", params.evaluate.max_questions)
    blocks = (None, 4, 1) if masked else (None,)  # LLaDA's semi-autoregressive blocks: one block, 4 tokens, 1 token
    for block in blocks:
        if masked:
            tuned.config.block_length = block
        started = time.perf_counter()
        predictions = heldout.generate_answers(tuned, tuned_tokenizer, questions["prompt"].tolist(), params.evaluate.max_new_tokens,
                                                params.evaluate.batch_size)  # fmt: skip
        correct, _ = scores.exact_match_report(questions, predictions)
        suffix = "" if block is None else f"_block{block}"
        out |= {f"exact_match{suffix}": sum(correct) / len(correct), f"answer_seconds{suffix}": time.perf_counter() - started,
                f"example{suffix}": predictions[:3]}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--unmask-steps", type=int, default=16)
    parser.add_argument("--skip-sft", action="store_true", help="pretraining only (no exact match)")
    args = parser.parse_args(argv)
    root = args.project.resolve()
    params, _ = params_file.load(root)
    print(f"{root.name}: pretrain {params.pretrain.train.max_steps} steps, sft {params.sft.train.max_steps} steps, "
          f"precision {precision.resolve(params.pretrain.train.precision)}, {torch.get_num_threads()} threads; "
          f"diffusion {params.pretrain.diffusion.time_steps} time steps, {args.unmask_steps} unmasking steps", flush=True)  # fmt: skip
    results: dict[str, list[dict]] = {"causal": [], "masked_diffusion": []}
    with tempfile.TemporaryDirectory(prefix="qllm-mdm-") as scratch:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for objective in results:
                r = one_run(root, params, objective, seed, args.unmask_steps, args.skip_sft, Path(scratch))
                results[objective].append(r)
                em = "".join(f", exact match{k.removeprefix('exact_match').replace('_block', ' block ')} {v:.3f} (e.g. {r['example' + k.removeprefix('exact_match')]})"
                             for k, v in r.items() if k.startswith("exact_match"))  # fmt: skip
                print(f"seed {seed} {objective}: val {r['val_loss']:.4f} nats/token -> perplexity{' bound' if objective != 'causal' else ''} "
                      f"{r['perplexity']:.3f} ({r['pretrain_seconds']:.0f} s){em}", flush=True)  # fmt: skip
    print("\nobjective | validation perplexity (mean +- std) | held-out exact match (mean +- std)")
    for objective, runs in results.items():
        ppl = [r["perplexity"] for r in runs]
        line = f"{objective} | {mean_sd(ppl, '.3f')}"
        for key in [k for k in runs[0] if k.startswith("exact_match")]:
            em = [r[key] for r in runs]
            line += f" | {key}: {mean_sd(em, '.3f')}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
