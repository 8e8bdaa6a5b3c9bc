"""The real-model profile (params/smollm2.yaml, SmolLM2-135M-Instruct) measured: its settings chosen
on validation, its runs over seeds, and the base model as it comes.

    python -m benchmarks.quality.real_model choose --run .qllm/runs/<hash> --stage sft --lrs 2e-5 5e-5 1e-4 [--steps 14] [--seeds 0 1 2]
    python -m benchmarks.quality.real_model profile --seeds 0 1 2 [--set KEY=VALUE ...] [--out real_model.json]
    python -m benchmarks.quality.real_model base --run .qllm/runs/<hash>
    python -m benchmarks.quality.real_model grpo --run .qllm/runs/<hash> [--steps 20] [--seeds 0 1 2]
    python -m benchmarks.quality.real_model prompts --run .qllm/runs/<hash>
    python -m benchmarks.quality.real_model recipe --run .qllm/runs/<hash> --answers <base_answers dir> --lrs 1e-4 [--epochs 1] [--seeds 0 1 2] [--cpt-replay F] [--sft-replay F]
    python -m benchmarks.quality.real_model nf4

`choose`: trains the stage (`sft` or `lora`, the profile's settings with each learning rate and
seed) from the base a finished profile run (`--run`, its run workspace) gave it
(`data/models/pretrain`), on that run's prepared chats, in-process and without MLflow, and prints
each run's chat validation loss (`data/prepared/chat/validation.parquet`, never the held-out test
questions) and time, then the mean and spread per learning rate. `lora` takes the run's
quantum_opt allocation, as the stage does.

`profile`: `qllm run --params params/smollm2.yaml` once per seed (every training stage's
`train.seed` set to it; the sample data stays the same, so the held-out questions do too), each in
its own run workspace; prints per seed the wall time, each stage's seconds and peak memory, and
`evaluate`'s metrics per model: exact and flexible match by question group, validation and
general-text perplexity, preference accuracy; then the mean and range over seeds.

`grpo`: GRPO on the arithmetic questions alone (the training chats whose id says `arith`), from the
run's SFT model, with the profile's `grpo` settings and `--steps` steps, its reward at every step;
then SFT from the same model on the same chats for the same wall time (the profile's `sft`
settings, stopped when GRPO's training time has passed); the held-out arithmetic before (the SFT
model), after GRPO and after the extra SFT, by exact and flexible match, per seed.

`prompts`: a few general prompts (`GENERAL_PROMPTS`, none about the sample's world) answered
greedily by the base as it comes and by each model of the run: what fine-tuning did to what the
model could do before, verbatim.

`recipe`: continued pretraining from the base on a run workspace's tokenized text (`--run`: its
sample written with validation people), then the profile's SFT, per learning rate, epochs and seed,
in-process; each run's strict match of the validation people's questions per group and the
retention log-loss on the validation third of the general prompts (against `--answers`, a
`base_answers` output), after continued pretraining and after SFT: what the knowledge recipe is
chosen on (never the held-out people).

`nf4`: the CPython-documentation perplexity of the base as it comes (fp32), and of the same weights
quantized again to nf4 and int8 with no adapter: what quantization costs before QLoRA trains.

`base`: `evaluate`'s metrics of the base as it comes (the GGUF file converted, no training) on
the same held-out questions as the run's models (`--run`): the row the profile's table starts with.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, cpu, per_seed
from pipelines.core.evaluation import heldout, report, scores

PROFILE = REPO / "params" / "smollm2.yaml"
TRAINED = ("pretrain", "probe_lora", "sft", "lora", "dpo", "grpo")
"""The stages whose `train.seed` a profile seed sets."""


def mean_range(values: list[float]) -> str:
    """`mean (min-max)` over seeds (the mean alone for one)."""
    if not values:
        return "-"
    mean = statistics.fmean(values)
    return f"{mean:.4f} ({min(values):.4f}-{max(values):.4f})" if len(values) > 1 else f"{mean:.4f}"


def choose(args) -> int:
    from pipelines import lora, sft
    from pipelines.core.outputs import read_json
    from pipelines.core.params import files as params_file
    from pipelines.core.run import stage

    run = args.run.resolve()
    params, _ = params_file.load(REPO, overlays=[PROFILE])
    section = getattr(params, args.stage)
    base = run / "data" / "models" / "pretrain"
    chat = run / "data" / "prepared" / "chat"
    results: dict[float, list[dict]] = {}
    print(f"{args.stage} from {base.relative_to(run.parents[2]) if run.is_relative_to(REPO) else base}; {cpu()}", flush=True)

    def one(lr: float, seed: int, tmp: Path) -> dict:
        train = section.train.model_copy(update={"lr": lr, "seed": seed, "extensions": [], "checkpoint_every": 0,
                                                  **({"max_steps": args.steps} if args.steps else {})})  # fmt: skip
        stage_params = section.model_copy(update={"base_model": str(base), "train": train})
        if args.stage == "lora" and stage_params.allocation == "quantum_opt":
            stage_params = lora.apply_allocation(stage_params, read_json(run / "data/quantum_opt/allocation.json"))
        stage_params = stage.resolve_precision(args.stage, stage_params)
        started = time.perf_counter()
        metrics = (sft.run if args.stage == "sft" else lora.run)(chat, tmp / "out", stage_params)
        seconds = time.perf_counter() - started
        return {"lr": lr, "seed": seed, "val_loss": round(metrics["val/loss"], 4), "seconds": round(seconds, 1), "steps": metrics["steps"]}

    for lr in args.lrs:
        results[lr] = per_seed(args.seeds, lambda seed, tmp, lr=lr: one(lr, seed, tmp))
    print(f"\n{args.stage}: chat validation loss after {results[args.lrs[0]][0]['steps']} steps, mean (min-max) over seeds {args.seeds}")
    for lr, rows in results.items():
        print(f"  lr {lr:g}: {mean_range([r['val_loss'] for r in rows])}, {statistics.fmean(r['seconds'] for r in rows):.0f} s a run")
    return 0


def evaluated(workspace: Path) -> dict[str, dict]:
    """`evaluate`'s metrics per model of a finished run."""
    data = json.loads((workspace / "data/metrics/evaluate.json").read_text())
    return {name: value for name, value in data.items() if isinstance(value, dict)}


