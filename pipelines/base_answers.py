"""The base model's own answers to the general prompts: the reference of the retention measure.

    python -m pipelines.base_answers   # what dvc.yaml runs; writes data/base_answers/

With a base model (`base_model.name`), the model that name loads (before continued pretraining)
answers every prompt of `pipelines/core/evaluation/general_prompts.jsonl` (six families, split into
train, validation and test thirds; no system message) by greedy decoding of at most
`base_answers.max_new_tokens` tokens, in fp32. The output holds:

- `answers.jsonl`: per prompt its `id`, `family`, `split`, `prompt`, the base's `answer` and that
  answer's `form` (`retention.form_of`: code, list, sentences, short_fact, or null);
- `meta.json`: the base's name, `max_new_tokens`, and the base's own mean per-token NLL of its
  answers per split (`retention.answer_nll`), what `evaluate` subtracts from each model's.

`evaluate` scores every model against it (the retention log-loss and the form kept, on the test
third; on the validation third too with `evaluate.validation`); the train third is what replay
mixes into training. Computed once per base: the stage reruns when the base, the prompts, the
settings or the kind of machine (`data/device.json`) change, never when only training does.
Without a base model (the pipeline pretrains its own) there is nothing to retain: a README.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipelines.core.evaluation import retention
from pipelines.core.evaluation.greedy import generate_answers
from pipelines.core.models import model_source
from pipelines.core.models.models import CONSTRUCTION, device, load_causal_lm, load_tokenizer
from pipelines.core.outputs import atomic_dir, write_json
from pipelines.core.params.release import BaseAnswersParams
from pipelines.core.paths import project_root
from pipelines.core.run import stage

NAME = "base_answers"
NO_BASE_README = """# No base model, nothing to retain

`base_model.name` is null: the pipeline pretrains its own model, which knew nothing before. With a
base model this directory holds the base's greedy answers to the general prompts and their NLL,
the reference `evaluate`'s retention measure compares every model with (docs/evaluation.md).
"""


def answer(model, tokenizer, out: Path, params: BaseAnswersParams, base_name: str) -> dict:
    """Answer every general prompt with `model` and write the answers and their meta into `out`
    (atomically); returns the metrics: answers per split and form, and the NLL per split."""
    prompts = retention.load_prompts()
    answers = generate_answers(model, tokenizer, retention.messages_of(prompts), params.max_new_tokens, params.batch_size)
    nll = {}
    for split in retention.SPLITS:
        chosen = [i for i, p in enumerate(prompts) if p["split"] == split]
        nll[split] = round(retention.answer_nll(model, tokenizer, retention.messages_of([prompts[i] for i in chosen]), [answers[i] for i in chosen],
                                                params.batch_size), 6)  # fmt: skip
    rows = [{"id": p["id"], "family": p["family"], "split": p["split"], "prompt": p["prompt"], "answer": a, "form": retention.form_of(a)}
            for p, a in zip(prompts, answers, strict=True)]  # fmt: skip
    forms: dict[str, int] = {}
    for row in rows:
        forms[str(row["form"])] = forms.get(str(row["form"]), 0) + 1
    with atomic_dir(out) as tmp:
        (tmp / retention.REFERENCE_ANSWERS).write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8", newline="\n")
        write_json(tmp / retention.REFERENCE_META, {"base": base_name, "max_new_tokens": params.max_new_tokens, "nll": nll})
    return {"prompts": len(rows), **{f"nll/{split}": value for split, value in nll.items()}, **{f"forms/{k}": v for k, v in sorted(forms.items())}}


def body(ctx: stage.StageContext) -> dict:
    record = model_source.current(ctx.root)
    if record["name"] is None:
        stage.placeholder(ctx, NO_BASE_README)
        ctx.log.info("base_answers: no base model (base_model.name is null): nothing to retain, wrote only a README")
        return {"prompts": 0}
    location = model_source.location(record, project_root(ctx.root))
    tokenizer = load_tokenizer(ctx.input("tokenizer"))
    with CONSTRUCTION:
        model = load_causal_lm(location, dtype=torch.float32).to(device()).eval()
    metrics = answer(model, tokenizer, ctx.output(), ctx.params, record["name"])
    ctx.log.info("base_answers: %s answered %d general prompts (at most %d new tokens); its NLL of its own answers: %s", record["name"],
                 metrics["prompts"], ctx.params.max_new_tokens, ", ".join(f"{s} {metrics[f'nll/{s}']:.4f}" for s in retention.SPLITS))  # fmt: skip
    return metrics


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
