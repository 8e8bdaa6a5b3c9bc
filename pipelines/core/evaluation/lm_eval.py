"""The held-out questions as an lm-evaluation-harness task: `evaluate`'s exact match from `lm_eval`.

    lm_eval --model hf --model_args pretrained=data/models/sft \\
        --include_path lm_eval_tasks --tasks qllm_heldout --apply_chat_template
    python -m pipelines.core.evaluation.lm_eval data/models/lora    # that command for any model the pipeline saved
    python -m pipelines.core.evaluation.lm_eval data/models/lora --root PROJECT   # ... of another project (cd PROJECT && lm_eval ...)

The task (`lm_eval_tasks/qllm_heldout/`, shipped with the code) scores a model as `evaluate` does:

- its documents are `heldout.heldout_questions` of `data/prepared/chat` (relative to the working
  directory; another with `--metadata '{"chat_dir": "DIR"}'`), in the same order, so `--limit N`
  is `evaluate.max_questions: N`;
- each prompt is the whole conversation before the last assistant turn (system message and
  earlier turns included), rendered by the model's tokenizer with its chat template and
  `add_generation_prompt=True`: `--apply_chat_template` is required, and `--num_fewshot` and
  `--system_instruction` are errors (they would change the prompts);
- greedy decoding of at most 16 new tokens (`evaluate.max_new_tokens`; another length with
  `--gen_kwargs max_gen_toks=N`), stopping where `evaluate` stops: at the stop tokens of the
  model's generation config (`<|im_end|>`/EOS, written into every model the pipeline saves);
- `exact_match` after `chat_template.normalize_answer` on both sides.

lm_eval encodes the rendered prompt with the tokenizer's special tokens, `evaluate` without: the
two agree for every tokenizer that adds nothing (the pipeline's, Qwen's, ...) or whose template
starts with the BOS token it would add (lm_eval then adds none; Llama 3, Gemma).

Adapter outputs (`lora`, `dpo` with `dpo.adapter: lora`) evaluate as `evaluate` loads them
(`models.load_for_inference`): `merged/` when the stage wrote one, else the adapter on its base
(`pretrained=<base>,peft=<adapter dir>`; lm_eval applies the adapter unmerged, and cannot load one
with `trainable_tokens` on a base with tied embeddings: `model_args` says so). `model_args` gives
the `--model_args` of a model directory.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from pipelines.core.data.chat_template import normalize_answer
from pipelines.core.errors import QllmError

TASK = "qllm_heldout"
TASKS_DIR = Path(__file__).resolve().parents[3] / "lm_eval_tasks"
"""What `lm_eval --include_path` takes: the directory of the shipped task."""
CHAT_DIR = "data/prepared/chat"
"""Where `prepare_data` writes the chat splits (the held-out questions' default source)."""


def heldout_docs(chat_dir: str = CHAT_DIR, **_metadata):
    """The task's dataset (lm_eval's `custom_dataset`): one `test` document per held-out question,
    `prompt` the messages as JSON (rendered as they are), `question` the last one's text (shown
    in lm_eval's samples), `reference` the answer. lm_eval passes its metadata, the model's
    arguments included, as keywords: all but `chat_dir` are ignored."""
    import datasets

    from pipelines.core.evaluation.heldout import heldout_questions
    from pipelines.core.evaluation.scores import group_of

    questions = heldout_questions(Path(chat_dir))
    docs = {
        "id": questions["id"].astype(str).tolist(),
        "group": [group_of(str(i)) for i in questions["id"]],
        "prompt": [json.dumps(p, ensure_ascii=False) for p in questions["prompt"]],
        "question": [p[-1]["content"] if p else "" for p in questions["prompt"]],
        "reference": questions["reference"].tolist(),
    }
    return datasets.DatasetDict({"test": datasets.Dataset.from_dict(docs)})


def render_prompt(doc: dict, chat_template, num_fewshot: int = 0, system_instruction: str | None = None) -> str:
    """The prompt of one document: its messages rendered by `chat_template` (lm_eval's
    `lm.apply_chat_template`, the model tokenizer's template with `add_generation_prompt=True`)."""
    if chat_template is None:
        raise QllmError(f"{TASK}: the prompts are chat conversations; run lm_eval with --apply_chat_template")
    if num_fewshot:
        raise QllmError(f"{TASK}: --num_fewshot {num_fewshot}: the task is zero-shot (as `evaluate` is); leave it out")
    if system_instruction:
        raise QllmError(f"{TASK}: --system_instruction: the prompts carry their own system messages (as in `evaluate`); leave it out")
    return chat_template(json.loads(doc["prompt"]))


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """`exact_match` of one answer, as `scores.exact_match_report` scores it."""
    return {"exact_match": float(normalize_answer(results[0]) == normalize_answer(doc["reference"]))}


def model_args(model_dir: Path | str, root: Path | str = ".") -> str:
    """`--model_args` for lm_eval's `hf` model that load what `evaluate` scores for `model_dir`
    (`models.load_for_inference`): the model, its `merged/`, or a PEFT adapter on its base (the
    base named in `adapter_config.json`); a pointer directory (`data/models/pretrain` when
    `pretrain` trained nothing) stands for the base it names.

    A relative `model_dir`, and a relative base, are relative to the project `root` (never to the
    current directory), and so are the paths in the result: lm_eval runs in `root` (`command`)."""
    from pipelines.core.models.model_source import follow
    from pipelines.core.models.models import model_location

    root = Path(root)
    given = Path(model_dir)
    where = given if given.is_absolute() else root / given

    def shown(path: Path | str) -> str:  # as lm_eval, run in root, reads it
        if isinstance(path, Path) and not given.is_absolute() and path.resolve().is_relative_to(root.resolve()):
            return path.resolve().relative_to(root.resolve()).as_posix()
        return str(path)

    if (where / "merged" / "config.json").exists():
        return f"pretrained={shown(where / 'merged')}"
    adapter_config = where / "adapter_config.json"
    if adapter_config.exists():
        settings = json.loads(adapter_config.read_text())
        base = follow(model_location(settings["base_model_name_or_path"], root))
        base_config = Path(base) / "config.json"
        tied = base_config.exists() and json.loads(base_config.read_text()).get("tie_word_embeddings", False)
        if settings.get("trainable_token_indices") and tied:
            raise QllmError(
                f"{model_dir}: lm_eval cannot load this adapter with peft= (it trains token embeddings, `trainable_tokens`, of a "
                "base with tied embeddings: lm_eval's tie_weights() on the PEFT model fails); write merged/ "
                "(`adapter.merge: true`) and evaluate that"
            )
        return f"pretrained={shown(base)},peft={shown(where)}"
    if not where.is_dir():
        elsewhere = not given.is_absolute() and root.resolve() != Path.cwd().resolve()
        raise QllmError(f"{model_dir}: no such model directory" + (f" in {root.resolve()}" if elsewhere else ""))
    return f"pretrained={shown(follow(where))}"


def command(model_dir: Path | str, root: Path | str = ".") -> list[str]:
    """The `lm_eval` command line that scores `model_dir`, to run in the project `root` (the task
    reads `data/prepared/chat` there; `main` prints a `cd` in front when root is elsewhere)."""
    tasks_dir = TASKS_DIR.relative_to(Path(root).resolve()) if TASKS_DIR.is_relative_to(Path(root).resolve()) else TASKS_DIR
    return ["lm_eval", "--model", "hf", "--model_args", model_args(model_dir, root), "--include_path", str(tasks_dir),
            "--tasks", TASK, "--apply_chat_template"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.core.evaluation.lm_eval", description=__doc__.split("\n", 1)[0])
    parser.add_argument("models", nargs="+", help="model directories the pipeline saved, relative to the project root (e.g. data/models/sft)")
    parser.add_argument("--root", default=".", help="project root: model directories and adapters' bases are relative to it (default: .)")
    args = parser.parse_args(argv)
    root = Path(args.root)
    elsewhere = root.resolve() != Path.cwd().resolve()
    try:
        for model_dir in args.models:
            line = shlex.join(command(model_dir, root))
            print(f"cd {shlex.quote(str(root.resolve()))} && {line}" if elsewhere else line)
    except QllmError as exc:
        parser.exit(2, f"error: {exc}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
