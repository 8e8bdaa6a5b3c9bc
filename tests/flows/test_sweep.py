"""Which stages a sweep computes once for every override set (flows/sweep.py); the sweep itself runs in tests/e2e/test_pipeline_e2e.py."""

from __future__ import annotations

from pathlib import Path


def test_a_sweep_over_a_key_another_stage_lists_does_not_share_that_stage():
    """ref_logprobs lists dpo.method and dpo.start in dvc.yaml, probe_lora and quantum_opt list
    lora.allocation: a sweep over those keys computes them per set, not once for all; a sweep over
    dpo.beta still shares everything before dpo."""
    from flows.sweep import shared_stages
    from pipelines.core import dag

    root = Path(__file__).resolve().parents[2]
    order = dag.order(root)
    assert shared_stages(root, [["dpo.beta=0.1"]]) == order[: order.index("dpo")] + ["grpo", "multimodal"]
    assert "grpo" not in shared_stages(root, [["grpo.beta=0.04"], ["grpo.beta=0.0"]])
    by_method = shared_stages(root, [["dpo.method=kto", "dpo.loss_type=null"], ["dpo.method=simpo", "dpo.loss_type=null"]])
    assert "ref_logprobs" not in by_method and "sft" in by_method
    by_allocation = shared_stages(root, [["lora.allocation=uniform"]])
    assert not {"probe_lora", "quantum_opt", "lora"} & set(by_allocation) and "sft" in by_allocation
