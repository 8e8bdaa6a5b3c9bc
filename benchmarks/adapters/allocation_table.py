"""The honest table: LoRA rank allocations at one parameter budget, several seeds, two worlds.

    python -m benchmarks.adapters.allocation_table --project DIR [--project DIR2 ...] [--seeds 0,1,2,3,4]
                                                   [--lams 0,0.02,0.1] [--menus 4,8,16] [--peer-lrs 0.003] [--static-lrs 0.003]
                                                   [--arms qubo,qubo_in_loop,greedy,uniform,adalora,random]
    python -m benchmarks.adapters.allocation_table --scaling        # solver wall time and gap at 1x, 4x, 16x the modules

Each DIR is a project after `qllm run --until pretrain` (it needs data/models/pretrain,
data/prepared/chat, data/tokenized); e.g. the default world and one with `sample_data.seed: 1`.
Per project, in this process, with params.yaml's `probe_lora`, `quantum_opt` and `lora` settings:

1. the probe (`probe_lora.run`, detrended redundancy) on the training chats;
2. λ and the budget split chosen on the *validation* chats (never on the held-out questions): for
   each rank menu of `--menus` (the ranks a module may get: how finely the budget may be split,
   e.g. many modules at rank 4 or few at 16; the probe scores the union) and each of `--lams`, the
   QUBO allocation trains LoRA (seed 0) and the pair with the lowest chat validation loss wins;
   `greedy` and `random` use the same menu. `--peer-lrs` does the same for the peers that allocate
   while training (`adalora`, `qubo_in_loop`): their learning rate is chosen on the validation chats
   (seed 0), as a user tuning them would, and `--static-lrs` one rate for the static arms (chosen
   with uniform ranks: they train the same adapters);
3. every arm at the budget of rank `quantum_opt.budget_rank` on every candidate module, for every
   seed (LoRA initialisation and data order): `qubo` (static, the chosen λ), `qubo_in_loop` (the
   QUBO re-solved during training, `lora.allocation: qubo_in_loop`), `greedy` (value per
   parameter), `uniform` (rank `budget_rank` everywhere), `adalora` (PEFT's AdaLoRA, target rank
   `budget_rank`: the same rank count, whose parameter count depends on where the ranks go) and
   `random` (random ranks that fit, a new draw per seed);
4. the held-out exact match (as `evaluate` computes it) and chat validation loss of each run.

Before them (`--validate-values N`): whether the probe's values predict the downstream gain, as
the Spearman correlation of v[m][8] with the chat validation loss of a rank-8 adapter on module m
alone (40 steps), for N modules spread over the ranking.

Prints one line per run, then per world a table (mean +- std over seeds, the parameters used,
and a paired t-test of each arm against `uniform` and against `qubo` on held-out exact match).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.adapters.lora_allocation import random_allocation
from benchmarks.common import mean_sd, record
from pipelines import lora, probe_lora, quantum_opt
from pipelines.core.evaluation.heldout import heldout_questions
from pipelines.core.evaluation.report import evaluate_model
from pipelines.core.params import files as params_file
from pipelines.core.quantum import qubo
from pipelines.core.run import stage

ARMS = ("qubo", "qubo_in_loop", "greedy", "uniform", "adalora", "random")


def train_and_score(root: Path, params, allocation: str, ranks: dict | None, seed: int, questions, scratch: Path, name: str) -> dict:
    base = params.lora.model_copy(update={"base_model": str(root / params.lora.base_model), "allocation": "uniform" if ranks is not None else allocation})
    base = base.model_copy(update={"adapter": base.adapter.model_copy(update={"merge": True})})
    allocation_file = {"rank_pattern": ranks, "budget_rank": params.quantum_opt.budget_rank}  # as quantum_opt writes it
    run_params = lora.apply_allocation(base, allocation_file) if ranks is not None else base
    run_params = run_params.model_copy(update={"train": run_params.train.model_copy(update={"seed": seed, "checkpoint_every": 0, "extensions": []})})
    out = scratch / f"{name}-{seed}"
    started = time.perf_counter()
    metrics = lora.run(root / "data/prepared/chat", out, stage.resolve_precision("lora", run_params))
    seconds = time.perf_counter() - started
    result = evaluate_model(out, root, root / "data/tokenized", questions, out / "eval", params.evaluate)
    parameters = metrics.get("allocation/active_parameters")
    if parameters is None:
        parameters = sum(r * (s["d_in"] + s["d_out"]) for m, r in ranks.items() for s in [SHAPES[m]] if r > 0)
    return {"arm": name, "seed": seed, "val_loss": round(metrics["val/loss"], 4), "exact_match": result["exact_match"], "parameters": int(parameters),
            "train_seconds": round(seconds, 1)}  # fmt: skip


SHAPES: dict = {}


def paired(a: list[float], b: list[float]) -> str:
    from scipy import stats

    if len(a) < 2 or a == b:
        return "n/a"
    diff = np.array(a) - np.array(b)
    if not diff.std():
        return f"{100 * diff.mean():+.1f} (no spread)"
    return f"{100 * diff.mean():+.1f}, p={stats.ttest_rel(a, b).pvalue:.3f}"


def with_lr(params, lr: float):
    """`params` with the lora stage's learning rate set to `lr`."""
    return params.model_copy(update={"lora": params.lora.model_copy(update={"train": params.lora.train.model_copy(update={"lr": lr})})})


