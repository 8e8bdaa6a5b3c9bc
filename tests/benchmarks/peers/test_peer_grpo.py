"""The GRPO comparison with TRL runs both trainers on the same questions and reward: each side's
step time, generation time and per-step rewards come back, TRL's from its own `GRPOTrainer`."""

from __future__ import annotations

from benchmarks.peers import peer_grpo
from benchmarks.peers.peer_dpo import WARMUP
from pipelines import grpo
from pipelines.core.models.models import load_for_inference
from pipelines.core.params.rl import GrpoParams
from pipelines.core.params.training import TrainParams


def test_both_trainers_run_the_same_problem_and_report_their_times(tiny_base):
    model, tokenizer = load_for_inference(tiny_base / "model")
    questions = grpo.questions(tiny_base / "chat")
    cfg = TrainParams(max_steps=WARMUP + 2, micro_batch_size=8, warmup_steps=0, lr=1e-3, eval_every=0, checkpoint_every=0, log_every=1,
                      precision="fp32", extensions=[])  # fmt: skip
    p = GrpoParams(group_size=4, max_completion_length=5, train=cfg)
    for side in (peer_grpo.time_ours, peer_grpo.time_trl):
        step, generating, rewards = side(model, tokenizer, questions, p, cfg)
        assert 0 < generating < step, side.__name__  # generation is part of the step
        assert len(rewards) == cfg.max_steps and all(0 <= r <= 1 for r in rewards), (side.__name__, rewards)
