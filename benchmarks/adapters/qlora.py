"""QLoRA against LoRA on the same base: backbone bytes, peak memory, step time, held-out quality.

    python -m benchmarks.adapters.qlora --project DIR --base MODEL_DIR [--seeds 0 1 2] [--quantizations none nf4 int8]
        [--steps 150] [--r 8] [--jsonl FILE]
    python -m benchmarks.adapters.qlora --size 30m [--steps 10]      # memory and step time on a random ~30M model

DIR is a project after `qllm run --until tokenize` (chats, tokenized validation text); MODEL_DIR a
pretrained base (e.g. data/models/pretrain). Every run is the `lora` stage's code (uniform rank `r`
on all seven projections, the chat markers trainable, `lora.*` defaults otherwise) in its own
process, so its peak resident memory (`ru_maxrss`) is its own; runs go one after another. Printed:
one JSON line per run and, per quantization, the ratios against `none` from the same command:
backbone linear-weight bytes (against bf16), peak memory, seconds per step, and the held-out exact
match of the merged model (`evaluate`'s greedy scoring), mean and spread over seeds.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import mean_sd, record


def one(args: argparse.Namespace) -> dict:
    import torch

    from pipelines import lora
    from pipelines.core.params import files as params_file
    from pipelines.core.params.finetuning import LoraParams
    from pipelines.core.params.training import TrainParams
    from pipelines.core.training import precision

    base, work = Path(args.base), Path(args.work)
    train = TrainParams(seed=args.seed, max_steps=args.steps, micro_batch_size=16, warmup_steps=max(1, args.steps // 15), lr=0.003,
                        eval_every=0, checkpoint_every=0, precision=precision.resolve("auto"))
    adapter = {"r": args.r, "lora_alpha": 2.0 * args.r, "quantization": args.quantization, "merge": args.project is not None}
    params = LoraParams(base_model=str(base), allocation="uniform", adapter=adapter, train=train)
    chat = Path(args.project) / "data/prepared/chat" if args.project else Path(args.chat)
    metrics = lora.run(chat, work / "lora", params)
    row = {"quantization": args.quantization, "seed": args.seed, "steps": metrics["steps"], "precision": train.precision,
           "seconds_per_step": round(metrics["train_seconds"] / max(1, metrics["steps"]), 4),
           "linear_weight_bytes": metrics.get("linear_weight_bytes"), "total_parameters": metrics["total_parameters"],
           "trainable_parameters": metrics["trainable_parameters"], "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if args.quantization == "none":
        from pipelines.core.models.models import load_causal_lm
        from pipelines.core.models.quantize import linear_weight_bytes

        row["linear_weight_bytes"] = linear_weight_bytes(load_causal_lm(base, dtype=torch.bfloat16))["linear_weight_bytes"]
    if args.project:
        from pipelines.core.evaluation.heldout import heldout_questions
        from pipelines.core.evaluation.report import evaluate_model

        root = Path(args.project)
        project_params, _ = params_file.load(root)
        questions = heldout_questions(root / "data/prepared/chat", project_params.evaluate.max_questions)
        result = evaluate_model(work / "lora", root, root / "data/tokenized", questions, work / "eval", project_params.evaluate)
        row |= {"exact_match": result["exact_match"], "val_perplexity": result["val_perplexity"]}
    return row


def random_base(size: str, out: Path) -> Path:
    """A randomly initialised Llama of about 30M parameters (linear weights dominate) with a
    trained tokenizer, and a handful of chats, for memory and step time only."""
    import json as _json

    import pandas as pd

    from pipelines.core.models.models import build_llama, save_pretrained
    from pipelines.core.params.pretraining import ModelParams
    from pipelines.train_tokenizer import train as train_tokenizer

    chats = [[{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": str(a + b)}] for a in range(10) for b in range(10)]
    tokenizer = train_tokenizer(iter([m["content"] for c in chats for m in c] * 5), vocab_size=512, min_frequency=1)
    dims = {"30m": ModelParams(hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8, num_kv_heads=8)}[size]
    save_pretrained(build_llama(dims, tokenizer, max_positions=256, seed=0), tokenizer, out / "model", max_length=256)
    (out / "chat").mkdir()
    for split in ("train", "validation"):
        pd.DataFrame({"id": [f"{split}-{i}" for i in range(len(chats))], "source": "b", "split": split,
                      "messages": [_json.dumps(c) for c in chats]}).to_parquet(out / "chat" / f"{split}.parquet")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--project")
    parser.add_argument("--base")
    parser.add_argument("--size", choices=["30m"], help="a random base of this size instead of --project/--base")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--quantizations", nargs="+", default=["none", "nf4", "int8"])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--jsonl", type=Path)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quantization", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--chat", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["--project", args.project, "--base", args.base] if args.size is None else []
        if args.size:
            base_dir = random_base(args.size, Path(tmp))
            extra = ["--base", str(base_dir / "model"), "--chat", str(base_dir / "chat")]
        rows = []
        for seed in args.seeds:
            for quantization in args.quantizations:
                work = Path(tmp) / f"{quantization}-{seed}"
                cmd = [sys.executable, "-m", "benchmarks.adapters.qlora", "--one", "--quantization", quantization, "--seed", str(seed),
                       "--steps", str(args.steps), "--r", str(args.r), "--work", str(work), *extra]
                done = subprocess.run(cmd, capture_output=True, text=True)
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if done.returncode or not lines:
                    print(done.stderr[-3000:], file=sys.stderr)
                    return 1
                row = json.loads(lines[0].removeprefix("RESULT ")) | ({"size": args.size} if args.size else {})
                rows.append(record(row, args.jsonl))
    base_rows = [r for r in rows if r["quantization"] == "none"]
    for quantization in args.quantizations:
        mine = [r for r in rows if r["quantization"] == quantization]
        out = {"quantization": quantization}
        for key in ("linear_weight_bytes", "peak_rss_mb", "seconds_per_step"):
            out[f"{key} ratio"] = round(statistics.mean(r[key] for r in mine) / statistics.mean(r[key] for r in base_rows), 3)
        if "exact_match" in mine[0]:
            values = [100 * r["exact_match"] for r in mine]
            out["exact_match"] = f"{mean_sd(values, '.1f')} {[round(v, 1) for v in values]}"
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