def restrict(table: dict, menu: list[int]) -> dict:
    """A probe's per-module, per-rank table with only the ranks of `menu`."""
    return {m: {r: x for r, x in by_rank.items() if r in menu} for m, by_rank in table.items()}


def world(root: Path, seeds: list[int], lams: list[float], arms: list[str], scratch: Path, validate_values: int = 0,
          menus: list[list[int]] | None = None, peer_lrs: list[float] | None = None,
          static_lrs: list[float] | None = None) -> list[dict]:  # fmt: skip
    params, _ = params_file.load(root)
    menus = menus or [list(params.probe_lora.ranks)]
    probe = params.probe_lora.model_copy(update={"base_model": str(root / params.probe_lora.base_model), "ranks": sorted({r for m in menus for r in m})})
    probe = probe.model_copy(update={"train": probe.train.model_copy(update={"extensions": []})})
    probe_lora.run(root / "data/prepared/chat", scratch / "probe", stage.resolve_precision("probe_lora", probe))
    values, costs, redundancy, shapes = quantum_opt.load_scores(scratch / "probe" / probe_lora.SCORES_FILE)
    SHAPES.clear()
    SHAPES.update(shapes)
    q = params.quantum_opt
    budget = quantum_opt.budget_for(shapes, q)
    questions = heldout_questions(root / "data/prepared/chat", params.evaluate.max_questions)
    mean_rho = float(np.mean(list(redundancy.values()) or [0.0]))
    print(f"# {root}: {len(values)} modules, budget {budget} parameters (rank {q.budget_rank}), detrended redundancy mean {mean_rho:.3f} "
          f"over {len(redundancy)} positive pairs", flush=True)  # fmt: skip

    if validate_values:
        validate(root, params, values, questions, scratch, validate_values)

    def solve(lam: float, menu: list[int]) -> dict:
        return dict(qubo.allocate_ranks(restrict(values, menu), restrict(costs, menu), budget, redundancy, lam=lam, solver=q.solver, seed=q.seed,
                                        timeout=q.timeout))  # fmt: skip

    candidates = [(lam, menu) for menu in menus for lam in lams]
    (chosen_lam, menu), best = candidates[0], None
    for lam, candidate in candidates if len(candidates) > 1 else []:  # on the validation chats (one given: taken as chosen)
        row = train_and_score(root, params, "uniform", solve(lam, candidate), 0, questions, scratch, f"lam{lam}-menu{'-'.join(map(str, candidate))}")
        print(json.dumps({"world": str(root), "select_lam": lam, "menu": candidate, **row}), flush=True)
        if best is None or row["val_loss"] < best:
            (chosen_lam, menu), best = (lam, candidate), row["val_loss"]
    chosen = f"λ = {chosen_lam}, ranks {menu}"
    print(f"# {chosen}" + (f" (lowest chat validation loss {best:.4f})" if best is not None else " (given)"), flush=True)
    lrs = {arm: choose_lr(root, params, arm, peer_lrs, questions, scratch) for arm in ("adalora", "qubo_in_loop") if arm in arms}
    static = {
        "qubo": solve(chosen_lam, menu), "greedy": dict(qubo.greedy(restrict(values, menu), restrict(costs, menu), budget)),
        "uniform": {m: q.budget_rank for m in values},
    }  # fmt: skip
    # the static arms train the same adapters with other ranks: one learning rate for all of them,
    # chosen with uniform ranks (after λ and the menu, which were chosen at the stage's own rate)
    has_static = any(arm not in ("adalora", "qubo_in_loop") for arm in arms)
    static_lr = choose_lr(root, params, "static", static_lrs if has_static else None, questions, scratch, ranks=static["uniform"])
    rows = []
    for seed in seeds:  # every arm of a seed before the next seed: a stopped run still compares them all
        for arm in arms:
            if arm in lrs:
                row = train_and_score(root, with_lr(params, lrs[arm]), arm, None, seed, questions, scratch, arm) | {"lr": lrs[arm]}
            else:
                ranks = random_allocation(restrict(values, menu), restrict(costs, menu), budget, 100 + seed) if arm == "random" else static[arm]
                row = train_and_score(root, with_lr(params, static_lr), "uniform", ranks, seed, questions, scratch, arm) | {"lr": static_lr}
            rows.append(record(row | {"world": str(root), "lam": chosen_lam, "menu": menu}))
    table(rows)
    return rows


