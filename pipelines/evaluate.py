"""Evaluate every trained model on the same held-out sets and compare them.

    python -m pipelines.evaluate       # what dvc.yaml runs; writes data/evaluate/ and
                                       # data/metrics/evaluate.json (DVC metrics, one entry per model)

For each model in `evaluate.models` (stage outputs `data/models/<stage>`), `evaluate.workers` at once:

- `val_loss`, `val_perplexity`: on the held-out pretraining text;
- `exact_match` (+ `exact_match_by_group`), `bleu` (sacrebleu, mean sentence BLEU, 0-100) and `rougeL`
  (rouge-score F-measure, mean over questions, 0-1) of greedy answers against the references:
  each held-out conversation (`data/prepared/chat/test.parquet`, else validation) is cut before
  its last assistant turn, rendered with the chat template and answered by greedy decoding;
  exact match compares after `chat.normalize_answer` (first line, trimmed, case-folded, no
  trailing punctuation). Every prediction goes to `data/evaluate/<model>/predictions.jsonl`;
- `preference_accuracy`: how often the model gives the chosen answer of a held-out preference pair
  (`data/ref_logprobs/test.parquet`) a higher summed log-probability than the rejected one;
- for a DPO policy (its directory holds `preference_config.json`): the implicit-reward metrics of
  TRL, `rewards/accuracies`, `rewards/margins`, ..., β·(policy − reference) on the same pairs.

Also written: `data/evaluate/comparison.csv` (one row per model; logged to MLflow as a table) and
`data/evaluate/plots/` (`loss_curves.png` from each model's `training_log.csv`/`eval_log.csv`,
`metrics.png` bars), which dvc.yaml declares as plots (`dvc plots show`).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from pipelines.core import losses, packed, plots, preference_data, stage, training
from pipelines.core.chat_template import normalize_answer, parse_messages, split_last_answer
from pipelines.core.config import EvaluateParams
from pipelines.core.errors import QllmError
from pipelines.core.models import load_for_inference, stop_token_ids
from pipelines.core.outputs import atomic_dir, read_json

NAME = "evaluate"
HELDOUT_PAIRS = "test.parquet"
"""The held-out preference pairs, in ref_logprobs' output directory."""
COMPARISON = "comparison.csv"
PLOTS = "plots"
COMPARED = ("exact_match", "bleu", "rougeL", "preference_accuracy", "val_loss", "val_perplexity", "rewards/accuracies", "rewards/margins")
"""The columns of the comparison table (those a model has)."""


