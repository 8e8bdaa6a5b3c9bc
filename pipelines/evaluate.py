"""Evaluate every trained model on the same held-out sets.

    python -m pipelines.evaluate       # what dvc.yaml runs; writes data/evaluate/<model>/ and
                                       # data/metrics/evaluate.json (DVC metrics, one entry per model)

For each model in `evaluate.models` (stage outputs `data/models/<stage>`): validation loss and
perplexity on the held-out pretraining text, and greedy exact-match accuracy on held-out questions.

Exact match: each held-out conversation (`data/prepared/chat/test.parquet`, else validation) is
cut before its last assistant turn, rendered with the chat template, answered by greedy decoding,
and compared with the reference after `chat.normalize_answer` (first line, trimmed, case-folded,
no trailing punctuation). Every prediction is written to `data/evaluate/predictions.jsonl`.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import defaultdict
from pathlib import Path

import pandas as pd
import torch

from pipelines import packed, stage, training
from pipelines.chat import normalize_answer, parse_messages, split_last_answer
from pipelines.config import EvaluateParams
from pipelines.errors import QllmError
from pipelines.models import load_for_inference, stop_token_ids
from pipelines.outputs import atomic_dir

NAME = "evaluate"
MODELS = "data/models"
TOKENIZED = "data/tokenized"
CHAT = "data/prepared/chat"
OUT = "data/evaluate"


def heldout_questions(chat_dir: Path, limit: int = 0) -> pd.DataFrame:
    """Held-out conversations (test split, else validation) as id / prompt messages / reference."""
    for split in ("test", "validation"):
        frame = pd.read_parquet(chat_dir / f"{split}.parquet")
        if len(frame):
            break
    else:
        raise QllmError(f"{chat_dir}: no held-out chat records (test and validation splits are empty)")
    rows = []
    for record in frame.itertuples(index=False):
        messages = parse_messages(record.messages)
        if messages and messages[-1]["role"] == "assistant":
            prompt, reference = split_last_answer(messages)
            rows.append({"id": record.id, "prompt": prompt, "reference": reference, "split": split})
    questions = pd.DataFrame(rows)
    return questions.head(limit) if limit else questions


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, batch_size: int) -> list[str]:
    """Greedy answers to chat prompts, batched with left padding, cut at `<|im_end|>`/EOS."""
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    # Similar lengths together: less padding per batch. Answers are put back in input order.
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    answers: list[str] = [""] * len(texts)
    model.eval()
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        encoded = tokenizer([texts[i] for i in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
        encoded = {k: v.to(model.device) for k, v in encoded.items()}
        output = model.generate(
            **encoded,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stop_token_ids(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
        )
        new_tokens = output[:, encoded["input_ids"].shape[1] :]
        for index, text in zip(chunk, tokenizer.batch_decode(new_tokens, skip_special_tokens=True), strict=True):
            answers[index] = text.strip()
    return answers


def group_of(example_id: str) -> str:
    """Ids like `heldout-fact-city-7` are grouped as `heldout-fact-city` in the breakdown."""
    return re.sub(r"-\d+$", "", example_id)


def exact_match_report(questions: pd.DataFrame, predictions: list[str]) -> tuple[list[bool], dict[str, float]]:
    correct = [normalize_answer(p) == normalize_answer(r) for p, r in zip(predictions, questions["reference"], strict=True)]
    groups: dict[str, list[bool]] = defaultdict(list)
    for example_id, ok in zip(questions["id"], correct, strict=True):
        groups[group_of(example_id)].append(ok)
    by_group = {g: round(sum(v) / len(v), 4) for g, v in sorted(groups.items())}
    return correct, by_group


def evaluate_model(model_dir: Path, root: Path, tokenized: Path, questions: pd.DataFrame, out: Path, params: EvaluateParams) -> dict:
    """Metrics of one model; its predictions go to `out/predictions.jsonl`."""
    model, tokenizer = load_for_inference(model_dir, root)
    started = time.perf_counter()
    val_rows = packed.load(tokenized, "validation")
    batches = packed.fixed_batches(val_rows, params.batch_size, params.eval_batches)
    val_loss = training.mean_loss(model, training.causal_lm_loss, batches, model.device, "fp32")

    predictions = generate_answers(model, tokenizer, questions["prompt"].tolist(), params.max_new_tokens, params.batch_size)
    correct, by_group = exact_match_report(questions, predictions)
    seconds = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "predictions.jsonl", "w", encoding="utf-8") as handle:
        for row, prediction, ok in zip(questions.itertuples(index=False), predictions, correct, strict=True):
            record = {"id": row.id, "prompt": row.prompt[-1]["content"], "reference": row.reference, "prediction": prediction, "correct": ok}
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return {
        "val_loss": round(val_loss, 6),
        "val_perplexity": round(math.exp(min(val_loss, 50.0)), 4),
        "exact_match": round(sum(correct) / max(1, len(correct)), 4),
        "questions": len(correct),
        "exact_match_by_group": by_group,
        "eval_seconds": round(seconds, 3),
    }


def run(root: Path, models_dir: Path, tokenized: Path, chat_dir: Path, out: Path, params: EvaluateParams) -> dict[str, dict]:
    """`{model: metrics}` for every model in `params.models`, predictions under `out/<model>/`."""
    questions = heldout_questions(chat_dir, params.max_questions)
    results = {}
    with atomic_dir(out) as tmp:
        for name in params.models:
            model_dir = models_dir / name
            if not model_dir.exists():
                raise QllmError(f"{model_dir}: model of stage {name!r} not found (evaluate.models lists it)")
            results[name] = evaluate_model(model_dir, root, tokenized, questions, tmp / name, params)
    return results


def _body(ctx: stage.StageContext) -> dict:
    results = run(ctx.root, ctx.path(MODELS), ctx.path(TOKENIZED), ctx.path(CHAT), ctx.path(OUT), ctx.params)
    for name, metrics in results.items():
        ctx.tracker.log_artifact(ctx.path(OUT) / name / "predictions.jsonl", f"predictions/{name}")
        ctx.log.info(
            "%s: val/loss %.4f (perplexity %.2f); exact match %.1f%% on %d held-out questions",
            name, metrics["val_loss"], metrics["val_perplexity"], 100 * metrics["exact_match"], metrics["questions"],
        )
    return results


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, _body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