def choose_lr(root: Path, params, arm: str, lrs: list[float] | None, questions, scratch: Path, ranks: dict | None = None) -> float:
    """The learning rate of `arm` (static arms: trained with `ranks`) with the lowest chat validation
    loss (seed 0); the stage's own if one or none is given."""
    if not lrs or len(lrs) == 1:
        return lrs[0] if lrs else params.lora.train.lr
    best = None
    for lr in lrs:
        row = train_and_score(root, with_lr(params, lr), arm if ranks is None else "uniform", ranks, 0, questions, scratch, f"{arm}-lr{lr}")
        print(json.dumps({"world": str(root), "select_lr": lr, **row}), flush=True)
        if best is None or row["val_loss"] < best[1]:
            best = (lr, row["val_loss"])
    print(f"# {arm}: lr {best[0]} (lowest chat validation loss {best[1]:.4f})", flush=True)
    return best[0]


def validate(root: Path, params, values: dict, questions, scratch: Path, count: int, rank: int = 8, steps: int = 40) -> None:
    """Do the probe's values predict the downstream gain? A rank-`rank` adapter on one module alone,
    `steps` steps, for the `count` modules spread evenly over the ranking by value; the Spearman
    correlation of v[m][rank] with the drop of the chat validation loss (higher value, lower loss)."""
    from scipy import stats

    ranked = sorted(values, key=lambda m: -values[m].get(rank, 0.0))
    chosen = [ranked[round(i * (len(ranked) - 1) / max(1, count - 1))] for i in range(count)]
    short = params.model_copy(update={"lora": params.lora.model_copy(update={"train": params.lora.train.model_copy(update={"max_steps": steps, "eval_every": steps})})})
    losses = []
    for module in chosen:
        row = train_and_score(root, short, "uniform", {module: rank}, 0, questions.head(1), scratch, f"value-{module}")
        losses.append(row["val_loss"])
        print(json.dumps({"world": str(root), "module": module, "value": round(values[module][rank], 5), "val_loss": row["val_loss"]}), flush=True)
    rho = stats.spearmanr([values[m][rank] for m in chosen], [-x for x in losses])
    print(f"# values vs downstream: Spearman {rho.statistic:.3f} (p={rho.pvalue:.3f}) over {count} single-module rank-{rank} probes of {steps} steps", flush=True)


def table(rows: list[dict]) -> None:
    by_arm: dict[str, list[dict]] = {}
    for row in rows:
        by_arm.setdefault(row["arm"], []).append(row)

    em = {arm: [r["exact_match"] for r in sorted(group, key=lambda r: r["seed"])] for arm, group in by_arm.items()}
    print("\n| allocation | parameters | chat val/loss | held-out exact match (%) | vs uniform (points, paired t) | vs qubo |")
    print("|---|---|---|---|---|---|")
    for arm, group in by_arm.items():
        parameters = sorted({r["parameters"] for r in group})
        shown = f"{parameters[0]:,}" if len(parameters) == 1 else f"{min(parameters):,}-{max(parameters):,}"
        print(f"| {arm} | {shown} | {mean_sd([r['val_loss'] for r in group])} | {mean_sd(em[arm], '.1f', scale=100)} | "
              f"{paired(em[arm], em['uniform']) if 'uniform' in em and arm != 'uniform' else ''} | "
              f"{paired(em[arm], em['qubo']) if 'qubo' in em and arm != 'qubo' else ''} |", flush=True)  # fmt: skip


