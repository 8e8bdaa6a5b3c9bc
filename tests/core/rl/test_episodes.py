"""pipelines/core/rl/episodes.py: multi-turn rollouts with tools, on the published Qwen2.5 and
Llama 3.1 templates. The model is scripted (a tiny Llama whose logits are replaced by the next token
of a written turn), so each episode is known; the tools are the real ones."""

from __future__ import annotations

import pytest
import torch

from pipelines.core.data.chat_template import (
    CHAT_TEMPLATE,
    EOS,
    IM_END,
    IM_START,
    TOOLS_KEY,
    left_padding,
    render_chat,
    render_prompt,
)
from pipelines.core.rl import episodes, tools
from pipelines.core.rl.tools import ToolEnvironment
from tests import numerics
from tests.chat_families import HERMES, LLAMA31_TOOLS, QWEN25, Family, tokenizer_for

QLLM = Family("qllm", CHAT_TEMPLATE, (EOS, IM_START, IM_END), eos=EOS, end_of_turn=IM_END)  # this project's own template

CALL = {"hermes": '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>', "llama3": '{{"name": "{name}", "parameters": {args}}}'}


def call(style: str, name: str, args: str) -> str:
    return CALL[style].format(name=name, args=args)


def scripts(style: str) -> dict[str, list[str]]:
    """Each question's turns, as the scripted model writes them."""
    return {
        "What is 48213 times 977?": [call(style, "calculator", '{"expression": "48213 * 977"}'), "47104101"],
        "Where does Tovik live?": ["Pelora"],
        "What is 12 plus 30?": ["<tool_call>{not json</tool_call>" if style == "hermes" else '{"name": "calculator", "parameters": {', "42"],
        "What is the weather in Pelora?": [call(style, "weather", '{"city": "Pelora"}'), "I do not know"],
        "What is 2 to the 9999?": [call(style, "calculator", '{"expression": "2 ** 9999"}')] * 3,
    }


class ScriptedLM(torch.nn.Module):
    """A tiny Llama (for its KV cache) whose next token is the next one of the turn written for the
    question the sequence holds: the turn is chosen when a sequence comes in whole (each turn's
    first pass), or when a next turn goes on from the cache (the tool's answer and the generation
    prompt: its tool answers counted on), and followed token by token after. The rows follow the
    cache's own selections and repeats (`batch_select_indices`, `batch_repeat_interleave`)."""

    MARKERS = ("<tool_response>", "ipython<|end_header_id|>", "<|im_start|>tool:")

    def __init__(self, tokenizer, turns: dict[str, list[str]], end_of_turn: str):
        from transformers import LlamaConfig, LlamaForCausalLM

        super().__init__()
        torch.manual_seed(0)
        self.inner = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048))  # fmt: skip
        self.tokenizer, self.eot = tokenizer, tokenizer.convert_tokens_to_ids(end_of_turn)
        self.turns = {q: [tokenizer(t, add_special_tokens=False)["input_ids"] + [self.eot] for t in ts] for q, ts in turns.items()}
        self.questions: list[str] = []
        self.answered: list[int] = []  # tool answers each row has read: its turn's index
        self.plan: list[list[int]] = []
        self.offset: list[int] = []

    def _rows(self, order: list[int]) -> None:
        self.questions, self.answered = [self.questions[i] for i in order], [self.answered[i] for i in order]
        self.plan, self.offset = [self.plan[i] for i in order], [self.offset[i] for i in order]

    def _follow(self, cache) -> None:
        """Keep the rows in step with the cache's."""
        if getattr(cache, "_scripted", False):
            return
        select, repeat = cache.batch_select_indices, cache.batch_repeat_interleave

        def selected(indices):
            select(indices)
            self._rows([int(i) for i in indices])

        def repeated(times):
            repeat(times)
            self._rows([i for i in range(len(self.questions)) for _ in range(times)])

        cache.batch_select_indices, cache.batch_repeat_interleave, cache._scripted = selected, repeated, True

    def _turn(self, row: int) -> list[int]:
        turns = self.turns[self.questions[row]]
        return turns[min(self.answered[row], len(turns) - 1)]

    def forward(self, input_ids, attention_mask=None, **kwargs):
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        self._follow(out.past_key_values)
        rows = input_ids.shape[0]
        texts = [self.tokenizer.decode(ids[mask.bool()].tolist()) for ids, mask in zip(input_ids, attention_mask[:, -input_ids.shape[1] :], strict=True)]
        if input_ids.shape[1] > 1 and attention_mask.shape[1] == input_ids.shape[1]:  # a sequence in whole: its question and answers so far
            self.questions = [next(q for q in self.turns if q in text) for text in texts]
            self.answered = [sum(text.count(m) for m in self.MARKERS) for text in texts]
            self.plan, self.offset = [self._turn(r) for r in range(rows)], [0] * rows
        elif input_ids.shape[1] > 1:  # a next turn from the cache: the tool's answers and the generation prompt
            self.answered = [a + sum(text.count(m) for m in self.MARKERS) for a, text in zip(self.answered, texts, strict=True)]
            self.plan, self.offset = [self._turn(r) for r in range(rows)], [0] * rows
        else:  # one more token
            self.offset = [o + 1 for o in self.offset]
        nexts = [plan[min(o, len(plan) - 1)] for plan, o in zip(self.plan, self.offset, strict=True)]
        logits = torch.full_like(out.logits[:, -1], -1e9)
        logits[torch.arange(rows), torch.tensor(nexts)] = 0.0
        out.logits = torch.cat([out.logits[:, :-1], logits[:, None]], dim=1)
        return out


