"""LoRA rank allocation as a QUBO, solved by simulated annealing, tabu search, a MILP, D-Wave or QAOA.

    from pipelines.core.quantum.qubo import allocate_ranks
    alloc = allocate_ranks(values, costs, budget, redundancy, lam=0.5, solver="sa", seed=0)
    alloc["model.layers.0.self_attn.q_proj"]   # 8 (0 = no adapter); alloc.as_dict() for JSON

`values[m][r]` (>= 0) is what a rank-r adapter on module m is worth, `costs[m][r]` (a positive
integer) its trainable parameters, `redundancy[(a, b)] = ρ` in [0, 1] (a < b) how much modules a
and b overlap. Choose at most one rank r_m per module (0 = no adapter: value 0, cost 0) to

    maximise  Σ_m v[m][r_m] − λ·Σ_{a<b} ρ[a,b]·sqrt(v[a][r_a]·v[b][r_b])   (pairs with both ranks > 0)
    subject to Σ_m c[m][r_m] <= budget

`build_bqm` writes this as a binary quadratic model (one binary x[m,r] per candidate, labelled
"m@r", penalties for a second rank and for exceeding the budget, slack variables from dimod). The
solvers in `SOLVERS`:

- `exact`: enumerates every allocation (small problems only); no BQM.
- `greedy`: the value-per-parameter heuristic (`greedy`), no BQM and no redundancy: the classical
  baseline every other solver is measured against.
- `milp`: scipy's HiGHS on the original problem (pairwise penalties linearised); the reference optimum.
- `sa`, `tabu`: dwave-samplers on the BQM (seeded).
- `dwave`: D-Wave Leap's hybrid sampler (extra `dwave` and a Leap token).
- `qaoa`: QAOA on a statevector simulator (extra `qaoa`; at most `max_qubits` BQM variables).

A BQM solver's samples are decoded (a module with several ranks keeps its most valuable one);
one that is over budget is repaired by giving up the smallest losses per parameter saved until it
fits; then upgrades that fit and raise the objective are taken, and the best allocation over the
distinct samples is returned. Every result is feasible; `Allocation.repaired` says whether the
chosen sample broke a constraint.

Over 700 lines, on purpose: every solver reads and writes the same private problem arrays
(`_Problem`: values, costs, pair penalties as NumPy arrays) and shares the decoding, repair and
upgrade steps; split into modules, those would have to become a public API only this file uses.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import numbers
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import dimod
import numpy as np
from dwave.samplers import SimulatedAnnealingSampler, TabuSampler
from scipy import optimize, sparse

from pipelines.core.errors import QllmError

log = logging.getLogger("qllm.quantum")

EXACT_LIMIT = 2_000_000
"""The most allocations `exact` enumerates: Π_m (ranks of m + 1)."""
PENALTY_MARGIN = 2.0
"""Penalty weights are this multiple of Σ_m max_r v[m][r] (see `_penalties`)."""
SA_READS = 1000
SA_SWEEPS = 1000
SA_CHUNK = 100
TABU_READS = 300
TABU_READ_MS = 2
QAOA_REPS = 2
QAOA_MAXITER = 200
_CHUNK = 1 << 16  # allocations per vectorised block in `exact`


class QuantumError(QllmError, ValueError):
    """Bad input to the allocation (named module, rank or key), an unknown solver, or a problem too
    large for the chosen solver."""


class BackendUnavailable(QuantumError):
    """A real backend cannot run here: its extra is not installed or it has no credentials."""


class TooManyQubits(QuantumError):
    """The problem has more BQM variables than `max_qubits` allows for QAOA."""


class NoSolution(QuantumError):
    """An exact solver (milp, exact) found no allocation within its time limit."""


class Allocation(dict):
    """Module -> rank (every module present; 0 = no adapter), with how it was found."""

    def __init__(self, ranks: Mapping[str, int], *, solver: str, objective: float, cost: int, budget: int,
                 energy: float | None = None, repaired: bool = False, num_variables: int = 0,
                 penalties: Mapping[str, float] | None = None, wall_seconds: float = 0.0, bound: float | None = None):  # fmt: skip
        super().__init__(ranks)
        # milp only: HiGHS's proven upper bound on the objective (its dual bound); the optimum lies
        # in [objective, bound], so (bound - x) / bound bounds any allocation's gap even when
        # HiGHS stopped at its time limit
        self.bound = None if bound is None else float(bound)
        self.solver = solver
        self.objective = float(objective)
        self.cost = int(cost)
        self.budget = int(budget)
        self.feasible = self.cost <= self.budget
        self.energy = None if energy is None else float(energy)
        self.repaired = bool(repaired)
        self.wall_seconds = float(wall_seconds)
        self.num_variables = int(num_variables)
        self.penalties = {k: float(v) for k, v in (penalties or {}).items()}

    def as_dict(self) -> dict:
        """Everything about the allocation as plain JSON types; the ranks under "ranks"."""
        return {
            "ranks": {m: int(r) for m, r in self.items()},
            "solver": self.solver,
            "objective": self.objective,
            "cost": self.cost,
            "budget": self.budget,
            "feasible": self.feasible,
            "energy": self.energy,
            "repaired": self.repaired,
            "wall_seconds": self.wall_seconds,
            "num_variables": self.num_variables,
            "penalties": dict(self.penalties),
        }


@dataclass(frozen=True)
class _Problem:
    """Checked input as tables over modules i and their options j: option 0 is "no adapter",
    then the candidate ranks ascending. An allocation is a vector k of option indices."""

    modules: tuple[str, ...]  # sorted
    options: tuple[tuple[int, ...], ...]  # options[i] = (0, ranks of module i ascending)
    value: np.ndarray  # (modules, options): v, 0 for "none" and past a module's last option
    cost: np.ndarray  # (modules, options): c, 0 for "none", huge past a module's last option
    valid: np.ndarray  # (modules, options): whether the option exists
    pairs: tuple[tuple[int, int, float], ...]  # (i, i', ρ) with i < i', ρ > 0
    overlap: np.ndarray  # (modules, modules): λ·ρ, symmetric, 0 on the diagonal
    lam: float
    budget: int

    def ranks(self, k: np.ndarray) -> dict[str, int]:
        """{module: rank} of allocation k."""
        return {m: self.options[i][j] for i, (m, j) in enumerate(zip(self.modules, k, strict=True))}

    def index(self, ranks: Mapping[str, int]) -> np.ndarray:
        """Allocation k of {module: rank} (missing modules: no adapter)."""
        return np.array([self.options[i].index(ranks.get(m, 0)) for i, m in enumerate(self.modules)])


@dataclass(frozen=True)
class _Options:
    seed: int
    deadline: float  # time.monotonic() by which the solver must return
    max_qubits: int
    num_reads: int | None
    setting: str = "timeout"  # the params key that sets the time limit, for messages

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


# ---------------------------------------------------------------- input checks


def _real(x, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x):
        raise QuantumError(f"{what} must be a finite number, got {x!r}")
    return float(x)


def _integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_tables(values: Mapping, costs: Mapping) -> tuple[dict, dict]:
    """values/costs as {module: {rank: float/int}}, with every mismatch and bad number named."""
    if not isinstance(values, Mapping) or not isinstance(costs, Mapping):
        raise QuantumError("values and costs must be mappings {module: {rank: number}}")
    if not values:
        raise QuantumError("no modules: values is empty")
    if set(values) != set(costs):
        only_v, only_c = sorted(map(str, set(values) - set(costs))), sorted(map(str, set(costs) - set(values)))
        raise QuantumError(f"values and costs name different modules: only in values {only_v}, only in costs {only_c}")
    value, cost = {}, {}
    for m in sorted(values, key=str):
        if not isinstance(m, str):
            raise QuantumError(f"module names must be strings, got {m!r}")
        if not isinstance(values[m], Mapping) or not isinstance(costs[m], Mapping):
            raise QuantumError(f"module {m!r}: values and costs must map rank -> number")
        if set(values[m]) != set(costs[m]):
            raise QuantumError(f"module {m!r}: values has ranks {sorted(values[m], key=str)} but costs has {sorted(costs[m], key=str)}")
        if not values[m]:
            raise QuantumError(f"module {m!r} has no candidate ranks")
        value[m], cost[m] = {0: 0.0}, {0: 0}
        for r in sorted(values[m], key=str):
            if not _integer(r) or r <= 0:
                raise QuantumError(f"module {m!r}: ranks must be positive integers, got {r!r} (JSON keys are strings: convert them with int)")
            v = _real(values[m][r], f"value of module {m!r} rank {r}")
            if v < 0:
                raise QuantumError(f"value of module {m!r} rank {r} is negative ({v}); values are shares of gradient energy, >= 0")
            c = _real(costs[m][r], f"cost of module {m!r} rank {r}")
            if c <= 0 or not c.is_integer():
                raise QuantumError(f"cost of module {m!r} rank {r} must be a positive integer (trainable parameters), got {costs[m][r]!r}")
            value[m][int(r)], cost[m][int(r)] = v, int(c)
    return value, cost


def _check_redundancy(redundancy: Mapping | None, modules: set[str]) -> tuple[tuple[str, str, float], ...]:
    """(a, b, ρ) for every pair with ρ > 0; keys must be (a, b) with a < b, both known modules."""
    if redundancy is None:
        return ()
    if not isinstance(redundancy, Mapping):
        raise QuantumError("redundancy must be a mapping {(module_a, module_b): rho}")
    pairs = []
    for key, rho in redundancy.items():
        if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, str) for k in key)):
            raise QuantumError(f"redundancy key {key!r} must be a pair (module_a, module_b) of module names")
        a, b = key
        if not a < b:
            raise QuantumError(f"redundancy key {key!r} must be ordered with a < b (string order): use {(b, a)!r}" if a != b
                               else f"redundancy key {key!r} pairs a module with itself")  # fmt: skip
        unknown = [k for k in key if k not in modules]
        if unknown:
            raise QuantumError(f"redundancy key {key!r} names unknown module(s) {unknown}")
        rho = _real(rho, f"redundancy {key!r}")
        if not 0 <= rho <= 1:
            raise QuantumError(f"redundancy {key!r} = {rho} is outside [0, 1]")
        if rho > 0:
            pairs.append((a, b, rho))
    return tuple(sorted(pairs))


def _check_budget(budget) -> int:
    b = _real(budget, "budget")
    if b < 0:
        raise QuantumError(f"budget must be >= 0 trainable parameters, got {budget!r}")
    return math.floor(b)  # costs are integers, so Σ c <= B exactly when Σ c <= floor(B)


def _problem(values: Mapping, costs: Mapping, budget, redundancy: Mapping | None = None, lam: float = 0.0) -> _Problem:
    value, cost = _check_tables(values, costs)
    pairs = _check_redundancy(redundancy, set(value))
    lam = _real(lam, "lam")
    if lam < 0:
        raise QuantumError(f"lam must be >= 0 (it weighs a penalty), got {lam}")
    modules = tuple(value)
    options = tuple(tuple(sorted(value[m])) for m in modules)
    width = max(map(len, options))
    table_v, table_c = np.zeros((len(modules), width)), np.full((len(modules), width), np.iinfo(np.int64).max // 4)
    for i, m in enumerate(modules):
        table_v[i, : len(options[i])] = [value[m][r] for r in options[i]]
        table_c[i, : len(options[i])] = [cost[m][r] for r in options[i]]
    index = {m: i for i, m in enumerate(modules)}
    overlap = np.zeros((len(modules), len(modules)))
    for a, b, rho in pairs:
        overlap[index[a], index[b]] = overlap[index[b], index[a]] = lam * rho
    valid = np.arange(width) < np.array([[len(o)] for o in options])
    pairs = tuple((index[a], index[b], rho) for a, b, rho in pairs)
    return _Problem(modules, options, table_v, table_c, valid, pairs, overlap, lam, _check_budget(budget))


# ---------------------------------------------------------------- objective and cost


def objective(ranks: Mapping[str, int], values: Mapping, redundancy: Mapping | None = None, lam: float = 0.0) -> float:
    """Σ_m v[m][r_m] − λ·Σ ρ[a,b]·sqrt(v[a][r_a]·v[b][r_b]) over pairs with both ranks > 0.

    Args:
        ranks: module -> rank (missing modules and rank 0: no adapter).
        values: {module: {rank: value}}.
        redundancy: {(a, b): ρ}; None for none.
        lam: the weight λ of the redundancy penalty.
    """

    def v(m: str) -> float:
        r = ranks.get(m, 0)
        if not r:
            return 0.0
        if m not in values or r not in values[m]:
            raise QuantumError(f"module {m!r} has no candidate rank {r}")
        return float(values[m][r])

    total = sum(v(m) for m in ranks)
    for (a, b), rho in (redundancy or {}).items():
        if ranks.get(a, 0) and ranks.get(b, 0):
            total -= lam * rho * math.sqrt(v(a) * v(b))
    return float(total)


def total_cost(ranks: Mapping[str, int], costs: Mapping) -> int:
    """Σ_m c[m][r_m]: the trainable parameters of the allocation (rank 0 costs nothing)."""
    total = 0
    for m, r in ranks.items():
        if r:
            if m not in costs or r not in costs[m]:
                raise QuantumError(f"module {m!r} has no candidate rank {r}")
            total += int(costs[m][r])
    return total


def _score(p: _Problem, k: np.ndarray) -> float:
    """The objective of allocation k: Σ v − ½·sqrt(v)ᵀ·overlap·sqrt(v) (overlap holds each pair twice)."""
    v = p.value[np.arange(len(k)), k]
    return float(v.sum() - 0.5 * np.sqrt(v) @ p.overlap @ np.sqrt(v))


def _cost(p: _Problem, k: np.ndarray) -> int:
    return int(p.cost[np.arange(len(k)), k].sum())


def _allocation(p: _Problem, k: np.ndarray, solver: str, **extra) -> Allocation:
    return Allocation(p.ranks(k), solver=solver, objective=_score(p, k), cost=_cost(p, k), budget=p.budget, **extra)


# ---------------------------------------------------------------- the BQM


def _penalties(p: _Problem) -> dict[str, float]:
    """Penalty weights A (a second rank of one module) and B (the budget, per scaled unit of
    violation, squared): both PENALTY_MARGIN·V with V = Σ_m max_r v[m][r], the most any violation
    can gain.

    The ground state is then the constrained optimum. Its energy is −objective wherever both
    constraints hold (the slack takes up the unused budget exactly). An infeasible state, with its
    slack at the best value, always has a strictly lower single-variable neighbour:

    - a module with k >= 2 ranks set: clearing one of them, x[m,r], changes the energy by at most
      v[m][r] − A·(k − 1) < 0 (its redundancy terms are >= 0 and go too, and the budget penalty
      cannot grow when a cost is removed);
    - over budget by t − B' >= 1 scaled units (costs and budget divided by their gcd, so integers):
      clearing any set x[m,r] (scaled cost c' >= 1) lowers the budget penalty B·(t − B')² by at
      least B (to B·(t − B' − c')², or to 0 once it fits), so the energy changes by at most
      v[m][r] − B < 0.

    So any A, B > max v[m][r] is exact. We take 2V, which is also exact by the simpler argument
    that no violating set of adapters gains more than V. SA's β range is tied to B (`_sample_sa`),
    which makes the scale matter little: 2·v_max, 2V and 10V gave mean gaps to the MILP optimum
    within 0.3 percentage points of each other (benchmarks/adapters/quantum_solvers.py instances).
    """
    most = float(p.value.max(axis=1).sum())
    weight = PENALTY_MARGIN * most if most > 0 else 1.0  # all values 0: any positive weight is exact
    return {"one_rank": weight, "budget": weight}


def _label(m: str, r: int) -> str:
    return f"{m}@{r}"


def _columns(p: _Problem) -> dict[str, tuple[int, int]]:
    """BQM label "m@r" -> (module index, option index) of every candidate."""
    return {_label(m, r): (i, j) for i, m in enumerate(p.modules) for j, r in enumerate(p.options[i]) if r}


def _bqm(p: _Problem) -> tuple[dimod.BinaryQuadraticModel, dict]:
    penalties = _penalties(p)
    scale = math.gcd(*(int(c) for c in p.cost[p.valid] if c))
    budget = p.budget // scale  # Σ c/scale <= B/scale exactly when <= floor(B/scale), costs being multiples of scale
    columns = _columns(p)
    bqm = dimod.BinaryQuadraticModel({label: -p.value[i, j] for label, (i, j) in columns.items()}, {}, 0.0, "BINARY")
    for i, m in enumerate(p.modules):
        for r, r2 in itertools.combinations(p.options[i][1:], 2):
            bqm.add_interaction(_label(m, r), _label(m, r2), penalties["one_rank"])
    for a, b, rho in p.pairs:
        for (ja, ra), (jb, rb) in itertools.product(enumerate(p.options[a][1:], 1), enumerate(p.options[b][1:], 1)):
            weight = p.lam * rho * math.sqrt(p.value[a, ja] * p.value[b, jb])
            if weight:
                bqm.add_interaction(_label(p.modules[a], ra), _label(p.modules[b], rb), weight)
    slack = []
    # with one rank per module (enforced by A alone) the most an allocation costs is Σ_m max_r c:
    # if that fits, the budget cannot bind and needs no slack
    if int(np.where(p.valid, p.cost, 0).max(axis=1).sum()) > p.budget:
        terms = [(label, int(p.cost[i, j]) // scale) for label, (i, j) in columns.items()]
        slack = [v for v, _ in bqm.add_linear_inequality_constraint(terms, penalties["budget"], "budget", lb=0, ub=budget)]
    variables = {label: (p.modules[i], p.options[i][j]) for label, (i, j) in columns.items()}
    return bqm, {"penalties": penalties, "cost_scale": scale, "scaled_budget": budget, "variables": variables, "slack": slack}


def build_bqm(values: Mapping, costs: Mapping, budget, redundancy: Mapping | None = None,
              lam: float = 0.0) -> tuple[dimod.BinaryQuadraticModel, dict]:  # fmt: skip
    """The allocation problem as a BINARY quadratic model whose ground state is the optimum.

        bqm, meta = build_bqm(values, costs, budget, redundancy, lam=0.5)
        dimod.ExactSolver().sample(bqm).first   # tiny problems only

    Variables "m@r" (x[m,r] = 1: module m gets rank r) with linear −v[m][r]; +λ·ρ·sqrt(v·v') on the
    ranks of redundant pairs; +A on two ranks of one module; the budget as
    B·(Σ c'·x + slack − B')² with costs and budget divided by the gcd of the costs (c', B').

    Returns:
        (bqm, meta) with meta: "penalties" {"one_rank": A, "budget": B}, "cost_scale" (the gcd),
        "scaled_budget" B', "variables" {label: (module, rank)}, "slack" (slack variable labels).
    """
    return _bqm(_problem(values, costs, budget, redundancy, lam))


# ---------------------------------------------------------------- decoding and repair


def _decode(p: _Problem, labels: list, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Allocations (samples x modules, option indices) from BQM samples (rows over `labels`), and
    whether each sample had at most one rank per module. Of several ranks, the most valuable wins."""
    columns = _columns(p)
    at = [(c, *columns[v]) for c, v in enumerate(labels) if v in columns]  # slack variables are not decoded
    c, i, j = (np.array(x) for x in zip(*at, strict=True))
    chosen = np.zeros((len(samples), *p.value.shape), dtype=bool)
    chosen[:, i, j] = samples[:, c] > 0
    # 1 + v ranks any set option above every unset one (0), also one worth nothing; ties: lower rank
    k = np.argmax(np.where(chosen, 1.0 + p.value, 0.0), axis=2)
    return k, chosen.sum(axis=2).max(axis=1) <= 1


def _moves(p: _Problem, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For allocations k (samples x modules): (objective gained, parameters added) by moving module
    i of sample s to option j, for every (s, i, j)."""
    rows = np.arange(k.shape[1])
    root = np.sqrt(p.value)
    at = root[rows, k]  # (samples, modules)
    # only module i's own terms change: its value and λ·ρ·sqrt(v_i·v_n) with each neighbour n
    # (einsum's own loop: the same sums in the same order for any number of samples)
    shared = np.einsum("si,ij->sj", at, p.overlap)
    gain = p.value[None] - p.value[rows, k][..., None] - shared[..., None] * (root[None] - at[..., None])
    return gain, p.cost[None] - p.cost[rows, k][..., None]


def _best_move(score: np.ndarray, pick: Callable) -> tuple[np.ndarray, np.ndarray]:
    """(module, option) of each sample's best move: `pick` (np.argmin, np.argmax) over its (i, j),
    the first in row order among equals."""
    return np.unravel_index(pick(score.reshape(len(score), -1), axis=1), score.shape[1:])


def _each(step: Callable[[_Problem, np.ndarray], np.ndarray]) -> Callable[[_Problem, np.ndarray], np.ndarray]:
    """`step` over allocations (samples x modules), for one allocation (a vector) too."""

    @functools.wraps(step)
    def over(p: _Problem, k: np.ndarray) -> np.ndarray:
        k = np.asarray(k)
        return step(p, k[None])[0] if k.ndim == 1 else step(p, k)

    return over


@_each
def _fit(p: _Problem, k: np.ndarray) -> np.ndarray:
    """Downgrade (or drop) modules of each allocation (samples x modules) until the budget holds,
    each time the move that loses the least objective per parameter saved."""
    k = k.copy()
    cost = p.cost[np.arange(k.shape[1]), k].sum(axis=1)
    while (over := np.flatnonzero(cost > p.budget)).size:
        gain, added = _moves(p, k[over])
        loss_per_saved = np.where(p.valid & (added < 0), gain / np.minimum(added, -1), np.inf)
        i, j = _best_move(loss_per_saved, np.argmin)
        k[over, i] = j
        cost[over] += added[np.arange(len(over)), i, j]
    return k


@_each
def _upgrade(p: _Problem, k: np.ndarray) -> np.ndarray:
    """Take upgrades that fit and raise the objective, the most objective per parameter first, in
    each allocation (samples x modules) until none is left."""
    k = k.copy()
    cost = p.cost[np.arange(k.shape[1]), k].sum(axis=1)
    going = np.arange(len(k))
    while going.size:
        gain, added = _moves(p, k[going])
        ok = p.valid & (added > 0) & (added <= (p.budget - cost[going])[:, None, None]) & (gain > 1e-12)
        movable = ok.reshape(len(going), -1).any(axis=1)
        going, gain, added, ok = going[movable], gain[movable], added[movable], ok[movable]
        if not going.size:
            break
        i, j = _best_move(np.where(ok, gain / np.maximum(added, 1), -np.inf), np.argmax)
        k[going, i] = j
        cost[going] += added[np.arange(len(going)), i, j]
    return k


def _repair(p: _Problem, k: np.ndarray) -> np.ndarray:
    """Feasible allocations from any (samples x modules): fit the budget, then use what it leaves.
    All samples at once: a greedy step of every sample per pass, not one sample's steps after another's."""
    return _upgrade(p, _fit(p, k))


# ---------------------------------------------------------------- solvers without a BQM


def _solve_exact(p: _Problem, o: _Options) -> Allocation:
    """Enumerate Π_m (R_m + 1) allocations in vectorised blocks; the first best one wins."""
    sizes = [len(opts) for opts in p.options]
    total = math.prod(sizes)
    if total > EXACT_LIMIT:
        raise QuantumError(f"exact: {total:,} allocations to enumerate ({len(sizes)} modules) > {EXACT_LIMIT:,}; "
                           "use solver 'milp' (also exact) or 'sa'")  # fmt: skip
    best, best_at = -math.inf, 0
    for start in range(0, total, _CHUNK):
        if time.monotonic() > o.deadline:
            raise NoSolution(f"exact: ran out of time after {start:,} of {total:,} allocations; raise {o.setting} or use 'milp'")
        k = _kth_allocations(np.arange(start, min(start + _CHUNK, total)), sizes)  # (block, modules)
        v, cost = p.value[np.arange(len(sizes)), k], p.cost[np.arange(len(sizes)), k].sum(axis=1)
        score = v.sum(axis=1) - 0.5 * np.einsum("bi,ij,bj->b", np.sqrt(v), p.overlap, np.sqrt(v))
        score = np.where(cost <= p.budget, score, -np.inf)
        i = int(np.argmax(score))
        if score[i] > best:
            best, best_at = float(score[i]), start + i
    return _allocation(p, _kth_allocations(np.array([best_at]), sizes)[0], "exact")


def _kth_allocations(n: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Allocations number n in mixed radix: module i's option is digit i (base sizes[i])."""
    digits = []
    for size in sizes:
        digits.append(n % size)
        n = n // size
    return np.stack(digits, axis=1)


def _solve_milp(p: _Problem, o: _Options) -> Allocation:
    """HiGHS on binaries x[m,r] (Σ_r x[m,r] <= 1, Σ c·x <= B) and, per positive pairwise penalty
    w·x_i·x_j, a continuous z >= x_i + x_j − 1, z >= 0 with cost w (exact: z is minimised)."""
    variables = [(i, j) for i, opts in enumerate(p.options) for j in range(1, len(opts))]
    col = {v: n for n, v in enumerate(variables)}
    c = [-p.value[i, j] for i, j in variables]
    entries, upper = [], []  # (row, column, coefficient) of rows `... <= upper`
    for i, opts in enumerate(p.options):
        entries += [(len(upper), col[i, j], 1) for j in range(1, len(opts))]
        upper.append(1)
    entries += [(len(upper), col[i, j], int(p.cost[i, j])) for i, j in variables]
    upper.append(p.budget)
    for a, b, rho in p.pairs:
        for ja, jb in itertools.product(range(1, len(p.options[a])), range(1, len(p.options[b]))):
            weight = p.lam * rho * math.sqrt(p.value[a, ja] * p.value[b, jb])
            if weight > 0:  # x_a + x_b − z <= 1
                entries += [(len(upper), col[a, ja], 1), (len(upper), col[b, jb], 1), (len(upper), len(c), -1)]
                c.append(weight)
                upper.append(1)
    rows, cols, coefs = zip(*entries, strict=True)
    matrix = sparse.csr_array((coefs, (rows, cols)), shape=(len(upper), len(c)))
    integrality = np.r_[np.ones(len(variables)), np.zeros(len(c) - len(variables))]
    result = optimize.milp(np.array(c), integrality=integrality, bounds=optimize.Bounds(0, 1),
                           constraints=optimize.LinearConstraint(matrix, -np.inf, upper),
                           options={"time_limit": max(o.remaining(), 0.01)})  # fmt: skip
    if result.x is None:
        raise NoSolution(f"milp: no solution within the time limit ({result.message}); raise {o.setting}")
    k = np.zeros(len(p.modules), dtype=int)
    for (i, j), x in zip(variables, result.x, strict=False):
        if x > 0.5:
            k[i] = j
    # HiGHS returns its best feasible point at the time limit (status 1): say it is not proven optimal,
    # and keep its dual bound (it minimises −objective, so −bound is the objective's upper bound)
    dual = getattr(result, "mip_dual_bound", None)
    bound = -float(dual) if dual is not None and np.isfinite(dual) else None
    return _allocation(p, k, "milp" if result.status == 0 else f"milp (stopped: {result.message})", bound=bound)


# ---------------------------------------------------------------- BQM samplers


def _sample_sa(bqm: dimod.BinaryQuadraticModel, penalty: float, o: _Options) -> dimod.SampleSet:
    # dimod's default β range follows the largest fields (the budget penalty's B·c'·B') and ends far
    # too hot to tell allocations apart by value. Instead: from accepting a one-unit budget violation
    # (energy B) with probability 1/e to β·(1e-4·B) = 1, resolving objective differences of 0.02% of
    # V (B = 2V). Mean gap to the MILP optimum at 24 modules (benchmark instances): 0.05% instead of
    # 2.0%; with dense redundancy (28 modules, half the pairs): 0.35% instead of 44%.
    # Every read runs, whatever the clock says: the allocation is a function of the problem, the seed
    # and num_reads alone, the same on every machine (`allocate_ranks` warns past the time limit). A
    # deadline checked per read made it depend on the load: in `qllm run` the solve shares the GIL with
    # the stages training beside it, and each check waits for it (300 reads: 0.02 s alone, 4 s beside
    # two busy Python threads), so the allocation, and with it the lora stage's adapter, could differ between two runs.
    # Reads run in chunks of their own seeds (dimod prepares every read's initial state up front).
    reads, chunks = o.num_reads or SA_READS, []
    seeds = np.random.default_rng(o.seed).integers(2**31, size=-(-reads // SA_CHUNK))  # one per chunk, from the seed
    for seed, start in zip(seeds, range(0, reads, SA_CHUNK), strict=True):
        chunks.append(SimulatedAnnealingSampler().sample(
            bqm, num_reads=min(SA_CHUNK, reads - start), num_sweeps=SA_SWEEPS, seed=int(seed), beta_range=(1 / penalty, 1e4 / penalty),
        ))  # fmt: skip
    return dimod.concatenate(chunks)


def _sample_tabu(bqm: dimod.BinaryQuadraticModel, penalty: float, o: _Options) -> dimod.SampleSet:
    # tabu's timeout is per read (ms) and it runs until then: fit the number of reads into the time left
    reads = max(1, min(o.num_reads or TABU_READS, int(1000 * o.remaining() / TABU_READ_MS)))
    return TabuSampler().sample(bqm, num_reads=reads, timeout=TABU_READ_MS, seed=o.seed)


def _sample_dwave(bqm: dimod.BinaryQuadraticModel, penalty: float, o: _Options) -> dimod.SampleSet:
    try:
        from dwave.cloud.config import load_config
        from dwave.cloud.exceptions import ConfigFileError
        from dwave.system import LeapHybridSampler
    except ImportError as err:
        raise BackendUnavailable("dwave: needs the 'dwave' extra: pip install 'qllm-pipeline[dwave]'") from err
    try:  # reads DWAVE_API_TOKEN and the dwave config files; no network
        token = load_config().get("token")
    except ConfigFileError as err:
        raise BackendUnavailable(f"dwave: cannot read the D-Wave config ({err})") from err
    if not token:
        raise BackendUnavailable("dwave: no D-Wave Leap token: set DWAVE_API_TOKEN or create a config file with `dwave config create`")
    sampler = LeapHybridSampler(token=token)
    time_limit = max(sampler.min_time_limit(bqm), o.remaining())  # Leap refuses less than its minimum
    return sampler.sample(bqm, time_limit=time_limit, label="qllm LoRA rank allocation")


def _sample_qaoa(bqm: dimod.BinaryQuadraticModel, penalty: float, o: _Options) -> dimod.SampleSet:
    if bqm.num_variables > o.max_qubits:
        raise TooManyQubits(f"qaoa: needs {bqm.num_variables} qubits > max_qubits {o.max_qubits}")
    try:
        from qiskit.primitives import StatevectorSampler
        from qiskit_optimization import QuadraticProgram
        from qiskit_optimization.algorithms import MinimumEigenOptimizer
        from qiskit_optimization.minimum_eigensolvers import QAOA
        from qiskit_optimization.optimizers import COBYLA
    except ImportError as err:
        raise BackendUnavailable("qaoa: needs the 'qaoa' extra: pip install 'qllm-pipeline[qaoa]'") from err
    labels = list(bqm.variables)
    index = {v: i for i, v in enumerate(labels)}
    program = QuadraticProgram("lora_ranks")
    for i in range(len(labels)):
        program.binary_var(f"x{i}")  # plain names: BQM labels may hold characters LP names reject
    program.minimize(constant=bqm.offset, linear=[bqm.get_linear(v) for v in labels],
                     quadratic={(index[u], index[v]): bias for (u, v), bias in bqm.quadratic.items()})  # fmt: skip
    deadline = o.deadline

    def stop_at_deadline(_result) -> None:  # scipy ends COBYLA cleanly on StopIteration from its callback
        if time.monotonic() > deadline:
            raise StopIteration

    start = np.random.default_rng(o.seed).uniform(-np.pi, np.pi, 2 * QAOA_REPS)  # seeded: no global RNG
    qaoa = QAOA(StatevectorSampler(seed=o.seed), COBYLA(maxiter=QAOA_MAXITER, callback=stop_at_deadline),
                reps=QAOA_REPS, initial_point=start)  # fmt: skip
    result = MinimumEigenOptimizer(qaoa).solve(program)
    sample = {v: int(round(result.x[i])) for v, i in index.items()}
    return dimod.SampleSet.from_samples_bqm(sample, bqm)


def _solve_bqm(sample: Callable[[dimod.BinaryQuadraticModel, float, _Options], dimod.SampleSet], name: str,
               p: _Problem, o: _Options) -> Allocation:  # fmt: skip
    """Sample the BQM; decode every distinct allocation, lowest energy first, repair those that break
    a constraint, take upgrades that fit, and keep the best."""
    bqm, meta = _bqm(p)
    samples = sample(bqm, meta["penalties"]["budget"], o)
    order = np.argsort(samples.record.energy, kind="stable")
    k, clean = _decode(p, list(samples.variables), samples.record.sample[order])
    _, first = np.unique(k, axis=0, return_index=True)  # the same allocation with other slack: once
    first = np.sort(first)
    repaired = _repair(p, k[first])  # every distinct allocation, whatever the clock says (as the reads)
    best = None
    for n, fixed in zip(first, repaired, strict=True):
        broken = not clean[n] or _cost(p, k[n]) > p.budget
        score = _score(p, fixed)
        if best is None or score > best[0] + 1e-12:
            best = (score, fixed, samples.record.energy[order[n]], broken)
    _, fixed, energy, broken = best
    return _allocation(p, fixed, name, energy=energy, repaired=broken, num_variables=bqm.num_variables,
                       penalties=meta["penalties"])  # fmt: skip


def _solve_greedy(p: _Problem, o: _Options) -> Allocation:
    """The classical baseline as a solver: value per parameter, redundancy ignored (`greedy`)."""
    return _allocation(p, _upgrade(p, np.zeros(len(p.modules), dtype=int)), "greedy")


_SOLVE: dict[str, Callable[[_Problem, _Options], Allocation]] = {
    "exact": _solve_exact,
    "sa": functools.partial(_solve_bqm, _sample_sa, "sa"),
    "tabu": functools.partial(_solve_bqm, _sample_tabu, "tabu"),
    "milp": _solve_milp,
    "dwave": functools.partial(_solve_bqm, _sample_dwave, "dwave"),
    "qaoa": functools.partial(_solve_bqm, _sample_qaoa, "qaoa"),
    "greedy": _solve_greedy,
}
SOLVERS = tuple(_SOLVE)


def _options(seed: int, timeout: float, max_qubits: int, num_reads: int | None, started: float, setting: str = "timeout") -> _Options:
    if _real(timeout, "timeout") <= 0:
        raise QuantumError(f"timeout must be > 0 seconds, got {timeout!r}")
    if not _integer(max_qubits) or max_qubits < 1:
        raise QuantumError(f"max_qubits must be a positive integer, got {max_qubits!r}")
    if num_reads is not None and (not _integer(num_reads) or num_reads < 1):
        raise QuantumError(f"num_reads must be a positive integer or None, got {num_reads!r}")
    if not _integer(seed):
        raise QuantumError(f"seed must be an integer, got {seed!r}")
    # dwave-samplers takes seeds in [0, 2^31)
    return _Options(seed=int(seed) % 2**31, deadline=started + timeout, max_qubits=int(max_qubits), num_reads=num_reads, setting=setting)


def _check_solver(name: str, what: str = "solver") -> None:
    if name not in _SOLVE:
        raise QuantumError(f"unknown {what} {name!r}; expected one of {', '.join(SOLVERS)}")


def allocate_ranks(values: Mapping, costs: Mapping, budget, redundancy: Mapping | None = None, lam: float = 0.0,
                   solver: str = "sa", seed: int = 0, *, timeout: float = 60.0, max_qubits: int = 16,
                   fallback: str | None = None, num_reads: int | None = None, setting: str = "timeout") -> Allocation:  # fmt: skip
    """The best rank per module within the budget, found by `solver`; always feasible.

        alloc = allocate_ranks(values, costs, budget, redundancy, lam=0.5, solver="qaoa", fallback="sa")
        alloc.solver   # e.g. "sa (fallback from qaoa: needs 40 qubits > max_qubits 16 ...)"

    Args:
        values: {module: {rank: value >= 0}}.
        costs: {module: {rank: trainable parameters}}, the same modules and ranks.
        budget: the most trainable parameters in total (>= 0).
        redundancy: {(a, b): ρ in [0, 1]} with a < b; None for none.
        lam: weight λ >= 0 of the redundancy penalty.
        solver: one of SOLVERS.
        seed: seeds sa, tabu and qaoa.
        timeout: seconds the solver may take: milp returns its best so far, exact and qaoa stop,
            tabu fits its reads (of TABU_READ_MS each) into it, Leap gets it as its time limit. sa
            runs all `num_reads` reads, so its allocation is the same on every machine, and warns
            past it.
        max_qubits: qaoa refuses BQMs with more variables.
        fallback: a solver (normally "sa") to use, with a logged warning, when `solver` is
            unavailable (BackendUnavailable) or too large for qaoa (TooManyQubits).
        num_reads: samples drawn by sa/tabu (None: SA_READS / TABU_READS).
        setting: the params key of `timeout`, named where the limit was too short.

    Returns:
        An Allocation (every module, 0 = none). If the budget is below the cheapest adapter,
        all zeros with solver "none (budget below the cheapest adapter ...)".

    Raises:
        QuantumError: bad input, unknown solver, too large for exact or qaoa (TooManyQubits), no
            allocation found by milp or exact within `timeout` (NoSolution, naming `setting`).
        BackendUnavailable: dwave/qaoa without its extra or dwave without a token (no fallback).
    """
    started = time.monotonic()
    _check_solver(solver)
    if fallback is not None:
        _check_solver(fallback, "fallback")
    p = _problem(values, costs, budget, redundancy, lam)
    opts = _options(seed, timeout, max_qubits, num_reads, started, setting)
    cheapest = int(p.cost[:, 1:].min())
    if p.budget < cheapest:
        nothing = np.zeros(len(p.modules), dtype=int)
        alloc = _allocation(p, nothing, f"none (budget below the cheapest adapter: {p.budget} < {cheapest} parameters)")
    else:
        ran = solver
        try:
            alloc = _SOLVE[solver](p, opts)
        except (BackendUnavailable, TooManyQubits) as err:
            if fallback is None:
                raise
            log.warning("%s; solving with %s instead", err, fallback)
            ran, alloc = fallback, _SOLVE[fallback](p, opts)  # the backend failed before doing any work: the time is left
            alloc.solver = f"{alloc.solver} (fallback from {err})"
        if ran == "sa" and time.monotonic() > opts.deadline:  # sa runs all its reads: late, not different
            log.warning("sa: %d reads took %.1f s, past %s (%g s); the allocation is the one any machine finds with this seed, "
                        "only later: lower num_reads, or raise %s", opts.num_reads or SA_READS, time.monotonic() - started, setting, timeout, setting)  # fmt: skip
    alloc.wall_seconds = time.monotonic() - started
    return alloc


def reference(values: Mapping, costs: Mapping, budget, redundancy: Mapping | None = None, lam: float = 0.0, *, timeout: float,
              seed: int = 0, setting: str = "reference_timeout") -> Allocation | None:  # fmt: skip
    """The MILP (HiGHS) allocation a solve is compared with (`gaps`), or None where HiGHS found none
    within `timeout` seconds. The reference only measures: on a slower or busier machine it may find
    nothing in time, which is logged (the gap is then unknown) and never stops the caller."""
    try:
        return allocate_ranks(values, costs, budget, redundancy, lam=lam, solver="milp", seed=seed, timeout=timeout, setting=setting)
    except NoSolution as exc:
        log.warning("no MILP reference: %s (%.3g s) for the gap to the optimum; the gap is unknown, the allocation stands", exc, timeout)
        return None


def gaps(found: Allocation, reference: Allocation) -> tuple[float | None, float | None]:
    """`found`'s relative gap to a MILP `reference`: to its best allocation (negative when HiGHS
    stopped at its time limit short of what `found` reached) and to its proven upper bound on the
    optimum (`found` is at most this far from the optimum, >= 0). None where undefined."""
    to_best = (reference.objective - found.objective) / reference.objective if reference.objective > 0 else None
    to_bound = max(0.0, (reference.bound - found.objective) / reference.bound) if reference.bound else None
    return to_best, to_bound


def greedy(values: Mapping, costs: Mapping, budget) -> Allocation:
    """The value-per-parameter baseline: from no adapters, repeatedly take the upgrade with the
    best value gained per parameter added that still fits (redundancy ignored).

        greedy(values, costs, budget).objective
    """
    started = time.monotonic()
    alloc = _solve_greedy(_problem(values, costs, budget), None)
    alloc.wall_seconds = time.monotonic() - started
    return alloc


def detrended_redundancy(names: list[str], energies: np.ndarray, floor: float = 1e-30) -> dict[tuple[str, str], float]:
    """ρ[a, b] = max(0, corr(Δ log g_a, Δ log g_b)) over the steps of `energies` ([modules, steps]):
    the correlation of the step-to-step changes of the gradient energies, not of the energies
    themselves, whose common downward trend makes every pair look alike."""
    if energies.ndim != 2 or energies.shape[1] < 3:
        return {}
    changes = np.diff(np.log(np.maximum(energies, floor)), axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        correlation = np.nan_to_num(np.corrcoef(changes))
    out = {}
    for i, a in enumerate(names):
        for j in range(i + 1, len(names)):
            rho = float(correlation[i, j])
            if rho > 0:
                out[(a, names[j])] = round(rho, 6)
    return out
