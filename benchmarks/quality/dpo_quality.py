"""Held-out quality of DPO against its SFT starting point, over several DPO seeds.

    python -m benchmarks.quality.dpo_quality --project DIR [--seeds 0 1 2] [--set dpo.KEY=VALUE ...]

DIR is a project after `qllm run` (it needs data/models/sft, data/ref_logprobs,
data/prepared/chat, data/tokenized). Runs the `dpo` stage's code with the project's params.yaml
once per seed (the seed changes the data order) and evaluates each result like `evaluate` does:
held-out exact match of greedy answers, and the held-out DPO reward accuracy. Prints SFT's exact
match, then each seed and the mean and standard deviation. `--set` overrides DPO settings the way
`qllm run --set` does (the reference pass is the project's, so only `dpo.*` keys make sense).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import mean_sd
from pipelines import dpo
from pipelines.core.evaluation.heldout import heldout_questions
from pipelines.core.evaluation.report import evaluate_model
from pipelines.core.params import files as params_file
from pipelines.core.params.release import EvaluateParams
from pipelines.core.run import stage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="dpo.KEY=VALUE")
    args = parser.parse_args(argv)
    root = args.project.resolve()
    not_dpo = [o for o in args.overrides if not o.startswith("dpo.")]
    if not_dpo:
        parser.error(f"--set {not_dpo[0]}: only dpo.* settings can change here (the reference pass is the project's)")
    params, _ = params_file.load(root, overrides=args.overrides)
    questions = heldout_questions(root / "data/prepared/chat", params.evaluate.max_questions)
    evaluate = params.evaluate.model_copy(update={"models": ["dpo"]})
    with tempfile.TemporaryDirectory() as tmp:
        sft = evaluate_model(root / "data/models/sft", root, root / "data/tokenized", questions, Path(tmp) / "sft", evaluate)
        print(f"SFT: held-out exact match {sft['exact_match']:.4f} on {sft['questions']} questions")
        exact, accuracy = [], []
        for seed in args.seeds:
            dpo_params = params.dpo.model_copy(update={"train": params.dpo.train.model_copy(update={"seed": seed, "checkpoint_every": 0})})
            out = Path(tmp) / f"dpo{seed}"
            metrics = dpo.run(root, root / "data/ref_logprobs", out, stage.resolve_precision("dpo", dpo_params))
            result = evaluate_model(out, root, root / "data/tokenized", questions, out / "eval", EvaluateParams(**{**evaluate.model_dump(), "models": ["dpo"]}))
            exact.append(result["exact_match"])
            accuracy.append(metrics["heldout/rewards/accuracies"])
            print(f"DPO seed {seed}: held-out exact match {exact[-1]:.4f}, held-out rewards/accuracies {accuracy[-1]:.3f}")
    print(f"DPO mean: exact match {mean_sd(exact)} "
          f"(SFT {sft['exact_match']:.4f}, difference {statistics.mean(exact) - sft['exact_match']:+.4f}); "
          f"rewards/accuracies {mean_sd(accuracy, '.3f')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
