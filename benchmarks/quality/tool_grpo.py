"""Does a calculator in the loop help? Held-out exact match on the tool arithmetic (products of two
and sums of four numbers, by operand digits) of four ways to train the same pretrained model, over
seeds (issue 55):

- `no tools`: SFT on the same questions answered directly (`tool_arithmetic.calls: false`), no tool
  anywhere: the arithmetic done in the model's head;
- `sft`: SFT on the calculator demonstrations, evaluated with the calculator (greedy episodes);
- `sft+grpo one-turn`: then GRPO without tools (one-turn rollouts), evaluated with the calculator;
- `sft+grpo tools`: then GRPO with the calculator in the loop (multi-turn episodes).

    python -m benchmarks.quality.tool_grpo --project DIR --baseline DIR2 [--seeds 0 1 2] [--turn-tokens 48] [--jsonl FILE]

DIR is a project after `qllm run --until tokenize --set sample_data.tool_arithmetic.enabled=true`,
DIR2 the same project after `qllm run --until prepare_data` with `sample_data.tool_arithmetic.calls=false`
as well: the same questions, ids and answers, and the same pretraining text (the tool chats are
chats only), so one pretrained model per seed serves all four. The stages' code runs with DIR's
params (and `--set`), each seed setting `pretrain.train.seed` and the fine-tuning stages' seeds;
`pretrain` does what the stage does with DIR's base model (SmolLM2's profile: continued pretraining
of the base). With a profile, DIR and DIR2 are the run workspaces the two runs name in their logs
(`running in workspace .qllm/runs/<id>`), whose params.yaml holds the profile:

    qllm run --params params/smollm2.yaml --params params/smollm2-tools.yaml --until tokenize
    qllm run --params params/smollm2.yaml --params params/smollm2-tools.yaml --until prepare_data \
        --set sample_data.tool_arithmetic.calls=false
    python -m benchmarks.quality.tool_grpo --project .qllm/runs/<first> --baseline .qllm/runs/<second> --turn-tokens 64

The
tools: `calculator`, `max_turns: 2` (the call, then the answer), `--turn-tokens` a turn, in GRPO
and in evaluate. Scored as `evaluate` scores (greedy; `exact_match_by_group` of the
`heldout-toolarith-d<digits>` groups; `tool_calls_correct`) on the tool questions only. Prints one
line per seed and, per arm, mean +- standard deviation [min, max]: the spread, not the best run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.common import cpu_name, per_seed
from benchmarks.quality.default_quality import _with, reads
from benchmarks.quality.grpo_gain import percent
from pipelines import grpo, pretrain, sft
from pipelines.core.evaluation.heldout import heldout_questions
from pipelines.core.evaluation.report import evaluate_model
from pipelines.core.outputs import write_json
from pipelines.core.params import files as params_file
from pipelines.core.params.rl import ToolsParams
from pipelines.core.training import precision

ARMS = ("no tools", "sft", "sft+grpo one-turn", "sft+grpo tools")
TOOLS = ToolsParams(functions=["calculator"], max_turns=2)


def tool_questions(chat_dir: Path):
    questions = heldout_questions(chat_dir)
    return questions[questions["id"].str.contains("-toolarith-")].reset_index(drop=True)


def one_seed(root: Path, baseline: Path, params, seed: int, precision_name: str, turn_tokens: int, work: Path) -> dict:
    tokenized, tokenizer = reads(root, "pretrain", "tokenized"), reads(root, "pretrain", "tokenizer")
    chat, plain_chat = reads(root, "sft", "chat"), reads(baseline, "sft", "chat")
    seconds = {}
    started = time.perf_counter()
    pretrain.from_project(root, tokenized, tokenizer, work / "pretrain", _with(params.pretrain, seed, precision_name))  # a base: continued or taken as it is
    seconds["pretrain"] = time.perf_counter() - started
    sft_params = _with(params.sft, seed, precision_name).model_copy(update={"base_model": str(work / "pretrain")})
    for name, chats in (("sft", chat), ("no tools", plain_chat)):
        started = time.perf_counter()
        sft.run(chats, work / name, sft_params)
        seconds[name] = time.perf_counter() - started
    base = _with(params.grpo, seed, precision_name).model_copy(update={"max_completion_length": turn_tokens})
    for name, tools in (("sft+grpo one-turn", ToolsParams()), ("sft+grpo tools", TOOLS)):
        started = time.perf_counter()
        summary = grpo.run(work, work / "sft", chat, work / name, base.model_copy(update={"tools": tools}))
        seconds[name] = time.perf_counter() - started
        write_json(work / f"{name}.json", {k: v for k, v in summary.items() if k != "history"})
    with_tools = params.evaluate.model_copy(update={"tools": TOOLS, "max_new_tokens": turn_tokens})
    row = {"seed": seed, "precision": precision_name, "seconds": {k: round(v, 1) for k, v in seconds.items()}}
    for name in ARMS:
        questions = tool_questions(plain_chat if name == "no tools" else chat)
        evaluate = params.evaluate if name == "no tools" else with_tools
        result = evaluate_model(work / name, root, tokenized, questions, work / "eval" / name, evaluate)
        row[name] = {"exact_match": result["exact_match"], **{g.removeprefix("heldout-toolarith-"): v for g, v in result["exact_match_by_group"].items()},
                     **({"tool_calls_correct": result["tool_calls_correct"]} if "tool_calls_correct" in result else {})}  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--baseline", type=Path, required=True, help="the project with sample_data.tool_arithmetic.calls=false")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--turn-tokens", type=int, default=48, help="a turn's tokens, in GRPO and evaluate (a call is about 30)")
    parser.add_argument("--precision", default="auto", choices=precision.PRECISIONS)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--jsonl", type=Path, help="append each seed's row as a JSON line")
    args = parser.parse_args(argv)
    root, baseline = args.project.resolve(), args.baseline.resolve()
    params, _ = params_file.load(root, overrides=args.overrides)
    resolved = precision.resolve(args.precision)
    machine = {"cpu": cpu_name(), "threads": torch.get_num_threads()}
    print(f"tool grpo: {' '.join(args.overrides) or 'params.yaml'}; {resolved}; {machine}; {len(tool_questions(reads(root, 'sft', 'chat')))} tool questions", flush=True)
    rows = per_seed(args.seeds, lambda seed, tmp: one_seed(root, baseline, params, seed, resolved, args.turn_tokens, tmp), jsonl=args.jsonl,
                    extra={"overrides": args.overrides, **machine})  # fmt: skip
    for name in ARMS:
        keys = [k for k in rows[0][name]]
        print(f"{name} ({len(rows)} seeds): " + "; ".join(f"{k} {percent([r[name][k] for r in rows])}" for k in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
