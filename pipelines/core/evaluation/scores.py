"""Metrics of answers and models: exact and flexible match by question group, sentence BLEU and
ROUGE-L, preference accuracy with DPO's implicit rewards, and the causal loss on packed text
(held-out pretraining text, or CPython's documentation as general text)."""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np
import pandas as pd
import torch

from pipelines.core.data import packed, real_text
from pipelines.core.data.chat_template import (
    answer_group,
    flexible_match,
    normalize_answer,
    strict_match,
)
from pipelines.core.params.release import EvaluateParams
from pipelines.core.preference import losses, preference_data
from pipelines.core.rl.rewards import candidate_answers
from pipelines.core.training import chunked_loss, diffusion, loop, objectives

VAL_CHUNK_TOKENS = 1024
"""Tokens whose logits the validation loss holds at once (`pipelines.core.training.chunked_loss`)."""


def group_of(example_id: str) -> str:
    """Ids like `heldout-fact-city-7` are grouped as `heldout-fact-city` in the breakdown."""
    return re.sub(r"-\d+$", "", example_id)


def by_group(questions: pd.DataFrame, correct: list[bool]) -> dict[str, float]:
    """The share of `correct` answers in each question group (`group_of`)."""
    groups: dict[str, list[bool]] = defaultdict(list)
    for example_id, ok in zip(questions["id"], correct, strict=True):
        groups[group_of(example_id)].append(ok)
    return {g: round(sum(v) / len(v), 4) for g, v in sorted(groups.items())}


def exact_match_report(questions: pd.DataFrame, predictions: list[str]) -> tuple[list[bool], dict[str, float]]:
    correct = [normalize_answer(p) == normalize_answer(r) for p, r in zip(predictions, questions["reference"], strict=True)]
    return correct, by_group(questions, correct)


def flexible_match_report(questions: pd.DataFrame, predictions: list[str]) -> tuple[list[bool], dict[str, float]]:
    """`chat_template.flexible_match` of every answer (the reference found in a free-form answer)."""
    correct = [flexible_match(p, r) for p, r in zip(predictions, questions["reference"], strict=True)]
    return correct, by_group(questions, correct)


def strict_match_report(questions: pd.DataFrame, predictions: list[str]) -> tuple[list[bool], dict[str, float]]:
    """`chat_template.strict_match` of every answer: the reference found as `flexible_match` finds
    it, and no other answer of the question's group named (another city for a city question; for a
    sum, any other number but the question's own operands): an answer listing every candidate
    scores 0. A group's candidates are the references of its questions here (`rewards.candidate_answers`,
    what GRPO's `strict_match` reward reads)."""
    candidates = candidate_answers(list(zip(questions["id"], questions["reference"], strict=True)))
    correct = [
        strict_match(p, r, candidates[answer_group(i)], prompt[-1]["content"])
        for p, r, i, prompt in zip(predictions, questions["reference"], questions["id"], questions["prompt"], strict=True)
    ]
    return correct, by_group(questions, correct)


