"""Every model of a run on the same held-out sets: one model's metrics and predictions
(`evaluate_model`), the multimodal model's (`evaluate_multimodal`), all of them with the comparison
table and plots (`evaluate_models`). The `evaluate` stage is this over its dvc.yaml inputs."""

from __future__ import annotations

import json
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import torch

from pipelines.core import paths
from pipelines.core.data import packed
from pipelines.core.errors import QllmError
from pipelines.core.evaluation import plots, retention, system_prompt
from pipelines.core.evaluation.bertscore import BertScore
from pipelines.core.evaluation.greedy import generate_answers
from pipelines.core.evaluation.heldout import answers_with_tools, called_correctly, heldout_questions
from pipelines.core.evaluation.scores import (
    causal_loss,
    exact_match_report,
    flexible_match_report,
    general_text_rows,
    preference_metrics,
    strict_match_report,
    text_similarity,
)
from pipelines.core.models.models import CONSTRUCTION, device, load_for_inference
from pipelines.core.outputs import atomic_dir, read_json
from pipelines.core.params.release import EvaluateParams
from pipelines.core.preference import preference_data

HELDOUT_PAIRS = "test.parquet"
"""The held-out preference pairs, in ref_logprobs' output directory."""
COMPARISON = "comparison.csv"
MULTIMODAL = "multimodal"
"""The multimodal stage's model directory, next to the others."""
PLOTS = "plots"
VALIDATION_PREDICTIONS = "validation_predictions.jsonl"
GENERAL_PREDICTIONS = "general_predictions.jsonl"
COMPARED = ("exact_match", "flexible_match", "strict_match", "retention_loss", "form_kept", *system_prompt.CELLS, "bleu", "rougeL", "bertscore_f1", "tool_calls_correct", "preference_accuracy", "val_loss", "val_perplexity", "general_perplexity", "rewards/accuracies", "rewards/margins")
"""The columns of the comparison table (those a model has)."""


def evaluate_model(
    model_dir: Path, root: Path, tokenized: Path, questions: pd.DataFrame, out: Path, params: EvaluateParams, pairs: list[preference_data.Pair] = (),
    bertscore: BertScore | None = None, validation: pd.DataFrame | None = None, reference: tuple[list[dict], dict] | None = None,
) -> dict:
    """Metrics of one model; its predictions go to `out/predictions.jsonl`. With `validation`
    questions, their scores too, under `validation` (predictions: `out/validation_predictions.jsonl`).
    With the base's `reference` answers (`retention.read_reference`), the retention measure:
    `retention_loss` and `form_kept` on the test third of the general prompts (the validation third's
    under `validation` too), the model's own answers in `out/general_predictions.jsonl`."""
    model, tokenizer = load_for_inference(model_dir, root)
    started = time.perf_counter()
    val_rows = packed.load(tokenized, "validation")
    val_loss = causal_loss(model, val_rows, params)
    general = {}
    if params.general_text_tokens:
        general_loss = causal_loss(model, general_text_rows(tokenizer, params.general_text_tokens, val_rows.shape[1]), params)
        general = {"general_loss": round(general_loss, 6), "general_perplexity": round(math.exp(min(general_loss, 50.0)), 4)}

    generating = time.perf_counter()
    answered = _answered(model, tokenizer, questions, params, paths.named(model_dir, root))
    generate_seconds = time.perf_counter() - generating
    predictions = answered.pop("predictions")
    similarity = text_similarity(predictions, questions["reference"].tolist())
    if bertscore is not None:
        similarity |= bertscore.metrics(predictions, questions["reference"].tolist(), params.batch_size)
    config_path = model_dir / preference_data.PREFERENCE_CONFIG
    trained = read_json(config_path) if config_path.exists() else {}
    beta = trained["beta"] if trained.get("reference") else None  # the reference-free methods have no implicit reward β·(π − ref)
    preference = preference_metrics(model, list(pairs), tokenizer.pad_token_id, params.batch_size, beta)
    chosen_on, retained, general_rows = {}, {}, []
    if reference is not None:
        retained, general_rows = _retained(model, tokenizer, reference, "test", params.batch_size)
    if model_dir.name in params.system_prompt_models:  # evaluate_models saw to the reference
        retained |= system_prompt.two_by_two(model, tokenizer, questions, predictions, reference, [row["answer"] for row in general_rows], "test",
                                             params.max_new_tokens, params.batch_size, "evaluate.system_prompt_models")  # fmt: skip
    if validation is not None:  # the validation split: what settings are chosen on
        chosen_on = _answered(model, tokenizer, validation, params, paths.named(model_dir, root))
        _write_predictions(out / VALIDATION_PREDICTIONS, validation, chosen_on.pop("predictions"), chosen_on.pop("rows"))
        if reference is not None:
            kept, rows = _retained(model, tokenizer, reference, "validation", params.batch_size)
            chosen_on |= kept
            general_rows += rows
        chosen_on = {"validation": chosen_on}
    if general_rows:
        out.mkdir(parents=True, exist_ok=True)
        (out / GENERAL_PREDICTIONS).write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in general_rows), encoding="utf-8")
    seconds = time.perf_counter() - started
    _write_predictions(out / "predictions.jsonl", questions, predictions, answered.pop("rows"))
    return {
        "val_loss": round(val_loss, 6),
        "val_perplexity": round(math.exp(min(val_loss, 50.0)), 4),
        **general,
        **answered,
        **retained,
        **similarity,
        **preference,
        **chosen_on,
        "eval_seconds": round(seconds, 3),
        "seconds_per_question": round(generate_seconds / max(1, len(predictions)), 4),  # batched greedy generation
    }


