"""Preference data -> token sequences for the `dpo` stage, and their summed completion log-probabilities.

Each pair becomes two sequences rendered with the chat template: prompt + chosen answer and
prompt + rejected answer. Only the answer's tokens (and its closing `<|im_end|>`) count: the
completion mask is the template's assistant mask of the final turn, so prompt tokens never do.
Chosen and rejected go through the model in one concatenated batch (`[chosen; rejected]`).

A sequence ends at the answer's end-of-turn token: what the template writes after it (the `\n` of
ours) is not scored: SFT's assistant mask does not train it and generation stops at `<|im_end|>`.
TRL's `DPOTrainer` (1.16) renders conversational pairs with the chat template itself (appending no
EOS) and scores everything after the rendered prompt, that newline included; our prompt ends on a
token boundary (`assistant:`), so the answers start at the same token and TRL's log-prob is ours
plus the newline's (6-16 nats under the sample SFT model). `tests/benchmarks/peers/test_peer_dpo.py` checks this
against TRL's own precompute pass; `python -m benchmarks.peers.peer_dpo --logps` on a finished run.

Bad pairs (empty or identical answers, no user turn, too long) are dropped and counted per
reason, or stop the stage with an error naming the pair (`on_invalid`), so they can never turn
into NaN losses.

KTO's unpaired examples (`Example`: the pairs split in two by `unpair`, plus `feedback` records,
each with its mismatched KL row) batch with `collate_examples`. In training each prompt goes
through the model once and its answers continue from its KV cache (`shared_prompt_logps`,
`prompt_cache`/`continuation_logps`, where `shares_prompt` allows): the same numbers for fewer tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from pipelines.core.data.chat_template import parse_messages, render_with_assistant_mask
from pipelines.core.errors import QllmError
from pipelines.core.training import chunked_loss, diffusion

PREFERENCE_CONFIG = "preference_config.json"
"""Written by `dpo` next to the policy: {"method", "beta", "loss_type", "reference"} (reference
null for the reference-free methods)."""
REASONS = ("empty_chosen", "empty_rejected", "chosen_equals_rejected", "no_user_turn", "prompt_too_long", "too_long")


@dataclass
class Pair:
    id: str
    prompt_length: int  # tokens before the answer (shared by both sequences)
    chosen_ids: np.ndarray  # prompt + chosen answer, ending with <|im_end|>
    rejected_ids: np.ndarray
    ref_chosen: float = float("nan")
    ref_rejected: float = float("nan")


def _render(tokenizer, prompt: list[dict], answer: str) -> tuple[np.ndarray, int]:
    """ids of prompt + answer (cut after the answer's end token) and where the answer starts."""
    out = render_with_assistant_mask(tokenizer, [*prompt, {"role": "assistant", "content": answer}])
    ids, mask = np.asarray(out["input_ids"], dtype=np.int64), np.asarray(out["assistant_masks"], dtype=bool)
    end = int(np.flatnonzero(mask)[-1]) + 1
    start = end
    while start > 0 and mask[start - 1]:  # the final assistant turn: the last run of masked tokens
        start -= 1
    return ids[:end], start


def _invalid(prompt: list[dict], chosen: str, rejected: str) -> str | None:
    if not chosen.strip():
        return "empty_chosen"
    if not rejected.strip():
        return "empty_rejected"
    if chosen.strip() == rejected.strip():
        return "chosen_equals_rejected"
    if not prompt or prompt[-1]["role"] != "user" or not prompt[-1]["content"].strip():
        return "no_user_turn"
    return None


def encode_pairs(tokenizer, frame: pd.DataFrame, max_length: int, max_prompt_length: int = 0, on_invalid: str = "drop", where: str = "") -> tuple[list[Pair], dict[str, int]]:
    """Encode a preference frame (`id, prompt, chosen, rejected`); returns pairs and drop counts."""
    dropped = dict.fromkeys(REASONS, 0)
    pairs = []
    for row in frame.itertuples(index=False):
        prompt = parse_messages(row.prompt)
        reason = _invalid(prompt, row.chosen, row.rejected)
        if reason is None:
            chosen_ids, start = _render(tokenizer, prompt, row.chosen)
            rejected_ids, start_rejected = _render(tokenizer, prompt, row.rejected)
            if start != start_rejected or not np.array_equal(chosen_ids[:start], rejected_ids[:start]):
                raise QllmError(f"{where}pair {row.id!r}: prompt tokens differ between chosen and rejected (tokenizer/template mismatch)")
            if max_prompt_length and start > max_prompt_length:
                reason = "prompt_too_long"
            elif max(len(chosen_ids), len(rejected_ids)) > max_length:
                reason = "too_long"
        if reason is not None:
            if on_invalid == "error":
                raise QllmError(f"{where}pair {row.id!r}: {reason.replace('_', ' ')} (set on_invalid: drop to skip such pairs)")
            dropped[reason] += 1
            continue
        pairs.append(Pair(str(row.id), start, chosen_ids, rejected_ids))
    return pairs, dropped


def right_padded(sequences: list[np.ndarray], starts: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows right-padded to the longest: ids, attention mask, and the mask of the tokens from
    each row's `start` on (its completion)."""
    width = max(len(s) for s in sequences)
    input_ids = np.full((len(sequences), width), pad_id, dtype=np.int64)
    attention = np.zeros((len(sequences), width), dtype=np.int64)
    completion = np.zeros((len(sequences), width), dtype=np.int64)
    for i, (ids, start) in enumerate(zip(sequences, starts, strict=True)):
        input_ids[i, : len(ids)], attention[i, : len(ids)], completion[i, start : len(ids)] = ids, 1, 1
    return torch.from_numpy(input_ids), torch.from_numpy(attention), torch.from_numpy(completion)


def left_padded_prompts(prompts: list[np.ndarray], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to the longest (so each ends at the last column, where its
    continuations start; `prompt_cache`): ids and attention mask."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :], mask[i, width - len(prompt) :] = prompt, 1
    return torch.from_numpy(ids), torch.from_numpy(mask)


def continuations(sequences: list[np.ndarray], starts: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What follows each row's prompt, right-padded, and its mask (`continuation_logps`)."""
    ids, attention, _ = right_padded([s[start:] for s, start in zip(sequences, starts, strict=True)], [0] * len(starts), pad_id)
    return ids, attention


def collate(pairs: list[Pair], pad_id: int) -> Callable[[np.ndarray], dict[str, torch.Tensor]]:
    """Batches of `[chosen_1..B; rejected_1..B]`, right-padded, with completion masks and the
    pairs' cached reference log-probabilities; and the same pairs as one left-padded prompt each
    with their two answers interleaved, `[chosen_1, rejected_1, chosen_2, ...]`
    (`shared_prompt_logps`)."""

    def batch(indices: np.ndarray) -> dict[str, torch.Tensor]:
        chosen = [pairs[i] for i in np.sort(indices)]
        input_ids, attention, completion = right_padded([p.chosen_ids for p in chosen] + [p.rejected_ids for p in chosen], [p.prompt_length for p in chosen] * 2, pad_id)
        prompt_ids, prompt_mask = left_padded_prompts([p.chosen_ids[: p.prompt_length] for p in chosen], pad_id)
        answer_ids, answer_mask = continuations([ids for p in chosen for ids in (p.chosen_ids, p.rejected_ids)], [p.prompt_length for p in chosen for _ in (0, 1)], pad_id)
        return {
            "input_ids": input_ids,
            "attention_mask": attention,
            "completion_mask": completion,
            "completion_tokens": completion.sum(1),
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "answer_ids": answer_ids,
            "answer_mask": answer_mask,
            "ref_chosen": torch.tensor([p.ref_chosen for p in chosen], dtype=torch.float32),
            "ref_rejected": torch.tensor([p.ref_rejected for p in chosen], dtype=torch.float32),
            "num_tokens": int(attention.sum()),
        }

    return batch


SCORE_CHUNK_TOKENS = 1024
"""Answer tokens through the head at a time when scoring without gradients (`ref_logprobs`,
`evaluate`): 64 sequences of a 151,936-token vocabulary otherwise hold gigabytes of fp32 logits."""


def row_logps(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """Summed completion-token log-probabilities of every row.

    Only the completions need logits, and they sit at the end of every row: `logits_to_keep` makes
    the model compute vocabulary logits (and this function the log-softmax) just for the trailing
    positions from the earliest completion on, instead of for every prompt token as well. `chunk`
    (without gradients: `ref_logprobs`, `evaluate`): the head over the completion tokens alone,
    that many at a time, so a large vocabulary's logits of a whole batch are never held
    (`chunked_loss.summed_logps`).
    """
    if diffusion.objective_of(model) == "masked_diffusion":  # no exact log-probability: its ELBO (`diffusion.sequence_elbo`)
        return diffusion.sequence_elbo(model, input_ids, attention_mask, completion)
    if chunk and not torch.is_grad_enabled() and chunked_loss.chunkable(model):
        return chunked_loss.summed_logps(model, input_ids, attention_mask, completion, chunk)
    width = input_ids.shape[1]
    first_answer = int(completion.argmax(dim=1).min())  # earliest completion token in the batch
    keep = width - first_answer + 1  # logits at position t predict token t + 1
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=keep).logits[:, :-1]
    targets = input_ids[:, width - keep + 1 :]
    token_logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (token_logps * completion[:, width - keep + 1 :]).sum(-1)


def shares_prompt(model: torch.nn.Module, continuations: int = 2) -> bool:
    """Whether a prompt with `continuations` continuations should run once for all of them
    (`shared_prompt_logps`, GRPO's groups): `model` is a transformers causal LM (PEFT-wrapped or
    not) in one process, not compiled, without gradient checkpointing (which turns the cache off),
    not a masked-diffusion model (no causal log-probability); and not under CPU bf16 autocast with
    fewer than 4 continuations a prompt, where each forward call casts every weight again: for
    DPO's two answers the second call cost what the saved prompt tokens gained, for GRPO's groups
    of 4 and 8 it saved 17% and 25% of the step (sample model, AVX512-BF16 EPYC; benchmarks/results/peers.md)."""
    from transformers import PreTrainedModel

    if diffusion.objective_of(model) == "masked_diffusion" or hasattr(model, "_orig_mod"):
        return False
    if torch.is_autocast_enabled("cpu") and continuations < 4:
        return False
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return False  # DDP/FSDP: one forward per backward
    lm = chunked_loss.causal_lm(model)
    if not isinstance(lm, PreTrainedModel):
        return False
    checkpointing = lm.is_activation_checkpointing if hasattr(type(lm), "is_activation_checkpointing") else lm.is_gradient_checkpointing  # transformers 5 renamed it
    return not checkpointing


def prompt_cache(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """Left-padded prompts through the model once: the logits of each one's last position (which
    predict a continuation's first token) and the KV cache continuations go on from."""
    from transformers import DynamicCache

    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
                past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)  # fmt: skip
    return out.logits[:, -1:], out.past_key_values


def continuation_logits(model: torch.nn.Module, first_logits: torch.Tensor, cache, prompt_mask: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The logits that predict each token of right-padded continuations `ids` of the cached prompts
    (one row each; `[rows, width, vocabulary]`). The model appends them to `cache`:
    `cache.crop(-continuation width)` before another set."""
    positions = prompt_mask.sum(-1)[:, None] + torch.arange(ids.shape[1], device=ids.device)[None]
    logits = model(input_ids=ids, attention_mask=torch.cat([prompt_mask, mask], dim=1), position_ids=positions, past_key_values=cache, use_cache=False).logits
    # the prompt's last position predicts the first token; continuation position t the token t + 1
    return torch.cat([first_logits, logits[:, :-1]], dim=1)


def continuation_logps(model: torch.nn.Module, first_logits: torch.Tensor, cache, prompt_mask: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed log-probabilities of right-padded continuations `ids` of the cached prompts (one row
    each); see `continuation_logits`."""
    logits = continuation_logits(model, first_logits, cache, prompt_mask, ids, mask)
    token_logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return (token_logps * mask).sum(-1)


def shared_prompt_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logps` with each pair's prompt run once: the left-padded prompts go through the
    model with a KV cache, which is repeated for the two answers, and the answers go through on
    top of it. The same log-probabilities and gradients (to float rounding; tested), for the
    tokens of one prompt instead of two: preference answers are often far shorter than their
    prompts."""
    prompt_mask = batch["prompt_mask"]
    first, cache = prompt_cache(model, batch["prompt_ids"], prompt_mask)
    cache.batch_repeat_interleave(2)  # [prompt_1, prompt_1, prompt_2, ...] as the answers are ordered
    summed = continuation_logps(model, first.repeat_interleave(2, dim=0), cache, prompt_mask.repeat_interleave(2, dim=0), batch["answer_ids"], batch["answer_mask"])
    return summed[0::2], summed[1::2]


def sequence_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed completion-token log-probabilities of the chosen and the rejected halves of a
    `collate` batch: in training (`chunk` 0) each prompt run once (`shared_prompt_logps`) where the
    model allows it; else, and for scoring (`ref_logprobs`, `evaluate`), every row whole (`row_logps`)."""
    if not chunk and "answer_ids" in batch and shares_prompt(model):
        return shared_prompt_logps(model, batch)
    return _rows(model, batch, chunk)


def _rows(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    summed = row_logps(model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"], chunk)
    half = summed.shape[0] // 2
    return summed[:half], summed[half:]


def to_frame(pairs: list[Pair], split: str) -> pd.DataFrame:
    """The cached form written by `ref_logprobs` (token ids as int32 lists)."""
    return pd.DataFrame(
        {
            "id": [p.id for p in pairs],
            "split": split,
            "prompt_length": [p.prompt_length for p in pairs],
            "chosen_ids": [p.chosen_ids.astype(np.int32).tolist() for p in pairs],
            "rejected_ids": [p.rejected_ids.astype(np.int32).tolist() for p in pairs],
            "ref_chosen_logp": [p.ref_chosen for p in pairs],
            "ref_rejected_logp": [p.ref_rejected for p in pairs],
        }
    )


def from_frame(frame: pd.DataFrame) -> list[Pair]:
    return [
        Pair(str(r.id), int(r.prompt_length), np.asarray(r.chosen_ids, dtype=np.int64), np.asarray(r.rejected_ids, dtype=np.int64), float(r.ref_chosen_logp), float(r.ref_rejected_logp))
        for r in frame.itertuples(index=False)
    ]


# ----------------------------------------------------------------------- unpaired (KTO) examples


@dataclass
class Example:
    """An unpaired KTO example: a prompt and a completion, desirable or not, and its mismatched
    pair for the KL estimate (the prompt with another example's completion)."""

    id: str
    prompt_length: int
    ids: np.ndarray  # prompt + completion
    desirable: bool
    kl_ids: np.ndarray  # the same prompt + another prompt's completion (the nearest example before, cyclically)
    ref: float = float("nan")
    ref_kl: float = float("nan")


@dataclass
class Feedback:
    """One encoded feedback record (KTO's own unpaired data), before its KL pair is chosen."""

    id: str
    prompt_length: int
    ids: np.ndarray
    desirable: bool
    ref: float = float("nan")


FEEDBACK_REASONS = ("empty_completion", "no_user_turn", "prompt_too_long", "too_long")


def encode_feedback(tokenizer, frame: pd.DataFrame, max_length: int, max_prompt_length: int = 0, on_invalid: str = "drop", where: str = "") -> tuple[list[Feedback], dict[str, int]]:
    """Encode a feedback frame (`id, prompt, completion, label`); returns the records and drop counts."""
    dropped = dict.fromkeys(FEEDBACK_REASONS, 0)
    records = []
    for row in frame.itertuples(index=False):
        prompt = parse_messages(row.prompt)
        reason = None
        if not row.completion.strip():
            reason = "empty_completion"
        elif not prompt or prompt[-1]["role"] != "user" or not prompt[-1]["content"].strip():
            reason = "no_user_turn"
        else:
            ids, start = _render(tokenizer, prompt, row.completion)
            if max_prompt_length and start > max_prompt_length:
                reason = "prompt_too_long"
            elif len(ids) > max_length:
                reason = "too_long"
        if reason is not None:
            if on_invalid == "error":
                raise QllmError(f"{where}record {row.id!r}: {reason.replace('_', ' ')} (set on_invalid: drop to skip such records)")
            dropped[reason] += 1
            continue
        records.append(Feedback(str(row.id), start, ids, row.label == "true"))
    return records, dropped


def unpair(pairs: list[Pair], feedback: list[Feedback] = ()) -> list[Example]:
    """KTO's examples: each pair split into a desirable (chosen) and an undesirable (rejected) one,
    as TRL's `unpair_preference_dataset` does, all desirable ones first, then `feedback` (records
    of the `feedback` kind) as they come. Example i's KL completion is another prompt's answer, as
    TRL's mismatched pairs mean it to be: the completion of the nearest example before it
    (cyclically) whose prompt differs (with this order usually i - 1, as TRL rotates completions
    within a batch; never the other answer to its own question). Data whose examples all share one
    prompt cannot be paired so: a `QllmError`. The paired examples' reference log-probabilities are
    their pairs' (`ref_chosen`, `ref_rejected`), the feedback's its own."""
    sides = [(f"{p.id}:chosen", p.prompt_length, p.chosen_ids, True, p.ref_chosen) for p in pairs]
    sides += [(f"{p.id}:rejected", p.prompt_length, p.rejected_ids, False, p.ref_rejected) for p in pairs]
    sides += [(f.id, f.prompt_length, f.ids, f.desirable, f.ref) for f in feedback]
    prompts = [tuple(ids[:start].tolist()) for _, start, ids, _, _ in sides]
    if len(set(prompts)) < 2:
        raise QllmError(f"KTO's KL term pairs each example with another prompt's completion, but all {len(sides)} examples share one prompt: "
                        "give it preference pairs or feedback for at least two different prompts")  # fmt: skip
    examples = []
    for i, (name, start, ids, desirable, ref) in enumerate(sides):
        j = next((i - back) % len(sides) for back in range(1, len(sides)) if prompts[(i - back) % len(sides)] != prompts[i])
        _, other_start, other_ids, _, _ = sides[j]
        kl_ids = np.concatenate([ids[:start], other_ids[other_start:]])
        examples.append(Example(name, start, ids, desirable, kl_ids, ref))
    return examples


def collate_examples(examples: list[Example], pad_id: int) -> Callable[[np.ndarray], dict[str, torch.Tensor]]:
    """Batches of KTO examples: their rows and their KL rows (right-padded, with completion
    masks), labels and cached reference log-probabilities; and the prompts left-padded with the
    two continuations of each (`shares_prompt`)."""

    def batch(indices: np.ndarray) -> dict[str, torch.Tensor]:
        chosen = [examples[i] for i in np.sort(indices)]
        starts = [e.prompt_length for e in chosen]
        input_ids, attention, completion = right_padded([e.ids for e in chosen], starts, pad_id)
        kl_ids, kl_attention, kl_completion = right_padded([e.kl_ids for e in chosen], starts, pad_id)
        prompt_ids, prompt_mask = left_padded_prompts([e.ids[: e.prompt_length] for e in chosen], pad_id)
        completion_ids, completion_only = continuations([e.ids for e in chosen], starts, pad_id)
        kl_completion_ids, kl_completion_only = continuations([e.kl_ids for e in chosen], starts, pad_id)
        return {
            "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids, "completion_only_mask": completion_only,
            "kl_completion_ids": kl_completion_ids, "kl_completion_only_mask": kl_completion_only,
            "input_ids": input_ids, "attention_mask": attention, "completion_mask": completion,
            "kl_input_ids": kl_ids, "kl_attention_mask": kl_attention, "kl_completion_mask": kl_completion,
            "desirable": torch.tensor([e.desirable for e in chosen]),
            "ref": torch.tensor([e.ref for e in chosen], dtype=torch.float32),
            "ref_kl": torch.tensor([e.ref_kl for e in chosen], dtype=torch.float32),
            "num_tokens": int(attention.sum() + kl_attention.sum()),
        }  # fmt: skip

    return batch


def examples_to_frame(examples: list[Example], split: str) -> pd.DataFrame:
    """The cached form of KTO examples written by `ref_logprobs` (`unpaired_<split>.parquet`)."""
    return pd.DataFrame(
        {
            "id": [e.id for e in examples],
            "split": split,
            "prompt_length": [e.prompt_length for e in examples],
            "ids": [e.ids.astype(np.int32).tolist() for e in examples],
            "desirable": [e.desirable for e in examples],
            "kl_ids": [e.kl_ids.astype(np.int32).tolist() for e in examples],
            "ref_logp": [e.ref for e in examples],
            "ref_kl_logp": [e.ref_kl for e in examples],
        }
    )


def examples_from_frame(frame: pd.DataFrame) -> list[Example]:
    return [
        Example(str(r.id), int(r.prompt_length), np.asarray(r.ids, dtype=np.int64), bool(r.desirable), np.asarray(r.kl_ids, dtype=np.int64), float(r.ref_logp), float(r.ref_kl_logp))
        for r in frame.itertuples(index=False)
    ]
