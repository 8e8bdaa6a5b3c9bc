"""The retention measure (issue 80): the general prompts file and its hash splits, the named form
checks on answers written the way SmolLM2-Instruct writes them, `form_kept`'s arithmetic, and
`answer_nll` against a plain unbatched computation."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pipelines.core.errors import QllmError
from pipelines.core.evaluation import retention
from tests.chat_families import LLAMA3, MISTRAL, SMOLLM2, Family, tokenizer_for
from tests.numerics import assert_within, model_roundings, tolerance

# --- the prompts file ------------------------------------------------------------------------------


def test_the_prompts_file_has_six_families_of_at_least_30_split_in_thirds():
    rows = retention.load_prompts()
    lines = retention.PROMPTS_FILE.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["id"] for line in lines] == sorted(row["id"] for row in rows)  # sorted by id, one object a line
    assert all(line == line.rstrip() for line in lines)
    families = Counter(row["family"] for row in rows)
    assert set(families) == set(retention.FAMILIES) and len(families) == 6
    assert min(families.values()) >= 30
    assert len({row["id"] for row in rows}) == len(rows) == len({row["prompt"] for row in rows})
    for family, n in families.items():
        for split in retention.SPLITS:
            size = sum(row["family"] == family and row["split"] == split for row in rows)
            assert abs(size - n / 3) <= 1 and size >= 8, (family, split, size)
    by_split = {split: retention.load_prompts(split) for split in retention.SPLITS}
    assert sorted(row["id"] for split in by_split.values() for row in split) == sorted(row["id"] for row in rows)
    assert all(row["split"] == split for split, chosen in by_split.items() for row in chosen)


def test_a_prompts_split_is_its_sha256_rank_in_its_family_and_never_changes():
    # computed once outside Python: `printf %s code-NN | sha256sum` for the 33 ids of a family,
    # sorted, the i-th of 33 in train / validation / test by 3*i // 33
    assert retention.split_of("code-01") == "train"
    assert retention.split_of("translation-20") == "validation"
    assert retention.split_of("code-18") == "test"
    ids = [row["id"] for row in retention.load_prompts()]
    for family in retention.FAMILIES:
        members = sorted((i for i in ids if i.startswith(family + "-")), key=lambda i: hashlib.sha256(i.encode()).hexdigest())
        expected = {i: ("train", "validation", "test")[3 * k // len(members)] for k, i in enumerate(members)}
        assert {i: retention.split_of(i) for i in members} == expected
    assert retention.assign_splits(reversed(ids)) == retention.assign_splits(ids)  # the file's order plays no part


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"id": "poems-01", "family": "poems", "prompt": "Write a poem."}', "unknown family 'poems'; expected one of code"),
        ('{"id": "code-01", "family": "code", "prompt": "Write a Python function that returns the square of a number."}', "duplicate id 'code-01'"),
        ('{"id": "code-02", "family": "code", "prompt": "Write a Python function that returns the square of a number."}', "duplicate prompt"),
        ('{"id": "code-02", "family": "code", "prompt": "  "}', "empty prompt; expected the text of a user turn"),
        ('{"id": "code-02", "family": "code"}', 'expected an object with exactly the keys "id", "family", "prompt"'),
        ('{"id": "lists-02", "family": "code", "prompt": "x"}', "expected code-<nn>"),
        ("{not json", "not JSON"),
    ],
)
def test_a_bad_line_names_the_file_the_line_and_what_was_expected(tmp_path, monkeypatch, line, message):
    path = tmp_path / "prompts.jsonl"
    good = '{"id": "code-01", "family": "code", "prompt": "Write a Python function that returns the square of a number."}'
    path.write_text(f"{good}\n{line}\n", encoding="utf-8")
    with pytest.raises(QllmError, match=rf"{re.escape(str(path))}:2: ") as raised:
        retention.load_prompts(path=path)
    assert message in str(raised.value)
    monkeypatch.setattr(retention, "PROMPTS_FILE", path)  # the default file is read at each call
    with pytest.raises(QllmError, match=rf"{re.escape(str(path))}:2: "):
        retention.load_prompts("test")
    with pytest.raises(QllmError, match="unknown split 'dev'"):
        retention.load_prompts("dev")


# --- the form checks -------------------------------------------------------------------------------

CODE_ANSWER = """Here's a simple Python function that returns the square of a number:

```python
def square(n):
    return n ** 2
```

You can call it like this: `square(4)` returns 16."""
BULLETS = "Here are five fruits:\n\n- Apple\n- Banana\n- Orange\n- Mango\n- Strawberry"
NUMBERED = "Sure! Here are three planets in our solar system:\n\n1. Mercury\n2. Venus\n3. Mars"
EXPLANATION = ("The sky appears blue because of a process called Rayleigh scattering. Sunlight is made of many colours of light. "
               "Blue light has a shorter wavelength, so the air scatters it much more than red light.")  # fmt: skip
ONE_LINE = "The capital of France is Paris."


def test_code_is_a_fenced_block_or_two_lines_of_code():
    assert retention.is_code(CODE_ANSWER)
    assert retention.is_code("```python\ndef square(n):\n    return n")  # cut off by the generation limit
    assert retention.is_code("def square(n):\n    return n * n")
    assert retention.is_code("SELECT *\nFROM products;\n")
    assert not retention.is_code("You can run this query: SELECT * FROM products;")  # one line of code is not enough
    assert retention.is_code("squares = []\nfor n in range(10):\n    squares.append(n * n)")
    for answer in (BULLETS, NUMBERED, EXPLANATION, ONE_LINE, "Paris.", "8", "```\n```", "Tom has 3 + 4 = 7 apples.\ntotal = 3 + 4 = 7"):
        assert not retention.is_code(answer), answer


def test_a_list_is_three_item_lines():
    assert retention.is_list(BULLETS) and retention.is_list(NUMBERED)
    assert retention.is_list("* one\n* two\n* three") and retention.is_list("• one\n• two\n• three") and retention.is_list("1) a\n2) b\n3) c")
    assert not retention.is_list("- Apple\n- Banana")  # two items
    assert retention.is_list("- Apple\n- Banana", at_least=2)
    assert not retention.is_list("Apple, banana, orange, mango and strawberry.")  # one line of commas: not the list form
    assert not retention.is_list("**Apple**\n**Banana**\n**Orange**")  # bold, not a bullet
    for answer in (CODE_ANSWER, EXPLANATION, ONE_LINE, "Paris.", "8"):
        assert not retention.is_list(answer), answer


def test_sentences_are_two_of_at_least_three_words():
    assert retention.is_sentences(EXPLANATION)
    assert retention.is_sentences("The distance is 3.5 km. The trip takes an hour!")  # 3.5 is no end of sentence
    assert not retention.is_sentences(ONE_LINE)
    assert not retention.is_sentences("Paris. It is big.")  # "Paris." has one word
    assert not retention.is_sentences("The sky is blue because of scattering. Sunlight is made of")  # the second is unfinished
    assert retention.is_sentences(EXPLANATION, at_least=3) and not retention.is_sentences(EXPLANATION, at_least=4)


def test_a_short_fact_is_one_line_of_at_most_twelve_words():
    for answer in ("Paris.", "8", ONE_LINE, "  Bonjour  \n", "Seven days."):
        assert retention.is_short_fact(answer), answer
    assert not retention.is_short_fact("one two three four five six seven eight nine ten eleven twelve thirteen")
    assert retention.is_short_fact("one two three four five six seven eight nine ten eleven twelve")
    for answer in ("", "   ", "Paris.\nIt is in France.", BULLETS, CODE_ANSWER, "x = 1; y = 2;", "return n * n", "- Paris"):
        assert not retention.is_short_fact(answer), answer


def test_form_of_takes_the_most_structured_form_first():
    assert list(retention.FORMS) == ["code", "list", "sentences", "short_fact"]
    assert retention.form_of(CODE_ANSWER) == "code"
    assert retention.form_of("Steps:\n- x = 1\n- y = 2\n- z = 3\n```\nprint(x)\n```") == "code"  # code before list
    assert retention.form_of(BULLETS) == "list" and retention.form_of(NUMBERED) == "list"
    assert retention.form_of("1. Sunlight is made of colours.\n2. Air scatters blue light more.\n3. So we see blue.") == "list"  # list before sentences
    assert retention.form_of(EXPLANATION) == "sentences"
    assert retention.form_of("It is Paris. It is in France.") == "sentences"  # sentences before short fact: both hold
    assert retention.is_short_fact("It is Paris. It is in France.")
    assert retention.form_of("Paris.") == retention.form_of("8") == retention.form_of(ONE_LINE) == "short_fact"
    assert retention.form_of("") is None and retention.form_of("Paris\nFrance") is None


def test_form_kept_counts_the_prompts_whose_base_answer_has_a_form():
    base = [CODE_ANSWER, BULLETS, EXPLANATION, "Paris.", "Paris\nFrance", ""]
    model = [CODE_ANSWER, "Apple, banana, orange, mango.", EXPLANATION, "8", BULLETS, "8"]
    # counted: the first four (the last two base answers have no form); kept: code, sentences, short fact
    assert retention.form_kept(base, model) == (3 / 4, 4)
    assert retention.form_kept(base[:4], base[:4]) == (1.0, 4)
    assert retention.form_kept(["Paris\nFrance", ""], [BULLETS, "8"]) == (None, 0)
    assert retention.form_kept([], []) == (None, 0)
    with pytest.raises(ValueError):
        retention.form_kept(["8"], [])


# --- the retention log-loss ------------------------------------------------------------------------

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "List three fruits."}],
    [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
    [{"role": "user", "content": "Explain why the sky is blue."}],
    [{"role": "user", "content": "Translate 'good morning' into French."}],
]
ANSWERS = ["Paris.", BULLETS, CODE_ANSWER, EXPLANATION, "Bonjour"]


def tiny_chat_model(family: Family, seed: int = 0, arch: str = "llama"):
    """A byte-level BPE with the family's chat template (tests/chat_families.py) and a tiny random
    Llama over its vocabulary, as `save_base_model` builds them, in memory (`arch="gpt2"`: a GPT-2,
    whose positions are absolute). Weights drawn wide (`initializer_range`), so that the answers'
    per-token NLLs differ between answers and positions matter."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    texts = [m["content"] for chat in PROMPTS for m in chat] + ANSWERS
    tokenizer = tokenizer_for(family, texts)
    if arch == "gpt2":
        torch.manual_seed(seed)
        return GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=512, initializer_range=0.5,
                                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)), tokenizer  # fmt: skip
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.5, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config), tokenizer