def scaling(root: Path | None, timeout: float, reference_timeout: float) -> None:
    """sa's wall time and gap to the MILP optimum on the probe's problem and on 4x and 16x the modules
    (each module copied with its values scaled by a random factor in [0.5, 1.5], redundancy kept within copies).
    Where HiGHS stops at its time limit, its dual bound still bounds the optimum: the last column is
    sa's largest possible gap to the true optimum."""
    rng = np.random.default_rng(0)
    if root is not None:
        values, costs, redundancy, shapes = quantum_opt.load_scores(root / "data/probe_lora" / quantum_opt.SCORES_FILE)
    else:  # a synthetic probe: 28 modules, decreasing returns in rank
        values = {f"m{i:02d}": {r: float(rng.uniform(0.01, 0.05)) * np.log1p(r) for r in (4, 8, 16)} for i in range(28)}
        costs = {m: {r: r * 256 for r in (4, 8, 16)} for m in values}
        redundancy = {(a, b): float(rng.uniform(0, 0.3)) for a in values for b in values if a < b and rng.random() < 0.2}
        shapes = {m: {"d_in": 128, "d_out": 128} for m in values}
    print("| modules | variables | sa wall s | MILP wall s | sa objective | MILP best | MILP bound | gap to MILP best | sa's gap to the optimum (at most) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for factor in (1, 4, 16):
        v, c, rho = {}, {}, {}
        for k in range(factor):
            scale = {m: rng.uniform(0.5, 1.5) for m in values}
            v |= {f"{m}#{k}": {r: x * scale[m] / factor for r, x in ranks.items()} for m, ranks in values.items()}
            c |= {f"{m}#{k}": dict(ranks) for m, ranks in costs.items()}
            rho |= {tuple(sorted((f"{a}#{k}", f"{b}#{k}"))): x for (a, b), x in redundancy.items()}
        budget = factor * sum(8 * (s["d_in"] + s["d_out"]) for s in shapes.values())
        sa = qubo.allocate_ranks(v, c, budget, rho, lam=0.02, solver="sa", seed=0, timeout=timeout)
        milp = qubo.allocate_ranks(v, c, budget, rho, lam=0.02, solver="milp", timeout=reference_timeout)
        gap, bound_gap = (float("nan") if g is None else g for g in qubo.gaps(sa, milp))
        print(f"| {len(v)} | {sa.num_variables} | {sa.wall_seconds:.2f} | {milp.wall_seconds:.2f}{'' if milp.solver == 'milp' else ' (limit)'} | "
              f"{sa.objective:.4f} | {milp.objective:.4f} | {milp.bound:.4f} | {100 * gap:.2f}% | {100 * bound_gap:.2f}% |", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--project", type=Path, action="append", default=[])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--lams", default="0,0.02,0.1")
    parser.add_argument("--menus", default="", help="rank menus to choose from on validation, ';'-separated (e.g. '4,8,16;2,4,8;8,16,32'); default: probe_lora.ranks")
    parser.add_argument("--peer-lrs", default="", help="learning rates to choose from on validation for adalora and qubo_in_loop (default: lora.train.lr)")
    parser.add_argument("--static-lrs", default="", help="learning rates to choose from on validation (uniform ranks) for the static arms (default: lora.train.lr)")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--scaling", action="store_true", help="only the solver scaling table")
    parser.add_argument("--validate-values", type=int, default=8, metavar="N", help="single-module probes checking the values (0: skip)")
    parser.add_argument("--timeout", type=float, default=10.0, help="sa timeout for --scaling")
    parser.add_argument("--reference-timeout", type=float, default=60.0, help="MILP time limit for --scaling")
    parser.add_argument("--aggregate", type=Path, nargs="+", metavar="LOG", help="only the tables of the runs in these outputs (the last row of an arm, seed and world wins)")
    args = parser.parse_args(argv)
    if args.aggregate:
        rows = {}
        for path in args.aggregate:
            for line in path.read_text().splitlines():
                if line.startswith("{") and '"arm"' in line and "select_l" not in line and '"module"' not in line:
                    row = json.loads(line)
                    rows[(row["world"], row["arm"], row["seed"])] = row
        for name in sorted({w for w, _, _ in rows}):
            print(f"\n## {name}")
            table([r for (w, _, _), r in sorted(rows.items(), key=lambda item: (ARMS.index(item[0][1]), item[0][2])) if w == name])
        return 0
    if args.scaling:
        scaling(args.project[0].resolve() if args.project else None, args.timeout, args.reference_timeout)
        return 0
    seeds = [int(s) for s in args.seeds.split(",")]
    lams = [float(x) for x in args.lams.split(",")]
    arms = [a for a in args.arms.split(",") if a]
    menus = [[int(r) for r in menu.split(",")] for menu in args.menus.split(";") if menu.strip()] or None
    peer_lrs = [float(x) for x in args.peer_lrs.split(",") if x] or None
    static_lrs = [float(x) for x in args.static_lrs.split(",") if x] or None
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")
    everything = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, root in enumerate(args.project):
            scratch = Path(tmp) / f"world{index}"
            scratch.mkdir()
            everything += world(root.resolve(), seeds, lams, arms, scratch, args.validate_values, menus, peer_lrs, static_lrs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
