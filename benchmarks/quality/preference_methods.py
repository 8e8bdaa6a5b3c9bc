"""DPO, IPO, KTO, ORPO and SimPO on the default world: held-out quality, wall time and peak memory.

    python -m benchmarks.quality.preference_methods --project DIR [--seeds 0 1 2] [--methods dpo ipo kto orpo simpo]

DIR is a project after `qllm run` (it needs data/models/pretrain, data/models/sft,
data/prepared/preference, data/prepared/chat, data/tokenized). Each (method, seed) runs in a fresh
process, as the pipeline's two stages would: `ref_logprobs` for that method (the reference pass, or
for the reference-free methods only the encoding; timed), then `dpo` with the project's `dpo`
params plus the branch's settings below and `dpo.train.seed` = the seed (the data order), then the
held-out evaluation `evaluate` does (greedy exact match on the held-out questions, preference
accuracy on the held-out pairs). Nothing is written to the project. Prints one line per run, then
per method the mean and standard deviation over seeds, and SFT's numbers for comparison.

The branches (TRL's defaults where the project has none):

- `dpo`: `loss_type: sigmoid`, beta 0.1 (TRL's default), from SFT;
- `ipo`: the pipeline's default (`ipo_sum`, beta 1.0), from SFT;
- `kto`: the pairs split into desirable and undesirable examples, beta 0.1, weights 1 (balanced), from SFT;
- `simpo`: beta 2.0, gamma 0.5 (the SimPO paper's range), from SFT, reference-free;
- `orpo`: from the base (pretrain), all weights, with SFT's learning rate and steps (its NLL term
  is the SFT), lambda (`beta`) 0.1 (TRL's default), reference-free.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import mean_sd, record, sd

BRANCHES: dict[str, list[str]] = {
    "dpo": ["dpo.method=dpo", "dpo.loss_type=sigmoid", "dpo.beta=0.1"],
    "ipo": ["dpo.method=dpo", "dpo.loss_type=ipo_sum", "dpo.beta=1.0"],
    "kto": ["dpo.method=kto", "dpo.loss_type=null", "dpo.beta=0.1"],
    "simpo": ["dpo.method=simpo", "dpo.loss_type=null", "dpo.beta=2.0", "dpo.simpo_gamma=0.5"],
    "orpo": ["dpo.method=orpo", "dpo.loss_type=null", "dpo.start=base", "dpo.beta=0.1", "dpo.adapter=none"],
}


def branch(root: Path, name: str, seed: int, out: Path) -> dict:
    """One method and seed, in this process: the reference pass, training, evaluation."""
    import pandas as pd

    from pipelines import dpo, ref_logprobs
    from pipelines.core.evaluation.heldout import heldout_questions
    from pipelines.core.evaluation.report import evaluate_model
    from pipelines.core.params import files as params_file
    from pipelines.core.preference import preference_data
    from pipelines.core.run import stage

    params, _ = params_file.load(root, overrides=BRANCHES[name])
    p = params.dpo
    train = p.train.model_copy(update={"seed": seed, "checkpoint_every": 0})
    if name == "orpo":  # it replaces SFT: SFT's budget
        train = train.model_copy(update={"lr": params.sft.train.lr, "max_steps": params.sft.train.max_steps, "min_lr_ratio": params.sft.train.min_lr_ratio})
    p = p.model_copy(update={"train": train})
    start = root / "data" / ref_logprobs.STARTS[p.start]
    started = time.perf_counter()
    ref_logprobs.run(root, start, root / "data/prepared/preference", out / "ref", params.ref_logprobs, p.method)
    ref_seconds = time.perf_counter() - started
    started = time.perf_counter()
    metrics = dpo.run(root, out / "ref", out / "model", stage.resolve_precision("dpo", p))
    train_seconds = time.perf_counter() - started
    questions = heldout_questions(root / "data/prepared/chat", params.evaluate.max_questions)
    pairs = preference_data.from_frame(pd.read_parquet(out / "ref" / "test.parquet"))
    result = evaluate_model(out / "model", root, root / "data/tokenized", questions, out / "eval", params.evaluate, pairs)
    return {
        "method": name, "seed": seed, "exact_match": result["exact_match"], "questions": result["questions"],
        "preference_accuracy": result["preference_accuracy"], "ref_seconds": round(ref_seconds, 2), "train_seconds": round(train_seconds, 2),
        "steps": metrics["steps"], "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
    }  # fmt: skip


def sft_baseline(root: Path) -> dict:
    import pandas as pd

    from pipelines.core.evaluation.heldout import heldout_questions
    from pipelines.core.evaluation.report import evaluate_model
    from pipelines.core.params import files as params_file
    from pipelines.core.preference import preference_data

    params, _ = params_file.load(root)
    questions = heldout_questions(root / "data/prepared/chat", params.evaluate.max_questions)
    with tempfile.TemporaryDirectory() as tmp:
        pairs_file = root / "data/ref_logprobs/test.parquet"
        pairs = preference_data.from_frame(pd.read_parquet(pairs_file)) if pairs_file.exists() else []
        result = evaluate_model(root / "data/models/sft", root, root / "data/tokenized", questions, Path(tmp) / "sft", params.evaluate, pairs)
    return {"exact_match": result["exact_match"], "preference_accuracy": result.get("preference_accuracy")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(BRANCHES), choices=list(BRANCHES))
    parser.add_argument("--branch", help=argparse.SUPPRESS)  # one run, in a child process
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    root = args.project.resolve()
    if args.branch:
        print(json.dumps(branch(root, args.branch, args.seed, args.out)))
        return 0
    sft = sft_baseline(root)
    print(f"SFT: held-out exact match {sft['exact_match']:.4f}, preference accuracy {sft['preference_accuracy']}", flush=True)
    rows: list[dict] = []
    for seed in args.seeds:
        for name in args.methods:
            with tempfile.TemporaryDirectory() as tmp:
                started = time.perf_counter()
                done = subprocess.run([sys.executable, "-m", "benchmarks.quality.preference_methods", "--project", str(root), "--branch", name, "--seed", str(seed),
                                       "--out", tmp], capture_output=True, text=True)  # fmt: skip
                if done.returncode != 0:
                    print(f"{name} seed {seed}: failed\n{done.stderr[-3000:]}", flush=True)
                    continue
                row = json.loads(done.stdout.strip().splitlines()[-1]) | {"process_seconds": round(time.perf_counter() - started, 1)}
            rows.append(record(row))
    print("\n| method | held-out exact match | preference accuracy | reference pass s | training s | peak RSS GB |")
    print("|---|---|---|---|---|---|")
    print(f"| SFT (start) | {100 * sft['exact_match']:.1f}% | {sft['preference_accuracy']} | | | |")
    for name in args.methods:
        mine = [r for r in rows if r["method"] == name]
        if not mine:
            continue
        def col(key: str, rows_of: list[dict] = mine) -> list:
            return [r[key] for r in rows_of]

        em, acc = col("exact_match"), col("preference_accuracy")
        print(f"| {name} | {100 * statistics.mean(em):.1f}% +- {100 * sd(em):.1f} (min {100 * min(em):.1f}, max {100 * max(em):.1f}) "
              f"| {mean_sd(acc, '.3f')} | {statistics.median(col('ref_seconds')):.1f} "
              f"| {statistics.median(col('train_seconds')):.1f} | {max(col('peak_rss_gb')):.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
