"""KTO, ORPO and SimPO step time: the `dpo` stage's step vs TRL's `KTOTrainer`, `ORPOTrainer` and
`CPOTrainer(loss_type="simpo")`.

    python -m benchmarks.peers.peer_preference [--methods kto orpo simpo] [--steps 30] [--trials 3] [--precision auto|fp32|bf16] [--project .] [--set dpo.KEY=VALUE]

Reads a finished `qllm run --until ref_logprobs` of the project (nothing is written there): the SFT
model, its tokenizer and chat template, the train pairs as `ref_logprobs` encoded them and the same
pairs as prepared records, which TRL tokenizes itself. For KTO both sides get the pairs split into
desirable and undesirable examples (ours: `ref_logprobs.run(method="kto")` into a temporary
directory; TRL: `{prompt, completion, label}` records, all desirable first, as
`trl.data_utils.unpair_preference_dataset` orders them), with the reference precomputed (ours:
that pass; TRL: `precompute_ref_log_probs=True`, in its constructor); neither is timed.

Step time, in one process, trials alternating (ours, TRL, ours, ...) so that machine noise hits
both alike; the first steps of every trial are warm-up and not timed. Both start from a fresh copy
of the SFT model and train params.yaml's `dpo` policy (by default a rank-4 LoRA on the last
decoder layer) with the same micro-batch (pairs, or KTO examples), learning rate, betas,
clipping, cosine schedule, optimizer, precision (`auto`: what this machine trains in), `max_length`
(that of the reference pass), no gradient checkpointing, evaluation or saving, and the method's
settings: KTO beta 0.1 with weights 1; ORPO lambda (`beta`) 0.1; SimPO beta 2.0, gamma 0.5 with no
NLL term (`cpo_alpha=0`). What each computes per step is the same work but for: TRL's ORPO takes
its NLL over the prompt tokens as well and from full logits; TRL's sequences end one token later
(the newline after `<|im_end|>`). Prints ms/step per trial, medians and the ratios ours/TRL (below
1: ours is faster).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import pandas as pd
import torch

from benchmarks.common import REPO
from benchmarks.peers.peer_dpo import WARMUP, fresh_policy, load_run, trainer_args
from pipelines import dpo, ref_logprobs
from pipelines.core.data.chat_template import parse_messages
from pipelines.core.extensions import Hook
from pipelines.core.models import adapters
from pipelines.core.params import files as params_file
from pipelines.core.preference import preference_data
from pipelines.core.training import loop, precision

SETTINGS = {
    "kto": {"method": "kto", "beta": 0.1},
    "orpo": {"method": "orpo", "beta": 0.1},
    "simpo": {"method": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "sft_weight": 0.0},
}


def _answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def trl_trainer(method: str, model, tokenizer, records: pd.DataFrame, dpo_params, cfg, max_length: int, out: str, callbacks=()):
    """TRL's trainer for `method` on a copy of `model` with the settings of `dpo_params`."""
    from datasets import Dataset

    common = trainer_args(cfg, out) | {"beta": dpo_params.beta, "max_length": max_length}
    prompts = [parse_messages(p) for p in records["prompt"]]
    lora = dpo_params.adapter
    policy = copy.deepcopy(model)
    peft_config = None
    if lora.enabled:
        peft_config = adapters.lora_config(lora, adapters.token_ids(tokenizer, lora.trainable_tokens, "dpo.adapter"), adapters.layer_indices(policy, lora, "dpo.adapter"))
    if method == "kto":
        from trl import KTOConfig, KTOTrainer

        data = Dataset.from_dict({"prompt": prompts + prompts, "completion": [_answer(c) for c in records["chosen"]] + [_answer(r) for r in records["rejected"]],
                                  "label": [True] * len(records) + [False] * len(records)})  # fmt: skip
        args = KTOConfig(**common, precompute_ref_log_probs=True, desirable_weight=dpo_params.desirable_weight, undesirable_weight=dpo_params.undesirable_weight)
        return KTOTrainer(policy, None, args=args, train_dataset=data, processing_class=tokenizer, peft_config=peft_config, callbacks=list(callbacks))
    pairs = Dataset.from_dict({"prompt": prompts, "chosen": [_answer(c) for c in records["chosen"]], "rejected": [_answer(r) for r in records["rejected"]]})
    if method == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        return ORPOTrainer(policy, args=ORPOConfig(**common), train_dataset=pairs, processing_class=tokenizer, peft_config=peft_config, callbacks=list(callbacks))
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    args = CPOConfig(**common, loss_type="simpo", cpo_alpha=0.0, simpo_gamma=dpo_params.simpo_gamma, label_smoothing=dpo_params.label_smoothing)
    return CPOTrainer(policy, args=args, train_dataset=pairs, processing_class=tokenizer, peft_config=peft_config, callbacks=list(callbacks))


