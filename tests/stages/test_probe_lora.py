"""probe_lora: gradient statistics -> values, costs, redundancies; lora applies an allocation."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from pipelines import lora, probe_lora
from pipelines.core.errors import QllmError
from pipelines.core.outputs import read_json
from pipelines.core.params.finetuning import LoraParams, ProbeLoraParams
from pipelines.core.params.training import TrainParams
from tests import numerics

TRAIN = TrainParams(max_steps=5, micro_batch_size=2, warmup_steps=1, lr=0.01, eval_every=0, log_every=1, checkpoint_every=0, precision="fp32")


def test_scores_from_a_probe_run(tiny_base, tmp_path):
    params = ProbeLoraParams(base_model=str(tiny_base / "model"), ranks=[1, 2, 64], train=TRAIN)
    metrics = probe_lora.run(tiny_base / "chat", tmp_path / "probe", params)
    table = read_json(tmp_path / "probe" / "scores.json")
    # tiny model: 2 layers x 7 projections
    assert metrics["modules"] == 14 == len(table["values"]) and table["steps"] == 5
    shares = [m["energy_share"] for m in table["modules"].values()]
    # each share's squared singular values against the total's sums of squares: an SVD of up to
    # 64 x 32 and the squares and sums (tests/numerics.py)
    assert sum(shares) == numerics.approx(1.0, n=numerics.svd_roundings(64, 32) + 2 * 64 * 32)
    for name, values in table["values"].items():
        v1, v2, v64 = values["1"], values["2"], values["64"]
        assert 0 < v1 <= v2 <= v64  # captured energy grows with the rank
        # rank 64 >= min(d_in, d_out) of every module here: the full energy share
        assert v64 == table["modules"][name]["energy_share"]  # the same element of the same cumulative sum: exact
        shape = table["modules"][name]
        assert table["costs"][name] == {str(r): r * (shape["d_in"] + shape["d_out"]) for r in (1, 2, 64)}
    assert set(table["redundancy"]) == {f"{a}|{b}" for a, b in itertools.combinations(sorted(table["values"]), 2)}
    assert all(0 <= rho <= 1 for rho in table["redundancy"].values())


def test_values_are_the_svd_energy_of_the_accumulated_gradient():
    """v[m][r] = sum of the r largest squared singular values of G_m over all modules' energy."""
    recorder = probe_lora.GradientRecorder({"a": torch.nn.Linear(3, 2, bias=False), "b": torch.nn.Linear(2, 2, bias=False)})
    recorder.accumulated["a"] = torch.tensor([[3.0, 0.0, 0.0], [0.0, 1.0, 0.0]])  # singular values 3, 1
    recorder.accumulated["b"] = torch.tensor([[0.0, 0.0], [0.0, 2.0]])  # singular value 2
    recorder.energies = {"a": [1.0, 2.0, 3.0], "b": [3.0, 2.0, 1.0]}  # perfectly anti-correlated
    table = probe_lora.scores(recorder, [1, 2], redundancy="energy")
    total = 9 + 1 + 4
    # fp32 SVDs of 2 x 3 and 2 x 2 matrices, their squares and sums, divided by the total
    n = numerics.svd_roundings(2, 3) + 4
    assert table["values"]["a"] == numerics.approx({1: 9 / total, 2: 10 / total}, n=n)
    assert table["values"]["b"] == numerics.approx({1: 4 / total, 2: 4 / total}, n=n)
    assert table["costs"]["a"] == {1: 5, 2: 10} and table["redundancy"] == {"a|b": 0.0}  # max(0, -1)


def test_detrended_redundancy_compares_the_changes_of_the_energies():
    """Both energies fall (the trend every module shares as the loss falls): `energy` calls them
    redundant; their changes from step to step disagree, which `detrended` sees."""
    recorder = probe_lora.GradientRecorder({"a": torch.nn.Linear(2, 2, bias=False), "b": torch.nn.Linear(2, 2, bias=False),
                                            "c": torch.nn.Linear(2, 2, bias=False)})  # fmt: skip
    for name in recorder.accumulated:
        recorder.accumulated[name] = torch.eye(2)
    recorder.energies = {"a": [8.0, 4.0, 3.0, 1.5, 1.2], "b": [8.0, 6.0, 3.0, 2.5, 1.2], "c": [16.0, 8.0, 6.0, 3.0, 2.4]}
    raw = probe_lora.scores(recorder, [1], redundancy="energy")["redundancy"]
    detrended = probe_lora.scores(recorder, [1])["redundancy"]
    assert raw["a|b"] > 0.9 and detrended["a|b"] == 0.0  # a halves when b barely moves, and the other way round
    # c moves exactly as a does (twice as big): the correlation is 1 up to float64's rounding, which
    # the 6 decimals it is rounded to cannot show
    assert raw["a|c"] > 0.9 and detrended["a|c"] == 1.0


