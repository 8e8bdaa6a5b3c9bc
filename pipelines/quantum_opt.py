"""Allocate LoRA ranks to modules by solving a QUBO over the probe's scores.

    python -m pipelines.quantum_opt     # what dvc.yaml runs; writes data/quantum_opt/allocation.json

Reads `data/probe_lora/scores.json` (values v[m][r], costs c[m][r], redundancies ρ[m,m']) and
chooses at most one rank per module to maximise Σ v − λ·Σ ρ·sqrt(v·v') within the parameter
budget B (default: rank `quantum_opt.budget_rank` on every candidate), with the solver named in
`quantum_opt.solver` (`pipelines.core.quantum.qubo`: a `dimod` BQM for sa/tabu/exact/dwave/qaoa, scipy's MILP
as the exact reference). Also solved, for the log: the MILP optimum (so the gap of the chosen
solver is known; in data/metrics/quantum_opt.json, with the solve time), the greedy
value-per-parameter allocation and uniform rank `budget_rank`.

`allocation.json` gives `lora` its `target_modules` and `rank_pattern` (the modules with rank
> 0), with `lora.allocation: quantum_opt`; with any other allocation (the default re-solves the
QUBO inside lora's training loop) the stage solves nothing and writes a README saying so.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.core.errors import QllmError
from pipelines.core.outputs import atomic_dir, read_json, write_json
from pipelines.core.params.finetuning import QuantumOptParams
from pipelines.core.quantum import qubo
from pipelines.core.run import stage

NAME = "quantum_opt"
SCORES_FILE = "scores.json"
"""The file of probe_lora's output directory that holds the scores."""


def load_scores(path: Path) -> tuple[dict, dict, dict, dict]:
    """(values, costs, redundancy, module shapes) with integer ranks and (a, b) pair keys."""
    table = read_json(path)
    values = {m: {int(r): float(v) for r, v in ranks.items()} for m, ranks in table["values"].items()}
    costs = {m: {int(r): int(c) for r, c in ranks.items()} for m, ranks in table["costs"].items()}
    redundancy = {tuple(pair.split("|")): rho for pair, rho in table["redundancy"].items() if rho > 0}
    return values, costs, redundancy, table["modules"]


def budget_for(shapes: dict, params: QuantumOptParams) -> int:
    """The parameter budget: `budget`, else rank `budget_rank` on every candidate module."""
    if params.budget:
        return params.budget
    return sum(params.budget_rank * (s["d_in"] + s["d_out"]) for s in shapes.values())


