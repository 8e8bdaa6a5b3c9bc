"""Merge the trained models in weight space, and keep the merge that does best on the validation split.

    python -m pipelines.merge          # what dvc.yaml runs; writes data/models/merge/
    qllm run --set merge.seed=1        # other DARE masks: reruns merge (and what reads it, if its output changes)

Each of `merge.candidates` (at most 6) names a method and the models it combines
(`pipelines.core.models.merging` has the formulas): `linear` averages models' weights (WiSE-FT:
`[pretrain, sft]` with weights `[1−α, α]`); `task_arithmetic`, `ties`, `dare` and `dare_ties` add
the models' deltas to the pretrained model, τ_sft = θ_sft − θ_pretrain, τ_lora = θ_lora − θ_pretrain
(the adapter merged into its base: an unmerged adapter is merged here), τ_dpo = θ_dpo − θ_sft
(θ_pretrain with `dpo.start: base`), τ_grpo = θ_grpo − θ_sft. `base` (with a base model) is the model
`base_model.name` loads, before continued pretraining.

Every candidate, and every model it reads, is scored on the validation split, never the test split:

- `strict_match` (+ `_by_group`, and `exact_match`): greedy answers (`merge.max_new_tokens`) to the
  validation chats' questions (the sample's validation people and sums), scored as `evaluate` scores
  them;
- `retention_loss`, with a base model: the mean per-token NLL of the base's own answers to the
  validation third of the general prompts (data/base_answers) under the model, minus the base's.

The choice: of the candidates whose retention loss is at most `merge.max_retention_loss`, the best
strict match (ties: the lower retention loss, then the first listed); if none is, the lowest
retention loss. Without a base model there is no retention measure: the best strict match (ties: the
first listed), and the metrics say so. The chosen merge is written as a `save_pretrained` model
directory (the SFT model's configuration and tokenizer, its weights merged), with `candidates.json`
(every candidate's and model's scores, the rule, the choice) and `tradeoff.png` (facts against
retention, one point each, the chosen one ringed), which also go to MLflow. With
`merge.enabled: false` the stage writes a README and evaluate skips it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from pipelines.core.errors import QllmError
from pipelines.core.evaluation import plots, retention
from pipelines.core.evaluation.greedy import generate_answers
from pipelines.core.evaluation.heldout import heldout_questions
from pipelines.core.evaluation.scores import exact_match_report, strict_match_report
from pipelines.core.models import merging, model_source
from pipelines.core.models.models import CONSTRUCTION, load_causal_lm, load_for_inference, save_pretrained
from pipelines.core.outputs import atomic_dir, write_json
from pipelines.core.params.release import MergeParams
from pipelines.core.paths import project_root
from pipelines.core.run import stage

NAME = "merge"
ORDER = ("base", "pretrain", "sft", "lora", "dpo", "grpo")
"""The models merge can read, in the pipeline's order (the order they are loaded and shown)."""
PARENTS = {"sft": "pretrain", "lora": "pretrain", "dpo": "sft", "grpo": "sft"}
"""The model each delta is taken from (τ_m = θ_m − θ_parent); dpo's follows `dpo.start` (`DPO_STARTS`)."""
DPO_STARTS = {"sft": "sft", "base": "pretrain"}
ANCHOR = "pretrain"
"""What the deltas are added to."""
CARRIER = "sft"
"""The model whose configuration and tokenizer the merged model is written with (and scored in)."""
CANDIDATES_FILE = "candidates.json"
PICTURE = "tradeoff.png"
DISABLED_README = """# Merging switched off

`merge.enabled` is false: no merge was made, and evaluate skips this directory. With it on, this
directory holds the merge of the trained models that did best on the validation split, its
candidates' scores (`candidates.json`) and their picture (`tradeoff.png`); docs/fine-tuning.md "Merging".
"""


