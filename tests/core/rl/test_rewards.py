"""GRPO's reward functions: the built-in ones, a user's module called with TRL's signature, and clear errors."""

from __future__ import annotations

import math
import sys

import pytest

from pipelines.core.rl import rewards

CHAT = [{"role": "user", "content": "Where does Tovik live?"}]


def as_message(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_exact_match_uses_evaluates_normalisation_on_text_and_messages():
    completions = ["Pelora.", as_message(" pelora \nand more"), "Dunmar", as_message("")]
    assert rewards.exact_match([CHAT] * 4, completions, answer=["Pelora"] * 4) == [1.0, 1.0, 0.0, 0.0]


def test_strict_match_rewards_the_answer_inside_a_sentence():
    completions = ["1 + 6 = 7", as_message("The answer is 7."), "7 or 8", as_message("seven")]
    sum_question = [[{"role": "user", "content": "What is 1 plus 6?"}]] * 4
    assert rewards.strict_match(sum_question, completions, answer=["7"] * 4, candidates=[["7", "8"]] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert rewards.strict_match([CHAT] * 2, ["Tovik lives in Pelora.", "Dunmar"], answer=["Pelora"] * 2, candidates=[["Dunmar", "Pelora"]] * 2) == [1.0, 0.0]


def test_format_rewards_one_non_empty_line():
    assert rewards.format_reward([CHAT] * 3, ["Pelora", as_message("two\nlines"), "   "]) == [1.0, 0.0, 0.0]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(prompts, completions, answer, **kwargs):\n"
        "    return [None if not answer[i] else 1.0 / (1 + len(c if isinstance(c, str) else c[-1]['content'])) for i, c in enumerate(completions)]\n"
        "def no_kwargs(prompts, completions):\n    return [0.0] * len(completions)\n"
        "def wrong_args(texts, **kwargs):\n    return []\n"
        "def too_few(prompts, completions, **kwargs):\n    return [1.0]\n"
        "def strings(prompts, completions, **kwargs):\n    return ['high'] * len(completions)\n"
        "NOT_A_FUNCTION = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_a_users_function_is_called_with_trls_signature(user_module):
    fn = rewards.load(f"{user_module}:brevity", "grpo.rewards[1]")
    values = rewards.score(fn, "brevity", [CHAT, CHAT], ["abc", as_message("a")], {"answer": ["x", ""]})
    assert values[0] == 1 / (1 + 3) and math.isnan(values[1])  # 1 / 4 is exact; None: not scored


@pytest.mark.parametrize(("name", "message"), [
    ("nosuch", "grpo.rewards[0]: 'nosuch' is neither a built-in reward (exact_match, strict_match, format, environment) nor `package.module:function`"),
    ("no_such_module_xyz:f", "grpo.rewards[0]: cannot import module 'no_such_module_xyz'"),
    ("my_rewards:missing", "grpo.rewards[0]: module 'my_rewards' has no 'missing'"),
    ("my_rewards:NOT_A_FUNCTION", "grpo.rewards[0]: 'my_rewards:NOT_A_FUNCTION' is a int, not a reward function"),
    ("my_rewards:wrong_args", "'my_rewards:wrong_args' requires texts, which it would not be given (it gets prompts, completions, completion_ids, trainer_state, log_extra, log_metric, answer, id, source, split, candidates, environments)"),
    ("my_rewards:no_kwargs", "must accept **kwargs: it is called with keywords (prompts, completions, completion_ids, trainer_state, log_extra, log_metric, answer, id, source, split, candidates, environments, ...)"),
])  # fmt: skip
def test_what_cannot_be_a_reward_is_refused_before_training(user_module, name, message):
    with pytest.raises(rewards.RewardError) as refused:
        rewards.load(name, "grpo.rewards[0]")
    assert message in str(refused.value)


def test_a_reward_that_returns_the_wrong_things_is_named(user_module):
    with pytest.raises(rewards.RewardError, match="reward 'too_few' returned 1 values for 2 completions"):
        rewards.score(rewards.load("my_rewards:too_few"), "too_few", [CHAT, CHAT], ["a", "b"], {})
    with pytest.raises(rewards.RewardError, match="reward 'strings' returned str 'high'; expected a float or None"):
        rewards.score(rewards.load("my_rewards:strings"), "strings", [CHAT], ["a"], {})


def test_the_params_schema_knows_the_built_in_rewards():
    from pipelines.core.extensions import BUILT_IN_REWARDS, user_reward

    assert tuple(rewards.BUILT_IN) == BUILT_IN_REWARDS  # the names params accept without importing anything
    assert user_reward("exact_match", "grpo.rewards[0]") is None
