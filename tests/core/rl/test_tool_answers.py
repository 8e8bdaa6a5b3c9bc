"""A tool's answer takes at most what the context check and the memory estimate count for it
(`episodes.added_tokens`: `max_turn_tokens` between two turns): a tool that answers with a book is
cut, and the model reads that it was. The scripted model and templates of test_episodes.py."""

from __future__ import annotations

import pytest

from pipelines.core.data.chat_template import TOOLS_KEY
from pipelines.core.rl import episodes, tools
from pipelines.core.rl.tools import ToolEnvironment
from tests.chat_families import QWEN25, tokenizer_for
from tests.core.rl.test_episodes import QLLM, ScriptedLM, call, lead

QUESTION = "What does the archive hold?"
WORDS = "amber basalt cobalt dune ember fjord granite harbor"


def archive(query: str) -> str:
    """Everything the archive holds on a query.

    Args:
        query: What to look for.
    """
    return " ".join([WORDS] * 4000)  # about 200,000 characters; the tool cuts it to 2,000, far past any turn's tokens


def setup(family):
    turns = {QUESTION: [lead(family) + call("hermes", "archive", '{"query": "all"}'), lead(family) + "amber"]}
    tokenizer = tokenizer_for(family, [QUESTION, *turns[QUESTION], WORDS, "archive query truncated of tokens characters"], vocab_size=400)
    offered = [tools.Tool.from_function(archive, "archive")]
    prompt = [{"role": "user", "content": QUESTION, TOOLS_KEY: [t.schema for t in offered]}]
    return tokenizer, ScriptedLM(tokenizer, turns, family.end_of_turn), offered, prompt


def bridges(rollouts, row: int) -> list[int]:
    """The lengths of the runs of tokens between the model's turns (read, never scored)."""
    runs, length = [], 0
    for read, scored in zip(rollouts.completion_mask[row].tolist(), rollouts.loss_mask[row].tolist(), strict=True):
        if read and not scored:
            length += 1
        elif length:
            runs, length = [*runs, length], 0
    return runs + ([length] if length else [])


@pytest.mark.parametrize("family", [QWEN25, QLLM])
@pytest.mark.parametrize("max_turn_tokens", [64, 96])
def test_a_huge_answer_is_cut_to_the_turns_tokens_and_says_so(family, max_turn_tokens):
    tokenizer, model, offered, prompt = setup(family)
    max_turns = 2
    got = episodes.run(model, tokenizer, [prompt], [ToolEnvironment(offered) for _ in range(2)], group_size=2, max_turn_tokens=max_turn_tokens,
                       max_turns=max_turns, style="hermes")  # fmt: skip
    out = got.rollouts
    # what preflight and the context check assumed: the longest prompt plus max_turn_tokens x (2 x max_turns - 1)
    assumed = episodes.longest_prompt(tokenizer, [prompt]) + episodes.added_tokens(max_turn_tokens, max_turns)
    for row, transcript in enumerate(got.transcripts):
        assert int(out.prompt_mask[0].sum()) + int(out.completion_mask[row].sum()) <= assumed
        assert bridges(out, row) and max(bridges(out, row)) <= max_turn_tokens
        assert [t["text"] for t in transcript.turns] == ["", "amber"] and not transcript.truncated  # the model read the cut answer and answered
        (answer,) = transcript.turns[0]["calls"]
        given = tools.call({"archive": offered[0]}, tools.ToolCall("archive", {"query": "all"}), 5.0).content  # what the environment gave back
        total = len(tokenizer(given, add_special_tokens=False)["input_ids"])
        assert answer["truncated_tokens"] == total and answer["error"] == "bad_result"  # past 2,000 characters too
        shown, _, note = answer["observation"].rpartition(" [truncated: ")
        kept = int(note.split(" of ")[0])
        assert note == f"{kept} of {total} tokens]" and 0 < kept < total
        assert WORDS.startswith(shown[: len(WORDS)]) or shown.startswith(WORDS)  # the answer's beginning
        # the cut answer is what the template rendered between the turns
        assert "[truncated: " in tokenizer.decode(out.completion_ids[row][out.completion_mask[row].bool()].tolist())
    assert got.metrics()["episodes/answers_truncated"] == 2 and got.metrics()["episodes/no_room_for_answers"] == 0


def test_an_answer_with_no_room_at_all_ends_the_episode():
    """A turn's tokens too few for the template's tool message and the cut note: the episode stops
    there, truncated and counted, rather than pass what the checks assumed."""
    tokenizer, model, offered, prompt = setup(QWEN25)
    got = episodes.run(model, tokenizer, [prompt], [ToolEnvironment(offered)], group_size=1, max_turn_tokens=40, max_turns=2, style="hermes")
    (transcript,) = got.transcripts
    assert transcript.truncated and transcript.no_room and len(transcript.turns) == 1
    assert int(got.rollouts.completion_mask[0].sum()) <= 40  # the call's turn only (28 tokens; the tool message alone takes 41)
    assert got.metrics()["episodes/no_room_for_answers"] == 1


def test_a_short_answer_is_read_whole():
    tokenizer, model, offered, prompt = setup(QWEN25)
    fitted = episodes.fit_answers(tokenizer, prompt, call("hermes", "archive", '{"query": "all"}'), [{"role": "tool", "name": "archive", "content": WORDS}], 64)
    bridge, sent, cut = fitted
    assert sent[0]["content"] == WORDS and cut == [0] and len(bridge) <= 64


def test_the_tools_own_cut_says_so():
    long = tools.call({"archive": tools.Tool.from_function(archive, "archive")}, tools.ToolCall("archive", {"query": "all"}), 5.0)
    assert long.error == "bad_result" and len(long.content) <= tools.MAX_RESULT_CHARS
    assert long.content.endswith(f" of {len(archive('all'))} characters]") and long.content.startswith(WORDS)