def text_similarity(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Mean sentence BLEU (sacrebleu, 0-100, effective n-gram order) and mean ROUGE-L F-measure
    (rouge-score, 0-1) over the answers.

    Held-out answers are one to three words: corpus BLEU-4 has no 4-grams to count and is 0 for
    every model, so each answer is scored with the n-gram orders it has (sacrebleu's
    `effective_order`, its recommended sentence-level setting) and the scores are averaged."""
    import sacrebleu

    if not predictions:
        return {"bleu": 0.0, "rougeL": 0.0}
    metric = sacrebleu.metrics.BLEU(effective_order=True)
    bleu = sum(metric.sentence_score(p, [r]).score for p, r in zip(predictions, references, strict=True)) / len(predictions)
    rouge = sum(rouge_l(r, p) for p, r in zip(predictions, references, strict=True)) / len(predictions)
    return {"bleu": round(bleu, 4), "rougeL": round(rouge, 4)}


def rouge_l(reference: str, prediction: str) -> float:
    """rouge-score's ROUGE-L F-measure (`RougeScorer(["rougeL"]).score(reference, prediction)`),
    from its own tokenizer and F-measure, without its `rouge_scorer` module: that module imports
    NLTK (for a stemmer this metric does not use), 1.4 s of every evaluating process on a 2-core
    AVX2-only EPYC. The longest common subsequence is the same dynamic programme, one row kept."""
    from rouge_score import scoring, tokenize

    ref, pred = tokenize.tokenize(reference, None), tokenize.tokenize(prediction, None)
    if not ref or not pred:
        return 0.0
    row = [0] * (len(pred) + 1)
    for word in ref:
        diagonal = 0
        for j, other in enumerate(pred, start=1):
            diagonal, row[j] = row[j], diagonal + 1 if word == other else max(row[j], row[j - 1])
    return scoring.fmeasure(row[-1] / len(pred), row[-1] / len(ref))


@torch.no_grad()
def preference_metrics(model, pairs: list[preference_data.Pair], pad_id: int, batch_size: int, beta: float | None) -> dict[str, float]:
    """`preference_accuracy` (log p(chosen) > log p(rejected)) over `pairs`; with `beta` (a DPO
    policy) also its implicit rewards against the pairs' cached reference log-probabilities."""
    if not pairs:
        return {}
    model.eval()
    make = preference_data.collate(pairs, pad_id)
    chosen, rejected = [], []
    for start in range(0, len(pairs), batch_size):
        batch = loop.to_device(make(np.arange(start, min(start + batch_size, len(pairs)))), model.device)
        c, r = preference_data.sequence_logps(model, batch, preference_data.SCORE_CHUNK_TOKENS)
        chosen.append(c.float().cpu())
        rejected.append(r.float().cpu())
    chosen, rejected = torch.cat(chosen), torch.cat(rejected)
    metrics = {"preference_accuracy": round(float((chosen > rejected).float().mean()), 4), "preference_pairs": len(pairs)}
    if beta is not None:
        ref_chosen = torch.tensor([p.ref_chosen for p in pairs])
        ref_rejected = torch.tensor([p.ref_rejected for p in pairs])
        _, chosen_rewards, rejected_rewards = losses.preference_loss(chosen, rejected, ref_chosen, ref_rejected, beta=beta)
        rewards = losses.reward_metrics(chosen_rewards, rejected_rewards, chosen, rejected, ref_chosen)
        metrics |= {k: round(v, 6) for k, v in rewards.items()}
    return metrics


def general_text_rows(tokenizer, tokens: int, seq_len: int) -> np.ndarray:
    """The first `tokens` tokens (whole rows of `seq_len`) of CPython's documentation
    (`real_text.documentation`: the same documents in the same order for an interpreter), each
    document followed by EOS as `tokenize` separates them."""
    ids: list[int] = []
    for document in real_text.documentation():
        ids += tokenizer(document, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(ids) >= tokens:
            break
    rows = max(1, min(len(ids), tokens) // seq_len)
    return np.asarray(ids[: rows * seq_len], dtype=np.int64).reshape(rows, seq_len)


def causal_loss(model, rows: np.ndarray, params: EvaluateParams) -> float:
    """Mean next-token loss of `model` over packed `rows` (the first `eval_batches` batches)."""
    batches = packed.fixed_batches(rows, params.batch_size, params.eval_batches)
    if diffusion.objective_of(model) == "masked_diffusion":  # the NELBO bound per token (its perplexity: a bound)
        return objectives.nelbo_fn(objectives.chat_objective(model), batches, "fp32")(model)["val/loss"]
    # the head a chunk of tokens at a time: whole, a 150k vocabulary's fp32 logits of one batch of
    # 256-token rows took 15 GB at the Qwen2.5-0.5B shape (the same mean, up to float rounding)
    return loop.mean_loss(model, chunked_loss.causal(VAL_CHUNK_TOKENS), batches, model.device, "fp32")
