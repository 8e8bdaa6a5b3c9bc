"""Completion-only masks with any chat template: the base model's own template, with or without
`{% generation %}` markers, for multi-turn chats, system prompts, preference pairs and prompts."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pipelines.core.data import chat_examples, chat_template
from pipelines.core.data.chat_examples import IGNORE
from pipelines.core.evaluation import heldout
from pipelines.core.models.models import load_tokenizer, stop_token_ids
from pipelines.core.preference import preference_data
from tests.chat_families import FAMILIES, QWEN25, SMOLLM2, SMOLLM2_TOOLS, Family, save_base_model, tokenizer_for
from tests.conftest import CHATS

TEXTS = [m["content"] for c in CHATS for m in c] * 5 + ["You are a helpful assistant.", "Answer with one word."]
SYSTEM_CHAT = CHATS[0]  # system, user, assistant
MULTI_TURN = CHATS[6]  # user, assistant, user, assistant
WEIGHTED = [
    {"role": "user", "content": "What is 1 plus 2?"},
    {"role": "assistant", "content": "4", "weight": 0},  # context (a wrong answer the user corrects), not a target
    {"role": "user", "content": "No. What is 1 plus 2?"},
    {"role": "assistant", "content": "3"},
]


def trained_pieces(tokenizer, example) -> list[str]:
    """The trained tokens decoded, one string per contiguous run."""
    mask = example.labels != IGNORE
    runs, current = [], []
    for token, on in zip(example.input_ids, mask, strict=True):
        if on:
            current.append(int(token))
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(r) for r in runs]


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda f: f.name)
def family(request) -> tuple[Family, object]:
    return request.param, tokenizer_for(request.param, TEXTS)


def test_trained_tokens_are_exactly_the_answers_and_their_end_of_turn_token(family):
    fam, tokenizer = family
    assert not chat_template.has_generation_marks(tokenizer)
    examples, stats = chat_examples.encode(tokenizer, [SYSTEM_CHAT, MULTI_TURN, WEIGHTED], max_len=512)
    assert stats.examples == 3 and stats.dropped_no_target == 0
    answers = [trained_pieces(tokenizer, e) for e in examples]
    eot = fam.end_of_turn
    # Templates that trim put no space in front of the answer; ChatML/Phi-3 keep the content as is.
    assert [[p.strip() for p in a] for a in answers] == [[f"Pelora{eot}"], [f"3{eot}", f"3{eot}"], [f"3{eot}"]]
    # Nothing of the prompt: the system prompt and the questions are never trained.
    for pieces in answers:
        assert not any(word in "".join(pieces) for word in ("Where", "plus", "Answer", "assistant", "user", "model", "INST"))


def test_end_of_turn_token_is_found_and_stops_generation(family):
    fam, tokenizer = family
    eot = tokenizer.convert_tokens_to_ids(fam.end_of_turn)
    assert chat_template.end_of_turn_token(tokenizer) == eot
    assert stop_token_ids(tokenizer)[0] == eot and tokenizer.eos_token_id in stop_token_ids(tokenizer)


def test_preference_pairs_score_only_the_answer(family):
    fam, tokenizer = family
    frame = pd.DataFrame({"id": ["p0"], "prompt": ['[{"role": "user", "content": "Where does Tovik live?"}]'], "chosen": ["Pelora"], "rejected": ["Dunmar"]})
    (pair,), dropped = preference_data.encode_pairs(tokenizer, frame, max_length=256)
    assert sum(dropped.values()) == 0
    assert tokenizer.decode(pair.chosen_ids[pair.prompt_length :]).strip() == f"Pelora{fam.end_of_turn}"
    assert tokenizer.decode(pair.rejected_ids[pair.prompt_length :]).strip() == f"Dunmar{fam.end_of_turn}"
    # The prompt part is what evaluation renders with add_generation_prompt=True.
    prompt_text = tokenizer.apply_chat_template([{"role": "user", "content": "Where does Tovik live?"}], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(pair.chosen_ids[: pair.prompt_length]) == prompt_text.rstrip(" ") or tokenizer.decode(
        pair.chosen_ids[: pair.prompt_length]
    ).startswith(prompt_text.rstrip())


def test_marker_less_template_trains_as_many_tokens_as_the_marker_template(tiny_base):
    marked = load_tokenizer(tiny_base / "model")
    assert chat_template.has_generation_marks(marked)
    unmarked = load_tokenizer(tiny_base / "model")
    unmarked.chat_template = chat_template.CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert not chat_template.has_generation_marks(unmarked)
    chats = [*CHATS, WEIGHTED]
    with_marks, stats_marks = chat_examples.encode(marked, chats, max_len=512)
    without, stats_plain = chat_examples.encode(unmarked, chats, max_len=512)
    assert stats_marks.target_tokens == stats_plain.target_tokens > 0
    for a, b in zip(with_marks, without, strict=True):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.labels, b.labels)
    # weight 0 is honoured with the markers too: only the second answer of WEIGHTED is trained
    assert trained_pieces(marked, with_marks[-1]) == [" 3<|im_end|>"]


class RewritingTemplate:
    """Drops the content of earlier assistant turns (as reasoning templates drop past thoughts)."""

    template = (
        "{%- for message in messages %}{%- if message['role'] == 'assistant' and not loop.last %}"
        "{{- '<|im_start|>assistant\n<|im_end|>\n' }}{%- else %}"
        "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
    )


def test_template_that_rewrites_earlier_turns_is_a_clear_error_naming_the_turn():
    from tests.chat_families import CHATML

    tokenizer = tokenizer_for(CHATML, TEXTS)
    tokenizer.chat_template = RewritingTemplate.template
    chat_examples.encode(tokenizer, [SYSTEM_CHAT], max_len=512)  # one assistant turn: fine
    with pytest.raises(chat_template.ChatTemplateError, match=r"turns 1-2 is not a prefix .*\(turn 2, assistant\)"):
        chat_examples.encode(tokenizer, [MULTI_TURN], max_len=512)


def test_tokenizer_without_a_chat_template_is_a_clear_error():
    from tests.chat_families import CHATML

    tokenizer = tokenizer_for(CHATML, TEXTS)
    tokenizer.chat_template = None
    with pytest.raises(chat_template.ChatTemplateError, match="no chat template"):
        chat_examples.encode(tokenizer, [SYSTEM_CHAT], max_len=512)


def test_sft_trains_and_answers_with_each_family_template(family, tiny_base, tmp_path):
    """SFT from a small random model of each family (its own tokenizer and template), then a
    greedy answer to a held-out prompt rendered with `add_generation_prompt`."""
    from pipelines import sft
    from pipelines.core.models.models import load_model_and_tokenizer
    from pipelines.core.params.finetuning import FinetuneParams
    from pipelines.core.params.training import TrainParams

    fam, _ = family
    base = save_base_model(fam, TEXTS, tmp_path / "base")
    train = TrainParams(max_steps=2, micro_batch_size=4, warmup_steps=0, eval_every=0, eval_batches=1, checkpoint_every=0, precision="fp32")
    metrics = sft.run(tiny_base / "chat", tmp_path / "sft", FinetuneParams(base_model=str(base), train=train))
    assert metrics["steps"] == 2 and metrics["data/train_dropped_no_target"] == 0
    assert metrics["data/train_examples"] == len(CHATS) and metrics["data/train_target_tokens"] > len(CHATS)
    model, tokenizer = load_model_and_tokenizer(tmp_path / "sft")
    assert tokenizer.chat_template == fam.template  # the fine-tuned model keeps the base's template
    assert model.generation_config.eos_token_id[0] == tokenizer.convert_tokens_to_ids(fam.end_of_turn)
    (answer,) = heldout.generate_answers(model, tokenizer, [[{"role": "user", "content": "Where does Tovik live?"}]], max_new_tokens=3, batch_size=1)
    assert isinstance(answer, str) and fam.end_of_turn not in answer


# This project's template before it rendered tools (2026-11-29): a chat without tools must render as it did.
TEMPLATE_BEFORE_TOOLS = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|im_start|>assistant:{% generation %} {{ message['content'] }}<|im_end|>{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}: {{ message['content'] }}<|im_end|>{{ '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}"
)


def test_the_projects_template_renders_tools_and_calls_and_chats_without_them_as_before():
    from pipelines.core.rl import tools
    from pipelines.train_tokenizer import train

    tokenizer = train(iter([m["content"] for chat in CHATS for m in chat] * 5), vocab_size=300, min_frequency=1)
    before = tokenizer_for(Family("before", TEMPLATE_BEFORE_TOOLS, tuple(chat_template.SPECIAL_TOKENS), eos=chat_template.EOS,
                                  end_of_turn=chat_template.IM_END), ["a"])  # fmt: skip
    for chat in CHATS:
        for generation in (False, True):
            assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation) == \
                before.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation)  # fmt: skip
    schema = tools.load("calculator").schema
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "48213 * 977"}}}
    chat = [{"role": "user", "content": "What is 48213 times 977?", chat_template.TOOLS_KEY: [schema]}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": "47104101"}, {"role": "assistant", "content": "47104101"}]  # fmt: skip
    chat_template.check_tool_support(tokenizer, chat)  # the template reads tools and tool_calls
    text = chat_template.render_chat(tokenizer, chat)
    assert text.split("<|im_end|>")[0] == ('<|im_start|>system: Tools, each called as <tool_call>{"name": ..., "arguments": {...}}</tool_call>: '
                                          "calculator(expression: string) " + schema["function"]["description"])  # fmt: skip
    turn = text.split("<|im_start|>assistant:")[1].split("<|im_end|>")[0]
    assert tools.parse_tool_calls(turn, "hermes") == tools.Parsed([tools.ToolCall("calculator", {"expression": "48213 * 977"})], "")
    string_arguments = {**call, "function": {**call["function"], "arguments": '{"expression": "48213 * 977"}'}}  # OpenAI's layout: a JSON string
    assert chat_template.render_chat(tokenizer, [*chat[:1], {"role": "assistant", "content": "", "tool_calls": [string_arguments]}]) == \
        chat_template.render_chat(tokenizer, chat[:2])  # fmt: skip
    # the call is the model's to write: SFT trains it, and the tool's answer it only reads
    example = chat_template.render_with_assistant_mask(tokenizer, chat)
    trained = tokenizer.decode([i for i, m in zip(example["input_ids"], example["assistant_masks"], strict=True) if m])
    assert "<tool_call>" in trained and "47104101<|im_end|>" in trained and "tool: 47104101" not in trained


def test_the_smollm2_tools_template_renders_plain_chats_as_smollm2s_own_and_tools_as_qwen25_does():
    """templates/smollm2-tools.jinja (base_model.chat_template_path for SmolLM2): what SmolLM2 was
    trained on is unchanged, and a tool chat is Qwen2.5's Hermes-style rendering with SmolLM2's
    default system turn, which `grpo.tools.style: auto` reads as hermes."""
    from pipelines.core.rl import episodes, tools

    own, with_tools, qwen = (tokenizer_for(f, TEXTS) for f in (SMOLLM2, SMOLLM2_TOOLS, QWEN25))
    for chat in [*CHATS, [{"role": "user", "content": "Hi"}]]:
        for generation in (False, True):
            assert chat_template.render_chat(with_tools, chat, generation) == chat_template.render_chat(own, chat, generation)
    schema = tools.load("calculator").schema
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "48213 * 977"}}}
    for system in ([], [{"role": "system", "content": "Answer with a number."}]):
        chat = [*system, {"role": "user", "content": "What is 48213 times 977?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": "47104101"}, {"role": "assistant", "content": "47104101"}]  # fmt: skip
        chat[0] = {**chat[0], chat_template.TOOLS_KEY: [schema]}
        text = chat_template.render_chat(with_tools, chat)
        assert text == chat_template.render_chat(qwen, chat).replace("You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
                                                                      "You are a helpful AI assistant named SmolLM, trained by Hugging Face")  # fmt: skip
        assert text.startswith("<|im_start|>system\n" + (system[0]["content"] if system else "You are a helpful AI assistant named SmolLM"))
        assert '\n<tools>\n{"type": "function", "function": {"name": "calculator"' in text
        turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
        assert tools.parse_tool_calls(turn, "hermes") == tools.Parsed([tools.ToolCall("calculator", {"expression": "48213 * 977"})], "")
        assert "<|im_start|>user\n<tool_response>\n47104101\n</tool_response><|im_end|>" in text
        chat_template.check_tool_support(with_tools, chat)
        with pytest.raises(chat_template.ChatTemplateError, match="does not render tool calls"):
            chat_template.check_tool_support(own, chat)
    assert episodes.tool_style(with_tools, "auto") == "hermes"


def test_a_masked_render_is_not_disturbed_by_renders_in_other_threads():
    """transformers compiles a chat template once per process and shares it between threads, with
    the tracker behind `{% generation %}`: a plain render of a chat with an assistant turn, in
    another thread while a masked render ran, added its spans to the masked one's (ref_logprobs
    beside grpo in one `qllm run`: "prompt tokens differ between chosen and rejected"). Threads
    switch every microsecond here, so the renders interleave within the test's few hundred."""
    import sys
    import threading

    from pipelines import train_tokenizer

    tokenizer = train_tokenizer.train(iter(TEXTS), 400, 1)
    chat = MULTI_TURN
    expected = chat_template.render_with_assistant_mask(tokenizer, chat)
    stop, errors = threading.Event(), []

    def prompts() -> None:  # what grpo and evaluate render: prompts with earlier assistant turns
        try:
            while not stop.is_set():
                chat_template.render_prompt(tokenizer, chat[:-1])
                chat_template.render_chat(tokenizer, chat)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(repr(error))

    interval = sys.getswitchinterval()
    threads = [threading.Thread(target=prompts) for _ in range(2)]
    sys.setswitchinterval(1e-6)
    try:
        for thread in threads:
            thread.start()
        rendered = [chat_template.render_with_assistant_mask(tokenizer, chat) for _ in range(300)]
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(interval)
    assert errors == []
    assert sum(r != expected for r in rendered) == 0


def test_rendering_a_template_text_waits_for_the_template_lock():
    """`render_jinja` (a template's text, no tokenizer: the tokenizer trainer's tool chats, the base
    model's template check) renders under `TEMPLATE_LOCK`, as a tokenizer's renders do: it waits
    while another thread holds the lock, then renders."""
    import threading

    done = []
    with chat_template.TEMPLATE_LOCK:
        worker = threading.Thread(target=lambda: done.append(chat_template.render_jinja([[{"role": "user", "content": "hi"}]], "{{ messages[0]['content'] }}!")))
        worker.start()
        worker.join(0.5)
        assert worker.is_alive() and not done  # held here: it waits
    worker.join(30)
    assert done and done[0][0] == ["hi!"]
