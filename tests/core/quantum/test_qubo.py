"""LoRA rank allocation (pipelines.core.quantum.qubo): the QUBO, every solver against enumeration, repair,
fallbacks and bad input. Small instances only (QAOA on <= 5 qubits); the whole file runs in seconds.

Hand-checked example used below (HAND):

    values a: {4: 0.3, 8: 0.55}   b: {4: 0.2, 8: 0.25}
    costs  a: {4: 40, 8: 80}      b: {4: 60, 8: 120}     budget 100
    feasible choices: a8 (80) 0.55 | a4 + b4 (100) 0.5 | a4 0.3 | b4 0.2 | none -> optimum {a: 8, b: 0}
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import sys
import threading
import time

import dimod
import numpy as np
import pytest
import torch

from pipelines.core.errors import QllmError
from pipelines.core.quantum import qubo
from pipelines.core.quantum.qubo import (
    Allocation,
    BackendUnavailable,
    QuantumError,
    TooManyQubits,
    allocate_ranks,
    build_bqm,
    gaps,
)
from tests import numerics

HAND_VALUES = {"a": {4: 0.3, 8: 0.55}, "b": {4: 0.2, 8: 0.25}}
HAND_COSTS = {"a": {4: 40, 8: 80}, "b": {4: 60, 8: 120}}
HAND_BUDGET = 100


def random_instance(seed: int, modules: int = 3, ranks: tuple[int, ...] = (4, 8), redundancy: bool = True):
    """Small random problems: values concave in rank, costs r·d with small d (small slack),
    redundancy on about half the pairs, a budget anywhere from tight to loose."""
    rng = random.Random(seed)
    values, costs = {}, {}
    for k in range(modules):
        share = rng.random()
        values[f"m{k}"] = {r: share * (1 - 0.5 ** (r / 4)) * rng.uniform(0.5, 1.5) for r in ranks}
        costs[f"m{k}"] = {r: r * rng.choice([3, 5, 7]) for r in ranks}
    pairs = {(a, b): rng.random() for a, b in itertools.combinations(sorted(values), 2) if redundancy and rng.random() < 0.5}
    budget = rng.randint(10, sum(max(c.values()) for c in costs.values()))
    return values, costs, budget, pairs


def brute_force(values, costs, budget, redundancy=None, lam=0.0) -> float:
    """The constrained optimum by enumerating every allocation with the public objective/cost."""
    modules = sorted(values)
    best = -1.0
    for choice in itertools.product(*[[0, *values[m]] for m in modules]):
        ranks = dict(zip(modules, choice, strict=True))
        if qubo.total_cost(ranks, costs) <= budget:
            best = max(best, qubo.objective(ranks, values, redundancy, lam))
    return best


def objective_approx(expected: float, values, redundancy=None):
    """An objective computed in float64 in another order (or for another optimal allocation): a sum
    over the modules and, per redundant pair, λ·ρ·sqrt(v·v') and its subtraction (5 roundings), on
    terms up to twice the sum of the modules' best values (tests/numerics.py)."""
    n = len(values) + 5 * len(redundancy or {}) + 1
    return numerics.approx(expected, n=n, dtype=torch.float64, magnitude=2 * sum(max(v.values()) for v in values.values()))


def energy_approx(expected: float, bqm: dimod.BinaryQuadraticModel):
    """A BQM's energy at a state against a value computed otherwise: the sum of its offset, linear
    and quadratic terms in float64, on their absolute sum (the penalties' terms cancel)."""
    n = 1 + bqm.num_variables + bqm.num_interactions
    magnitude = abs(bqm.offset) + sum(map(abs, bqm.linear.values())) + sum(map(abs, bqm.quadratic.values()))
    return numerics.approx(expected, n=n, dtype=torch.float64, magnitude=magnitude)


def decode(p, sample: dict) -> tuple[dict, bool]:
    """qubo._decode on one sample given as {label: 0/1}: ({module: rank}, one rank per module)."""
    labels = list(sample)
    k, one_rank_each = qubo._decode(p, labels, np.array([[sample[v] for v in labels]]))
    return p.ranks(k[0]), bool(one_rank_each[0])


# ---------------------------------------------------------------- objective, cost, BQM


def test_objective_and_cost_by_hand():
    """ranks {a: 8, b: 4}, ρ = 0.5, λ = 0.5: 0.55 + 0.2 − 0.25·sqrt(0.55·0.2) = 0.75 − 0.25·0.331662 = 0.667084;
    cost 80 + 60 = 140. With b at rank 0 the pair's penalty vanishes: 0.55."""
    red = {("a", "b"): 0.5}
    assert qubo.objective({"a": 8, "b": 4}, HAND_VALUES, red, lam=0.5) == numerics.approx(0.667084, n=7, dtype=torch.float64, decimals=6)
    assert qubo.objective({"a": 8, "b": 0}, HAND_VALUES, red, lam=0.5) == 0.55  # one value and a zero added: exact
    assert qubo.total_cost({"a": 8, "b": 4}, HAND_COSTS) == 140
    assert qubo.total_cost({"a": 0, "b": 0}, HAND_COSTS) == 0
    with pytest.raises(QuantumError, match="'a' has no candidate rank 16"):
        qubo.objective({"a": 16}, HAND_VALUES)


def test_bqm_terms_without_a_binding_budget():
    """Budget 200 >= every module at its top rank: no constraint, no slack. Linear −v; one-rank
    penalty A = 2·Σ_m max_r v = 2·(0.55 + 0.25) = 1.6; redundancy λρ·sqrt(v·v'): a4·b8 = 0.5·0.5·sqrt(0.3·0.25)."""
    bqm, meta = build_bqm(HAND_VALUES, HAND_COSTS, 200, {("a", "b"): 0.5}, lam=0.5)
    assert set(bqm.variables) == {"a@4", "a@8", "b@4", "b@8"} and meta["slack"] == []
    assert bqm.get_linear("a@8") == -0.55 and bqm.get_linear("b@4") == -0.2  # negated values: exact
    # float64: 2·(0.55 + 0.25) (2 roundings); λρ·sqrt(v·v') (4)
    assert meta["penalties"] == numerics.approx({"one_rank": 1.6, "budget": 1.6}, n=2, dtype=torch.float64)
    assert bqm.get_quadratic("a@4", "a@8") == numerics.approx(1.6, n=2, dtype=torch.float64)
    assert bqm.get_quadratic("a@4", "b@8") == numerics.approx(0.25 * (0.3 * 0.25) ** 0.5, n=4, dtype=torch.float64)
    assert meta["variables"]["b@8"] == ("b", 8)


def test_bqm_budget_constraint_with_gcd_scaling():
    """Costs 40/80/60/120 have gcd 20: scaled 2/4/3/6 and budget 100 -> 5. dimod's slack covers
    0..5 with coefficients 1, 2, 2 (3 variables). At a feasible x with the right slack the energy is
    −objective; over budget, the best slack still leaves a penalty >= B = 1.6."""
    bqm, meta = build_bqm(HAND_VALUES, HAND_COSTS, HAND_BUDGET)
    assert meta["cost_scale"] == 20 and meta["scaled_budget"] == 5
    assert len(meta["slack"]) == 3 and all(s.startswith("slack_budget") for s in meta["slack"])
    assert bqm.num_variables == 7

    def best_energy(x: dict) -> float:
        return min(bqm.energy({**x, **dict(zip(meta["slack"], bits, strict=True))}) for bits in itertools.product([0, 1], repeat=3))

    a8 = {"a@4": 0, "a@8": 1, "b@4": 0, "b@8": 0}
    assert best_energy(a8) == energy_approx(-0.55, bqm)
    a8_b4 = {**a8, "b@4": 1}  # scaled cost 4 + 3 = 7 > 5: penalty 1.6·2² = 6.4
    assert best_energy(a8_b4) == energy_approx(-0.75 + 6.4, bqm)


@pytest.mark.parametrize("seed", range(8))
def test_ground_state_is_the_constrained_optimum(seed):
    """dimod's ExactSolver on the BQM (3 modules x 2 ranks, with and without redundancy): the
    lowest-energy state decodes to an optimal allocation, one rank per module, within budget."""
    values, costs, budget, red = random_instance(seed, redundancy=seed % 2 == 0)
    lam = 0.5 if red else 0.0
    bqm, _ = build_bqm(values, costs, budget, red, lam)
    ground = dimod.ExactSolver().sample(bqm).first
    p = qubo._problem(values, costs, budget, red, lam)
    ranks, one_rank_each = decode(p, dict(ground.sample))
    optimum = brute_force(values, costs, budget, red, lam)
    assert one_rank_each and qubo.total_cost(ranks, costs) <= budget
    assert qubo.objective(ranks, values, red, lam) == objective_approx(optimum, values, red)
    assert ground.energy == energy_approx(-optimum, bqm)


# ---------------------------------------------------------------- solvers


CASES = [dict(seed=s, modules=3, ranks=(4, 8)) for s in range(3)] + [
    dict(seed=10, modules=4, ranks=(4, 8)),
    dict(seed=11, modules=3, ranks=(4, 8, 16)),
    dict(seed=12, modules=5, ranks=(4, 8), redundancy=False),
]


@pytest.mark.parametrize("solver", ["exact", "sa", "tabu", "milp"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['modules']}x{len(c['ranks'])}-seed{c['seed']}")
def test_solvers_find_the_optimum_of_small_instances(solver, case):
    values, costs, budget, red = random_instance(**case)
    alloc = allocate_ranks(values, costs, budget, red, lam=0.5, solver=solver, seed=0)
    assert set(alloc) == set(values) and alloc.feasible and alloc.cost <= budget
    assert alloc.objective == objective_approx(brute_force(values, costs, budget, red, 0.5), values, red)
    assert alloc.solver == solver
    assert (alloc.energy is None) == (solver in ("exact", "milp"))
    assert alloc.num_variables == (0 if solver in ("exact", "milp") else build_bqm(values, costs, budget, red, 0.5)[0].num_variables)


def test_milp_bound_brackets_the_optimum():
    """HiGHS's dual bound: equal to the optimum when it proves it, and never below what any solver
    finds; other solvers carry none."""
    values, costs, budget, red = random_instance(seed=11, modules=3, ranks=(4, 8, 16))
    optimum = brute_force(values, costs, budget, red, 0.5)
    milp = allocate_ranks(values, costs, budget, red, lam=0.5, solver="milp")
    # HiGHS proves its optimum within its relative gap (tests/numerics.py: HIGHS_MIP_REL_GAP), not to rounding
    assert milp.solver == "milp" and milp.bound == pytest.approx(optimum, rel=numerics.HIGHS_MIP_REL_GAP)
    sa = allocate_ranks(values, costs, budget, red, lam=0.5, solver="sa", seed=0)
    assert sa.bound is None and sa.objective <= milp.bound * (1 + numerics.HIGHS_MIP_REL_GAP)
    to_best, to_bound = gaps(sa, milp)  # against a proven optimum both gaps are sa's true gap
    # two objectives of terms up to twice the best values (objective_approx) and the gap's division
    gap_tolerance = numerics.tolerance(3 + 5 * len(red) + 3, torch.float64, 4 * sum(max(v.values()) for v in values.values()) / optimum)
    assert to_best == pytest.approx((optimum - sa.objective) / optimum, rel=0, abs=gap_tolerance)
    assert to_bound == pytest.approx(to_best, rel=0, abs=gap_tolerance + numerics.HIGHS_MIP_REL_GAP)
    assert gaps(milp, sa) == ((sa.objective - milp.objective) / sa.objective, None)  # the same expression on the same floats; no bound: no bound gap


@pytest.mark.parametrize("solver", ["exact", "sa", "tabu", "milp"])
def test_modules_with_different_candidate_ranks(solver):
    """a: 4 or 8, b: only 16, c: 4, 8 or 16 (tables of different widths)."""
    values = {"a": {4: 0.2, 8: 0.3}, "b": {16: 0.5}, "c": {4: 0.1, 8: 0.25, 16: 0.3}}
    costs = {"a": {4: 8, 8: 16}, "b": {16: 32}, "c": {4: 4, 8: 8, 16: 16}}
    red = {("a", "c"): 0.8}
    alloc = allocate_ranks(values, costs, 40, red, lam=0.5, solver=solver)
    assert alloc.objective == objective_approx(brute_force(values, costs, 40, red, 0.5), values, red) and alloc.cost <= 40


def test_qaoa_finds_the_optimum_of_tiny_instances():
    """a: 0.3 for 2 params, b: 0.5 for 3. Budget 3: only one fits, b (4 qubits: 2 + slack 1, 2).
    Budget 5: both (2 qubits, the budget cannot bind)."""
    values, costs = {"a": {4: 0.3}, "b": {4: 0.5}}, {"a": {4: 2}, "b": {4: 3}}
    alloc = allocate_ranks(values, costs, 3, solver="qaoa", seed=0)
    assert dict(alloc) == {"a": 0, "b": 4} and alloc.num_variables == 4 and alloc.solver == "qaoa"
    assert alloc.energy == energy_approx(-0.5, build_bqm(values, costs, 3)[0]) and not alloc.repaired
    both = allocate_ranks(values, costs, 5, solver="qaoa", seed=0)
    assert dict(both) == {"a": 4, "b": 4} and both.num_variables == 2


def test_sa_is_reproducible_for_a_seed():
    values, costs, budget, red = random_instance(3, modules=6, ranks=(4, 8, 16))
    first, second = (allocate_ranks(values, costs, budget, red, lam=0.5, solver="sa", seed=7) for _ in range(2))
    assert dict(first) == dict(second) and first.energy == second.energy


def test_as_dict_is_json():
    alloc = allocate_ranks(HAND_VALUES, HAND_COSTS, HAND_BUDGET, solver="sa")
    record = json.loads(json.dumps(alloc.as_dict()))
    assert record["ranks"] == {"a": 8, "b": 0} and record["objective"] == 0.55  # one value and a zero added: exact
    assert {"solver", "cost", "budget", "feasible", "energy", "repaired", "wall_seconds", "num_variables", "penalties"} <= set(record)
    assert record["penalties"] == numerics.approx({"one_rank": 1.6, "budget": 1.6}, n=2, dtype=torch.float64)  # 2·(0.55 + 0.25)


def test_solver_names():
    assert qubo.SOLVERS == ("exact", "sa", "tabu", "milp", "dwave", "qaoa", "greedy")


# ---------------------------------------------------------------- repair


def test_decode_keeps_the_most_valuable_of_two_ranks():
    p = qubo._problem(HAND_VALUES, HAND_COSTS, HAND_BUDGET)
    ranks, one_rank_each = decode(p, {"a@4": 1, "a@8": 1, "b@4": 0, "b@8": 0, "slack_budget_0": 1})
    assert ranks == {"a": 8, "b": 0} and not one_rank_each


def test_repair_fits_the_budget_by_hand():
    """{a: 8, b: 8} costs 200 > 100. Loss per parameter saved: b 8->4 0.05/60 (cheapest), then
    b 4->0 0.2/60 = 0.0033 beats a 8->4 0.25/40 = 0.00625: {a: 8, b: 0}, cost 80; b4 (60) no longer fits."""
    p = qubo._problem(HAND_VALUES, HAND_COSTS, HAND_BUDGET)
    assert p.ranks(qubo._fit(p, p.index({"a": 8, "b": 8}))) == {"a": 8, "b": 0}
    assert p.ranks(qubo._repair(p, p.index({"a": 8, "b": 8}))) == {"a": 8, "b": 0}


def test_repair_upgrades_into_unused_budget():
    """From nothing, with budget 100: a4 gains 0.3/40 = 0.0075 per parameter, a8 0.55/80 = 0.0069,
    b4 0.2/60: take a4, then a 4->8 (0.25/40) beats b4 (0.2/60) and leaves 20 unused."""
    p = qubo._problem(HAND_VALUES, HAND_COSTS, HAND_BUDGET)
    assert p.ranks(qubo._repair(p, p.index({}))) == {"a": 8, "b": 0}


def test_an_infeasible_sample_is_repaired(monkeypatch):
    """A sampler that sets every variable: two ranks per module and far over budget."""

    class AllOnes:
        def sample(self, bqm, **kwargs):
            return dimod.SampleSet.from_samples_bqm({v: 1 for v in bqm.variables}, bqm)

    monkeypatch.setattr(qubo, "SimulatedAnnealingSampler", AllOnes)
    values, costs, budget, red = random_instance(4, modules=4)
    alloc = allocate_ranks(values, costs, budget, red, lam=0.5, solver="sa")
    assert alloc.repaired and alloc.feasible and alloc.cost <= budget
    assert set(alloc.values()) <= {0, 4, 8}
    assert alloc.energy > 0  # the raw sample's energy, dominated by its penalties


# ---------------------------------------------------------------- fallbacks and backends


def test_qaoa_refuses_more_than_max_qubits():
    with pytest.raises(TooManyQubits, match=r"qaoa: needs 7 qubits > max_qubits 4"):
        allocate_ranks(HAND_VALUES, HAND_COSTS, HAND_BUDGET, solver="qaoa", max_qubits=4)


def test_qaoa_falls_back_to_sa(caplog):
    with caplog.at_level(logging.WARNING, logger="qllm.quantum"):
        alloc = allocate_ranks(HAND_VALUES, HAND_COSTS, HAND_BUDGET, solver="qaoa", max_qubits=4, fallback="sa")
    assert alloc.solver == "sa (fallback from qaoa: needs 7 qubits > max_qubits 4)"
    assert dict(alloc) == {"a": 8, "b": 0} and alloc.feasible
    assert any(r.name == "qllm.quantum" and r.levelno == logging.WARNING and "needs 7 qubits" in r.getMessage() for r in caplog.records)


@pytest.fixture
def no_dwave_token(monkeypatch, tmp_path):
    """An empty dwave config file and no token in the environment; Leap must never be contacted."""
    (tmp_path / "dwave.conf").write_text("")
    monkeypatch.setenv("DWAVE_CONFIG_FILE", str(tmp_path / "dwave.conf"))
    monkeypatch.delenv("DWAVE_API_TOKEN", raising=False)
    monkeypatch.delenv("DWAVE_PROFILE", raising=False)

    def no_network(*args, **kwargs):
        raise AssertionError("LeapHybridSampler was constructed: the token check must come first")

    monkeypatch.setattr("dwave.system.LeapHybridSampler", no_network)


def test_dwave_without_a_token(no_dwave_token):
    with pytest.raises(BackendUnavailable, match="DWAVE_API_TOKEN"):
        allocate_ranks(HAND_VALUES, HAND_COSTS, HAND_BUDGET, solver="dwave")


def test_dwave_without_a_token_falls_back_to_sa(no_dwave_token):
    alloc = allocate_ranks(HAND_VALUES, HAND_COSTS, HAND_BUDGET, solver="dwave", fallback="sa")
    assert alloc.solver.startswith("sa (fallback from dwave: no D-Wave Leap token")
    assert dict(alloc) == {"a": 8, "b": 0}


def test_dwave_with_a_token_uses_leap_hybrid(monkeypatch):
    """A stand-in for Leap (no network): it gets the token and at least its minimum time limit."""
    calls = {}

    class FakeLeap:
        def __init__(self, token):
            calls["token"] = token

        def min_time_limit(self, bqm):
            return 3.0

        def sample(self, bqm, time_limit, label):
            calls["time_limit"] = time_limit
            return dimod.ExactSolver().sample(bqm)

    monkeypatch.setenv("DWAVE_API_TOKEN", "test-token")
    monkeypatch.setattr("dwave.system.LeapHybridSampler", FakeLeap)
    alloc = allocate_ranks(HAND_VALUES, HAND_COSTS, HAND_BUDGET, solver="dwave", timeout=1.0)
    assert alloc.solver == "dwave" and dict(alloc) == {"a": 8, "b": 0} and not alloc.repaired
    assert calls == {"token": "test-token", "time_limit": 3.0}


def test_dwave_with_an_unreadable_config(monkeypatch, tmp_path):
    monkeypatch.setenv("DWAVE_CONFIG_FILE", str(tmp_path / "missing.conf"))
    with pytest.raises(BackendUnavailable, match="cannot read the D-Wave config"):
        allocate_ranks(HAND_VALUES, HAND_COSTS, HAND_BUDGET, solver="dwave")


@pytest.mark.parametrize(("solver", "module", "extra"), [("dwave", "dwave.system", "dwave"), ("qaoa", "qiskit_optimization", "qaoa")])
def test_missing_extra(monkeypatch, solver, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(BackendUnavailable, match=rf"pip install 'qllm-pipeline\[{extra}\]'"):
        allocate_ranks(HAND_VALUES, HAND_COSTS, HAND_BUDGET, solver=solver)
    alloc = allocate_ranks(HAND_VALUES, HAND_COSTS, HAND_BUDGET, solver=solver, fallback="sa")
    assert alloc.solver.startswith(f"sa (fallback from {solver}: needs the '{extra}' extra")


# ---------------------------------------------------------------- bad input


def with_value(m, r, v):
    return {**HAND_VALUES, m: {**HAND_VALUES[m], r: v}}


def with_cost(m, r, c):
    return {**HAND_COSTS, m: {**HAND_COSTS[m], r: c}}


BAD = {
    "empty": (dict(values={}, costs={}), "no modules"),
    "modules differ": (dict(costs={"a": HAND_COSTS["a"], "c": HAND_COSTS["b"]}), r"only in values \['b'\], only in costs \['c'\]"),
    "ranks differ": (dict(costs={**HAND_COSTS, "b": {4: 60, 16: 240}}), "module 'b': values has ranks"),
    "negative value": (dict(values=with_value("b", 8, -0.1)), "value of module 'b' rank 8 is negative"),
    "nan value": (dict(values=with_value("a", 4, float("nan"))), "value of module 'a' rank 4 must be a finite number"),
    "zero cost": (dict(costs=with_cost("a", 8, 0)), "cost of module 'a' rank 8 must be a positive integer"),
    "fractional cost": (dict(costs=with_cost("a", 8, 80.5)), "cost of module 'a' rank 8 must be a positive integer"),
    "string rank": (dict(values={**HAND_VALUES, "b": {"4": 0.2}}, costs={**HAND_COSTS, "b": {"4": 60}}), "ranks must be positive integers, got '4'"),
    "no ranks": (dict(values={**HAND_VALUES, "b": {}}, costs={**HAND_COSTS, "b": {}}), "module 'b' has no candidate ranks"),
    "pair order": (dict(redundancy={("b", "a"): 0.5}), r"must be ordered with a < b .*use \('a', 'b'\)"),
    "self pair": (dict(redundancy={("a", "a"): 0.5}), "pairs a module with itself"),
    "unknown pair module": (dict(redundancy={("a", "z"): 0.5}), r"unknown module\(s\) \['z'\]"),
    "pair not a tuple": (dict(redundancy={"a|b": 0.5}), "must be a pair"),
    "rho above 1": (dict(redundancy={("a", "b"): 1.5}), r"outside \[0, 1\]"),
    "rho below 0": (dict(redundancy={("a", "b"): -0.1}), r"outside \[0, 1\]"),
    "negative budget": (dict(budget=-1), "budget must be >= 0"),
    "negative lam": (dict(lam=-0.5), "lam must be >= 0"),
    "unknown solver": (dict(solver="annealer"), "unknown solver 'annealer'; expected one of exact, sa, tabu, milp, dwave, qaoa, greedy"),
    "unknown fallback": (dict(solver="qaoa", fallback="qpu"), "unknown fallback 'qpu'"),
    "zero timeout": (dict(timeout=0), "timeout must be > 0"),
    "zero num_reads": (dict(num_reads=0), "num_reads must be a positive integer or None"),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_input_is_a_clear_error(case):
    changes, message = case
    kwargs = {"values": HAND_VALUES, "costs": HAND_COSTS, "budget": HAND_BUDGET, **changes}
    with pytest.raises(QuantumError, match=message) as info:
        allocate_ranks(**kwargs)
    assert isinstance(info.value, QllmError) and isinstance(info.value, ValueError)


def test_budget_below_the_cheapest_adapter_gives_no_adapters():
    alloc = allocate_ranks(HAND_VALUES, HAND_COSTS, 39, solver="sa")
    assert dict(alloc) == {"a": 0, "b": 0} and alloc.feasible and alloc.cost == 0 and alloc.objective == 0
    assert "budget below the cheapest adapter" in alloc.solver and "39 < 40" in alloc.solver


def test_exact_refuses_large_problems():
    values, costs, budget, _ = random_instance(0, modules=12, ranks=(4, 8, 16))
    with pytest.raises(QuantumError, match=r"exact: 16,777,216 allocations .* > 2,000,000; use solver 'milp'"):
        allocate_ranks(values, costs, budget, solver="exact")


# ---------------------------------------------------------------- greedy and time limits


def test_greedy_baseline():
    """HAND: a4 first (0.3/40 per parameter), then a 4->8 (0.25/40); b4 (60) no longer fits."""
    alloc = qubo.greedy(HAND_VALUES, HAND_COSTS, HAND_BUDGET)
    assert dict(alloc) == {"a": 8, "b": 0} and alloc.solver == "greedy" and alloc.feasible
    for seed in range(5):
        values, costs, budget, _ = random_instance(seed, modules=5, ranks=(4, 8, 16))
        alloc = qubo.greedy(values, costs, budget)
        assert isinstance(alloc, Allocation) and alloc.feasible and set(alloc) == set(values)
        assert alloc.objective <= brute_force(values, costs, budget) + 1e-9
        as_solver = qubo.allocate_ranks(values, costs, budget, solver="greedy")  # quantum_opt.solver: greedy
        assert dict(as_solver) == dict(alloc) and as_solver.solver == "greedy"


def large_instance(modules: int = 72):
    rng = random.Random(0)
    values = {f"model.layers.{k // 7}.proj{k % 7}": {} for k in range(modules)}
    costs = {m: {} for m in values}
    for m in values:
        share, width = rng.random() / modules, rng.choice([1024, 2304, 7680])
        for r in (4, 8, 16):
            values[m][r], costs[m][r] = share * (1 - 0.7 ** r), r * width
    names = sorted(values)
    red = {(a, b): rng.random() for a, b in zip(names, names[1:], strict=False) if rng.random() < 0.5}
    return values, costs, sum(c[8] for c in costs.values()), red


def test_tabu_honours_the_timeout():
    """72 modules x 3 ranks (227 BQM variables) with far too many reads for half a second: tabu fits
    its reads into the time (its allocation depends on the machine's speed; docs/lora.md)."""
    values, costs, budget, red = large_instance()
    started = time.monotonic()
    alloc = allocate_ranks(values, costs, budget, red, lam=0.5, solver="tabu", timeout=0.5, num_reads=100_000)
    assert time.monotonic() - started < 2.5
    assert alloc.feasible and set(alloc) == set(values) and alloc.objective > 0


def test_sa_allocation_does_not_depend_on_the_clock(caplog):
    """sa runs every read and repairs every distinct allocation, past the time limit too: a solve
    that a busy machine (or the GIL, shared with stages training beside it) slows finds what a quiet
    one finds, only later, and says so naming the key."""
    values, costs, budget, red = large_instance(24)
    quiet = allocate_ranks(values, costs, budget, red, lam=0.5, solver="sa", seed=3, timeout=600, num_reads=300)
    assert "past" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="qllm.quantum"):
        late = allocate_ranks(values, costs, budget, red, lam=0.5, solver="sa", seed=3, timeout=1e-6, num_reads=300, setting="lora.adaptive.timeout")
    assert (dict(late), late.objective, late.energy) == (dict(quiet), quiet.objective, quiet.energy)
    assert "sa: 300 reads took" in caplog.text and "past lora.adaptive.timeout (1e-06 s)" in caplog.text
    # a seed of its own finds its own samples (the check above is not vacuous: the reads matter)
    assert any(allocate_ranks(values, costs, budget, red, lam=0.5, solver="sa", seed=s, timeout=600, num_reads=3).energy != quiet.energy for s in range(4))


def test_sa_allocation_is_the_same_beside_a_thread_holding_the_gil():
    """The in-loop solve beside busy Python threads in one process (`qllm run`'s stages): the same
    allocation as alone."""
    values, costs, budget, red = large_instance(12)
    alone = allocate_ranks(values, costs, budget, red, lam=0.5, solver="sa", seed=1, timeout=0.05, num_reads=300)
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(range(1000))

    threads = [threading.Thread(target=busy) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        beside = allocate_ranks(values, costs, budget, red, lam=0.5, solver="sa", seed=1, timeout=0.05, num_reads=300)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert (dict(beside), beside.energy) == (dict(alone), alone.energy)
