"""Quality and time of the pretrain -> sft defaults, over seeds and precisions, on one machine.

    python -m benchmarks.quality.default_quality --project DIR [--seeds 0 1 2] [--precisions fp32 bf16]
        [--set pretrain.train.max_steps=300 ...] [--label NAME] [--jsonl FILE] [--cache DIR]

DIR is a project after `qllm run --until tokenize` (it needs data/tokenized, data/tokenizer and
data/prepared/chat). For every precision and seed this runs the `pretrain` and `sft` stages' code
with the project's params.yaml plus `--set` (the seed sets both stages' `train.seed`), then scores
the SFT model as `evaluate` does (greedy held-out exact match), and probes the pretrained model itself:
`pretrain_qa_heldout` is its greedy completion of `Question: <q>\nAnswer:` (the plain form of the
pretraining text's QA lines) for the held-out people, the skill SFT needs and cannot add
(`--pretrain-only` stops there: a cheaper screen of pretraining settings). Prints one line per run and, per
precision, mean +- standard deviation and the range: the spread, not the best run. `--jsonl`
appends every run as a JSON line (for the tables in benchmarks/results/quality.md). `--cache DIR` keeps each
pretrained model under DIR, named by its params, seed and precision, and reuses it: sweeps over `sft.*`
settings then pretrain once per seed and precision.

Choosing defaults: run it with the candidate `--set`s on both CPU kinds (an AVX2-only CPU, or an
AMX/AVX512-BF16 one with `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2` to imitate it: check
with `python -c "from pipelines import precision; print(precision.cpu_bf16_slowdown())"` that bf16
became slow), and both precisions where the machine has bf16 natively.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.common import cpu_name, mean_sd, per_seed
from pipelines import pretrain, sft
from pipelines.core import dag
from pipelines.core.data import sample_world
from pipelines.core.data.chat_template import normalize_answer
from pipelines.core.evaluation.heldout import heldout_questions
from pipelines.core.evaluation.report import evaluate_model
from pipelines.core.models import models
from pipelines.core.outputs import digest, read_json, to_plain, write_json
from pipelines.core.params import files as params_file
from pipelines.core.run import stage
from pipelines.core.training import precision


def _with(section, seed: int, precision_name: str):
    train = section.train.model_copy(update={"seed": seed, "precision": precision_name, "checkpoint_every": 0})
    return section.model_copy(update={"train": train})


def reads(root: Path, name: str, what: str) -> Path:
    """The path stage `name` reads as `what`, from the project's dvc.yaml."""
    return stage.StageContext(name=name, root=root, params=None, tracker=None).input(what)


@torch.no_grad()
def qa_probe(model_dir: Path, tokenizer_dir: Path, sample_params) -> float:
    """Share of held-out people's facts the pretrained model completes after `Question: ...\nAnswer:`
    (greedy, first wording of each question). The first word is compared, with `evaluate`'s
    normalisation: a pretrained model runs on past the answer (". Liviki works as ..."), where
    `evaluate` would compare the whole first line."""
    world = sample_world.build_world(sample_params)
    heldout = [fact for fact in sample_world.facts(world, heldout=True) if fact.kind != sample_world.ARITH]
    model = models.load_causal_lm(model_dir).eval()
    tokenizer = models.load_tokenizer(tokenizer_dir)
    correct = 0
    for fact in heldout:
        prompt = f"Question: {fact.ask(sample_world.QUESTION_TEMPLATES[fact.kind][0])}\nAnswer:"
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id or 0)
        words = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split()
        correct += bool(words) and normalize_answer(words[0]) == normalize_answer(fact.answer)
    return correct / max(1, len(heldout))


def one_run(
    root: Path, params, seed: int, precision_name: str, questions, work: Path, cache: Path | None = None, pretrain_only: bool = False,
) -> dict:
    tokenized, tokenizer = reads(root, "pretrain", "tokenized"), reads(root, "pretrain", "tokenizer")
    pre_params = _with(params.pretrain, seed, precision_name)
    sft_params = _with(params.sft, seed, precision_name)
    pre_out, sft_out = work / "pretrain", work / "sft"
    if cache is not None:
        key = digest({"params": to_plain(pre_params), "data": dag.dvc_md5(tokenized)})[:16]
        pre_out = cache / f"pretrain-{key}"
    started = time.perf_counter()
    if (pre_out / "metrics.json").exists():
        pre = read_json(pre_out / "metrics.json")
    else:
        pre = pretrain.run(tokenized, tokenizer, pre_out, pre_params, None)
        pre.pop("history", None)
        if cache is not None:
            write_json(pre_out / "metrics.json", pre)
    pre_seconds = pre["train_seconds"]
    probe = round(qa_probe(pre_out, tokenizer, params.sample_data), 4)
    row = {"seed": seed, "precision": precision_name, "pretrain_val_perplexity": round(pre["val/perplexity"], 4),
           "pretrain_qa_heldout": probe, "pretrain_seconds": round(pre_seconds, 1)}  # fmt: skip
    if pretrain_only:
        return row
    sft_params = sft_params.model_copy(update={"base_model": str(pre_out)})
    started = time.perf_counter()
    tuned = sft.run(reads(root, "sft", "chat"), sft_out, sft_params, checkpoint_dir=work / "sft-checkpoints")  # best-weight restore with early stopping
    sft_seconds = time.perf_counter() - started
    evaluate = params.evaluate.model_copy(update={"models": ["sft"]})
    result = evaluate_model(sft_out, root, tokenized, questions, work / "eval", evaluate)
    return row | {
        "sft_val_loss": round(tuned.get("val/loss", float("nan")), 4),
        "sft_exact_match": round(result["exact_match"], 4),
        "sft_steps": tuned["steps"], "sft_best_step": tuned["best_step"],
        "sft_seconds": round(sft_seconds, 1),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--precisions", nargs="+", default=["auto"], choices=precision.PRECISIONS)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--label", default="", help="a name for this setting in the output")
    parser.add_argument("--jsonl", type=Path, help="append each run as a JSON line")
    parser.add_argument("--cache", type=Path, help="keep and reuse pretrained models here")
    parser.add_argument("--pretrain-only", action="store_true", help="pretrain and probe only (no sft, no evaluate)")
    args = parser.parse_args(argv)
    root = args.project.resolve()
    params, _ = params_file.load(root, overrides=args.overrides)
    questions = heldout_questions(reads(root, "sft", "chat"), params.evaluate.max_questions)
    machine = {"cpu": cpu_name(), "bf16_slowdown": round(precision.cpu_bf16_slowdown(), 3), "threads": torch.get_num_threads()}
    print(f"{args.label or 'setting'}: {' '.join(args.overrides) or 'params.yaml'}; {machine}")
    runs: dict[str, list[dict]] = {}
    for name in args.precisions:
        resolved = precision.resolve(name)
        runs.setdefault(resolved, []).extend(per_seed(
            args.seeds, lambda seed, tmp, resolved=resolved: one_run(root, params, seed, resolved, questions, tmp, args.cache, args.pretrain_only),
            jsonl=args.jsonl, extra={"label": args.label, "overrides": args.overrides, **machine}))  # fmt: skip
    for name, rows in runs.items():
        summary = []
        for key in ("pretrain_val_perplexity", "pretrain_qa_heldout", "sft_exact_match", "pretrain_seconds", "sft_seconds"):
            values = [r[key] for r in rows if key in r]
            if not values:
                continue
            summary.append(f"{key} {mean_sd(values, '.4g', '.2g', with_range=True)}")
        print(f"{args.label or 'setting'} {name} ({len(rows)} seeds): " + "; ".join(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
