"""GRPO's rollouts: groups of sampled completions with their masks, reproducible from the seed, and
their per-token log-probabilities as the training forward computes them."""

from __future__ import annotations

import torch

from pipelines.core.models.models import load_causal_lm, load_tokenizer, stop_token_ids
from pipelines.core.preference import preference_data
from pipelines.core.rl import rollouts
from tests import numerics

PROMPTS = [[{"role": "user", "content": "Where does Tovik live?"}], [{"role": "system", "content": "Answer with one word."},
           {"role": "user", "content": "What is 3 plus 4?"}]]  # fmt: skip


def test_groups_of_samples_with_masks_up_to_the_stop_token(tiny_base):
    tokenizer = load_tokenizer(tiny_base / "model")
    model = load_causal_lm(tiny_base / "model").train()  # as the loop holds it
    torch.manual_seed(0)
    out = rollouts.sample(model, tokenizer, PROMPTS, group_size=4, max_completion_length=12, temperature=1.0)
    assert out.completion_ids.shape[0] == 8 and out.prompt_ids.shape[0] == 2 and len(out.texts) == 8
    assert out.completion_ids.shape[1] <= 12 and model.training  # the mode it came in
    stops = torch.tensor(stop_token_ids(tokenizer))
    for ids, mask, truncated in zip(out.completion_ids, out.completion_mask, out.truncated, strict=True):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()  # one run from the start
        if truncated:
            assert n == out.completion_ids.shape[1] and not torch.isin(ids, stops).any()
        else:
            assert ids[n - 1] in stops and not torch.isin(ids[: n - 1], stops).any()  # through its first stop token
    # the same seed, the same samples (the loop's checkpoints restore torch's generator)
    torch.manual_seed(0)
    again = rollouts.sample(model, tokenizer, PROMPTS, group_size=4, max_completion_length=12, temperature=1.0)
    assert torch.equal(again.completion_ids, out.completion_ids) and again.texts == out.texts
    # a random untrained model samples differently within a group
    assert len({tuple(r.tolist()) for r in out.completion_ids[:4]}) > 1