def weather(city: str) -> str:
    """The forecast.

    Args:
        city: A city.
    """
    raise ConnectionError("the weather service is down")


def lead(family) -> str:
    """What the template writes between the generation prompt and the content, inside the model's
    part: this project's template trains the model to write the space after `assistant:`."""
    return " " if family is QLLM else ""


def setup(family, style):
    turns = {q: [lead(family) + t for t in ts] for q, ts in scripts(style).items()}
    texts = [*turns, *(t for ts in turns.values() for t in ts), "47104101 calculator expression weather city output"]
    tokenizer = tokenizer_for(family, texts, vocab_size=500)
    model = ScriptedLM(tokenizer, turns, family.end_of_turn)
    offered = [tools.load("calculator"), tools.Tool.from_function(weather, "weather")]
    prompts = [[{"role": "user", "content": q, TOOLS_KEY: [t.schema for t in offered]}] for q in turns]
    return tokenizer, model, offered, prompts


@pytest.mark.parametrize("family, style", [(QWEN25, "hermes"), (HERMES, "hermes"), (LLAMA31_TOOLS, "llama3"), (QLLM, "hermes")])
def test_episodes_call_tools_read_their_answers_and_score_only_the_models_tokens(family, style):
    tokenizer, model, offered, prompts = setup(family, style)
    envs = [ToolEnvironment(offered, timeout=2.0) for _ in prompts]
    # 96: these test tokenizers spell Qwen2.5's tool message in 41 tokens, and each answer must fit beside it (episodes.fit_answers)
    got = episodes.run(model, tokenizer, prompts, envs, group_size=1, max_turn_tokens=96, max_turns=3, style=style)
    product, refuse, bad_parse, down, power = got.transcripts

    assert [t["text"] for t in product.turns] == ["", "47104101"] and not product.truncated
    assert product.turns[0]["calls"] == [{"name": "calculator", "arguments": {"expression": "48213 * 977"}, "observation": str(48213 * 977), "error": None}]
    assert [t["text"] for t in refuse.turns] == ["Pelora"] and refuse.turns[0]["calls"] == []
    assert len(bad_parse.turns) == 1 and bad_parse.turns[0]["parse_failure"] and not bad_parse.truncated  # read as its answer
    assert down.turns[0]["calls"][0]["error"] == "raised" and "the weather service is down" in down.turns[0]["calls"][0]["observation"]
    assert down.answer == "I do not know"
    assert [c["error"] for t in power.turns for c in t["calls"]] == ["raised", "raised", "max_turns"] and power.truncated  # 2 ** 9999: past the bounds
    assert got.rollouts.texts == ["47104101", "Pelora", bad_parse.answer, "I do not know", power.answer]
    assert got.rollouts.truncated.tolist() == [False, False, False, False, True]

    out = got.rollouts
    for row, transcript in enumerate(got.transcripts):
        real = out.completion_ids[row][out.completion_mask[row].bool()].tolist()
        written = out.completion_ids[row][out.loss_mask[row].bool()].tolist()
        # the model's own tokens are exactly its turns as scripted, each with its end of turn
        expected = [i for turn in model.turns[prompts[row][0]["content"]][: len(transcript.turns)] for i in turn]
        assert written == expected
        # and the whole sequence is the conversation as the template renders it, tool messages included
        prompt = out.prompt_ids[row][out.prompt_mask[row].bool()].tolist()
        conversation = _interleave(prompts[row], transcript, model, tokenizer, lead(family))
        rendered, decoded = render_chat(tokenizer, conversation), tokenizer.decode(prompt + real)
        assert rendered.startswith(decoded) and not rendered[len(decoded):].strip(), (row, rendered[len(decoded) - 80 :], decoded[-80:])
    metrics = got.metrics()
    # counts divided by 5: one correctly rounded division of the same integers on each side, exact
    assert metrics["episodes/mean_turns"] == (2 + 1 + 1 + 2 + 3) / 5
    assert metrics["episodes/tool_calls_per_episode"] == (1 + 0 + 0 + 1 + 3) / 5
    assert metrics["episodes/parse_failures"] == 1 and metrics["episodes/tool_errors"] == 3 and metrics["episodes/truncated_ratio"] == 1 / 5


