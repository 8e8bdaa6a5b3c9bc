"""The GRPO stage on a tiny random model: its questions, its micro-batches (whole groups, the first
step's loss and gradient being the policy gradient), what it logs, the KL to a reference, the reuse
of a generation (num_iterations) resumed exactly, and a reward function from a user's module."""

from __future__ import annotations

import json
import math
import shutil
import signal
import sys
import textwrap

import pandas as pd
import pytest
import torch
from pydantic import ValidationError

from pipelines import grpo
from pipelines.core.errors import QllmError, request_stop
from pipelines.core.extensions import Extension
from pipelines.core.models.models import load_causal_lm, load_tokenizer
from pipelines.core.params.rl import GrpoParams, RewardParams
from pipelines.core.params.training import TrainParams
from pipelines.core.rl import rewards, rollouts
from pipelines.core.training import loop
from pipelines.core.training.loop import TrainingInterrupted
from tests import numerics

TRAIN = TrainParams(max_steps=4, micro_batch_size=8, warmup_steps=1, lr=0.01, log_every=1, checkpoint_every=0, precision="fp32",
                    weight_decay=0.0, extensions=[])  # fmt: skip

REWARDS = '''
def brevity(prompts, completions, **kwargs):
    """1 for an answer of at most 8 characters, else 0 (a random model's vary)."""
    return [1.0 if len(c[-1]["content"]) <= 8 else 0.0 for c in completions]

def echo_answer(prompts, completions, answer, **kwargs):
    assert len(answer) == len(completions) and isinstance(prompts[0], list)
    return [float(len(a)) for a in answer]
'''


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    """A user's module of reward functions, importable as `my_grpo_rewards` (as from the project root)."""
    (tmp_path / "my_grpo_rewards.py").write_text(textwrap.dedent(REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_grpo_rewards"
    sys.modules.pop("my_grpo_rewards", None)


@pytest.fixture
def workspace(tiny_base, tmp_path):
    """A project-like tree: the SFT model at data/models/sft and the prepared chats."""
    shutil.copytree(tiny_base / "model", tmp_path / "data/models/sft")
    shutil.copytree(tiny_base / "chat", tmp_path / "data/prepared/chat")
    return tmp_path


def params(user_rewards: str, **changes) -> GrpoParams:
    settings = {"rewards": [RewardParams(function=f"{user_rewards}:brevity")], "group_size": 4, "max_completion_length": 6, "train": TRAIN,
                "log_completions_every": 2} | changes  # fmt: skip
    return GrpoParams(**settings)


class Recorder:
    """The tracker calls the stage and the loop make, kept."""

    root = None

    def __init__(self):
        self.metrics: list[tuple[int, dict]] = []
        self.tables: dict[str, pd.DataFrame] = {}
        self.params: dict = {}

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))

    def log_table(self, data, artifact_file):
        self.tables[artifact_file] = data

    def log_params(self, params):
        self.params |= dict(params)

    def flush(self):
        return None