def _answered(model, tokenizer, questions: pd.DataFrame, params: EvaluateParams, model_name: str) -> dict:
    """Greedy answers to `questions` and their scores: exact, flexible and strict match with their
    breakdown by group, the tool metrics; `predictions` and per-question `rows` for the predictions file."""
    predictions, transcripts = answers_with_tools(model, tokenizer, questions["prompt"].tolist(), params, model_name=model_name,
                                                  ids=questions["id"].tolist())  # fmt: skip
    episodes_run = [t for t in transcripts if t is not None]
    tool_metrics = {"tool_questions": len(episodes_run), "tool_calls_correct": round(sum(map(called_correctly, episodes_run)) / len(episodes_run), 4)} if episodes_run else {}
    correct, exact_by_group = exact_match_report(questions, predictions)
    flexible, flexible_by_group = flexible_match_report(questions, predictions)
    strict, strict_by_group = strict_match_report(questions, predictions)
    rows = [{"correct": ok, "flexible": loose, "strict": tight, **({"episode": episode} if episode is not None else {})}
            for ok, loose, tight, episode in zip(correct, flexible, strict, transcripts, strict=True)]  # fmt: skip
    return {
        "exact_match": round(sum(correct) / max(1, len(correct)), 4),
        "questions": len(correct),
        "exact_match_by_group": exact_by_group,
        "flexible_match": round(sum(flexible) / max(1, len(flexible)), 4),
        "flexible_match_by_group": flexible_by_group,
        "strict_match": round(sum(strict) / max(1, len(strict)), 4),
        "strict_match_by_group": strict_by_group,
        **tool_metrics,
        "predictions": predictions,
        "rows": rows,
    }


def _retained(model, tokenizer, reference: tuple[list[dict], dict], split: str, batch_size: int) -> tuple[dict, list[dict]]:
    """The retention measure on one third of the general prompts: the model's mean NLL of the base's
    answers minus the base's own (`retention_loss`, nats/token), and of the prompts whose base
    answer has a form, the share the model's greedy answer keeps (`form_kept`; `form_counted`
    prompts); the rows of `general_predictions.jsonl`."""
    rows, meta = reference
    chosen = [row for row in rows if row["split"] == split]
    messages = retention.messages_of(chosen)
    base = [row["answer"] for row in chosen]
    nll = retention.answer_nll(model, tokenizer, messages, base, batch_size)
    answers = generate_answers(model, tokenizer, messages, meta["max_new_tokens"], batch_size)
    kept, counted = retention.form_kept(base, answers)
    predictions = [{"id": row["id"], "split": split, "base_form": row["form"], "form": retention.form_of(text), "answer": text}
                   for row, text in zip(chosen, answers, strict=True)]  # fmt: skip
    return {"retention_loss": round(retention.retention_loss(nll, meta["nll"][split]), 6), "form_kept": None if kept is None else round(kept, 4),
            "form_counted": counted}, predictions  # fmt: skip