def needed(params: MergeParams, parents: dict[str, str]) -> list[str]:
    """The models the candidates read (their own, and for deltas the anchor and each one's parent)
    and the carrier, in `ORDER`."""
    names = {CARRIER}
    for candidate in params.candidates:
        names |= set(candidate.models)
        if candidate.method != "linear":
            names |= {ANCHOR, *(parents[m] for m in candidate.models)}
    return [name for name in ORDER if name in names]


def score(model, tokenizer, questions: pd.DataFrame, reference: tuple[list[dict], dict] | None, params: MergeParams) -> dict:
    """A model's validation scores: strict and exact match of its greedy answers to `questions`, and
    with the base's `reference` answers its retention loss on the validation third of the prompts."""
    answers = generate_answers(model, tokenizer, questions["prompt"].tolist(), params.max_new_tokens, params.batch_size)
    strict, strict_by_group = strict_match_report(questions, answers)
    exact, _ = exact_match_report(questions, answers)
    scores = {"strict_match": round(sum(strict) / len(strict), 4), "strict_match_by_group": strict_by_group, "exact_match": round(sum(exact) / len(exact), 4)}
    if reference is not None:
        rows, meta = reference
        chosen = [row for row in rows if row["split"] == "validation"]
        nll = retention.answer_nll(model, tokenizer, retention.messages_of(chosen), [row["answer"] for row in chosen], params.batch_size)
        scores["retention_loss"] = round(retention.retention_loss(nll, meta["nll"]["validation"]), 6)
    return scores


def choose(rows: list[dict], max_retention_loss: float) -> tuple[int, str]:
    """The index of the chosen candidate among `rows` (each with `strict_match`, and
    `retention_loss` where there is a base model) and the rule that chose it (see the module docstring)."""
    order = range(len(rows))
    if any(row.get("retention_loss") is None for row in rows):
        best = max(order, key=lambda i: (rows[i]["strict_match"], -i))
        return best, "the best validation strict match (no base model: no retention measure, chosen on facts alone)"
    within = [i for i in order if rows[i]["retention_loss"] <= max_retention_loss]
    if within:
        best = max(within, key=lambda i: (rows[i]["strict_match"], -rows[i]["retention_loss"], -i))
        return best, f"the best validation strict match among the candidates with a retention loss of at most {max_retention_loss:g}"
    best = min(order, key=lambda i: (rows[i]["retention_loss"], -rows[i]["strict_match"], i))
    return best, f"no candidate has a retention loss of at most {max_retention_loss:g}: the lowest retention loss"


def _settings(candidate) -> dict:
    """The candidate's settings as the table shows them: only those its method reads."""
    keys = {"ties": ("density", "scale"), "dare": ("drop_rate",), "dare_ties": ("drop_rate",)}.get(candidate.method, ())
    return {"method": candidate.method, "models": list(candidate.models), "weights": candidate.weight_list(), **{k: getattr(candidate, k) for k in keys}}