def test_questions_are_the_chats_that_end_with_an_answer(tmp_path):
    chats = [[{"role": "user", "content": "What is 1 plus 2?"}, {"role": "assistant", "content": "3"}],
             [{"role": "user", "content": "Hello?"}],  # no answer to check against
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where?"}, {"role": "assistant", "content": "Pelora"}]]  # fmt: skip
    pd.DataFrame({"id": ["a", "b", "c"], "messages": [json.dumps(c) for c in chats]}).to_parquet(tmp_path / "train.parquet")
    found = grpo.questions(tmp_path)
    assert [(q.id, q.answer, len(q.prompt)) for q in found] == [("a", "3", 1), ("c", "Pelora", 2)]
    pd.DataFrame({"id": ["b"], "messages": [json.dumps(chats[1])]}).to_parquet(tmp_path / "train.parquet")
    with pytest.raises(QllmError, match=r"train.parquet: no chat record ends with an assistant's text answer"):
        grpo.questions(tmp_path)


def test_records_that_end_with_a_tool_call_are_counted_and_said(tmp_path, caplog):
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
    chats = [[{"role": "user", "content": "What is 1 plus 2?"}, {"role": "assistant", "content": "3"}],
             [{"role": "user", "content": "Add 1 and 2."}, call], [{"role": "user", "content": "Add 3 and 4."}, call]]  # fmt: skip
    pd.DataFrame({"id": ["a", "b", "c"], "source": "s", "split": "train", "messages": [json.dumps(c) for c in chats]}).to_parquet(tmp_path / "train.parquet")
    with caplog.at_level("WARNING", logger="qllm.grpo"):
        found = grpo.questions(tmp_path)
    assert [q.id for q in found] == ["a"] and found.tool_calls == 2
    assert "2 of the chat records end with a tool call, not a text answer" in caplog.text
    assert found[0].columns == {"source": "s", "split": "train"}  # what reward functions get besides the answer


def test_micro_batches_hold_whole_groups_and_the_first_step_is_the_policy_gradient(workspace, user_rewards):
    model = load_causal_lm(workspace / "data/models/sft").train()
    tokenizer = load_tokenizer(workspace / "data/models/sft")
    p = params(user_rewards, train=TRAIN.model_copy(update={"grad_accum_steps": 2}))
    settings = rollouts.Settings(group_size=4, max_completion_length=6, temperature=1.0, top_p=1.0, scale_rewards="group", num_iterations=1,
                                 mask_truncated_completions=False, micro_batch_size=8, grad_accum_steps=2, seed=0, precision="fp32")  # fmt: skip
    brevity = rewards.load(f"{user_rewards}:brevity")
    torch.manual_seed(3)
    batches = rollouts.RolloutBatches(model, tokenizer, grpo.questions(workspace / "data/prepared/chat"), settings, [("brevity", brevity, 1.0)])
    batches.begin_step(0)
    micro = [next(batches), next(batches)]
    assert [b["prompt_ids"].shape[0] for b in micro] == [2, 2] and [b["completion_ids"].shape[0] for b in micro] == [8, 8]  # 2 questions x 4
    tokens = sum(float(b["completion_mask"].sum()) for b in micro)
    assert all(float(b["num_items"]) == tokens / 2 for b in micro)  # dapo: the generation's tokens (the loop divides by the 2 steps)
    for b in micro:  # centred within each group: up to the rounding of the group's mean, deviation and divisions (tests/numerics.py)
        numerics.assert_close_as(b["advantages"].view(-1, 4).sum(-1), torch.zeros(2), n=4 + 8 + 4, magnitude=float(b["advantages"].view(-1, 4).abs().sum(-1).max()))
    metrics = batches.metrics(1)
    assert 0 <= metrics["reward"] <= 1 and metrics["completions/max_length"] <= 6 and 0 <= metrics["frac_reward_zero_std"] <= 1
    assert metrics["timing/generation_seconds"] > 0 and "rewards/brevity/mean" in metrics
    # Step 1 (the policy generated the batch): every ratio is 1, so the loss is -sum(A x tokens) / N and
    # its gradient the policy gradient -sum_i A_i grad log p(completion_i) / N.
    loss_fn = grpo.grpo_loss(p)
    model.zero_grad()
    total = 0.0
    for b in micro:
        loss, step_metrics = loss_fn(model, b)
        (loss / 2).backward()
        total += float(loss.detach()) / 2
        assert step_metrics["clip_ratio/region_mean"] == 0 and step_metrics["entropy"] > 0
    expected = -sum(float((b["advantages"] * b["completion_mask"].sum(-1)).sum()) for b in micro) / tokens
    # every ratio is exp(0) = 1 exactly: the same sums over 8 completions' tokens in another order, and the divisions
    magnitude = sum(float((b["advantages"].abs() * b["completion_mask"].sum(-1)).sum()) for b in micro) / tokens
    assert total == numerics.approx(expected, n=8 + 8 + 3, magnitude=magnitude)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    surrogate = sum(-(b["advantages"] * rollouts.completion_logps(model, b["prompt_ids"], b["prompt_mask"], b["completion_ids"],
                                                                   b["completion_mask"], 4)[0].sum(-1)).sum() for b in micro) / tokens  # fmt: skip
    surrogate.backward()
    # the loss's batches against the surrogate's: two orders of the backward's chain (tests/numerics.py)
    seq = micro[0]["prompt_ids"].shape[1] + micro[0]["completion_ids"].shape[1]
    backward = numerics.model_roundings(model.config, seq, tokens=int(tokens), backward=True)
    for i, (got, want) in enumerate(zip(grads, (p.grad for p in model.parameters()), strict=True)):
        numerics.assert_close_as(got, want, n=backward, what=f"gradient {i}")


def test_the_stage_trains_and_logs_what_users_watch(workspace, user_rewards):
    tracker = Recorder()
    p = params(user_rewards, rewards=[RewardParams(function=f"{user_rewards}:brevity"), RewardParams(function="format", weight=0.5)],
               train=TRAIN.model_copy(update={"extensions": ["mlflow_metrics"]}))
    metrics = grpo.run(workspace, workspace / "data/models/sft", workspace / "data/prepared/chat", workspace / "data/models/grpo", p, tracker)
    assert metrics["steps"] == 4 and metrics["questions"] == 10 and (workspace / "data/models/grpo/model.safetensors").exists()
    logged = {k for _, m in tracker.metrics for k in m}
    watched = {"reward", "reward_std", "rewards/brevity/mean", "rewards/brevity/std", "rewards/format/mean", "frac_reward_zero_std",
               "completions/mean_length", "completions/min_length", "completions/max_length", "completions/clipped_ratio",
               "clip_ratio/region_mean", "entropy", "timing/generation_seconds", "timing/optimisation_seconds", "train/loss"}  # fmt: skip
    assert watched <= logged, watched - logged
    assert "kl" not in logged  # beta 0: no reference
    # the completions table at step 1 and every 2 steps: each row a completion with its rewards and advantage
    assert sorted(tracker.tables) == ["completions/step-000001.json", "completions/step-000002.json", "completions/step-000004.json"]
    table = tracker.tables["completions/step-000002.json"]
    assert len(table) == 8 and set(table.columns) >= {"step", "prompt", "completion", "answer", "reward/brevity", "reward/format", "advantage"}
    assert set(table["step"]) == {2} and table["reward/brevity"].isin([0.0, 1.0]).all()
    assert tracker.params["grpo.start_model"] == "data/models/sft"


@pytest.mark.parametrize("adapter", ["none", "lora"])
def test_beta_adds_the_kl_to_the_start_model(workspace, user_rewards, adapter):
    tracker = Recorder()
    p = params(user_rewards, beta=0.1, adapter={"enabled": adapter == "lora"}, train=TRAIN.model_copy(update={"lr": 0.05, "extensions": ["mlflow_metrics"]}))
    grpo.run(workspace, workspace / "data/models/sft", workspace / "data/prepared/chat", workspace / "data/models/grpo", p, tracker)
    kl = [m["kl"] for _, m in tracker.metrics if "kl" in m]
    # step 1: the policy is the reference, each log-ratio d 0 up to two forward passes' rounding `tol`
    # (on a sampled token's log-probability: about ln V for the near-uniform tiny model, 4 ln V at
    # most); e^d - d - 1 <= d^2 there, and the formula's own rounding on its terms' size (3) (tests/numerics.py)
    config = load_causal_lm(workspace / "data/models/sft").config
    tol = numerics.tolerance(numerics.model_roundings(config, 128), magnitude=4 * math.log(config.vocab_size))
    rounding = tol**2 + numerics.tolerance(numerics.FUNCTION + 2, magnitude=3.0)
    assert len(kl) == 4 and kl[0] == pytest.approx(0.0, abs=rounding)
    assert kl[-1] > rounding  # then it moves away, beyond rounding (a frozen copy, or the model under its disabled adapter)
    saved = workspace / "data/models/grpo"
    assert (saved / ("adapter_config.json" if adapter == "lora" else "model.safetensors")).exists()


class StopAt(Extension):
    """Ask the loop to stop after `step` steps (as SIGTERM would): it checkpoints and raises."""

    name = "stop_at"

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, state, metrics) -> None:
        if state.step == self.step:
            request_stop(signal.SIGTERM)


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_a_reused_generation_resumes_exactly(workspace, user_rewards, monkeypatch):
    """num_iterations 2 with a checkpoint in the middle of a generation (after step 3 of 2-3): the
    resumed run restores that generation and the sampler's generator, and saves the same weights."""
    p = params(user_rewards, num_iterations=2, train=TRAIN.model_copy(update={"max_steps": 6, "checkpoint_every": 3}))
    chat = workspace / "data/prepared/chat"
    grpo.run(workspace, workspace / "data/models/sft", chat, workspace / "reference", p, checkpoint_dir=workspace / "ckpt-reference")
    real_train = loop.train
    monkeypatch.setattr(loop, "train", lambda *a, **k: real_train(*a, **{**k, "extensions": [*k.get("extensions", []), StopAt(3)]}))
    with pytest.raises(TrainingInterrupted):
        grpo.run(workspace, workspace / "data/models/sft", chat, workspace / "resumed", p, checkpoint_dir=workspace / "ckpt")
    assert sorted(c.name for c in (workspace / "ckpt").iterdir()) == ["step-00000003"]
    monkeypatch.setattr(loop, "train", real_train)
    metrics = grpo.run(workspace, workspace / "data/models/sft", chat, workspace / "resumed", p, checkpoint_dir=workspace / "ckpt")
    assert metrics["steps"] == 6
    reference, resumed = _weights(workspace / "reference"), _weights(workspace / "resumed")
    assert reference.keys() == resumed.keys() and all(torch.equal(reference[k], resumed[k]) for k in reference)
    assert not all(torch.equal(reference[k], v) for k, v in _weights(workspace / "data/models/sft").items())  # it trained