def stage_table(workspace: Path) -> dict[str, dict]:
    out = {}
    for path in sorted((workspace / "data/metrics").glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "seconds" in data:
            out[path.stem] = {"seconds": data["seconds"], "peak_rss_mb": data.get("peak_rss_mb")}
    return out


def profile(args) -> int:
    runs = []
    print(f"{cpu()}", flush=True)
    for seed in args.seeds:
        seeds = [f"{name}.train.seed={seed}" for name in TRAINED]
        with tempfile.TemporaryDirectory() as tmp:
            summary_file = Path(tmp) / "summary.json"
            command = [str(Path(sys.executable).parent / "qllm"), "run", "--params", str(PROFILE.relative_to(REPO)), "--summary-json", str(summary_file)]
            for override in seeds + list(args.set):
                command += ["--set", override]
            started = time.perf_counter()
            subprocess.run(command, cwd=REPO, check=True)
            wall = time.perf_counter() - started
            summary = json.loads(summary_file.read_text())
        workspace = Path(summary["workspace"])
        run = {"seed": seed, "wall_seconds": round(wall, 1), "stages": {s["name"]: s.get("seconds") for s in summary["stages"]},
               "metrics": stage_table(workspace), "evaluate": evaluated(workspace), "workspace": str(workspace.relative_to(REPO))}  # fmt: skip
        runs.append(run)
        print(f"seed {seed}: {wall:.0f} s ({run['workspace']})", flush=True)
        for name, metrics in run["evaluate"].items():
            print(f"  {name:8s} exact {metrics['exact_match']:.3f} flexible {metrics['flexible_match']:.3f} by group exact "
                  f"{metrics['exact_match_by_group']} flexible {metrics['flexible_match_by_group']} general ppl {metrics.get('general_perplexity')} "
                  f"preference {metrics.get('preference_accuracy')}", flush=True)  # fmt: skip
    print("\nmean (min-max) over seeds", args.seeds)
    print(f"  wall: {mean_range([r['wall_seconds'] for r in runs])} s")
    for name in runs[0]["evaluate"]:
        for key in ("exact_match", "flexible_match", "general_perplexity", "preference_accuracy"):
            values = [r["evaluate"][name][key] for r in runs if key in r["evaluate"][name]]
            print(f"  {name:8s} {key}: {mean_range(values)}")
        for group in runs[0]["evaluate"][name]["exact_match_by_group"]:
            exact = [r["evaluate"][name]["exact_match_by_group"][group] for r in runs]
            flexible = [r["evaluate"][name]["flexible_match_by_group"][group] for r in runs]
            print(f"  {name:8s} {group}: exact {mean_range(exact)}, flexible {mean_range(flexible)}")
    if args.out:
        args.out.write_text(json.dumps({"cpu": cpu(), "runs": runs}, indent=1) + "\n")
    return 0


def base(args) -> int:
    """The base as it comes, scored as the run's models were."""
    from pipelines.core.models import gguf_import
    from pipelines.core.models.models import save_pretrained
    from pipelines.core.params import files as params_file
    from pipelines.core.preference import preference_data

    run = args.run.resolve()
    params, _ = params_file.load(REPO, overlays=[PROFILE])
    path = gguf_import.locate(params.base_model.name, REPO)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "base"
        save_pretrained(gguf_import.load_model(path), gguf_import.load_tokenizer(path), model_dir)
        questions = heldout.heldout_questions(run / "data/prepared/chat", params.evaluate.max_questions)
        import pandas as pd

        pairs = preference_data.from_frame(pd.read_parquet(run / "data/ref_logprobs/test.parquet"))
        started = time.perf_counter()
        metrics = report.evaluate_model(model_dir, REPO, run / "data/tokenized", questions, Path(tmp) / "out", params.evaluate, pairs)
        answers = [json.loads(line) for line in (Path(tmp) / "out/predictions.jsonl").read_text().splitlines()]
    print(f"{cpu()}; {time.perf_counter() - started:.0f} s")
    print(json.dumps({k: v for k, v in metrics.items()}, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"cpu": cpu(), "metrics": metrics, "answers": answers}, indent=1) + "\n")
    return 0


