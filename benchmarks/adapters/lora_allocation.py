"""Downstream ablation of LoRA rank allocations at one trainable-parameter budget.

    python -m benchmarks.adapters.lora_allocation --project DIR [--seeds 0 1 2] [--random 3]

DIR is a project after `qllm run` (it needs data/probe_lora/scores.json, data/models/pretrain,
data/prepared/chat, data/tokenized). With the project's `quantum_opt` budget (rank
`budget_rank` on every candidate module) it compares, for every seed (LoRA initialisation and
data order), LoRA trained with:

- `qubo`: the `quantum_opt` allocation (its solver, λ and the probe's scores),
- `uniform`: rank `budget_rank` on every candidate module (exactly the budget),
- `greedy`: the best value per parameter first, while it fits,
- `random-k`: random ranks in random module order while they fit (k = 0..random-1),

and reports the chat validation loss and the held-out exact match (as `evaluate` computes it)
as mean +- standard deviation over the seeds, plus each arm's parameter count and probe objective.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import sd
from pipelines import lora, quantum_opt
from pipelines.core.evaluation.heldout import heldout_questions
from pipelines.core.evaluation.report import evaluate_model
from pipelines.core.params import files as params_file
from pipelines.core.quantum import qubo
from pipelines.core.run import stage


def random_allocation(values: dict, costs: dict, budget: int, seed: int) -> dict[str, int]:
    """Random modules in random order get a random rank that still fits the budget."""
    rng = random.Random(seed)
    modules = sorted(values)
    rng.shuffle(modules)
    ranks, left = dict.fromkeys(values, 0), budget
    for module in modules:
        fitting = [r for r, c in costs[module].items() if c <= left]
        if fitting:
            ranks[module] = rng.choice(fitting)
            left -= costs[module][ranks[module]]
    return ranks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--random", type=int, default=3, help="number of random allocations")
    args = parser.parse_args(argv)
    root = args.project.resolve()
    params, _ = params_file.load(root)
    values, costs, redundancy, shapes = quantum_opt.load_scores(stage.StageContext(name="quantum_opt", root=root, params=None, tracker=None).input("probe_lora") / quantum_opt.SCORES_FILE)
    q = params.quantum_opt
    budget = quantum_opt.budget_for(shapes, q)
    arms = {
        "qubo": dict(qubo.allocate_ranks(values, costs, budget, redundancy, lam=q.lam, solver=q.solver, seed=q.seed, timeout=q.timeout)),
        "uniform": {m: q.budget_rank for m in values},
        "greedy": dict(qubo.greedy(values, costs, budget)),
        **{f"random-{k}": random_allocation(values, costs, budget, seed=100 + k) for k in range(args.random)},
    }
    questions = heldout_questions(root / "data/prepared/chat", params.evaluate.max_questions)
    base = params.lora.model_copy(update={"base_model": str(root / params.lora.base_model), "merge": True})
    print(f"budget {budget} parameters (rank {q.budget_rank} on {len(values)} modules); seeds {args.seeds}; "
          f"{base.train.max_steps} LoRA steps per run")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, ranks in arms.items():
            cost = qubo.total_cost(ranks, costs)
            probe_objective = qubo.objective(ranks, values, redundancy, q.lam)
            losses, exact = [], []
            for seed in args.seeds:
                run_params = lora.apply_allocation(base, {"rank_pattern": ranks, "budget_rank": q.budget_rank})  # as quantum_opt writes it
                run_params = run_params.model_copy(update={"train": run_params.train.model_copy(update={"seed": seed, "checkpoint_every": 0})})
                out = Path(tmp) / f"{name}-{seed}"
                metrics = lora.run(root / "data/prepared/chat", out, stage.resolve_precision("lora", run_params))
                result = evaluate_model(out, root, root / "data/tokenized", questions, out / "eval", params.evaluate)
                losses.append(metrics["val/loss"])
                exact.append(result["exact_match"])
                print(f"{name} seed {seed}: val/loss {losses[-1]:.4f}, held-out exact match {exact[-1]:.4f}", flush=True)
            rows.append((name, cost, probe_objective, statistics.mean(losses), sd(losses), statistics.mean(exact), sd(exact)))
    print("\n| allocation | parameters | probe objective | chat val/loss | held-out exact match |")
    print("|---|---|---|---|---|")
    for name, cost, objective, loss, loss_sd, em, em_sd in rows:
        print(f"| {name} | {cost:,} | {objective:.4f} | {loss:.4f} +- {loss_sd:.4f} | {100 * em:.1f}% +- {100 * em_sd:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