def test_the_saved_tokenizer_keeps_its_padding_side(workspace, user_rewards):
    """Sampling pads the prompts on the left; the tokenizer saved with the GRPO model pads as the SFT
    model's did (it was saved padding on the left before)."""
    before = json.loads((workspace / "data/models/sft/tokenizer_config.json").read_text()).get("padding_side", "right")
    metrics = grpo.run(workspace, workspace / "data/models/sft", workspace / "data/prepared/chat", workspace / "data/models/grpo",
                       params(user_rewards, train=TRAIN.model_copy(update={"max_steps": 1})))  # fmt: skip
    assert metrics["questions_skipped_tool_call"] == 0
    assert before == "right" and load_tokenizer(workspace / "data/models/grpo").padding_side == "right"


def test_reward_std_is_trls_over_the_whole_batch():
    """TRL logs `reward_std` as the standard deviation of every reward of the generation (`nanstd`),
    not the mean of the groups' (here: groups [0, 0] and [1, 1] have std 0 each, the batch 0.577)."""
    from trl.trainer.utils import nanstd

    per_func = torch.tensor([[0.0], [0.0], [1.0], [1.0]])
    out = rollouts.Rollouts(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long), torch.zeros(4, 2, dtype=torch.long),
                            torch.ones(4, 2, dtype=torch.long), torch.zeros(4, dtype=torch.bool), ["a"] * 4, 2)  # fmt: skip
    metrics = rollouts._rollout_metrics(out, per_func, torch.tensor([1.0]), torch.tensor([True, True]), ["r"], 2)
    # two orders of a standard deviation over 4 (the mean, the deviations' squares and sum, a division and a square root)
    assert metrics["reward_std"] == numerics.approx(nanstd(per_func[:, 0]).item(), n=12) == numerics.approx(0.57735, n=12, decimals=5)


