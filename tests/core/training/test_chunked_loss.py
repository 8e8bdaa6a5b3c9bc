"""train.loss_chunk_tokens: the chunked head and cross-entropy give the model's own loss and
gradients, never hold the whole batch's logits, and refuse the models and strategies they cannot serve."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipelines import lora, sft
from pipelines.core.data import chat_examples
from pipelines.core.errors import QllmError
from pipelines.core.models import adapters
from pipelines.core.models.models import load_causal_lm, load_tokenizer
from pipelines.core.params.finetuning import FinetuneParams, LoraAdapterParams
from pipelines.core.params.training import TrainParams
from pipelines.core.training import chunked_loss, loop
from tests import numerics
from tests.stages.test_lora import TRAIN, lora_params


def batch(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 24), generator=g)
    labels = ids.clone()
    labels[:, :10] = -100  # a prompt that is not trained
    labels[1, 15:] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_same_loss_and_grads(model, data, loss, own, got, expected) -> None:
    """The chunked and the whole head are two orders of one forward and backward pass (tests/numerics.py)."""
    seq, tokens = data["input_ids"].shape[1], int((data["labels"][:, 1:] != -100).sum())
    numerics.assert_close_as(loss, own, n=numerics.model_roundings(model.config, seq, tokens=tokens), what="loss")
    assert len(got) == len(expected)
    for i, (g, want) in enumerate(zip(got, expected, strict=True)):
        numerics.assert_close_as(g, want, n=numerics.model_roundings(model.config, seq, tokens=tokens, backward=True), what=f"gradient {i}")


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_the_chunked_loss_and_gradients_are_the_models_own(tiny_base, chunk):
    model = load_causal_lm(tiny_base / "model")
    data = batch(model.config.vocab_size)
    own, _ = chat_examples.chat_loss(model, data)
    own.backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    loss, _ = chunked_loss.causal(chunk)(model, data)
    loss.backward()
    assert_same_loss_and_grads(model, data, loss.detach(), own.detach(), grads(model), expected)
    assert isinstance(model.lm_head, torch.nn.Linear)  # the head is back after the forward


def test_under_peft_the_adapters_get_the_same_gradients(tiny_base):
    tokenizer = load_tokenizer(tiny_base / "model")
    params = LoraAdapterParams(enabled=True, r=4, lora_alpha=8, lora_dropout=0.0, trainable_tokens=[])  # no dropout: both passes see one function
    torch.manual_seed(0)
    model = adapters.wrap(params)(load_causal_lm(tiny_base / "model"), tokenizer)
    with torch.no_grad():  # B starts at 0, which makes A's gradients exactly 0 in both passes: a B of a trained adapter
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02)
    data = batch(len(tokenizer))
    own, _ = chat_examples.chat_loss(model, data)
    own.backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    loss, _ = chunked_loss.causal(5)(model, data)
    loss.backward()
    assert_same_loss_and_grads(model, data, loss.detach(), own.detach(), grads(model), expected)


def test_only_one_chunk_of_logits_is_ever_made(tiny_base):
    model = load_causal_lm(tiny_base / "model")
    data = batch(model.config.vocab_size)
    shapes = []
    model.lm_head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    loss, _ = chunked_loss.causal(4)(model, data)
    loss.backward()
    trained = int((data["labels"][:, 1:] != -100).sum())
    assert shapes and all(s[0] <= 4 and len(s) == 2 for s in shapes)  # [tokens <= chunk, vocab], never [batch, seq, vocab]
    assert sum(s[0] for s in shapes) == 2 * trained  # every trained token once forward, once recomputed in the backward


def test_sft_and_lora_train_with_chunks_to_the_same_result(tiny_base, tmp_path):
    chunked = TRAIN.model_copy(update={"loss_chunk_tokens": 8})
    config = load_causal_lm(tiny_base / "model").config
    # TRAIN's 4 steps in two orders of the head, each a backward pass over chat rows of up to 128
    # positions and an AdamW update (tests/numerics.py: OPTIMIZER_STEP)
    n = numerics.model_roundings(config, 128, tokens=TRAIN.micro_batch_size * 128, backward=True) + numerics.OPTIMIZER_STEP
    for stage, make in (("sft", lambda t: FinetuneParams(base_model=str(tiny_base / "model"), train=t)), ("lora", lambda t: lora_params(tiny_base).model_copy(update={"train": t}))):
        module = {"sft": sft, "lora": lora}[stage]
        plain = module.run(tiny_base / "chat", tmp_path / f"{stage}-plain", make(TRAIN))
        chunks = module.run(tiny_base / "chat", tmp_path / f"{stage}-chunked", make(chunked))
        assert chunks["train_loss"] == numerics.approx(plain["train_loss"], n=n, steps=TRAIN.max_steps)
        assert chunks["val/loss"] == numerics.approx(plain["val/loss"], n=n, steps=TRAIN.max_steps)
        assert np.isfinite(chunks["val/loss"])


def test_models_that_change_logits_after_the_head_are_refused(tiny_base):
    model = load_causal_lm(tiny_base / "model")
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(QllmError, match=r"sft\.train\.loss_chunk_tokens: LlamaForCausalLM applies final_logit_softcapping=30.0"):
        chunked_loss.for_loop(chat_examples.chat_loss, model, TrainParams(loss_chunk_tokens=16), "sft")


def test_fsdp_is_refused_and_zero_leaves_the_loss_alone(tiny_base):
    model = load_causal_lm(tiny_base / "model")
    with pytest.raises(QllmError, match=r"lora\.train\.loss_chunk_tokens: .*FSDP.*--set lora\.train\.strategy=ddp"):
        chunked_loss.for_loop(chat_examples.chat_loss, model, TrainParams(loss_chunk_tokens=16, strategy="fsdp", nproc=2, grad_accum_steps=2), "lora")
    assert chunked_loss.for_loop(loop.causal_lm_loss, model, TrainParams(), "pretrain") is loop.causal_lm_loss


def test_a_masked_diffusion_objective_is_refused():
    from pipelines.core.params.pretraining import DiffusionParams
    from pipelines.core.training import diffusion

    with pytest.raises(QllmError, match=r"pretrain\.train\.loss_chunk_tokens: the masked-diffusion objective scores its own masked tokens"):
        chunked_loss.for_loop(diffusion.Objective(DiffusionParams(), 3), torch.nn.Linear(2, 2), TrainParams(loss_chunk_tokens=16), "pretrain")


@pytest.mark.parametrize("stage", ["dpo", "grpo", "multimodal"])
def test_stages_that_do_not_chunk_their_loss_refuse_the_setting(stage):
    from pipelines.core.params import files as params_file
    from tests.conftest import REPO

    with pytest.raises(QllmError, match=rf"{stage}.*train.loss_chunk_tokens: {stage} does not chunk its loss"):
        params_file.load(REPO, overrides=[f"{stage}.train.loss_chunk_tokens=64"])


def test_without_labels_every_next_token_is_scored_as_causal_lm_loss_does(tiny_base):
    """evaluate's validation loss: packed text rows, no labels, under no_grad."""
    model = load_causal_lm(tiny_base / "model").eval()
    rows = {"input_ids": batch(model.config.vocab_size)["input_ids"]}
    with torch.no_grad():
        own, _ = loop.causal_lm_loss(model, rows)
        chunked, _ = chunked_loss.causal(5)(model, rows)
    numerics.assert_close_as(chunked, own, n=numerics.model_roundings(model.config, rows["input_ids"].shape[1], tokens=rows["input_ids"].numel()))


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_chunked_preference_scores_are_the_whole_logits_ones(tiny_base, chunk):
    """ref_logprobs and evaluate score answers a chunk of tokens at a time: the same summed
    log-probabilities as the whole batch's logits, padded rows and prompts excluded."""
    from pipelines.core.preference import preference_data
    from pipelines.core.preference.preference_data import Pair

    model = load_causal_lm(tiny_base / "model").eval()
    g = np.random.default_rng(0)
    chosen = [g.integers(3, 300, 9 + 3 * i) for i in range(3)]  # a pair's two rows share their prompt, as encode_pairs makes them
    pairs = [Pair(f"p{i}", 4 + i, chosen[i], np.concatenate([chosen[i][: 4 + i], g.integers(3, 300, 8 - 2 * i)]), 0.0, 0.0) for i in range(3)]
    batch = preference_data.collate(pairs, pad_id=0)(np.arange(3))
    with torch.no_grad():
        whole = preference_data.sequence_logps(model, batch)
        chunked = preference_data.sequence_logps(model, batch, chunk)
    for a, b in zip(whole, chunked, strict=True):  # sums of log-probabilities, two orders of the head
        numerics.assert_close_as(b, a, n=numerics.model_roundings(model.config, batch["input_ids"].shape[1]))
    assert (whole[0] < 0).all()
    with torch.enable_grad():  # with gradients (dpo's policy) it keeps the whole-logits path
        assert torch.equal(preference_data.sequence_logps(model, batch, chunk)[0].detach(), whole[0])