def _raw_turns(transcript, model, prompt, tokenizer) -> list[str]:
    return [tokenizer.decode(t[:-1]) for t in model.turns[prompt[0]["content"]][: len(transcript.turns)]]


def _interleave(prompt, transcript, model, tokenizer, lead: str) -> list[dict]:
    """The conversation the episode is: each turn as the model wrote it, then the tool messages."""
    out = list(prompt)
    for turn, raw in zip(transcript.turns, _raw_turns(transcript, model, prompt, tokenizer), strict=True):
        out.append({"role": "assistant", "content": raw.removeprefix(lead)})
        out.extend({"role": "tool", "name": c["name"], "content": c["observation"]} for c in turn["calls"] if c["error"] != "max_turns")
    return out


def test_a_group_of_episodes_shares_the_prompt_and_each_has_its_own_environment():
    tokenizer, model, offered, prompts = setup(QWEN25, "hermes")
    envs = [ToolEnvironment(offered) for _ in range(4)]
    got = episodes.run(model, tokenizer, prompts[:2], envs, group_size=2, max_turn_tokens=64, max_turns=3, style="hermes")
    assert [t.answer for t in got.transcripts] == ["47104101", "47104101", "Pelora", "Pelora"]
    assert torch.equal(got.rollouts.completion_ids[0], got.rollouts.completion_ids[1]) and got.rollouts.prompt_ids.shape[0] == 2
    with pytest.raises(ValueError, match="4 episodes need 4 environments, got 3"):
        episodes.run(model, tokenizer, prompts[:2], envs[:3], group_size=2, max_turn_tokens=8, max_turns=2, style="hermes")


def test_the_bridge_is_the_templates_own_tokens_between_the_turns():
    for family, style in [(QWEN25, "hermes"), (HERMES, "hermes"), (LLAMA31_TOOLS, "llama3"), (QLLM, "hermes")]:
        tokenizer, model, offered, prompts = setup(family, style)
        turn = call(style, "calculator", '{"expression": "48213 * 977"}')
        answer = [{"role": "tool", "name": "calculator", "content": "47104101"}]
        bridge = episodes.bridge_ids(tokenizer, prompts[0], turn, answer)
        written = tokenizer(render_prompt(tokenizer, prompts[0]) + lead(family) + turn, add_special_tokens=False)["input_ids"] + [model.eot]
        whole = render_chat(tokenizer, [*prompts[0], {"role": "assistant", "content": turn}, *answer], add_generation_prompt=True)
        assert tokenizer.decode(written + bridge) == whole, family.name