GENERAL_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a Python function that returns the square of a number.",
    "What is 12 times 11?",
]


def prompts(args) -> int:
    """The base and each model of the run answering `GENERAL_PROMPTS` (greedy, 48 new tokens)."""
    from pipelines.core.models import gguf_import
    from pipelines.core.models.models import load_for_inference, save_pretrained
    from pipelines.core.params import files as params_file

    run = args.run.resolve()
    params, _ = params_file.load(REPO, overlays=[PROFILE])
    chats = [[{"role": "user", "content": p}] for p in GENERAL_PROMPTS]
    answers = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = gguf_import.locate(params.base_model.name, REPO)
        save_pretrained(gguf_import.load_model(path), gguf_import.load_tokenizer(path), Path(tmp) / "base")
        for name, model_dir in [("base", Path(tmp) / "base")] + [(m, run / "data/models" / m) for m in params.evaluate.models]:
            model, tokenizer = load_for_inference(model_dir, run)  # an adapter names its base relative to the run workspace
            answers[name] = heldout.generate_answers(model, tokenizer, chats, 48, len(chats))
    print(cpu())
    for index, prompt in enumerate(GENERAL_PROMPTS):
        print(f"\n{prompt}")
        for name, said in answers.items():
            print(f"  {name:8s} {said[index]!r}")
    if args.out:
        args.out.write_text(json.dumps({"prompts": GENERAL_PROMPTS, "answers": answers}, indent=1) + "\n")
    return 0


class Recorder:
    """A tracker that keeps the metrics the loop logs (`MlflowMetrics` calls `log_metrics`)."""

    def __init__(self):
        self.metrics: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.metrics.setdefault(step, {}).update(metrics)

    def __getattr__(self, name: str):  # log_params, log_table, flush, ...: nothing to keep
        return lambda *args, **kwargs: None


def time_limit(seconds: float):
    """A loop extension that stops training once `seconds` of it have passed (at a step's end)."""
    from pipelines.core.extensions import Extension

    class TimeLimit(Extension):
        name = "time_limit"

        def on_train_begin(self, state) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, state, metrics) -> None:
            if time.perf_counter() - self.started >= seconds:
                state.stop = True

    return TimeLimit()