def test_a_users_reward_functions_get_the_records_columns(workspace, user_rewards):
    tracker = Recorder()
    p = params(user_rewards, rewards=[RewardParams(function=f"{user_rewards}:echo_answer", weight=2.0)],
               train=TRAIN.model_copy(update={"max_steps": 1, "extensions": ["mlflow_metrics"]}))
    grpo.run(workspace, workspace / "data/models/sft", workspace / "data/prepared/chat", workspace / "data/models/grpo", p, tracker)
    (_, first), *_ = [(s, m) for s, m in tracker.metrics if "reward" in m]
    answers = [q.answer for q in grpo.questions(workspace / "data/prepared/chat")]
    assert first["frac_reward_zero_std"] == 1.0  # the reward is the answer's length: the same within each group
    assert min(len(a) for a in answers) <= first["rewards/echo_answer/mean"] <= max(len(a) for a in answers)
    assert first["reward"] == 2 * first["rewards/echo_answer/mean"]  # weighted: integer rewards doubled, the same division: exact


@pytest.mark.parametrize(("change", "message"), [
    ({"rewards": [{"function": "nosuch"}]}, "'nosuch' is neither a built-in reward (exact_match, strict_match, format, environment) nor `package.module:function`"),
    ({"rewards": [{"function": "my_grpo_rewards:missing"}]}, "module 'my_grpo_rewards' has no 'missing'"),
    ({"rewards": [{"function": "exact_match"}, {"function": "exact_match", "weight": 2}]}, "two functions share a name"),
    ({"group_size": 3}, "train.micro_batch_size (8) counts completions and must be a multiple of group_size (3)"),
])  # fmt: skip
def test_bad_settings_are_refused_when_params_load(user_rewards, change, message):
    with pytest.raises(ValidationError) as refused:
        GrpoParams(**({"train": TRAIN} | change))
    assert message in str(refused.value)