def test_unknown_candidate_is_a_clear_error(tiny_base, tmp_path):
    params = ProbeLoraParams(base_model=str(tiny_base / "model"), target_modules=["q_proj", "qkv"], train=TRAIN)
    with pytest.raises(QllmError, match=r"probe_lora.target_modules: \['qkv'\] match no linear module"):
        probe_lora.run(tiny_base / "chat", tmp_path / "probe", params)


def test_lora_applies_an_allocation_with_consistent_scaling():
    params = LoraParams(allocation="quantum_opt", adapter={"lora_alpha": 10.0})
    allocation = {"rank_pattern": {"model.layers.0.self_attn.q_proj": 16, "model.layers.1.mlp.up_proj": 4, "model.layers.1.mlp.down_proj": 0},
                  "budget_rank": 5}  # fmt: skip
    applied = lora.apply_allocation(params, allocation).adapter
    assert applied.target_modules == ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"]
    assert applied.rank_pattern == {"model.layers.0.self_attn.q_proj": 16, "model.layers.1.mlp.up_proj": 4}
    # every module's alpha / r is lora_alpha over the budget's uniform rank: 10 / 5 = 2, whatever its rank
    assert {m: applied.alpha_pattern[m] / r for m, r in applied.rank_pattern.items()} == {m: 2.0 for m in applied.rank_pattern}
    assert lora.apply_allocation(params.model_copy(update={"adapter": params.adapter.model_copy(update={"use_rslora": True})}), allocation).adapter.alpha_pattern == {}
    with pytest.raises(QllmError, match="no module was given a rank"):
        lora.apply_allocation(params, {"rank_pattern": {"x": 0}, "budget_rank": 5})
    with pytest.raises(QllmError, match="no budget_rank .* rerun quantum_opt"):
        lora.apply_allocation(params, {"rank_pattern": allocation["rank_pattern"]})  # an allocation.json of an older quantum_opt


def _scores_file(path):
    from pipelines.core.outputs import write_json

    modules = {"a": {"d_in": 4, "d_out": 4}, "b": {"d_in": 4, "d_out": 8}}
    write_json(path, {
        "ranks": [1, 2],
        "values": {"a": {"1": 0.3, "2": 0.4}, "b": {"1": 0.2, "2": 0.6}},
        "costs": {m: {str(r): r * (s["d_in"] + s["d_out"]) for r in (1, 2)} for m, s in modules.items()},
        "redundancy": {"a|b": 0.5}, "modules": modules, "steps": 3,
    })  # fmt: skip
    return path


def test_quantum_opt_writes_the_allocation_and_its_reference(tmp_path):
    from pipelines import quantum_opt
    from pipelines.core.params.finetuning import QuantumOptParams

    scores = _scores_file(tmp_path / "scores.json")
    # budget = rank 1 everywhere = 8 + 12 = 20: {a: 1, b: 1} (0.5 − λ·0.5·sqrt(0.06)) beats {b: 1} (0.2)
    # and {a: 2} (cost 16, 0.4); b at rank 2 costs 24 > 20
    metrics = quantum_opt.run(scores, tmp_path / "out", QuantumOptParams(budget_rank=1, lam=0.02, solver="exact"))
    allocation = read_json(tmp_path / "out" / "allocation.json")
    assert allocation["ranks"] == {"a": 1, "b": 1} and allocation["rank_pattern"] == {"a": 1, "b": 1}
    # a DVC output holds nothing that depends on the clock: the solve time and the time-limited MILP reference
    assert not {"wall_seconds", "gap_to_milp", "milp_objective"} & set(allocation) and metrics["solve_seconds"] >= 0
    # float64 (7 roundings, as tests/core/quantum/test_qubo.py's objective_approx), written with 6 decimals
    assert metrics["objective"] == numerics.approx(0.5 - 0.02 * 0.5 * (0.3 * 0.2) ** 0.5, n=7, dtype=torch.float64, decimals=6)
    assert metrics["gap_to_milp"] == 0.0 and metrics["milp_optimal"] and metrics["budget"] == 20
    # the MILP proved the optimum: its bound is the exact solver's objective, within HiGHS's gap and 6 decimals
    assert metrics["gap_to_bound"] == pytest.approx(0.0, abs=numerics.HIGHS_MIP_REL_GAP + 0.5e-6)
    skipped = quantum_opt.run(scores, tmp_path / "out2", QuantumOptParams(budget_rank=1, reference_timeout=0))
    assert skipped["gap_to_milp"] is None and skipped["milp_objective"] is None and skipped["gap_to_bound"] is None


def test_quantum_opt_budget_below_every_adapter_is_a_clear_error(tmp_path):
    from pipelines import quantum_opt
    from pipelines.core.params.finetuning import QuantumOptParams

    with pytest.raises(QllmError, match=r"budget \(5 parameters\) is below the cheapest adapter"):
        quantum_opt.run(_scores_file(tmp_path / "scores.json"), tmp_path / "out", QuantumOptParams(budget=5))
    assert not (tmp_path / "out").exists()


