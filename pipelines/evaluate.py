"""Evaluate every trained model on the same held-out sets and compare them: the stage over the
evaluation library (`pipelines.core.evaluation`: `answers`, `scores`, `bertscore`, `report`).

    python -m pipelines.evaluate       # what dvc.yaml runs; writes data/evaluate/ and
                                       # data/metrics/evaluate.json (DVC metrics, one entry per model)

For each model in `evaluate.models` (stage outputs `data/models/<stage>`), `evaluate.workers` at once:

- `val_loss`, `val_perplexity`: on the held-out pretraining text; with `evaluate.general_text_tokens`,
  `general_loss`, `general_perplexity` on real text the sample never shows (CPython's documentation):
  what fine-tuning costs the model outside the task;
- `exact_match` (+ `exact_match_by_group`), `flexible_match` (+ `_by_group`: the reference found in
  a free-form answer, lm-eval's "flexible extract": the last number for a numeric reference, the
  reference's words in the first line otherwise; `chat_template.flexible_match`), `bleu` (sacrebleu, mean sentence BLEU, 0-100) and `rougeL`
  (rouge-score F-measure, mean over questions, 0-1) of greedy answers against the references:
  each held-out conversation (`data/prepared/chat/test.parquet`, else validation) is cut before
  its last assistant turn, rendered with the chat template and answered by greedy decoding;
  exact match compares after `chat.normalize_answer` (first line, trimmed, case-folded, no
  trailing punctuation). Every prediction goes to `data/evaluate/<model>/predictions.jsonl`;
- with `evaluate.tools.functions` set, a question whose chat offers tools is answered by a greedy
  episode instead (`episodes.run`: the model's calls run, their results read, each turn up to
  `max_new_tokens`) and its last turn is the answer scored; `tool_questions` counts them and
  `tool_calls_correct` is the share whose episode called a tool, every call parsed, named an offered
  tool and returned without error; each episode's turns go to predictions.jsonl (`episode`);
- `bertscore_f1` (+ `_precision`, `_recall`), with `evaluate.bertscore_model` set: BERTScore of the
  same answers against the references with that local encoder (`BertScore`), mean over questions;
- `preference_accuracy`: how often the model gives the chosen answer of a held-out preference pair
  (`data/ref_logprobs/test.parquet`) a higher summed log-probability than the rejected one;
- for a policy trained with a reference (its directory holds `preference_config.json`; dpo.method
  dpo or kto): the implicit-reward metrics of TRL, `rewards/accuracies`, `rewards/margins`, ...,
  β·(policy − reference) on the same pairs (orpo and simpo have no reference: no such metrics).

When the multimodal stage ran (`data/models/multimodal` holds a model), an entry `multimodal` too,
on the held-out image questions (`data/prepared/image_chat/test.parquet`; `pipelines.core.models.vision.evaluate`):
`exact_match` of the greedy answers, `image_answer_loss` with each question's own image and
`shuffled_image_answer_loss` with another question's image (a seeded derangement), their difference
`image_loss_gap` (how much the image matters) and `image_loss_right_lower_fraction`; its predictions go to
`data/evaluate/multimodal/predictions.jsonl`. It is not a row of the text comparison.

Also written: `data/evaluate/comparison.csv` (one row per model; logged to MLflow as a table) and
`data/evaluate/plots/` (`loss_curves.png` from each model's `training_log.csv`/`eval_log.csv`,
`metrics.png` bars), which dvc.yaml declares as plots (`dvc plots show`).
"""

from __future__ import annotations

import pandas as pd

from pipelines.core.errors import QllmError
from pipelines.core.evaluation.report import COMPARISON, HELDOUT_PAIRS, PLOTS, evaluate_models
from pipelines.core.run import stage

NAME = "evaluate"


def body(ctx: stage.StageContext) -> dict:
    out = ctx.output()
    models_dir = {ctx.input(f"models/{name}").parent for name in ctx.params.models}  # each model a dvc.yaml dep
    if len(models_dir) != 1:
        raise QllmError(f"dvc.yaml: the models evaluate reads must share one directory, not {sorted(map(str, models_dir))}")
    if ctx.params.bertscore_model:
        ctx.log.info("BERTScore with %s, layer %s: its files are not a dvc.yaml dependency (DVC reruns evaluate when the param changes, "
                     "not when the files do)", ctx.params.bertscore_model, "last" if ctx.params.bertscore_layer is None else ctx.params.bertscore_layer)  # fmt: skip
    models_dir = models_dir.pop()
    if ctx.input("models/multimodal").parent != models_dir:
        raise QllmError(f"dvc.yaml: evaluate reads the multimodal model from {ctx.input('models/multimodal')}, outside {models_dir}")
    results = evaluate_models(ctx.root, models_dir, ctx.input("tokenized"), ctx.input("chat"), out, ctx.params, ctx.input("ref_logprobs") / HELDOUT_PAIRS,
                              ctx.input("image_chat"), ctx.input("base_answers"))  # fmt: skip
    image = results.pop("multimodal", None)
    if image is not None:
        ctx.tracker.log_artifact(out / "multimodal" / "predictions.jsonl", "predictions/multimodal")
        ctx.log.info("multimodal: exact match %.1f%% on %d held-out image questions; answer loss %.4f with the right image, %.4f with a "
                     "shuffled one (gap %.4f)", 100 * image["exact_match"], image["questions"], image["image_answer_loss"],
                     image["shuffled_image_answer_loss"], image["image_loss_gap"])  # fmt: skip
    for name, metrics in results.items():
        ctx.tracker.log_artifact(out / name / "predictions.jsonl", f"predictions/{name}")
        ctx.log.info(
            "%s: val/loss %.4f (perplexity %.2f); exact match %.1f%% (flexible %.1f%%), BLEU %.1f, ROUGE-L %.3f%s on %d held-out questions%s",
            name, metrics["val_loss"], metrics["val_perplexity"], 100 * metrics["exact_match"], 100 * metrics["flexible_match"], metrics["bleu"],
            metrics["rougeL"],
            f", BERTScore F1 {metrics['bertscore_f1']:.3f}" if "bertscore_f1" in metrics else "",
            metrics["questions"], f"; prefers chosen {100 * metrics['preference_accuracy']:.1f}%" if "preference_accuracy" in metrics else "",
        )  # fmt: skip
    ctx.tracker.log_table(pd.read_csv(out / COMPARISON), "comparison.json")
    ctx.tracker.log_artifacts(out / PLOTS, "plots")
    return results | ({"multimodal": image} if image is not None else {})


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
