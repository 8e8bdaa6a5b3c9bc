"""A reward function's `trainer_state` is TRL's `transformers.TrainerState`, with the values TRL's
`GRPOTrainer` holds when it scores a generation (tests/fixtures/trl_rewards.py's
`reward_func_training_progress` reads them), also after a resume."""

from __future__ import annotations

import math

import pytest
import transformers

from pipelines import grpo
from pipelines.core.data.chat_template import render_prompt
from pipelines.core.models.models import load_tokenizer
from pipelines.core.params.rl import GrpoParams, RewardParams
from pipelines.core.training import loop
from pipelines.core.training.loop import TrainingInterrupted
from tests.fixtures import trl_rewards
from tests.stages.test_grpo import TRAIN, Recorder, StopAt, workspace  # noqa: F401 - a fixture

QUESTIONS = 10  # tests/conftest.py's CHATS, each ending with an answer
GROUP, MICRO, ACCUM, ITERATIONS, STEPS = 4, 8, 2, 2, 6
PER_GENERATION = MICRO * ACCUM // GROUP  # 4 questions
STEPS_PER_EPOCH = (QUESTIONS // PER_GENERATION) * ITERATIONS  # 2 whole generations of 4 (TRL drops the partial third), each 2 steps: 4
VARYING = ("timing/", "train/tokens_per_sec")  # wall times: never the same twice


def run(workspace, monkeypatch, out: str, stop_at: int | None = None) -> tuple[list[dict], Recorder]:  # noqa: F811 - the fixture
    monkeypatch.setattr(trl_rewards, "TRAINER_STATES", [])
    p = GrpoParams(rewards=[RewardParams(function="tests.fixtures.trl_rewards:reward_func_training_progress")], group_size=GROUP, max_completion_length=6,
                   num_iterations=ITERATIONS, train=TRAIN.model_copy(update={"max_steps": STEPS, "grad_accum_steps": ACCUM, "checkpoint_every": 3,
                                                                              "extensions": ["mlflow_metrics"]}))  # fmt: skip
    tracker = Recorder()
    args = (workspace, workspace / "data/models/sft", workspace / "data/prepared/chat", workspace / out, p, tracker)
    if stop_at is None:
        grpo.run(*args, checkpoint_dir=workspace / f"ckpt-{out}")
    else:
        real_train = loop.train
        monkeypatch.setattr(loop, "train", lambda *a, **k: real_train(*a, **{**k, "extensions": [*k.get("extensions", []), StopAt(stop_at)]}))
        with pytest.raises(TrainingInterrupted):
            grpo.run(*args, checkpoint_dir=workspace / f"ckpt-{out}")
        monkeypatch.setattr(loop, "train", real_train)
        monkeypatch.setattr(trl_rewards, "TRAINER_STATES", [])
        grpo.run(*args, checkpoint_dir=workspace / f"ckpt-{out}")
    return trl_rewards.TRAINER_STATES, tracker


def steady(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in entry.items() if not k.startswith(VARYING)} for entry in history]


def test_reward_functions_read_trls_trainer_state(workspace, monkeypatch):  # noqa: F811 - the fixture
    states, tracker = run(workspace, monkeypatch, "grpo")
    assert [s["global_step"] for s in states] == [0, 2, 4]  # one call per generation (every num_iterations steps), TRL's steps done
    # epoch: the steps done over the steps of one pass over the questions; num_train_epochs as Trainer derives it from max_steps
    assert [s["epoch"] for s in states] == [0.0, 0.5, 1.0]
    assert all(s["num_train_epochs"] == math.ceil(STEPS / STEPS_PER_EPOCH) == 2 and s["max_steps"] == STEPS for s in states)
    assert all(s["train_batch_size"] == MICRO and s["logging_steps"] == 1 and s["save_steps"] == 3 for s in states)
    assert all(s["total_flos"] == 0 and s["is_world_process_zero"] and s["best_metric"] is None for s in states)
    # the prompt and completion tokens of every generation so far, this one included (TRL adds them before scoring)
    tokenizer = load_tokenizer(workspace / "data/models/sft")
    seen = 0
    for state in states:
        seen += sum(len(tokenizer(render_prompt(tokenizer, p), add_special_tokens=False)["input_ids"]) for p in state["prompts"])
        seen += state["completion_tokens"]
        assert state["num_input_tokens_seen"] == seen
    # log_history: what was logged at each step before the generation, under TRL's names, with epoch and step
    logged = {step: m for step, m in tracker.metrics if "train/loss" in m}
    for state in states:
        history = state["log_history"]
        assert [e["step"] for e in history] == list(range(1, state["global_step"] + 1))
        for entry in history:
            assert entry["loss"] == logged[entry["step"]]["train/loss"] and entry["learning_rate"] == logged[entry["step"]]["train/lr"]
            assert entry["reward"] == logged[entry["step"]]["reward"] and entry["epoch"] == entry["step"] / STEPS_PER_EPOCH


def test_a_resumed_run_gives_reward_functions_the_same_state(workspace, monkeypatch):  # noqa: F811 - the fixture
    """Killed after step 3 (a checkpoint in the middle of the second generation) and resumed: the
    generation at step 4 reads the same tokens seen and log history as a run never stopped."""
    whole, _ = run(workspace, monkeypatch, "whole")
    resumed, _ = run(workspace, monkeypatch, "resumed", stop_at=3)
    assert [s["global_step"] for s in resumed] == [4]
    last = whole[-1]
    again = resumed[0]
    assert {k: v for k, v in again.items() if k != "log_history"} == {k: v for k, v in last.items() if k != "log_history"}
    assert steady(again["log_history"]) == steady(last["log_history"])


def test_trainer_state_is_transformers_own():
    from pipelines.core.rl import rewards

    state = rewards.trainer_state(global_step=3, steps_per_epoch=2, max_steps=5, train_batch_size=8, logging_steps=1, save_steps=0,
                                  num_input_tokens_seen=100, log_history=[{"loss": 1.0, "step": 1}])  # fmt: skip
    assert isinstance(state, transformers.TrainerState)
    assert (state.epoch, state.num_train_epochs) == (1.5, 3)  # 5 steps at 2 an epoch: a third, partial epoch, as Trainer counts it
