"""The grpo stage with tools (issue 55): params that refuse bad tool specs naming the key, questions
cut before a demonstration's calls, the style read from the template, and a run whose rollouts are
multi-turn episodes with the calculator, logged as users watch them. A tiny random Llama with
Qwen2.5's published template stands in for a real base here; the episodes' calls themselves are
tested with a scripted model in tests/core/rl/test_episodes.py."""

from __future__ import annotations

import json
import sys

import pandas as pd
import pytest
from pydantic import ValidationError

from pipelines import grpo
from pipelines.core.data.chat_template import TOOLS_KEY, ChatTemplateError
from pipelines.core.errors import QllmError
from pipelines.core.models.models import load_tokenizer
from pipelines.core.params.rl import GrpoParams, RewardParams
from pipelines.core.params.training import TrainParams
from pipelines.core.rl import episodes, tools
from tests.chat_families import CHATML, QWEN25, save_base_model
from tests.stages.test_grpo import Recorder

QUESTIONS = [(a, b) for a, b in [(48213, 977), (1234, 5678), (999, 999), (31337, 42), (2024, 11), (86, 75), (123, 456), (77, 88)]]


def demonstration(a: int, b: int) -> list[dict]:
    """A chat in OpenAI's layout: the question, the calculator call, its answer, the final answer."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}}
    return [{"role": "user", "content": f"What is {a} times {b}?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": str(a * b)}, {"role": "assistant", "content": str(a * b)}]  # fmt: skip


@pytest.fixture
def tool_workspace(tmp_path):
    texts = [m["content"] for a, b in QUESTIONS for m in demonstration(a, b)] + ["<tool_call> calculator expression </tool_call>"] * 5
    save_base_model(QWEN25, texts, tmp_path / "data/models/sft", max_positions=1024)  # Qwen2.5's tools prompt: ~700 tokens of this tiny BPE
    chat = tmp_path / "data/prepared/chat"
    chat.mkdir(parents=True)
    pd.DataFrame({"id": [f"q{i}" for i in range(len(QUESTIONS))], "source": "s", "split": "train",
                  "messages": [json.dumps(demonstration(a, b)) for a, b in QUESTIONS]}).to_parquet(chat / "train.parquet")  # fmt: skip
    return tmp_path


def test_bad_tool_specs_are_refused_when_params_load_naming_the_key(tmp_path, monkeypatch):
    (tmp_path / "my_grpo_tools.py").write_text("def undocumented(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_grpo_tools", raising=False)
    for functions, says in [(["eval"], "functions[0]: 'eval' is neither a built-in tool"), (["calculator", "my_grpo_tools:undocumented"], "functions[1]: 'undocumented' cannot be described"),
                            (["calculator", "calculator"], "two tools share a name (calculator)"), (["lookup"], "functions[0]: the lookup tool answers from a table the data provides")]:  # fmt: skip
        with pytest.raises(ValidationError, match="tools.functions") as error:
            GrpoParams(tools={"functions": functions})
        assert says in str(error.value)
    with pytest.raises(ValidationError, match="tools.max_turns"):
        GrpoParams(tools={"functions": ["calculator"], "max_turns": 1})
    with pytest.raises(ValidationError, match="tools.styl"):
        GrpoParams(tools={"style": "xml"})
    with pytest.raises(ValidationError, match=r"max_turns: applies only with tools listed in `functions` or an `environment` \(here functions is \[\], environment is null\), so here it would change nothing"):  # an option that would do nothing
        GrpoParams(tools={"max_turns": 4, "style": "hermes"})
    assert GrpoParams(tools={"max_turns": 3}).tools.functions == []  # the default, as params.yaml spells it out


def test_with_tools_a_questions_prompt_stops_before_the_demonstrated_calls(tool_workspace):
    schema = tools.load("calculator").schema
    found = grpo.questions(tool_workspace / "data/prepared/chat", offered=[schema])
    assert [(q.answer, len(q.prompt)) for q in found] == [(str(a * b), 1) for a, b in QUESTIONS]
    assert found[0].prompt == [{"role": "user", "content": "What is 48213 times 977?", TOOLS_KEY: [schema]}]
    plain = grpo.questions(tool_workspace / "data/prepared/chat")  # without tools: everything before the answer, as before
    assert len(plain[0].prompt) == 3
    # a chat with no user turn keeps the turns before its answer as its prompt
    odd = [{"role": "system", "content": "Say 7."}, {"role": "assistant", "content": "7"}]
    pd.DataFrame({"id": ["s"], "messages": [json.dumps(odd)]}).to_parquet(tool_workspace / "odd.parquet")
    (only,) = grpo.questions(tool_workspace, "odd", offered=[schema])
    assert only.prompt == [{"role": "system", "content": "Say 7.", TOOLS_KEY: [schema]}] and only.answer == "7"


def test_the_call_style_comes_from_the_template_or_is_asked_for(tool_workspace, tmp_path):
    assert episodes.tool_style(load_tokenizer(tool_workspace / "data/models/sft"), "auto") == "hermes"
    plain = save_base_model(CHATML, ["a b c"], tmp_path / "plain")
    with pytest.raises(QllmError, match="grpo.tools.style: auto cannot tell how .* writes tool calls"):
        episodes.tool_style(load_tokenizer(plain), "auto")
    assert episodes.tool_style(load_tokenizer(plain), "llama3") == "llama3"


def tool_params(**changes) -> GrpoParams:
    train = TrainParams(max_steps=2, micro_batch_size=4, lr=0.01, warmup_steps=0, log_every=1, checkpoint_every=0, precision="fp32", extensions=["mlflow_metrics"])
    return GrpoParams(**({"rewards": [RewardParams(function="exact_match")], "group_size": 2, "max_completion_length": 8, "train": train,
                          "log_completions_every": 1, "tools": {"functions": ["calculator"], "max_turns": 2}} | changes))  # fmt: skip


def test_the_stage_samples_episodes_with_the_calculator_and_logs_them(tool_workspace):
    tracker = Recorder()
    ws = tool_workspace
    metrics = grpo.run(ws, ws / "data/models/sft", ws / "data/prepared/chat", ws / "data/models/grpo", tool_params(), tracker)
    assert metrics["steps"] == 2 and (ws / "data/models/grpo/model.safetensors").exists()
    logged = {k for _, m in tracker.metrics for k in m}
    assert {"episodes/mean_turns", "episodes/tool_calls_per_episode", "episodes/parse_failures", "episodes/tool_errors", "episodes/truncated_ratio"} <= logged
    turns = [m["episodes/mean_turns"] for _, m in tracker.metrics if "episodes/mean_turns" in m]
    assert all(1 <= t <= 2 for t in turns)
    table = tracker.tables["completions/step-000001.json"]
    assert {"turns", "episode", "completion", "answer"} <= set(table.columns) and len(table) == 4
    first = json.loads(table["episode"][0])
    assert first and {"text", "calls", "parse_failure"} <= set(first[0])


def test_a_template_that_cannot_render_tools_is_refused_before_training(tool_workspace, tmp_path):
    save_base_model(CHATML, [m["content"] for m in demonstration(1, 2)], tmp_path / "plain")
    ws = tool_workspace
    with pytest.raises(ChatTemplateError, match="chat template does not render tool calls"):
        grpo.run(ws, tmp_path / "plain", ws / "data/prepared/chat", ws / "data/models/grpo", tool_params(), Recorder())
    assert not (ws / "data/models/grpo").exists()


def test_episodes_longer_than_the_models_context_are_refused_before_training(tool_workspace, tmp_path):
    texts = [m["content"] for a, b in QUESTIONS for m in demonstration(a, b)]
    short = save_base_model(QWEN25, texts, tmp_path / "short", max_positions=256)
    ws = tool_workspace
    with pytest.raises(QllmError, match=r"grpo.tools: the longest question with the tools' schemas is \d+ tokens and an episode may add 24 .* "
                                        r"context of 256 tokens"):  # fmt: skip
        grpo.run(ws, short, ws / "data/prepared/chat", ws / "data/models/grpo", tool_params(), Recorder())
    assert not (ws / "data/models/grpo").exists()


LEDGER = '''
class Ledger:
    """A stateful environment: a balance the model deposits into; reset from the record, rewarded by the balance."""

    created = 0

    def __init__(self):
        Ledger.created += 1
        self.balance = 0

    def reset(self, record):
        self.balance = len(record["id"])

    def deposit(self, amount: int) -> str:
        """Add to the balance.

        Args:
            amount: What to add.
        """
        if amount < 0:
            raise ValueError("a deposit is positive")
        self.balance += amount
        return str(self.balance)

    def reward(self):
        return float(self.balance)


class Scorerless(Ledger):
    def reward(self):
        raise RuntimeError("the scorer is down")


class Unresettable(Ledger):
    def reset(self, record):
        raise KeyError("balance")


class Hookless:
    def reset(self, record):
        self.record = record


class Unbuildable:
    def __init__(self):
        raise RuntimeError("no database")

    def act(self) -> str:
        """Act."""
        return ""
'''


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(LEDGER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_envs", raising=False)
    import my_envs

    return my_envs


def test_an_environment_class_keeps_each_episodes_state_and_gives_its_reward(ledger, caplog):
    from pipelines.core.params.rl import ToolsParams
    from pipelines.core.rl import rewards

    make, offered = tools.environments(ToolsParams(functions=["calculator"], environment="my_envs:Ledger"), "grpo.tools")
    assert [t.name for t in offered] == ["calculator", "deposit"] and offered[1].parameters["properties"]["amount"]["type"] == "integer"
    one, two = make(), make()
    one.reset({"id": "q12"}), two.reset({"id": "q1"})
    assert [one.step(tools.ToolCall("deposit", {"amount": n})).content for n in (5, 4)] == ["8", "12"]  # 3 from the record, then the state
    assert two.step(tools.ToolCall("deposit", {"amount": 1})).content == "3"  # an episode of its own
    refused = one.step(tools.ToolCall("deposit", {"amount": -1}))
    assert refused.error == "raised" and "a deposit is positive" in refused.content
    assert one.step(tools.ToolCall("deposit", {"amount": "ten"})).error == "bad_arguments"
    assert one.step(tools.ToolCall("calculator", {"expression": "6 * 7"})).content == "42"
    assert rewards.environment(prompts=[[], []], completions=[[], []], environments=[one, two]) == [12.0, 3.0]
    make_broken, _ = tools.environments(ToolsParams(environment="my_envs:Scorerless"), "grpo.tools")
    with caplog.at_level("WARNING", logger="qllm.tools"):
        assert make_broken().reward() is None  # not scored, logged; the run goes on
    assert "grpo.tools.environment: Scorerless.reward() failed (RuntimeError: the scorer is down)" in caplog.text
    make_unresettable, _ = tools.environments(ToolsParams(environment="my_envs:Unresettable"), "grpo.tools")
    with pytest.raises(QllmError, match=r"grpo.tools.environment: Unresettable.reset\(\) failed on record 'q7' \(KeyError: 'balance'\)"):
        make_unresettable().reset({"id": "q7"})
    with pytest.raises(rewards.RewardError, match="reads the episodes' environments, and these rollouts had none"):
        rewards.environment(prompts=[[]], completions=[[]])


def test_bad_environments_are_refused_when_params_load_naming_the_key(ledger):
    for name, says in [("my_envs:Nowhere", "module 'my_envs' has no 'Nowhere'"), ("my_envs:Hookless", "my_envs:Hookless has no public method to offer as a tool"),
                       ("my_envs:Unbuildable", "could not be constructed with no arguments (RuntimeError: no database)"), ("my_envs", "is not `package.module:function`")]:  # fmt: skip
        with pytest.raises(ValidationError, match="tools.environment") as error:
            GrpoParams(tools={"environment": name})
        assert says in str(error.value)
    with pytest.raises(ValidationError, match=r"rewards\[1\]: `environment` is the episode's reward from its environment's `reward\(\)`, and `tools.environment` names none"):
        GrpoParams(rewards=[{"function": "exact_match"}, {"function": "environment"}], tools={"functions": ["calculator"]})
    assert GrpoParams(tools={"environment": "my_envs:Ledger", "max_turns": 2}).tools.enabled  # its methods are tools: no `functions` needed


def test_the_stage_runs_an_environment_per_episode_and_scores_its_reward(tool_workspace, ledger):
    tracker = Recorder()
    ws = tool_workspace
    params = tool_params(rewards=[RewardParams(function="exact_match"), RewardParams(function="environment", weight=0.5)],
                         tools={"functions": ["calculator"], "environment": "my_envs:Ledger", "max_turns": 2})  # fmt: skip
    before = ledger.Ledger.created
    grpo.run(ws, ws / "data/models/sft", ws / "data/prepared/chat", ws / "data/models/grpo", params, tracker)
    tables = [tracker.tables[f"completions/step-{step:06d}.json"] for step in (1, 2)]
    assert ledger.Ledger.created - before == 1 + sum(len(t) for t in tables)  # one to list its tools, then one per episode
    for table in tables:
        episodes_ = [json.loads(e) for e in table["episode"]]
        deposits = [sum(c["arguments"].get("amount", 0) for turn in e for c in turn["calls"] if c["name"] == "deposit" and c["error"] is None) for e in episodes_]
        assert table["reward/environment"].tolist() == [float(len(i) + d) for i, d in zip(table["id"], deposits, strict=True)]
    logged = {k for _, m in tracker.metrics for k in m}
    assert {"rewards/environment/mean", "rewards/exact_match/mean"} <= logged