def test_a_turn_from_the_kv_cache_reads_what_the_whole_sequence_gives(monkeypatch):
    """`rollouts.sample_after`: rows that stopped at different steps (one at the last, its stop token
    never read; the others read padding after theirs), some dropped and the rest reordered, each
    with appended tokens of its own length: the logits of the next turn's first two tokens equal
    those of the whole sequence sent again, left-padded (to float rounding)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipelines.core.models.models import stop_token_ids
    from pipelines.core.preference import preference_data
    from pipelines.core.rl import rollouts

    tokenizer = tokenizer_for(QWEN25, ["What is 48213 times 977?", "Where does Tovik live? In Pelora.", "a b c"], vocab_size=300)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=512)).eval()  # fmt: skip
    stop = stop_token_ids(tokenizer)[0]
    plan = [[5, 7, 11], [6, 8, stop], [stop, 9, 0], [0, 10, 0], [0, stop, 0],  # turn 1: rows stop at steps 2, 4 (the last), 1
            [12, 14], [13, 15]]  # fmt: skip  # turn 2, rows 2 and 0: two tokens each
    seen = []

    def draw(logits, temperature, top_p):
        seen.append(logits.clone())
        return torch.tensor(plan[len(seen) - 1])

    monkeypatch.setattr(rollouts, "_draw", draw)
    with left_padding(tokenizer):
        encoded = tokenizer(["What is 48213 times 977?", "Where does Tovik live?", "a b"], return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask, truncated, cached = rollouts.sample_from_prompts(model, tokenizer, encoded["input_ids"], encoded["attention_mask"], group_size=1,
                                                                max_new_tokens=5, temperature=1.0)  # fmt: skip
    assert mask.sum(-1).tolist() == [3, 5, 2] and not truncated.any()
    appended = {2: [20, 21, 22], 0: [23]}
    rows = [2, 0]
    rollouts.sample_after(model, tokenizer, cached, rows, ids, mask, [appended[r] for r in rows], max_new_tokens=2, temperature=1.0)
    prompts = [encoded["input_ids"][r][encoded["attention_mask"][r].bool()].tolist() for r in rows]
    whole = [p + ids[r, : int(mask[r].sum())].tolist() + appended[r] for p, r in zip(prompts, rows, strict=True)]
    for step, extra in enumerate([[], [[12], [14]]]):  # the first token's logits, then the second's (after the first drawn)
        sequences = [w + (extra[k] if extra else []) for k, w in enumerate(whole)]
        width = max(len(s) for s in sequences)
        batch = torch.tensor([[0] * (width - len(s)) + s for s in sequences])
        batch_mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences])
        first, _ = preference_data.prompt_cache(model, batch, batch_mask)
        # from the cache against the sequences whole: two orders of the forward's chain (tests/numerics.py)
        numerics.assert_close_as(seen[5 + step], first[:, -1], n=numerics.model_roundings(model.config, width), what=f"step {step}")


@pytest.mark.parametrize("family, style", [(QWEN25, "hermes"), (LLAMA31_TOOLS, "llama3")])
def test_episodes_from_the_cache_are_the_episodes_sent_whole(family, style):
    """The scripted model through `run` with the KV cache kept across turns and without: the same
    transcripts and the same token sequences and masks."""
    tokenizer, model, offered, prompts = setup(family, style)
    got = {}
    for reuse in (True, False):
        envs = [ToolEnvironment(offered, timeout=2.0) for _ in prompts]
        got[reuse] = episodes.run(model, tokenizer, prompts, envs, group_size=1, max_turn_tokens=64, max_turns=3, style=style, reuse_cache=reuse)
    assert [t.turns for t in got[True].transcripts] == [t.turns for t in got[False].transcripts]
    for name in ("completion_ids", "completion_mask", "loss_mask", "truncated"):
        assert torch.equal(getattr(got[True].rollouts, name), getattr(got[False].rollouts, name)), name