def no_solution_in_time(monkeypatch):
    """HiGHS as on a slow or busy machine: its time limit reached before it found any allocation."""
    from scipy import optimize

    def milp(*args, **kwargs):
        return optimize.OptimizeResult(x=None, status=1, message="Time limit reached. (HiGHS Status 13)", success=False)

    monkeypatch.setattr(optimize, "milp", milp)


def test_a_reference_solve_that_finds_nothing_in_time_is_logged_and_the_stage_goes_on(tmp_path, monkeypatch, caplog):
    """The MILP reference only measures the gap: on a slower machine it may find nothing in time
    (seen on an AVX2 EPYC: `milp: no solution (Time limit reached)` stopped lora at step 111)."""
    from pipelines import quantum_opt
    from pipelines.core.params.finetuning import QuantumOptParams

    scores = _scores_file(tmp_path / "scores.json")
    expected = quantum_opt.run(scores, tmp_path / "before", QuantumOptParams(budget_rank=1, lam=0.02, solver="sa"))
    no_solution_in_time(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="qllm.quantum"):
        metrics = quantum_opt.run(scores, tmp_path / "out", QuantumOptParams(budget_rank=1, lam=0.02, solver="sa"))
    assert read_json(tmp_path / "out" / "allocation.json") == read_json(tmp_path / "before" / "allocation.json")  # the same allocation
    assert metrics["objective"] == expected["objective"]
    assert metrics["gap_to_milp"] is None and metrics["milp_objective"] is None and metrics["gap_to_bound"] is None
    assert "no MILP reference: milp: no solution within the time limit" in caplog.text
    assert "raise quantum_opt.reference_timeout" in caplog.text and "the gap is unknown" in caplog.text
    # where the MILP is the solver itself, it protects the result: a clear error naming the setting
    with pytest.raises(QllmError, match=r"milp: no solution within the time limit \(Time limit reached.*raise quantum_opt.timeout"):
        quantum_opt.run(scores, tmp_path / "milp", QuantumOptParams(budget_rank=1, solver="milp"))
    assert not (tmp_path / "milp").exists()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_frozen_base_probe_records_the_base_gradients_and_leaves_the_weights(tiny_base, tmp_path, checkpointing):
    """`frozen_base: true`: no optimizer, nothing updated; each step's record is autograd's weight
    gradient at the base (activation checkpointing on or off), so the scores equal those of a
    plain backward pass over the same batches, and the base's weights are untouched."""
    from pipelines.core.data import chat_examples
    from pipelines.core.models.models import load_causal_lm, load_tokenizer
    from pipelines.core.training import finetune, loop

    train = TRAIN.model_copy(update={"max_steps": 3, "micro_batch_size": 2, "grad_accum_steps": 2, "gradient_checkpointing": checkpointing})
    params = ProbeLoraParams(base_model=str(tiny_base / "model"), ranks=[1, 2], target_modules=["q_proj", "down_proj"], train=train,
                             frozen_base=True)  # fmt: skip
    metrics = probe_lora.run(tiny_base / "chat", tmp_path / "probe", params)
    table = read_json(tmp_path / "probe" / "scores.json")
    assert metrics["steps"] == 3 == table["steps"] and len(table["values"]) == 4

    reference = load_causal_lm(tiny_base / "model")
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    recorder = probe_lora.GradientRecorder(probe_lora.candidate_modules(reference, params.target_modules))
    tokenizer = load_tokenizer(tiny_base / "model")
    rows, _, _ = finetune.build_rows(tokenizer, tiny_base / "chat", params, 128)
    batches = iter(loop.Batches(len(rows), 2, train.seed, chat_examples.collate(rows, tokenizer.pad_token_id, True)))
    for _ in range(3):
        reference.zero_grad()
        for _ in range(2):
            loss, _ = chat_examples.chat_loss(reference, next(batches))
            (loss / 2).backward()
        recorder.on_gradients(None)
    expected = probe_lora.scores(recorder, [1, 2])
    # the stage's gradients and these are two orders of one backward pass (128 positions, 2 rows a
    # micro-batch, 6 micro-batches summed), squared, through an SVD of up to 64 x 32 (tests/numerics.py)
    backward = numerics.model_roundings(reference.config, 128, tokens=2 * 128, backward=True) + 6
    n = 2 * backward + numerics.svd_roundings(64, 32) + 2 * 64 * 32
    for name, shape in table["modules"].items():
        assert shape["energy_share"] == numerics.approx(expected["modules"][name]["energy_share"], n=n), name
        assert table["values"][name] == numerics.approx({str(r): v for r, v in expected["values"][name].items()}, n=n), name
    # over 3 steps a correlation is of two changes: +-1 or 0 (rounded to 6 decimals), which rounding cannot move
    assert table["redundancy"] == expected["redundancy"]
    assert all(torch.equal(before[k], v) for k, v in load_causal_lm(tiny_base / "model").state_dict().items())