def test_token_logps_are_the_rows_log_probabilities(tiny_base):
    tokenizer = load_tokenizer(tiny_base / "model")
    model = load_causal_lm(tiny_base / "model").eval()
    torch.manual_seed(1)
    out = rollouts.sample(model, tokenizer, PROMPTS, group_size=3, max_completion_length=10, temperature=1.0)
    per_token = rollouts.token_logps(model, out)
    assert per_token.shape == out.completion_ids.shape and (per_token[out.completion_mask == 0] == 0).all()
    # the same sums as the preference code's whole-row scoring of prompt + completion, row by row
    for row in range(6):
        prompt = out.prompt_ids[row // 3][out.prompt_mask[row // 3].bool()]
        completion = out.completion_ids[row][out.completion_mask[row].bool()]
        ids = torch.cat([prompt, completion]).unsqueeze(0)
        mask = torch.zeros_like(ids)
        mask[0, len(prompt) :] = 1
        whole = preference_data.row_logps(model, ids, torch.ones_like(ids), mask)
        # the group's batch against one row: two orders of the forward's chain (tests/numerics.py)
        numerics.assert_close_as(per_token[row].sum(), whole[0], n=numerics.model_roundings(model.config, ids.shape[1]), what=f"row {row}")


def test_each_prompt_runs_once_for_its_group_with_the_same_logps_and_gradients(tiny_base, monkeypatch):
    tokenizer = load_tokenizer(tiny_base / "model")
    model = load_causal_lm(tiny_base / "model").train()
    torch.manual_seed(2)
    out = rollouts.sample(model, tokenizer, PROMPTS, group_size=3, max_completion_length=8, temperature=1.0)
    args = (out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask, 3)
    assert preference_data.shares_prompt(model, 3)
    shared, shared_entropy = rollouts.completion_logps(model, *args, entropy=True)
    shared.sum().backward()
    shared_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    monkeypatch.setattr(preference_data, "shares_prompt", lambda m, n=2: False)  # every row whole: prompt repeated per completion
    rows, rows_entropy = rollouts.completion_logps(model, *args, entropy=True)
    rows.sum().backward()
    # the prompt once against every row whole: two orders of the forward's and the backward's chains (tests/numerics.py)
    seq = out.prompt_ids.shape[1] + out.completion_ids.shape[1]
    forward = numerics.model_roundings(model.config, seq)
    numerics.assert_close_as(shared, rows, n=forward, what="log-probabilities")
    numerics.assert_close_as(shared_entropy, rows_entropy, n=forward, what="entropy")
    backward = numerics.model_roundings(model.config, seq, tokens=out.completion_ids.numel(), backward=True)
    for i, (got, want) in enumerate(zip(shared_grads, (p.grad for p in model.parameters()), strict=True)):
        numerics.assert_close_as(got, want, n=backward, what=f"gradient {i}")
    # entropy: at most log(vocabulary) (up to the forward's rounding of it), 0 outside the completions
    log_vocabulary = float(torch.log(torch.tensor(float(model.config.vocab_size))))
    assert (shared_entropy <= log_vocabulary + numerics.tolerance(forward, magnitude=log_vocabulary)).all()
    assert (shared_entropy[out.completion_mask == 0] == 0).all()


def test_top_p_samples_only_from_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    torch.manual_seed(0)
    drawn = rollouts._draw(logits, temperature=1.0, top_p=0.7)
    assert set(drawn.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.7: the two likeliest only
    share = (drawn == 0).float().mean().item()
    assert abs(share - 0.5 / 0.8) < 0.04  # renormalised over the nucleus
    assert set(rollouts._draw(logits, temperature=1.0, top_p=1.0).tolist()) == {0, 1, 2, 3}


def test_log_probabilities_are_of_the_distribution_sampled_at_the_temperature(tiny_base):
    """At temperature 1.7 the whole path agrees: the frequency of the likeliest first token over 4,000
    samples is exp of the log-probability `completion_logps` gives it (which the importance ratio,
    the KL and the entropy use), and every sampled token's log-probability and entropy equal TRL's
    `selective_log_softmax_and_entropy(logits, temperature=1.7)` on the full logits. At temperature 1
    (what the stage computed before) the frequency does not match."""
    from trl.trainer.utils import selective_log_softmax_and_entropy

    tokenizer = load_tokenizer(tiny_base / "model")
    model = load_causal_lm(tiny_base / "model").eval()
    with torch.no_grad():  # logits x 12 (the final norm's scale): a peaked distribution the temperature visibly flattens
        model.model.norm.weight.mul_(12.0)
    temperature, group = 1.7, 4000
    torch.manual_seed(3)
    out = rollouts.sample(model, tokenizer, PROMPTS[:1], group_size=group, max_completion_length=1, temperature=temperature)
    logps, entropy = rollouts.completion_logps(model, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask, group,
                                               entropy=True, temperature=temperature)  # fmt: skip
    first = out.completion_ids[:, 0]
    top = int(torch.bincount(first).argmax())
    frequency = float((first == top).float().mean())
    expected = float(logps[first == top, 0][0].exp())
    assert 0.1 < expected < 0.3 and abs(frequency - expected) < 0.02, (frequency, expected)  # 3 standard errors: 0.017
    at_one, _ = rollouts.completion_logps(model, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask, group)
    assert float(at_one[first == top, 0][0].exp()) > 0.5  # the temperature-1 probability: not what was sampled
    # TRL's formula on the prompt's full logits
    ids = out.prompt_ids[0][out.prompt_mask[0].bool()].unsqueeze(0)
    with torch.no_grad():
        last = model(input_ids=ids).logits[:, -1].float().expand(group, -1)
    trl_logps, trl_entropy = selective_log_softmax_and_entropy(last, first, temperature=temperature)
    # the group's forward against one row's: two orders of the forward's chain (tests/numerics.py)
    forward = numerics.model_roundings(model.config, ids.shape[1] + 1)
    numerics.assert_close_as(logps[:, 0], trl_logps, n=forward, what="log-probabilities")
    numerics.assert_close_as(entropy[:, 0], trl_entropy, n=forward, what="entropy")


def test_temperature_zero_is_greedy_decoding_as_generate_does_it(tiny_base):
    """Temperature 0 (evaluate's episodes): the most likely token each step, the tokens
    transformers' `generate(do_sample=False)` gives for the same prompts; a group needs sampling."""
    import pytest

    from pipelines.core.data.chat_template import left_padding, render_prompt

    tokenizer = load_tokenizer(tiny_base / "model")
    model = load_causal_lm(tiny_base / "model").eval()
    with left_padding(tokenizer):
        encoded = tokenizer([render_prompt(tokenizer, p) for p in PROMPTS], return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask, _ = rollouts.sample_ids(model, tokenizer, encoded["input_ids"], encoded["attention_mask"], group_size=1, max_new_tokens=10, temperature=0.0)
    expected = model.generate(**encoded, max_new_tokens=10, do_sample=False, eos_token_id=stop_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id)
    expected = expected[:, encoded["input_ids"].shape[1] :]
    for row in range(len(PROMPTS)):
        n = int(mask[row].sum())
        assert ids[row, :n].tolist() == expected[row, :n].tolist()
    with pytest.raises(ValueError, match="temperature must be > 0 to sample a group"):
        rollouts.sample_ids(model, tokenizer, encoded["input_ids"], encoded["attention_mask"], group_size=2, max_new_tokens=4, temperature=0.0)