def plain_nll(model, tokenizer, family: Family, messages: list[dict], answer: str) -> tuple[float, int]:
    """The summed NLL of an answer's tokens and their number, unbatched and unpadded: the prompt
    rendered for generation, the answer's text up to and with the end-of-turn token after it."""
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": answer}], tokenize=False)
    assert full.startswith(prompt)
    cut = full.index(family.end_of_turn, len(prompt)) + len(family.end_of_turn)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = tokenizer(full[:cut], add_special_tokens=False)["input_ids"]
    assert ids[: len(prompt_ids)] == prompt_ids and ids[-1] == tokenizer.convert_tokens_to_ids(family.end_of_turn)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    targets = torch.tensor(ids[len(prompt_ids) :])
    nll = F.cross_entropy(logits[len(prompt_ids) - 1 : -1].double(), targets, reduction="sum")
    return float(nll), len(targets)


@pytest.mark.parametrize("family", [SMOLLM2, LLAMA3, MISTRAL], ids=lambda f: f.name)
def test_answer_nll_is_the_token_weighted_mean_of_unpadded_forwards(family):
    model, tokenizer = tiny_chat_model(family)
    model.train()  # answer_nll scores in eval mode and gives the mode back
    plain = [plain_nll(model.eval(), tokenizer, family, m, a) for m, a in zip(PROMPTS, ANSWERS, strict=True)]
    model.train()
    expected = sum(nll for nll, _ in plain) / sum(n for _, n in plain)
    counts = [n for _, n in plain]
    assert len(set(counts)) == len(counts)  # answers of different lengths
    longest = max(len(retention.answer_tokens(tokenizer, m, a)[0]) for m, a in zip(PROMPTS, ANSWERS, strict=True))
    bound = tolerance(model_roundings(model.config, longest), torch.float32, magnitude=expected)
    for side in ("left", "right"):
        tokenizer.padding_side = side
        for batch_size in (1, 2, 8):
            got = retention.answer_nll(model, tokenizer, PROMPTS, ANSWERS, batch_size=batch_size)
            assert_within(got, expected, bound, f"{side} padding, batches of {batch_size}")
        assert model.training
    # weighted by tokens, not a mean of the answers' means (which the random model puts elsewhere)
    mean_of_means = sum(nll / n for nll, n in plain) / len(plain)
    assert abs(mean_of_means - expected) > 100 * bound
    # each answer's tokens: the answer and its end-of-turn token, not the newline a template writes after it
    for messages, answer, n in zip(PROMPTS, ANSWERS, counts, strict=True):
        ids, marked = retention.answer_tokens(tokenizer, messages, answer)
        scored = [i for i, m in enumerate(marked) if m]
        assert scored == list(range(scored[0], scored[0] + n))
        assert ids[scored[-1]] == tokenizer.convert_tokens_to_ids(family.end_of_turn)
        assert len(ids) - 1 - scored[-1] == (family is SMOLLM2)  # SmolLM2's template writes "\n" after <|im_end|>