def run(scores_path: Path, out: Path, params: QuantumOptParams, tracker=None) -> dict:
    values, costs, redundancy, shapes = load_scores(scores_path)
    budget = budget_for(shapes, params)
    allocation = qubo.allocate_ranks(
        values, costs, budget, redundancy, lam=params.lam, solver=params.solver, seed=params.seed,
        timeout=params.timeout, max_qubits=params.max_qubits, fallback=params.fallback, num_reads=params.num_reads or None,
        setting="quantum_opt.timeout",
    )  # fmt: skip
    if params.solver == "milp" or not params.reference_timeout:
        reference = allocation if params.solver == "milp" else None
    else:  # only measures: None (logged) where HiGHS finds nothing in time on this machine
        reference = qubo.reference(values, costs, budget, redundancy, lam=params.lam, seed=params.seed, timeout=params.reference_timeout,
                                   setting="quantum_opt.reference_timeout")  # fmt: skip
    greedy = qubo.greedy(values, costs, budget)
    uniform = {m: params.budget_rank for m in values} if all(params.budget_rank in v for v in values.values()) else None

    def score(ranks: dict) -> float:  # every allocation on the same objective (redundancy included)
        return qubo.objective(ranks, values, redundancy, params.lam)

    gap, bound_gap = qubo.gaps(allocation, reference) if reference else (None, None)
    chosen = {m: r for m, r in allocation.items() if r > 0}
    if not chosen:
        raise QllmError(f"quantum_opt: the budget ({budget} parameters) is below the cheapest adapter; no module gets a rank "
                        "(raise quantum_opt.budget/budget_rank or use lora.allocation: uniform)")
    # allocation.json is a DVC output: the same scores give the same bytes. So the solve time and
    # the MILP reference (what HiGHS reaches by reference_timeout depends on the machine's speed)
    # go to the metrics file only; module lists are sorted, the JSON key-sorted.
    record = {
        **{k: v for k, v in allocation.as_dict().items() if k != "wall_seconds"},
        "lam": params.lam,
        # the uniform rank of the same parameter budget: lora scales every module's update by lora_alpha over it
        "budget_rank": round(budget / sum(s["d_in"] + s["d_out"] for s in shapes.values()), 6),
        "target_modules": sorted(chosen),
        "rank_pattern": dict(sorted(chosen.items())),
        "greedy_objective": score(greedy),
        "uniform_objective": score(uniform) if uniform else None,
    }
    with atomic_dir(out) as tmp:
        write_json(tmp / "allocation.json", record)
    if tracker is not None:
        import pandas as pd

        rows = [
            {"module": m, "rank": allocation[m], "value": values[m].get(allocation[m], 0.0), "cost": costs[m].get(allocation[m], 0),
             "milp_rank": reference[m] if reference else None, "greedy_rank": greedy[m], **shapes[m]}
            for m in sorted(values)
        ]  # fmt: skip
        tracker.log_table(pd.DataFrame(rows), "allocation_table.json")
        tracker.log_params({"solver_used": allocation.solver, "num_variables": allocation.num_variables,
                            **{f"penalty_{k}": v for k, v in allocation.penalties.items()}})
    return {
        "solver": allocation.solver,
        "num_variables": allocation.num_variables,
        "energy": allocation.energy,
        "feasible": allocation.feasible,
        "repaired": allocation.repaired,
        "objective": round(allocation.objective, 6),
        "milp_objective": round(reference.objective, 6) if reference else None,
        "milp_optimal": reference.solver == "milp" if reference else None,
        "gap_to_milp": round(gap, 6) if gap is not None else None,
        "gap_to_bound": round(bound_gap, 6) if bound_gap is not None else None,
        "greedy_objective": round(record["greedy_objective"], 6),
        "uniform_objective": round(record["uniform_objective"], 6) if uniform else None,
        "cost": allocation.cost,
        "budget": budget,
        "modules_with_adapter": len(chosen),
        "solve_seconds": round(allocation.wall_seconds, 3),
    }


UNUSED_README = """\
# No static LoRA rank allocation

`lora.allocation` is not `quantum_opt`: the lora stage allocates its ranks while it trains or
uses uniform ranks (docs/lora.md, "LoRA rank allocation as a QUBO"), so nothing was solved here. For the static
QUBO allocation: `lora.allocation: quantum_opt`.
"""


def body(ctx: stage.StageContext) -> dict:
    allocation = ctx.param("lora.allocation")
    if allocation != "quantum_opt":  # the lora stage reads this output only with the static allocation
        stage.placeholder(ctx, UNUSED_README)  # the same bytes for every other allocation
        ctx.log.info("quantum_opt: not needed (lora.allocation is %s)", allocation)
        return {"used": False}
    metrics = run(ctx.input("probe_lora") / SCORES_FILE, ctx.output(), ctx.params, ctx.tracker)
    if metrics["gap_to_milp"] is None:
        reference = "no MILP reference"
    else:
        reference = (f"MILP {'optimum' if metrics['milp_optimal'] else 'best at its time limit'} {metrics['milp_objective']:.4f}, "
                     f"gap {100 * metrics['gap_to_milp']:.2f}%")  # fmt: skip
    ctx.log.info(
        "%s: objective %.4f (%s; greedy %.4f, uniform %s), %d of %d parameters on %d modules%s",
        metrics["solver"], metrics["objective"], reference, metrics["greedy_objective"],
        "n/a" if metrics["uniform_objective"] is None else f"{metrics['uniform_objective']:.4f}",
        metrics["cost"], metrics["budget"], metrics["modules_with_adapter"], " (repaired to fit the budget)" if metrics["repaired"] else "",
    )
    return {"used": True, **{k: v for k, v in metrics.items() if v is not None}}


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