def _write_predictions(path: Path, questions: pd.DataFrame, predictions: list[str], rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for question, prediction, row in zip(questions.itertuples(index=False), predictions, rows, strict=True):
            record = {"id": question.id, "prompt": question.prompt[-1]["content"], "reference": question.reference, "prediction": prediction, **row}
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def evaluate_multimodal(model_dir: Path, image_dir: Path, out: Path, params: EvaluateParams) -> dict:
    """The multimodal model's metrics on the held-out image questions (see the module docstring)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from pipelines.core.models import vision

    chats = vision.read_chats(image_dir, "test")
    if params.max_questions:
        chats = chats[: params.max_questions]
    with CONSTRUCTION:
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
        processor = AutoProcessor.from_pretrained(model_dir)
    started = time.perf_counter()
    metrics = vision.evaluate(model.to(device()), processor, chats, max_new_tokens=params.max_new_tokens, batch_size=params.batch_size, device=device())
    rows = metrics.pop("rows", [])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "predictions.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    renamed = {"image_questions": "questions", "image_exact_match": "exact_match"}
    return {renamed.get(k, k): v for k, v in metrics.items()} | {"eval_seconds": round(time.perf_counter() - started, 3)}


def switched_off(model_dir: Path) -> bool:
    """Whether a stage's model directory holds only the README of a stage its params switch off
    (`grpo.enabled: false`: `stage.placeholder`), no model."""
    return {p.name for p in model_dir.iterdir()} == {"README.md"}


def evaluate_models(root: Path, models_dir: Path, tokenized: Path, chat_dir: Path, out: Path, params: EvaluateParams, preferences: Path | None = None,
        image_dir: Path | None = None, base_answers: Path | None = None) -> dict[str, dict]:  # fmt: skip
    """`{model: metrics}` for every model in `params.models` (and `multimodal` when `models_dir/multimodal`
    holds a model and `image_dir` is given); predictions under `out/<model>/`, the comparison table and
    plots under `out/`. `base_answers`: a `base_answers` output; where it holds the base's answers
    (a run with a base model), every model's retention measure too."""
    from pipelines.core.models import vision
    questions = heldout_questions(chat_dir, params.max_questions)
    validation = None
    if params.validation:
        try:
            validation = heldout_questions(chat_dir, splits=("validation",))
        except QllmError as exc:
            raise QllmError(f"evaluate.validation is true, but {exc} (the sample writes validation people with "
                            "sample_data.validation_entity_fraction > 0; ingest chat_validation.jsonl with split: validation)") from None  # fmt: skip
    reference = retention.read_reference(base_answers) if base_answers is not None else None
    if params.system_prompt_models:
        if reference is None:
            raise QllmError(f"evaluate.system_prompt_models ({', '.join(params.system_prompt_models)}): the 2x2 compares the general prompts' "
                            "answers with the base model's, and this run has no base model (base_model.name is null); set it to []")  # fmt: skip
        system_prompt.system_of(questions, f"evaluate.system_prompt_models, the held-out questions of {chat_dir}")
    bertscore = BertScore(params.bertscore_model, root, params.bertscore_layer) if params.bertscore_model else None
    pairs = preference_data.from_frame(pd.read_parquet(preferences)) if preferences is not None and preferences.exists() else []
    for name in params.models:
        if not (models_dir / name).exists():
            raise QllmError(f"{models_dir / name}: model of stage {name!r} not found (evaluate.models lists it)")
    models = [name for name in params.models if not switched_off(models_dir / name)]
    if skipped := sorted(set(params.models) - set(models)):
        logging.getLogger("qllm.evaluate").info("not evaluated: %s (switched off: the stage wrote only its README)", ", ".join(skipped))
    if not models:
        raise QllmError(f"{models_dir}: none of evaluate.models ({', '.join(params.models)}) holds a trained model")
    with atomic_dir(out) as tmp:

        def one(name: str) -> dict:
            return evaluate_model(models_dir / name, root, tokenized, questions, tmp / name, params, pairs, bertscore, validation, reference)

        with ThreadPoolExecutor(max_workers=params.workers) as pool:
            results = dict(zip(models, pool.map(one, models), strict=True))
        comparison(results).to_csv(tmp / COMPARISON, index=False)
        plots.loss_curves({name: models_dir / name for name in models}, tmp / PLOTS / "loss_curves.png")
        plots.metric_bars(results, [m for m in ("exact_match", "rougeL", "preference_accuracy") if any(m in r for r in results.values())],
                          tmp / PLOTS / "metrics.png")  # fmt: skip
        if image_dir is not None and vision.trained(models_dir / MULTIMODAL):
            results[MULTIMODAL] = evaluate_multimodal(models_dir / MULTIMODAL, image_dir, tmp / MULTIMODAL, params)
    return results


def comparison(results: dict[str, dict]) -> pd.DataFrame:
    """One row per model, the metrics of `COMPARED` it has as columns."""
    columns = [c for c in COMPARED if any(c in r for r in results.values())]
    return pd.DataFrame([{"model": name, **{c: r.get(c) for c in columns}} for name, r in results.items()])
