"""Solver quality on random LoRA rank-allocation problems: gap to the MILP optimum, feasibility, time.

    python -m benchmarks.adapters.quantum_solvers [--instances 10] [--sizes 8 24 72] [--seed 0] [--pairs P]

Each instance has M modules (the q/k/v/o/gate/up/down projections of M/7 transformer layers) and
candidate ranks 4, 8, 16:

- shapes: hidden size 1024, 2048 or 4096, key/value width hidden/1, /4 or /8, MLP width
  2.75, 3.5 or 4 x hidden (one draw per instance); cost c[m][r] = r·(d_in + d_out);
- values: each module a random share of the gradient energy (log-normal, normalised to sum 1)
  times the share a rank-r update captures of a spectrum σ_i² ∝ i^-α, α ~ U(0.5, 2): increasing
  and concave in r, as `probe_lora` measures it;
- redundancy: each pair with probability 3/M (or --pairs P), ρ ~ U(0, 1); λ = 0.5;
- budget: the cost of rank 8 on every module.

Per size and solver: mean and max gap to the MILP optimum (% of its objective, every allocation
scored with redundancy, greedy's too), how often the solver's chosen raw sample was feasible
before repair and how often the result is feasible after it, and the mean wall time. `exact`
runs where it enumerates at most `qubo.EXACT_LIMIT` allocations; `qaoa` where the BQM has at
most 16 variables. Prints one markdown table (for benchmarks/results/adapters.md) and notes; progress goes
to stderr, and so do the debug lines HiGHS prints to the C-level stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import statistics
import sys

import numpy as np

from pipelines.core.quantum import qubo

RANKS = (4, 8, 16)
LAYER = [("self_attn.q_proj", "h", "h"), ("self_attn.k_proj", "h", "kv"), ("self_attn.v_proj", "h", "kv"),
         ("self_attn.o_proj", "h", "h"), ("mlp.gate_proj", "h", "i"), ("mlp.up_proj", "h", "i"), ("mlp.down_proj", "i", "h")]  # fmt: skip
LAM = 0.5
MAX_QUBITS = 16
TIMEOUT = 60.0
SOLVERS = ("milp", "exact", "sa", "tabu", "qaoa", "greedy")


def instance(modules: int, seed: int, pairs: float | None = None) -> tuple[dict, dict, int, dict]:
    """(values, costs, budget, redundancy) of one random problem; see the module docstring."""
    rng = np.random.default_rng(seed)
    hidden = int(rng.choice([1024, 2048, 4096]))
    width = {"h": hidden, "kv": hidden // int(rng.choice([1, 4, 8])), "i": int(hidden * rng.choice([2.75, 3.5, 4.0]))}
    share = rng.lognormal(0.0, 1.0, modules)
    share /= share.sum()
    values, costs = {}, {}
    for k in range(modules):
        name, d_in, d_out = LAYER[k % len(LAYER)]
        m = f"model.layers.{k // len(LAYER)}.{name}"
        spectrum = np.arange(1, min(width[d_in], width[d_out]) + 1, dtype=float) ** -rng.uniform(0.5, 2.0)
        captured = np.cumsum(spectrum) / spectrum.sum()
        values[m] = {r: float(share[k] * captured[r - 1]) for r in RANKS}
        costs[m] = {r: r * (width[d_in] + width[d_out]) for r in RANKS}
    redundancy = {(a, b): float(rng.uniform(0, 1)) for a, b in itertools.combinations(sorted(values), 2) if rng.random() < (min(1.0, 3 / modules) if pairs is None else pairs)}
    budget = sum(costs[m][8] for m in values)
    return values, costs, budget, redundancy


def solve(solver: str, values: dict, costs: dict, budget: int, redundancy: dict, seed: int) -> qubo.Allocation:
    if solver == "greedy":
        return qubo.greedy(values, costs, budget)
    return qubo.allocate_ranks(values, costs, budget, redundancy, LAM, solver=solver, seed=seed, timeout=TIMEOUT, max_qubits=MAX_QUBITS)


def applicable(solver: str, values: dict, num_variables: int) -> bool:
    if solver == "exact":
        return math.prod(len(r) + 1 for r in values.values()) <= qubo.EXACT_LIMIT
    if solver == "qaoa":
        return num_variables <= MAX_QUBITS
    return True


def pct(x: float) -> str:
    return f"{100 * x:.2f}"


@contextlib.contextmanager
def c_stdout_to_stderr():
    """Send what C code writes to file descriptor 1 (HiGHS' debug lines) to stderr meanwhile."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def run_size(modules: int, instances: int, seed: int, pairs: float | None) -> tuple[list[str], list[str]]:
    """Table rows and notes for one problem size."""
    runs: dict[str, list[tuple[float, bool | None, bool, float]]] = {s: [] for s in SOLVERS}  # gap, raw ok, feasible, s
    sizes, notes = [], []
    for i in range(instances):
        values, costs, budget, redundancy = instance(modules, seed + i, pairs)
        bqm, _ = qubo.build_bqm(values, costs, budget, redundancy, LAM)
        sizes.append(bqm.num_variables)
        reference = solve("milp", values, costs, budget, redundancy, seed + i)
        if reference.solver != "milp":
            notes.append(f"M={modules} instance {i}: {reference.solver}: the reference is not proven optimal")
        for solver in SOLVERS:
            if not applicable(solver, values, bqm.num_variables):
                continue
            alloc = reference if solver == "milp" else solve(solver, values, costs, budget, redundancy, seed + i)
            score = qubo.objective(alloc, values, redundancy, LAM)
            gap = (reference.objective - score) / reference.objective if reference.objective > 0 else 0.0
            raw = None if alloc.energy is None else not alloc.repaired  # milp/exact/greedy draw no samples
            runs[solver].append((gap, raw, alloc.feasible, alloc.wall_seconds))
        print(f"M={modules}: instance {i + 1}/{instances} done", file=sys.stderr, flush=True)
    rows = []
    for solver, results in runs.items():
        if not results:
            why = f"{len(RANKS) + 1}^{modules} = {(len(RANKS) + 1) ** modules:.1e} allocations > {qubo.EXACT_LIMIT:,}" if solver == "exact" \
                else f"BQMs have {min(sizes)}-{max(sizes)} variables > max_qubits {MAX_QUBITS}"  # fmt: skip
            notes.append(f"M={modules}: {solver} not run: {why}")
            continue
        gaps = [g for g, _, _, _ in results]
        raws = [r for _, r, _, _ in results if r is not None]
        rows.append(
            f"| {modules} | {min(sizes)}-{max(sizes)} | {solver} | {pct(statistics.mean(gaps))} | {pct(max(gaps))} | "
            f"{pct(statistics.mean(raws)) if raws else 'n/a'} | {pct(statistics.mean(f for _, _, f, _ in results))} | "
            f"{statistics.mean(t for _, _, _, t in results):.3f} |"
        )
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instances", type=int, default=10)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 24, 72])
    parser.add_argument("--seed", type=int, default=0, help="instance i of every size uses seed + i (also the solvers' seed)")
    parser.add_argument("--pairs", type=float, default=None, help="probability that a pair of modules is redundant (default 3/M)")
    args = parser.parse_args(argv)
    rows, notes = [], []
    with c_stdout_to_stderr():
        for modules in args.sizes:
            size_rows, size_notes = run_size(modules, args.instances, args.seed, args.pairs)
            rows += size_rows
            notes += size_notes
    density = "3/M" if args.pairs is None else f"{args.pairs:g}"
    print(f"{args.instances} instances per size, ranks {RANKS}, λ = {LAM}, redundant pairs {density}, budget = rank 8 everywhere; "
          f"sa: {qubo.SA_READS} reads x {qubo.SA_SWEEPS} sweeps; tabu: {qubo.TABU_READS} reads x {qubo.TABU_READ_MS} ms\n")  # fmt: skip
    print("| modules | BQM variables | solver | mean gap % | max gap % | raw sample feasible % | feasible after repair % | mean wall s |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if notes:
        print()
        print("\n".join(f"- {note}" for note in notes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