def test_left_padding_keeps_each_conversations_positions():
    """GPT-2 adds absolute position embeddings: left padding moves every token of a shorter
    conversation unless the position ids count from its first token (Llama's rotary embeddings see
    only relative positions, so the test above cannot tell)."""
    model, tokenizer = tiny_chat_model(SMOLLM2, arch="gpt2")
    plain = [plain_nll(model.eval(), tokenizer, SMOLLM2, m, a) for m, a in zip(PROMPTS, ANSWERS, strict=True)]
    expected = sum(nll for nll, _ in plain) / sum(n for _, n in plain)
    longest = max(len(retention.answer_tokens(tokenizer, m, a)[0]) for m, a in zip(PROMPTS, ANSWERS, strict=True))
    sizes = SimpleNamespace(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=4 * 32, vocab_size=len(tokenizer))
    bound = tolerance(model_roundings(sizes, longest), torch.float32, magnitude=expected)
    for side in ("left", "right"):
        tokenizer.padding_side = side
        assert_within(retention.answer_nll(model, tokenizer, PROMPTS, ANSWERS, batch_size=8), expected, bound, f"{side} padding")


def test_retention_loss_is_the_models_nll_minus_the_bases():
    model, tokenizer = tiny_chat_model(SMOLLM2, seed=0)
    base, _ = tiny_chat_model(SMOLLM2, seed=1)
    base_nll = retention.answer_nll(base, tokenizer, PROMPTS, ANSWERS)
    model_nll = retention.answer_nll(model, tokenizer, PROMPTS, ANSWERS)
    assert retention.retention_loss(model_nll, base_nll) == model_nll - base_nll  # the same subtraction
    assert retention.retention_loss(base_nll, base_nll) == 0.0
    assert math.isfinite(model_nll) and model_nll > 0


def test_a_template_that_renders_the_answer_apart_from_the_prompt_is_a_clear_error():
    model, tokenizer = tiny_chat_model(SMOLLM2)
    # the generation prompt says "ASSISTANT:", an answered turn "A:": the prompt is no prefix of it
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}A: {{ m['content'] }}<|im_end|>\n"
                               "{% else %}U: {{ m['content'] }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")  # fmt: skip
    with pytest.raises(QllmError, match="not a prefix"):
        retention.answer_nll(model, tokenizer, PROMPTS[:1], ANSWERS[:1])
    with pytest.raises(ValueError):
        retention.answer_nll(model, tokenizer, PROMPTS, ANSWERS[:1])