def heldout_questions(chat_dir: Path, limit: int = 0) -> pd.DataFrame:
    """Held-out conversations (test split, else validation) as id / prompt messages / reference.

    A conversation is scored against its last turn, so one that does not end with an assistant
    turn has no reference answer: it is skipped with a warning that counts and names them
    (`ingest` already rejects such a chat in a `split: test` source), and a `QllmError` says so
    when no conversation is left.
    """
    import logging

    for split in ("test", "validation"):
        path = chat_dir / f"{split}.parquet"
        frame = pd.read_parquet(path)
        if len(frame):
            break
    else:
        raise QllmError(f"{chat_dir}: no held-out chat records (test and validation splits are empty)")
    rows, skipped = [], []
    for record in frame.itertuples(index=False):
        messages = parse_messages(record.messages)
        if messages and messages[-1]["role"] == "assistant":
            prompt, reference = split_last_answer(messages)
            rows.append({"id": record.id, "prompt": prompt, "reference": reference, "split": split})
        else:
            skipped.append(str(record.id))
    if skipped:
        shown = ", ".join(skipped[:10]) + (f", ... ({len(skipped) - 10} more)" if len(skipped) > 10 else "")
        logging.getLogger(f"qllm.{NAME}").warning(
            "%s: skipped %d of %d held-out chats that do not end with an assistant turn (no reference answer to score): %s",
            path, len(skipped), len(frame), shown,
        )  # fmt: skip
    if not rows:
        raise QllmError(
            f"{path}: none of the {len(frame)} held-out chats ends with an assistant turn, so there is no "
            "reference answer to score (each chat must end with the assistant's answer)"
        )
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
    stop = stop_token_ids(tokenizer)  # renders the template: once, not per batch
    model.eval()
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        encoded = tokenizer([texts[i] for i in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
        encoded = {k: v.to(model.device) for k, v in encoded.items()}
        output = model.generate(
            **encoded,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stop,
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


def text_similarity(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Mean sentence BLEU (sacrebleu, 0-100, effective n-gram order) and mean ROUGE-L F-measure
    (rouge-score, 0-1) over the answers.

    Held-out answers are one to three words: corpus BLEU-4 has no 4-grams to count and is 0 for
    every model, so each answer is scored with the n-gram orders it has (sacrebleu's
    `effective_order`, its recommended sentence-level setting) and the scores are averaged."""
    import sacrebleu
    from rouge_score import rouge_scorer

    if not predictions:
        return {"bleu": 0.0, "rougeL": 0.0}
    metric = sacrebleu.metrics.BLEU(effective_order=True)
    bleu = sum(metric.sentence_score(p, [r]).score for p, r in zip(predictions, references, strict=True)) / len(predictions)
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    rouge = sum(scorer.score(r, p)["rougeL"].fmeasure for p, r in zip(predictions, references, strict=True)) / len(predictions)
    return {"bleu": round(bleu, 4), "rougeL": round(rouge, 4)}


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
        batch = training.to_device(make(np.arange(start, min(start + batch_size, len(pairs)))), model.device)
        c, r = preference_data.sequence_logps(model, batch)
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


def evaluate_model(
    model_dir: Path, root: Path, tokenized: Path, questions: pd.DataFrame, out: Path, params: EvaluateParams, pairs: list[preference_data.Pair] = ()
) -> dict:
    """Metrics of one model; its predictions go to `out/predictions.jsonl`."""
    model, tokenizer = load_for_inference(model_dir, root)
    started = time.perf_counter()
    val_rows = packed.load(tokenized, "validation")
    batches = packed.fixed_batches(val_rows, params.batch_size, params.eval_batches)
    val_loss = training.mean_loss(model, training.causal_lm_loss, batches, model.device, "fp32")

    predictions = generate_answers(model, tokenizer, questions["prompt"].tolist(), params.max_new_tokens, params.batch_size)
    correct, by_group = exact_match_report(questions, predictions)
    similarity = text_similarity(predictions, questions["reference"].tolist())
    config_path = model_dir / preference_data.PREFERENCE_CONFIG
    beta = read_json(config_path)["beta"] if config_path.exists() else None
    preference = preference_metrics(model, list(pairs), tokenizer.pad_token_id, params.batch_size, beta)
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
        **similarity,
        **preference,
        "eval_seconds": round(seconds, 3),
    }


def run(root: Path, models_dir: Path, tokenized: Path, chat_dir: Path, out: Path, params: EvaluateParams, preferences: Path | None = None) -> dict[str, dict]:
    """`{model: metrics}` for every model in `params.models`; predictions under `out/<model>/`,
    the comparison table and plots under `out/`."""
    questions = heldout_questions(chat_dir, params.max_questions)
    pairs = preference_data.from_frame(pd.read_parquet(preferences)) if preferences is not None and preferences.exists() else []
    for name in params.models:
        if not (models_dir / name).exists():
            raise QllmError(f"{models_dir / name}: model of stage {name!r} not found (evaluate.models lists it)")
    with atomic_dir(out) as tmp:

        def one(name: str) -> dict:
            return evaluate_model(models_dir / name, root, tokenized, questions, tmp / name, params, pairs)

        with ThreadPoolExecutor(max_workers=params.workers) as pool:
            results = dict(zip(params.models, pool.map(one, params.models), strict=True))
        comparison(results).to_csv(tmp / COMPARISON, index=False)
        plots.loss_curves({name: models_dir / name for name in params.models}, tmp / PLOTS / "loss_curves.png")
        plots.metric_bars(results, [m for m in ("exact_match", "rougeL", "preference_accuracy") if any(m in r for r in results.values())],
                          tmp / PLOTS / "metrics.png")  # fmt: skip
    return results


def comparison(results: dict[str, dict]) -> pd.DataFrame:
    """One row per model, the metrics of `COMPARED` it has as columns."""
    columns = [c for c in COMPARED if any(c in r for r in results.values())]
    return pd.DataFrame([{"model": name, **{c: r.get(c) for c in columns}} for name, r in results.items()])


def body(ctx: stage.StageContext) -> dict:
    out = ctx.output()
    models_dir = {ctx.input(f"models/{name}").parent for name in ctx.params.models}  # each model a dvc.yaml dep
    if len(models_dir) != 1:
        raise QllmError(f"dvc.yaml: the models evaluate reads must share one directory, not {sorted(map(str, models_dir))}")
    results = run(ctx.root, models_dir.pop(), ctx.input("tokenized"), ctx.input("chat"), out, ctx.params, ctx.input("ref_logprobs") / HELDOUT_PAIRS)
    for name, metrics in results.items():
        ctx.tracker.log_artifact(out / name / "predictions.jsonl", f"predictions/{name}")
        ctx.log.info(
            "%s: val/loss %.4f (perplexity %.2f); exact match %.1f%%, BLEU %.1f, ROUGE-L %.3f on %d held-out questions%s",
            name, metrics["val_loss"], metrics["val_perplexity"], 100 * metrics["exact_match"], metrics["bleu"], metrics["rougeL"],
            metrics["questions"], f"; prefers chosen {100 * metrics['preference_accuracy']:.1f}%" if "preference_accuracy" in metrics else "",
        )  # fmt: skip
    ctx.tracker.log_table(pd.read_csv(out / COMPARISON), "comparison.json")
    ctx.tracker.log_artifacts(out / PLOTS, "plots")
    return results


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
