"""Does GRPO add to SFT? Held-out exact match of SFT, SFT + GRPO, and SFT trained longer for the
time GRPO took, over pretraining seeds, per question group.

    python -m benchmarks.quality.grpo_gain --project DIR [--seeds 0 1 2] [--set grpo.KEY=VALUE ...] [--cache DIR] [--jsonl FILE]

DIR is a project after `qllm run --until tokenize` (it needs data/tokenized, data/tokenizer and
data/prepared/chat). For each seed (both `pretrain.train.seed` and the fine-tuning stages' seeds)
this runs the stages' code with the project's params.yaml plus `--set`: `pretrain`, `sft` from it,
`grpo` from that SFT model, and `sft` again from the same pretrained model with as many more steps
as GRPO's training time buys at SFT's measured speed ("SFT longer": the same wall time, spent on
more SFT instead of RL). Each model is scored as `evaluate` scores it: greedy held-out exact match,
overall and per question group (arithmetic; each fact type). Prints one line per run and, per
variant, the mean +- standard deviation and range: the spread, not the best run. `--cache DIR`
keeps each pretrained model (by params, seed and precision) for reruns with other `grpo` settings.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import cpu_name, mean_sd, per_seed
from benchmarks.quality.default_quality import _with, reads
from pipelines import grpo, pretrain, sft
from pipelines.core import dag
from pipelines.core.evaluation.heldout import heldout_questions
from pipelines.core.evaluation.report import evaluate_model
from pipelines.core.outputs import digest, to_plain, write_json
from pipelines.core.params import files as params_file
from pipelines.core.training import precision

VARIANTS = ("sft", "sft+grpo", "sft longer")


def percent(values: list[float]) -> str:
    """Shares over seeds as percent: mean +- sd [min, max]."""
    return mean_sd(values, ".1f", scale=100, with_range=True)


def one_seed(root: Path, params, seed: int, precision_name: str, questions, work: Path, cache: Path | None) -> dict:
    tokenized, tokenizer, chat = reads(root, "pretrain", "tokenized"), reads(root, "pretrain", "tokenizer"), reads(root, "sft", "chat")
    pre_params = _with(params.pretrain, seed, precision_name)
    pre_out = work / "pretrain"
    if cache is not None:
        pre_out = cache / f"pretrain-{digest({'params': to_plain(pre_params), 'data': dag.dvc_md5(tokenized)})[:16]}"
    if not (pre_out / "metrics.json").exists():
        metrics = pretrain.run(tokenized, tokenizer, pre_out, pre_params, None)
        metrics.pop("history", None)
        write_json(pre_out / "metrics.json", metrics)
    sft_params = _with(params.sft, seed, precision_name).model_copy(update={"base_model": str(pre_out)})
    started = time.perf_counter()
    tuned = sft.run(chat, work / "sft", sft_params)
    sft_seconds = time.perf_counter() - started
    grpo_params = _with(params.grpo, seed, precision_name)
    started = time.perf_counter()
    rl = grpo.run(work, work / "sft", chat, work / "sft+grpo", grpo_params)
    grpo_seconds = time.perf_counter() - started
    extra = round(grpo_seconds / (sft_seconds / tuned["steps"]))  # SFT steps in GRPO's time, at SFT's speed
    longer = sft_params.model_copy(update={"train": sft_params.train.model_copy(update={"max_steps": tuned["steps"] + extra})})
    started = time.perf_counter()
    sft.run(chat, work / "sft longer", longer)
    longer_seconds = time.perf_counter() - started
    row = {"seed": seed, "precision": precision_name, "sft_steps": tuned["steps"], "grpo_steps": rl["steps"], "sft_longer_steps": tuned["steps"] + extra,
           "seconds": {"sft": round(sft_seconds, 1), "sft+grpo": round(sft_seconds + grpo_seconds, 1), "sft longer": round(longer_seconds, 1)},
           "grpo_last_reward": rl.get("reward")}  # fmt: skip
    evaluate = params.evaluate.model_copy(update={"models": ["sft"]})
    for name in VARIANTS:
        result = evaluate_model(work / name, root, tokenized, questions, work / "eval" / name, evaluate)
        row[name] = {"exact_match": result["exact_match"], **{g.removeprefix("heldout-"): v for g, v in result["exact_match_by_group"].items()}}
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--precision", default="auto", choices=precision.PRECISIONS)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--jsonl", type=Path, help="append each run as a JSON line")
    parser.add_argument("--cache", type=Path, help="keep and reuse pretrained models here")
    args = parser.parse_args(argv)
    root = args.project.resolve()
    params, _ = params_file.load(root, overrides=args.overrides)
    questions = heldout_questions(reads(root, "sft", "chat"), params.evaluate.max_questions)
    resolved = precision.resolve(args.precision)
    machine = {"cpu": cpu_name(), "threads": torch.get_num_threads()}
    print(f"grpo gain: {' '.join(args.overrides) or 'params.yaml'}; {resolved}; {machine}", flush=True)
    rows = per_seed(args.seeds, lambda seed, tmp: one_seed(root, params, seed, resolved, questions, tmp, args.cache), jsonl=args.jsonl,
                    extra={"overrides": args.overrides, **machine})  # fmt: skip
    groups = [k for k in rows[0]["sft"] if k != "exact_match"]
    for name in VARIANTS:
        seconds = statistics.mean(r["seconds"][name] for r in rows)
        parts = [f"exact match {percent([r[name]['exact_match'] for r in rows])}"] + [f"{g} {percent([r[name][g] for r in rows])}" for g in groups]
        print(f"{name} ({len(rows)} seeds, {seconds:.0f} s): " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
