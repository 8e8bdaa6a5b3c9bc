"""Multi-turn episodes (issue 55): the tool's and the template's tokens between the model's turns are
read by the model but reach neither GRPO's loss nor its KL. The gradient and the KL are computed
here independently, by a plain forward pass over each row's real tokens."""

from __future__ import annotations

import pytest
import torch

from pipelines import grpo
from pipelines.core.params.rl import GrpoParams
from pipelines.core.rl import rollouts
from tests import numerics

GROUP = 2


def tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64, attention_dropout=0.0)  # fmt: skip
    return LlamaForCausalLM(config).train()


def episode_batch() -> dict[str, torch.Tensor]:
    """Two prompts (left-padded) x a group of 2 episodes. Each episode: the model's first turn, the
    tool's answer rendered by the template (read, not the model's), the model's final answer; then
    right padding."""
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, 48, (2, 5), generator=g)
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    completion_ids = torch.randint(3, 48, (4, 12), generator=g)
    real = [12, 9, 11, 7]  # each episode's tokens; the rest is padding
    model_spans = [[(0, 3), (8, 12)], [(0, 2), (6, 9)], [(0, 4), (9, 11)], [(0, 3), (5, 7)]]  # the model's turns; between them, the tool's
    completion_mask = torch.zeros(4, 12, dtype=torch.long)
    loss_mask = torch.zeros(4, 12, dtype=torch.long)
    for row, (n, spans) in enumerate(zip(real, model_spans, strict=True)):
        completion_mask[row, :n] = 1
        for a, b in spans:
            loss_mask[row, a:b] = 1
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids, "completion_mask": completion_mask,
            "loss_mask": loss_mask, "advantages": advantages, "num_items": loss_mask.sum().float(), "group_size": torch.tensor(GROUP)}  # fmt: skip


def plain_logps(model, batch, row: int) -> torch.Tensor:
    """The row's completion tokens' log-probabilities from one forward pass over its real tokens."""
    prompt = batch["prompt_ids"][row // GROUP][batch["prompt_mask"][row // GROUP].bool()]
    completion = batch["completion_ids"][row][batch["completion_mask"][row].bool()]
    ids = torch.cat([prompt, completion])[None]
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, completion[:, None])[:, 0]


def gradients(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def surrogate_gradients(model, batch, mask_key: str) -> list[torch.Tensor]:
    """The first step's policy gradient (every ratio 1): -sum_i A_i sum_{t in mask} grad log p_t / N."""
    model.zero_grad()
    total = 0.0
    for row in range(4):
        mask = batch[mask_key][row][batch["completion_mask"][row].bool()].float()
        total = total - batch["advantages"][row] * (plain_logps(model, batch, row) * mask).sum()
    (total / batch[mask_key].sum()).backward()
    return gradients(model)


def test_the_tools_tokens_reach_neither_the_loss_nor_its_gradient():
    model, batch = tiny_llama(0), episode_batch()
    model.zero_grad()
    loss, metrics = grpo.grpo_loss(GrpoParams(loss_type="dapo"))(model, batch)
    loss.backward()
    got = gradients(model)
    want = surrogate_gradients(model, batch, "loss_mask")
    # the loss's batch against a forward per row: two orders of the backward's chain (tests/numerics.py)
    seq = batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
    backward = numerics.model_roundings(model.config, seq, tokens=int(batch["num_items"]), backward=True)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        numerics.assert_close_as(g, w, n=backward, what=f"gradient {i}")
    # every ratio is exp(0) = 1 exactly and the advantages are halves: each sum is exact, then one division
    assert float(loss.detach()) == -float((batch["advantages"] * batch["loss_mask"].sum(-1)).sum() / batch["num_items"])
    # the check can tell: had the tool's tokens been scored, the gradient would differ
    leaked = surrogate_gradients(model, batch | {"num_items": batch["completion_mask"].sum().float()}, "completion_mask")
    assert any(not numerics.within(g, w, numerics.tolerance(backward, magnitude=float(w.abs().max()))) for g, w in zip(got, leaked, strict=True))


def test_the_kl_to_the_reference_counts_the_models_tokens_only():
    model, reference, batch = tiny_llama(0), tiny_llama(1).eval(), episode_batch()
    with torch.no_grad():
        ref = rollouts.completion_logps(reference, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"], GROUP,
                                        loss_mask=batch["loss_mask"])[0]  # fmt: skip
    assert bool((ref[batch["loss_mask"] == 0] == 0).all())  # nothing scored outside the model's turns
    _, metrics = grpo.grpo_loss(GrpoParams(loss_type="dapo", beta=0.1))(model, batch | {"ref_logps": ref})
    terms, differences, sizes = [], [], []
    with torch.no_grad():
        for row in range(4):
            mask = batch["loss_mask"][row][batch["completion_mask"][row].bool()].bool()
            mine, theirs = plain_logps(model, batch, row)[mask], plain_logps(reference, batch, row)[mask]
            terms.append(torch.exp(theirs - mine) - (theirs - mine) - 1)
            differences.append(theirs - mine)
            sizes.append(mine.abs() + theirs.abs())
    # each log-ratio d from two forward passes in other batch shapes, within tol on both log-probabilities'
    # size; a term's slope e^d - 1 on it; then the formula and the mean (tests/numerics.py)
    seq = batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
    tol = numerics.tolerance(numerics.model_roundings(model.config, seq), magnitude=float(torch.cat(sizes).max()))
    slope = float((torch.cat(differences).exp() - 1).abs().max())
    expected = float(torch.cat(terms).mean())
    assert metrics["kl"] == pytest.approx(expected, abs=slope * tol + numerics.tolerance(numerics.FUNCTION + 4 + len(torch.cat(terms)), magnitude=float(torch.cat(terms).max())))


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_micro_batches_of_episodes_carry_what_the_model_reads_and_what_it_wrote(mask_truncated):
    batch = episode_batch()
    truncated = torch.tensor([False, True, False, False])
    out = rollouts.Rollouts(batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"], truncated,
                            ["a", "b", "c", "d"], GROUP, loss_mask=batch["loss_mask"])  # fmt: skip
    settings = rollouts.Settings(group_size=GROUP, max_completion_length=12, temperature=1.0, top_p=1.0, scale_rewards="group", num_iterations=2,
                                 mask_truncated_completions=mask_truncated, micro_batch_size=4, grad_accum_steps=1, seed=0, precision="fp32")  # fmt: skip
    model = tiny_llama(0)
    batches = rollouts.RolloutBatches(model, None, [rollouts.Question("q", [{"role": "user", "content": "q"}], "a")] * 2, settings, [])
    scored = batch["loss_mask"] * (~truncated).long()[:, None] if mask_truncated else batch["loss_mask"]
    (micro,) = batches._micro_batches(out, scored, batch["advantages"])
    assert torch.equal(micro["completion_mask"], batch["completion_mask"]) and torch.equal(micro["loss_mask"], scored)
    assert float(micro["num_items"]) == float(scored.sum())  # dapo normalises by the model's own tokens
    assert bool((micro["old_logps"][scored == 0] == 0).all()) and bool((micro["old_logps"][scored == 1] < 0).all())