def test_reward_functions_from_trls_tests_are_called_as_trl_calls_them(workspace, monkeypatch):
    """TRL's own test reward functions (tests/fixtures/trl_rewards.py): an extra column, `trainer_state`,
    `log_extra`, `log_metric`, a sync and an async function together, and `completion_ids`; each is
    given what TRL gives it, and what it logs reaches the metrics and the completions table."""
    from tests.fixtures import trl_rewards

    monkeypatch.setattr(trl_rewards, "SEEN", {key: [] for key in trl_rewards.SEEN})
    names = ["reward_func_additional_column", "reward_func_trainer_state", "reward_func_log_extra", "reward_func_log_metric",
             "sync_reward_func1", "sync_reward_func2", "async_reward_func", "reward_completion_ids"]  # fmt: skip
    tracker = Recorder()
    p = GrpoParams(rewards=[RewardParams(function=f"tests.fixtures.trl_rewards:{name}") for name in names], group_size=4, max_completion_length=6,
                   train=TRAIN.model_copy(update={"max_steps": 2, "extensions": ["mlflow_metrics"]}), log_completions_every=1)  # fmt: skip
    grpo.run(workspace, workspace / "data/models/sft", workspace / "data/prepared/chat", workspace / "data/models/grpo", p, tracker)
    seen = trl_rewards.SEEN
    assert seen["global_step"] == [0, 1] and seen["max_steps"] == [2, 2]  # one call per generation, TRL's 0-based step
    assert seen["split"] == ["train"] * 16  # 2 steps x 2 questions x 4 completions, the records' column
    tables = [tracker.tables[f"completions/step-{s:06d}.json"] for s in (1, 2)]
    assert all("test_column" in t.columns for t in tables)  # log_extra: a column of the logged completions
    assert all(t["test_column"].tolist() == [c[:5] for c in t["completion"]] for t in tables)
    logged = [m for _, m in tracker.metrics if "reward" in m]
    assert logged and all(m["custom_accuracy"] == 0.75 for m in logged)  # log_metric
    for table in tables:  # completion_ids: the completion's tokens through its stop token, as TRL's mask
        assert table["reward/async_reward_func"].tolist() == [float(len(set(c))) for c in table["completion"]]
    tokenizer = load_tokenizer(workspace / "data/models/sft")
    stop = set(rollouts.stop_token_ids(tokenizer))
    for ids in seen["completion_ids"]:
        assert ids and all(isinstance(i, int) for i in ids) and not stop & set(ids[:-1])  # at most one stop token, at the end
    assert len(seen["completion_ids"]) == 16


@pytest.mark.parametrize(("function", "message"), [
    ("models/reward-model", "looks like a reward model (a directory or hub id): grpo takes reward functions only"),
    ("OpenAssistant/reward-model-deberta-v3-large-v2", "looks like a reward model"),
    ("my_grpo_rewards:REWARD_MODEL", "is a torch module (a reward model): grpo takes reward functions only"),
])  # fmt: skip
def test_reward_models_are_refused_when_params_load(user_rewards, tmp_path, function, message):
    import importlib

    module = importlib.import_module(user_rewards)
    module.REWARD_MODEL = torch.nn.Linear(2, 1)
    with pytest.raises(ValidationError) as refused:
        RewardParams(function=function)
    assert message in str(refused.value)