def run(root: Path, model_dirs: dict[str, Path], base: Path | None, chat_dir: Path, base_answers: Path, out: Path, params: MergeParams,
        parents: dict[str, str], log: logging.Logger | None = None) -> dict:  # fmt: skip
    """Merge and score every candidate, write the chosen one to `out` (with `candidates.json` and
    `tradeoff.png`); the table and the choice as metrics. `model_dirs`: each stage's model directory
    by name; `base`: where the base model loads from (None without a base model)."""
    log = log or logging.getLogger("qllm.merge")
    try:
        questions = heldout_questions(chat_dir, splits=("validation",))
    except QllmError as exc:
        raise QllmError(f"merge chooses on the validation split, but {exc} (sample_data.validation_entity_fraction > 0 writes validation "
                        "people; prepare_data.validation_fraction sets chats aside; ingest chat_validation.jsonl with split: validation)") from None  # fmt: skip
    reference = retention.read_reference(base_answers)
    states, carrier, tokenizer = {}, None, None
    for name in needed(params, parents):
        if name == "base":
            if base is None:
                raise QllmError("merge: a candidate names base, and this run has no base model (base_model.name is null)")
            with CONSTRUCTION:
                model = load_causal_lm(base)
        else:
            model, loaded_tokenizer = load_for_inference(model_dirs[name], root)
            if name == CARRIER:
                carrier, tokenizer = model, loaded_tokenizer
        states[name] = merging.parameters(model, name)
        del model
    merging.check_compatible(states)
    carrier.eval()

    models = []
    for name, state in states.items():
        merging.load_into(carrier, state)
        models.append({"model": name, **score(carrier, tokenizer, questions, reference, params)})
        log.info("merge: %s scores %s", name, _shown(models[-1]))
    candidates = []
    for index, candidate in enumerate(params.candidates, start=1):
        merging.load_into(carrier, merging.merge(candidate, states, parents, ANCHOR, params.seed))
        candidates.append({"candidate": index, "label": candidate.label(), **_settings(candidate),
                           **score(carrier, tokenizer, questions, reference, params)})  # fmt: skip
        log.info("merge: #%d %s scores %s", index, candidate.label(), _shown(candidates[-1]))
    chosen, rule = choose(candidates, params.max_retention_loss)
    for row in candidates:
        row["chosen"] = row["candidate"] == chosen + 1
    table = {"rule": rule, "chosen": chosen + 1, "chosen_label": candidates[chosen]["label"], "retention_measured": reference is not None,
             "validation_questions": len(questions), "candidates": candidates, "models": models}  # fmt: skip

    merging.load_into(carrier, merging.merge(params.candidates[chosen], states, parents, ANCHOR, params.seed))  # the same bytes again
    points = [{"label": r["model"], "kind": "model", "strict_match": r["strict_match"], "retention_loss": r.get("retention_loss")} for r in models]
    points += [{"label": r["label"], "kind": "candidate", "strict_match": r["strict_match"], "retention_loss": r.get("retention_loss"),
                "chosen": r["chosen"]} for r in candidates]  # fmt: skip
    with atomic_dir(out) as tmp:
        save_pretrained(carrier, tokenizer, tmp)
        write_json(tmp / CANDIDATES_FILE, table)
        plots.tradeoff(points, tmp / PICTURE, params.max_retention_loss if reference is not None else None)
    log.info("merge: chose #%d %s (%s)", chosen + 1, candidates[chosen]["label"], rule)
    best = candidates[chosen]
    return {**table, "strict_match": best["strict_match"], **({"retention_loss": best["retention_loss"]} if reference is not None else {})}


def _shown(row: dict) -> str:
    return f"strict match {row['strict_match']:.4f}" + (f", retention loss {row['retention_loss']:.4f}" if "retention_loss" in row else "")


def body(ctx: stage.StageContext) -> dict:
    params = ctx.params
    if not params.enabled:
        return stage.switched_off(ctx, DISABLED_README)
    parents = {**PARENTS, "dpo": DPO_STARTS[ctx.param("dpo.start")]}
    names = needed(params, parents)
    base = None
    if "base" in names:
        record = model_source.current(ctx.root)
        base = model_source.location(record, project_root(ctx.root)) if record["name"] is not None else None
    model_dirs = {name: ctx.input(f"models/{name}") for name in names if name != "base"}
    out = ctx.output()
    metrics = run(ctx.root, model_dirs, base, ctx.input("chat"), ctx.input("base_answers"), out, params, parents, ctx.log)
    ctx.tracker.log_artifact(out / PICTURE, "plots")
    ctx.tracker.log_artifact(out / CANDIDATES_FILE)
    flat = [{k: ", ".join(map(str, v)) if isinstance(v, list) else v for k, v in row.items() if not isinstance(v, dict)} for row in metrics["candidates"]]
    ctx.tracker.log_table(pd.DataFrame(flat), "candidates_table.json")  # MLflow's table view: one row per candidate
    return {"enabled": True, **metrics}


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