def time_ours(base, tokenizer, items: list, make, dpo_params, cfg) -> float:
    """Seconds per step of the `dpo` stage's loop for the method (its cached inputs)."""
    policy = fresh_policy(base, tokenizer, dpo_params, "dpo", cfg.seed)
    marks: list[float] = []
    batches = loop.Batches(len(items), cfg.micro_batch_size, cfg.seed, make)
    loop.train(policy, dpo.dpo_loss(dpo_params), batches, cfg, extensions=[Hook("on_step_end", lambda state, metrics: marks.append(time.perf_counter()))])
    return (marks[-1] - marks[WARMUP - 1]) / (cfg.max_steps - WARMUP)


def time_trl(method: str, base, tokenizer, records, dpo_params, cfg, max_length: int) -> float:
    """Seconds per step of the TRL trainer's `train` (its constructor, tokenization and any precompute pass untimed)."""
    from transformers import TrainerCallback

    marks: list[float] = []

    class Mark(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        trl_trainer(method, base, tokenizer, records, dpo_params, cfg, max_length, out, callbacks=[Mark()]).train()
    return (marks[-1] - marks[WARMUP - 1]) / (cfg.max_steps - WARMUP)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"])
    parser.add_argument("--project", type=Path, default=REPO, help="a project with a finished `qllm run --until ref_logprobs`")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="dpo.KEY=VALUE", help="e.g. dpo.train.attention=eager (ours only)")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than the {WARMUP} warm-up steps")

    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")  # transformers 5's renames TRL 1.16 still uses; TRL's experimental-API notices
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    root = args.project.resolve()
    base, tokenizer, pairs, records, max_length = load_run(root)
    params, _ = params_file.load(root, overrides=args.overrides)
    resolved = precision.resolve(args.precision)
    cfg = params.dpo.train.model_copy(update={"max_steps": args.steps, "warmup_steps": 0, "eval_every": 0, "checkpoint_every": 0,
                                              "log_every": 10, "precision": resolved, "extensions": []})  # fmt: skip
    pad = tokenizer.pad_token_id
    summary = []
    for method in args.methods:
        dpo_params = params.dpo.model_copy(update={**SETTINGS[method], "train": cfg})
        if method == "kto":
            with tempfile.TemporaryDirectory() as tmp:
                sft = root / "data/models/sft"
                ref_logprobs.run(root, sft, root / "data/prepared/preference", Path(tmp) / "ref", params.ref_logprobs.model_copy(update={"max_length": max_length}), "kto")
                items = dpo.load_examples(Path(tmp) / "ref", "train")
            make = preference_data.collate_examples(items, pad)
        else:
            items, make = pairs, preference_data.collate(pairs, pad)
        print(f"{method} step: {sum(p.numel() for p in base.parameters()) / 1e6:.2f}M-parameter model, policy {dpo_params.adapter}, {len(items)} "
              f"{'examples' if method == 'kto' else 'pairs'}, {cfg.micro_batch_size} a step, max_length {max_length}, {resolved}, "
              f"{torch.get_num_threads()} threads, {args.steps - WARMUP} timed steps x {args.trials} trials", flush=True)  # fmt: skip
        ours, trl = [], []
        for trial in range(args.trials):
            ours.append(time_ours(base, tokenizer, items, make, dpo_params, cfg))
            trl.append(time_trl(method, base, tokenizer, records, dpo_params, cfg, max_length))
            print(f"  trial {trial + 1}: ours {1000 * ours[-1]:.1f}, TRL {1000 * trl[-1]:.1f} ms/step", flush=True)
        ratios = sorted(a / b for a, b in zip(ours, trl, strict=True))
        line = (f"{method}: median ours {1000 * statistics.median(ours):.1f}, TRL {1000 * statistics.median(trl):.1f} ms/step; "
                f"ours/TRL per trial median {statistics.median(ratios):.3f}, range {ratios[0]:.3f}-{ratios[-1]:.3f}")  # fmt: skip
        print(line, flush=True)
        summary.append(line)
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