def _arithmetic_chats(run: Path, out: Path) -> Path:
    import pandas as pd

    out.mkdir(parents=True)
    for split in ("train", "validation"):
        frame = pd.read_parquet(run / f"data/prepared/chat/{split}.parquet")
        frame[frame["id"].str.contains("arith")].to_parquet(out / f"{split}.parquet", index=False)
    return out


def _heldout(model_dir: Path, questions) -> dict:
    from pipelines.core.models.models import load_for_inference

    model, tokenizer = load_for_inference(model_dir, REPO)
    answers = heldout.generate_answers(model, tokenizer, questions["prompt"].tolist(), 16, 32)
    exact, exact_groups = scores.exact_match_report(questions, answers)
    flexible, flexible_groups = scores.flexible_match_report(questions, answers)
    return {"exact_match": round(sum(exact) / len(exact), 4), "flexible_match": round(sum(flexible) / len(flexible), 4),
            "exact_match_by_group": exact_groups, "flexible_match_by_group": flexible_groups}  # fmt: skip


def grpo(args) -> int:
    from pipelines import grpo as grpo_stage
    from pipelines.core.models.models import save_pretrained
    from pipelines.core.params import files as params_file
    from pipelines.core.run import stage
    from pipelines.core.training import finetune

    run = args.run.resolve()
    params, _ = params_file.load(REPO, overlays=[PROFILE])
    start = run / "data/models/sft"
    questions = heldout.heldout_questions(run / "data/prepared/chat")
    print(cpu(), flush=True)
    before = _heldout(start, questions)
    print("SFT model (start):", json.dumps(before), flush=True)

    def one(seed: int, tmp: Path) -> dict:
        chats = _arithmetic_chats(run, tmp / "chat")
        train = params.grpo.train.model_copy(update={"seed": seed, "max_steps": args.steps, "log_every": 1, "checkpoint_every": 0,
                                                     "extensions": ["mlflow_metrics"]})  # fmt: skip
        grpo_params = stage.resolve_precision("grpo", params.grpo.model_copy(update={"train": train, "log_completions_every": 0}))
        recorder = Recorder()
        started = time.perf_counter()
        metrics = grpo_stage.run(REPO, start, chats, tmp / "grpo", grpo_params, tracker=recorder)
        grpo_seconds = metrics["train_seconds"]
        rewards = [round(recorder.metrics[s].get("reward", float("nan")), 4) for s in sorted(recorder.metrics) if "reward" in recorder.metrics[s]]
        after_grpo = _heldout(tmp / "grpo", questions)
        sft_train = params.sft.train.model_copy(update={"seed": seed, "max_steps": 10_000, "extensions": [], "checkpoint_every": 0,
                                                        "eval_every": 0, "warmup_steps": 0})  # fmt: skip
        sft_params = stage.resolve_precision("sft", params.sft.model_copy(update={"base_model": str(start), "train": sft_train}))
        more = finetune.run(chats, tmp / "sft", sft_params, wrap=lambda model, tokenizer: model, desc="sft",
                            save=lambda model, tokenizer, directory: save_pretrained(model, tokenizer, directory),
                            extensions=lambda model, tracker, limit=grpo_seconds: [time_limit(limit)])  # fmt: skip
        after_sft = _heldout(tmp / "sft", questions)
        return {"seed": seed, "grpo_steps": metrics["steps"], "grpo_train_seconds": grpo_seconds, "rewards": rewards,
                "sft_steps": more["steps"], "sft_train_seconds": more["train_seconds"], "after_grpo": after_grpo, "after_sft": after_sft,
                "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip

    results = per_seed(args.seeds, one)
    group = "heldout-arith"
    print(f"\nheld-out arithmetic (exact / flexible): SFT model {before['exact_match_by_group'][group]:.3f} / "
          f"{before['flexible_match_by_group'][group]:.3f}")  # fmt: skip
    for key in ("after_grpo", "after_sft"):
        exact = [r[key]["exact_match_by_group"][group] for r in results]
        flexible = [r[key]["flexible_match_by_group"][group] for r in results]
        print(f"  {key}: exact {mean_range(exact)}, flexible {mean_range(flexible)}")
    if args.out:
        args.out.write_text(json.dumps({"cpu": cpu(), "before": before, "runs": results}, indent=1) + "\n")
    return 0


def recipe(args) -> int:
    """Continued pretraining then SFT from the base, per setting and seed, scored on the validation
    people (strict match per group) and the validation third of the general prompts (retention
    log-loss): what the profile's knowledge recipe is chosen on."""
    from pipelines import pretrain, sft
    from pipelines.core.data import replay
    from pipelines.core.evaluation import retention
    from pipelines.core.evaluation.greedy import generate_answers
    from pipelines.core.models.models import load_for_inference
    from pipelines.core.outputs import read_json
    from pipelines.core.params import files as params_file
    from pipelines.core.run import stage

    run = args.run.resolve()
    params, _ = params_file.load(REPO, overlays=[PROFILE])
    rows = read_json(run / "data/tokenized/meta.json")["sequences"]["train"]
    questions = heldout.heldout_questions(run / "data/prepared/chat", splits=("validation",))
    questions = questions[questions["id"].str.startswith("validation-")].reset_index(drop=True)
    reference = replay.read(args.answers.resolve())
    chosen = [row for row in reference[0] if row["split"] == "validation"]
    print(f"{cpu()}; {rows} rows of text, {len(questions)} validation questions, {len(chosen)} validation prompts", flush=True)
    base_state = {}
    if args.wise:
        from pipelines.core.models import gguf_import

        base_state = gguf_import.load_model(gguf_import.locate(params.base_model.name, REPO)).state_dict()

    def one(lr: float, epochs: float, seed: int, tmp: Path) -> dict:
        steps = max(1, round(epochs * rows / params.pretrain.train.micro_batch_size))
        train = params.pretrain.train.model_copy(update={"lr": lr, "seed": seed, "max_steps": steps, "warmup_steps": max(2, steps // 20)})
        started = time.perf_counter()
        cpt_params = params.pretrain.model_copy(update={"train": train, "replay": params.pretrain.replay.model_copy(update={"fraction": args.cpt_replay})})
        cpt = pretrain.from_project(run, run / "data/tokenized", run / "data/tokenizer", tmp / "cpt", stage.resolve_precision("pretrain", cpt_params),
                                    replay_answers=args.answers.resolve())  # fmt: skip
        cpt_seconds = time.perf_counter() - started
        cpt_model, cpt_tokenizer = load_for_inference(tmp / "cpt", run)
        cpt_nll = retention.answer_nll(cpt_model, cpt_tokenizer, retention.messages_of(chosen), [r["answer"] for r in chosen], params.evaluate.batch_size)
        del cpt_model
        sft_train = params.sft.train.model_copy(update={"seed": seed, "extensions": [], "checkpoint_every": 0})
        sft_params = params.sft.model_copy(update={"base_model": str(tmp / "cpt"), "train": sft_train,
                                                   "replay": params.sft.replay.model_copy(update={"fraction": args.sft_replay})})  # fmt: skip
        sft.run(run / "data/prepared/chat", tmp / "sft", stage.resolve_precision("sft", sft_params), replay_answers=args.answers.resolve())
        model, tokenizer = load_for_inference(tmp / "sft", run)

        def scored(model) -> tuple[float, dict, float]:
            predictions = generate_answers(model, tokenizer, questions["prompt"].tolist(), params.evaluate.max_new_tokens, params.evaluate.batch_size)
            strict, by_group = scores.strict_match_report(questions, predictions)
            nll = retention.answer_nll(model, tokenizer, retention.messages_of(chosen), [r["answer"] for r in chosen], params.evaluate.batch_size)
            return round(sum(strict) / len(strict), 4), by_group, round(retention.retention_loss(nll, reference[1]["nll"]["validation"]), 4)

        wise = {}
        if args.wise:  # linear interpolation with the base (WiSE-FT): base + alpha (sft - base)
            tuned = {k: v.clone() for k, v in model.state_dict().items()}
            for alpha in args.wise:
                model.load_state_dict({k: base_state[k] + alpha * (v - base_state[k]) if v.is_floating_point() else v for k, v in tuned.items()})
                facts, _, kept = scored(model)
                wise[str(alpha)] = {"strict": facts, "retention_loss": kept}
            model.load_state_dict(tuned)
        facts, by_group, kept = scored(model)
        result = {"lr": lr, "epochs": epochs, "seed": seed, "cpt_replay": args.cpt_replay, "sft_replay": args.sft_replay, "steps": steps, "cpt_seconds": round(cpt_seconds), "cpt_val_loss": round(cpt["val/loss"], 4),
                  "strict": facts, "by_group": by_group, "retention_loss": kept,
                  "cpt_retention_loss": round(retention.retention_loss(cpt_nll, reference[1]["nll"]["validation"]), 4), "wise": wise,
                  "seconds": round(time.perf_counter() - started)}  # fmt: skip
        return result

    for lr in args.lrs:
        for epochs in args.epochs:
            per_seed(args.seeds, lambda seed, tmp, lr=lr, epochs=epochs: one(lr, epochs, seed, tmp), jsonl=args.out, extra={"run": run.name, "cpu": cpu()})
    return 0


def nf4(args) -> int:
    """CPython-documentation perplexity (`evaluate.general_text_tokens` of the profile) of the base as
    it comes (the GGUF Q4_1 file dequantized to fp32) and of the same weights quantized again to nf4
    with no adapter (what QLoRA trains on): the quantization's own cost, apart from training."""
    import math

    from pipelines.core.models import gguf_import, quantize
    from pipelines.core.models.models import load_for_inference, save_pretrained
    from pipelines.core.params import files as params_file

    params, _ = params_file.load(REPO, overlays=[PROFILE])
    path = gguf_import.locate(params.base_model.name, REPO)
    out = {"cpu": cpu()}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        save_pretrained(gguf_import.load_model(path), gguf_import.load_tokenizer(path), base)
        for name, kind in (("fp32", "none"), ("nf4", "nf4"), ("int8", "int8")):
            qparams = params.lora.adapter.base_quantization.model_copy(update={"quantization": kind})
            qconfig = quantize.from_params(qparams, "fp32", "lora.adapter")
            model, tokenizer = load_for_inference(base) if qconfig is None else quantize.load(base, qconfig, "lora.adapter")
            rows = scores.general_text_rows(tokenizer, params.evaluate.general_text_tokens, 256)
            loss = scores.causal_loss(model.eval(), rows, params.evaluate)
            out[name] = {"general_loss": round(loss, 4), "general_perplexity": round(math.exp(loss), 2)}
            print(name, out[name], flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    c = commands.add_parser("choose")
    c.add_argument("--run", type=Path, required=True)
    c.add_argument("--stage", choices=["sft", "lora"], required=True)
    c.add_argument("--lrs", type=float, nargs="+", required=True)
    c.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    c.add_argument("--steps", type=int, default=0, help="0: the profile's max_steps")
    p = commands.add_parser("profile")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--out", type=Path)
    b = commands.add_parser("base")
    b.add_argument("--run", type=Path, required=True)
    b.add_argument("--out", type=Path)
    g = commands.add_parser("grpo")
    g.add_argument("--run", type=Path, required=True)
    g.add_argument("--steps", type=int, default=20)
    g.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    g.add_argument("--out", type=Path)
    q = commands.add_parser("prompts")
    q.add_argument("--run", type=Path, required=True)
    q.add_argument("--out", type=Path)
    r = commands.add_parser("recipe")
    r.add_argument("--run", type=Path, required=True, help="a run workspace with the sample's text tokenized")
    r.add_argument("--answers", type=Path, required=True, help="a base_answers output (the reference)")
    r.add_argument("--lrs", type=float, nargs="+", required=True)
    r.add_argument("--epochs", type=float, nargs="+", default=[1.0])
    r.add_argument("--seeds", type=int, nargs="+", default=[0])
    r.add_argument("--cpt-replay", type=float, default=0.0, help="pretrain.replay.fraction")
    r.add_argument("--sft-replay", type=float, default=0.0, help="sft.replay.fraction")
    r.add_argument("--wise", type=float, nargs="*", default=[], help="also score base + alpha (sft - base) for these alphas (WiSE-FT)")
    r.add_argument("--out", type=Path)
    n = commands.add_parser("nf4")
    n.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    return {"nf4": nf4, "recipe": recipe, "choose": choose, "profile": profile, "base": base, "grpo": grpo, "prompts": prompts}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
