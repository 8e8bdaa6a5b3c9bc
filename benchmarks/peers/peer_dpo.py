"""DPO step time: the `dpo` stage's step vs TRL's `DPOTrainer`; reference log-probs vs TRL's.

    python -m benchmarks.peers.peer_dpo [--steps 30] [--trials 3] [--precision auto|fp32|bf16] [--logps] [--project .]

Reads a finished `qllm run --until ref_logprobs` of the project (nothing is written there): the
reference model (`data/ref_logprobs/meta.json`, the SFT model), its tokenizer and chat template,
the train pairs as `ref_logprobs` encoded them (`data/ref_logprobs/train.parquet`) and the same
pairs as prepared records (`data/prepared/preference/train.parquet`), which TRL tokenizes itself.

Step time, in one process, trials alternating (ours, ours-live, TRL precomputed, TRL live, ours,
...) so that machine noise hits all alike; the first steps of every trial are warm-up and not
timed. Every one starts from a fresh copy of the same model and trains params.yaml's `dpo` policy
(by default a rank-4 LoRA on q/k/v/o/gate/up/down of the last decoder layer only; `dpo.adapter:
none` trains all weights) with the same micro-batch, learning rate, betas, clipping, cosine
schedule, optimizer (fused AdamW), loss (`dpo.loss_type` and `beta`; TRL's `ipo` divides each
log-ratio by the answer's token count, ours does not: the same arithmetic cost), `max_length` (that
of the reference pass), precision (`auto`: what this machine trains in) and no gradient
checkpointing, evaluation or saving:

- `ours`: the step `pipelines/dpo.py` runs (`pipelines.core.training.loop.train` with `dpo.dpo_loss`):
  one policy forward over `[chosen; rejected]`, reference log-probs read from the batch (the
  `ref_logprobs` cache);
- `ours-live`: the same with the reference computed every step (the adapter disabled, or a frozen
  copy for `adapter: none`), as `benchmarks/speed/dpo_reference.py` does;
- `TRL precomputed`: `DPOTrainer(precompute_ref_log_probs=True)`; its reference pass runs in the
  trainer's constructor and is not timed, as our `ref_logprobs` stage is not;
- `TRL live`: `precompute_ref_log_probs=False`, a reference forward (adapter disabled) each step.

Both sample the train pairs in their own seeded order and drop the last partial batch. TRL's
sequences are one token longer (the newline after `<|im_end|>`, below). Prints ms/step per
trial, medians, and the ratios ours/TRL (below 1: ours is faster).

Reference log-probs (also alone, with `--logps`): the train pairs scored in fp32 by our
`ref_logprobs.score` and by TRL's precompute pass (`DPOTrainer(precompute_ref_log_probs=True)`,
its own tokenization of the conversational records). TRL applies the chat template itself to
message lists, rendering the prompt (generation prompt on) and `prompt + [answer]`, appends no EOS
(a BOS only if the template writes one), and takes as completion everything after their longest
common prefix. With our template the prompt ends at `assistant:` on a token boundary, so both put
the answer at the same token, but TRL's completion ends with the template's `\n` after
`<|im_end|>`, which we do not score (`pipelines/core/preference/preference_data.py`). Prints whether the
tokens agree so, and the largest difference as is and after adding to ours the log-probability
of those trailing template tokens.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from benchmarks.common import REPO
from pipelines import dpo, ref_logprobs
from pipelines.core.data.chat_template import parse_messages
from pipelines.core.errors import QllmError
from pipelines.core.extensions import Hook
from pipelines.core.models import adapters
from pipelines.core.models.models import CONSTRUCTION, load_for_inference
from pipelines.core.params import files as params_file
from pipelines.core.preference import preference_data
from pipelines.core.training import loop, precision

WARMUP = 3
MODES = ("ours", "ours-live", "TRL precomputed", "TRL live")


def load_run(root: Path):
    """(reference model, tokenizer, encoded train pairs, the same prepared records, max_length)."""
    ref_dir, prepared = root / "data/ref_logprobs", root / "data/prepared/preference/train.parquet"
    meta_path = ref_dir / "meta.json"
    missing = [p for p in (meta_path, ref_dir / "train.parquet", prepared) if not p.exists()]
    if not missing:
        meta = json.loads(meta_path.read_text())
        missing = [] if (root / meta["reference"]).exists() else [root / meta["reference"]]
    if missing:
        raise QllmError(f"{', '.join(map(str, missing))} missing: run `qllm run --until ref_logprobs` in {root} first")
    model, tokenizer = load_for_inference(root / meta["reference"], root)
    pairs = dpo.load_pairs(ref_dir, "train")
    records = pd.read_parquet(prepared).set_index("id").loc[[p.id for p in pairs]].reset_index()
    return model, tokenizer, pairs, records, int(meta["max_length"])


def trl_dataset(records: pd.DataFrame):
    """Prepared preference records in TRL's conversational form: prompt messages and one assistant message each."""
    from datasets import Dataset

    def answer(text: str) -> list[dict]:
        return [{"role": "assistant", "content": text}]

    return Dataset.from_dict({"id": [str(i) for i in records["id"]], "prompt": [parse_messages(p) for p in records["prompt"]],
                              "chosen": [answer(c) for c in records["chosen"]], "rejected": [answer(r) for r in records["rejected"]]})  # fmt: skip


def trainer_args(cfg, out: str) -> dict:
    """The `transformers.TrainingArguments` a TRL trainer gets to match the loop's `cfg`: steps,
    batch, learning rate and schedule, AdamW, clipping, precision, CPU, nothing saved or logged."""
    return dict(
        output_dir=out, max_steps=cfg.max_steps, per_device_train_batch_size=cfg.micro_batch_size, learning_rate=cfg.lr,
        weight_decay=cfg.weight_decay, adam_beta1=cfg.beta1, adam_beta2=cfg.beta2, max_grad_norm=cfg.max_grad_norm,
        lr_scheduler_type="cosine", warmup_steps=0, bf16=cfg.precision == "bf16", fp16=False, gradient_checkpointing=cfg.gradient_checkpointing,
        optim="adamw_torch_fused" if cfg.optimizer == "adamw_fused" else "adamw_torch", use_cpu=True, save_strategy="no",
        report_to=[], logging_steps=10, disable_tqdm=True, dataloader_num_workers=0, dataloader_drop_last=True, seed=cfg.seed,
    )  # fmt: skip


def trl_trainer(model, tokenizer, records: pd.DataFrame, dpo_params, cfg, *, precompute: bool, max_length: int, out: str, callbacks=()):
    """`trl.DPOTrainer` on a copy of `model` with the settings of `dpo_params` (its `train` as `cfg`)."""
    from trl import DPOConfig, DPOTrainer

    loss_types, weights = [dpo_params.loss_type], [1.0]
    if dpo_params.sft_weight:
        loss_types, weights = [*loss_types, "sft"], [1.0, dpo_params.sft_weight]
    args = DPOConfig(
        **trainer_args(cfg, out), beta=dpo_params.beta, loss_type=loss_types, loss_weights=weights, label_smoothing=dpo_params.label_smoothing,
        precompute_ref_log_probs=precompute, max_length=max_length,
    )  # fmt: skip
    policy, peft_config, reference = copy.deepcopy(model), None, None
    if dpo_params.adapter.enabled:
        lora = dpo_params.adapter
        peft_config = adapters.lora_config(lora, adapters.token_ids(tokenizer, lora.trainable_tokens, "dpo.adapter"), adapters.layer_indices(policy, lora, "dpo.adapter"))
    elif not precompute:
        reference = copy.deepcopy(model).eval().requires_grad_(False)  # as ours-live: a frozen copy, not a reload from disk
    return DPOTrainer(policy, reference, args=args, train_dataset=trl_dataset(records), processing_class=tokenizer,
                      peft_config=peft_config, callbacks=list(callbacks))  # fmt: skip


def trl_precomputed(model, tokenizer, records: pd.DataFrame, max_length: int, batch_size: int = 16) -> pd.DataFrame:
    """`records` as `trl.DPOTrainer` prepares them (`prompt_ids`, `chosen_ids`, `rejected_ids`: its
    own tokenization) with its reference log-probs (`ref_chosen_logps`, `ref_rejected_logps`: its
    own precompute pass, in fp32 with `model` as the reference), in the order of `records`."""
    import datasets

    from pipelines.core.params.preference import DpoParams
    from pipelines.core.params.training import TrainParams

    datasets.disable_progress_bars()
    os.environ.setdefault("TQDM_DISABLE", "1")
    params = DpoParams(adapter={"enabled": False}, train=TrainParams(max_steps=1, warmup_steps=0, micro_batch_size=batch_size, precision="fp32"))
    with tempfile.TemporaryDirectory() as out:
        dataset = trl_trainer(model, tokenizer, records, params, params.train, precompute=True, max_length=max_length, out=out).train_dataset
        columns = ["id", "prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logps", "ref_rejected_logps"]
        prepared = pd.DataFrame({name: dataset[name] for name in columns})
    return prepared.set_index("id").loc[[str(i) for i in records["id"]]].reset_index()


def template_tails(tokenizer, records: pd.DataFrame, pairs: list[preference_data.Pair]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per pair, the token ids the chat template renders after our chosen and rejected sequences
    end (after the answer's `<|im_end|>`): what TRL's completions have in addition to ours."""
    tails = []
    for row, pair in zip(records.itertuples(index=False), pairs, strict=True):
        both = []
        for answer, ids in ((row.chosen, pair.chosen_ids), (row.rejected, pair.rejected_ids)):
            messages = [*parse_messages(row.prompt), {"role": "assistant", "content": answer}]
            full = np.asarray(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"], dtype=np.int64)
            if not np.array_equal(full[: len(ids)], ids):
                raise QllmError(f"pair {pair.id!r}: our sequence is not a prefix of the rendered conversation")
            both.append(full[len(ids) :])
        tails.append((both[0], both[1]))
    return tails


@torch.no_grad()
def tail_logps(model, pairs: list[preference_data.Pair], tails: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Summed log-probabilities of each pair's template tail after its chosen / rejected sequence (rows: chosen, rejected)."""
    model.eval()
    out = np.zeros((len(pairs), 2))
    for i, (pair, pair_tails) in enumerate(zip(pairs, tails, strict=True)):
        for j, (ids, tail) in enumerate(zip((pair.chosen_ids, pair.rejected_ids), pair_tails, strict=True)):
            sequence = torch.from_numpy(np.concatenate([ids, tail]))
            logps = model(input_ids=sequence[None], use_cache=False).logits[0, len(ids) - 1 : -1].float().log_softmax(-1)
            out[i, j] = float(logps.gather(-1, sequence[len(ids) :, None]).sum())
    return out


def compare_logps(model, tokenizer, pairs, records, max_length: int) -> None:
    ours_pairs = copy.deepcopy(pairs)
    ref_logprobs.score(model, ours_pairs, tokenizer.pad_token_id, batch_size=32)  # the stage's own pass, here and now
    ours = np.asarray([[p.ref_chosen, p.ref_rejected] for p in ours_pairs])
    cached = np.asarray([[p.ref_chosen, p.ref_rejected] for p in pairs])
    tails = template_tails(tokenizer, records, pairs)
    trailing = tail_logps(model, pairs, tails)
    prepared = trl_precomputed(model, tokenizer, records, max_length)
    trl = prepared[["ref_chosen_logps", "ref_rejected_logps"]].to_numpy(np.float64)
    spelled = ", ".join(sorted({repr(tokenizer.decode(t)) for pair_tails in tails for t in pair_tails}))
    print(f"reference log-probs of {len(pairs)} train pairs x (chosen, rejected), fp32: ours (ref_logprobs.score; the cache "
          f"differs from it by at most {np.abs(cached - ours).max():.2e}) vs TRL's precompute pass")  # fmt: skip
    print(f"  tokens: in {same_split(prepared, pairs, tails).sum()} of {len(pairs)} pairs TRL's prompt is ours and its completions "
          f"are ours plus the template's {spelled} after <|im_end|>")  # fmt: skip
    print(f"  raw: max |ours - TRL| {np.abs(ours - trl).max():.4f} nats, mean TRL - ours {(trl - ours).mean():.4f}")
    print(f"  log-prob of that tail under the reference: mean {trailing.mean():.4f} ({trailing.min():.4f} to {trailing.max():.4f})")
    print(f"  aligned: max |ours + tail - TRL| {np.abs(ours + trailing - trl).max():.2e} nats")


def same_split(prepared: pd.DataFrame, pairs: list[preference_data.Pair], tails: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Per pair: is TRL's prompt (`trl_precomputed`) our prompt, and are its chosen and rejected
    completions our answers followed by the template tails?"""
    return np.asarray([
        list(row.prompt_ids) == p.chosen_ids[: p.prompt_length].tolist()
        and list(row.chosen_ids) == [*p.chosen_ids[p.prompt_length :], *chosen_tail]
        and list(row.rejected_ids) == [*p.rejected_ids[p.prompt_length :], *rejected_tail]
        for row, p, (chosen_tail, rejected_tail) in zip(prepared.itertuples(index=False), pairs, tails, strict=True)
    ])  # fmt: skip


def fresh_policy(base, tokenizer, params, section: str, seed: int):
    """A copy of `base` as a stage trains it: all weights, or under the LoRA adapter `params`
    (`params.adapter`) builds, initialised from `seed`."""
    policy = copy.deepcopy(base)
    with CONSTRUCTION:
        torch.manual_seed(seed)
        if params.adapter.enabled:
            policy = adapters.wrap(params.adapter, f"{section}.adapter")(policy, tokenizer)
    return policy


def time_ours(base, tokenizer, pairs, dpo_params, cfg, live: bool) -> float:
    """Seconds per step of the `dpo` stage's loop (reference cached, or computed every step)."""
    policy = fresh_policy(base, tokenizer, dpo_params, "dpo", cfg.seed)
    reference = None
    if live and dpo_params.adapter.enabled:

        def reference(batch):  # under the loop's autocast and dpo_loss's no_grad
            with policy.disable_adapter():
                return preference_data.sequence_logps(policy, batch)

    elif live:
        frozen = copy.deepcopy(base).eval().requires_grad_(False)

        def reference(batch):
            return preference_data.sequence_logps(frozen, batch)

    marks: list[float] = []
    batches = loop.Batches(len(pairs), cfg.micro_batch_size, cfg.seed, preference_data.collate(pairs, tokenizer.pad_token_id))
    loop.train(policy, dpo.dpo_loss(dpo_params, reference), batches, cfg, extensions=[Hook("on_step_end", lambda state, metrics: marks.append(time.perf_counter()))])
    return (marks[-1] - marks[WARMUP - 1]) / (cfg.max_steps - WARMUP)


def time_trl(base, tokenizer, records, dpo_params, cfg, max_length: int, precompute: bool) -> float:
    """Seconds per step of `trl.DPOTrainer.train` (its constructor, tokenization and precompute pass untimed)."""
    from transformers import TrainerCallback

    marks: list[float] = []

    class Mark(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        trl_trainer(base, tokenizer, records, dpo_params, cfg, precompute=precompute, max_length=max_length, out=out, callbacks=[Mark()]).train()
    return (marks[-1] - marks[WARMUP - 1]) / (cfg.max_steps - WARMUP)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"])
    parser.add_argument("--logps", action="store_true", help="only compare the reference log-probs with TRL's")
    parser.add_argument("--project", type=Path, default=REPO, help="a project with a finished `qllm run --until ref_logprobs`")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than the {WARMUP} warm-up steps")

    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5's renames TRL 1.16 still uses
    os.environ.setdefault("TQDM_DISABLE", "1")
    root = args.project.resolve()
    base, tokenizer, pairs, records, max_length = load_run(root)
    compare_logps(base, tokenizer, pairs, records, max_length)
    if args.logps:
        return 0

    params, _ = params_file.load(root)
    resolved = precision.resolve(args.precision)
    cfg = params.dpo.train.model_copy(update={"max_steps": args.steps, "warmup_steps": 0, "eval_every": 0, "checkpoint_every": 0,
                                              "log_every": 10, "precision": resolved, "extensions": []})  # fmt: skip
    dpo_params = params.dpo.model_copy(update={"train": cfg})
    lora = dpo_params.adapter
    policy = (f"LoRA r={lora.r} alpha={lora.lora_alpha:g} on {'/'.join(lora.target_modules)} of layers "
              f"{adapters.layer_indices(base, lora, 'dpo.adapter') or 'all'}" if lora.enabled else "all weights")  # fmt: skip
    print(f"dpo step: {sum(p.numel() for p in base.parameters()) / 1e6:.2f}M-parameter reference, policy {policy}, {len(pairs)} pairs, "
          f"{cfg.micro_batch_size} pairs/step, max_length {max_length}, loss {dpo_params.loss_type} beta {dpo_params.beta:g}, {resolved}, "
          f"optimizer {cfg.optimizer}, {torch.get_num_threads()} threads, {args.steps - WARMUP} timed steps x {args.trials} trials")  # fmt: skip
    results: dict[str, list[float]] = {mode: [] for mode in MODES}
    for trial in range(args.trials):
        results["ours"].append(time_ours(base, tokenizer, pairs, dpo_params, cfg, live=False))
        results["ours-live"].append(time_ours(base, tokenizer, pairs, dpo_params, cfg, live=True))
        results["TRL precomputed"].append(time_trl(base, tokenizer, records, dpo_params, cfg, max_length, precompute=True))
        results["TRL live"].append(time_trl(base, tokenizer, records, dpo_params, cfg, max_length, precompute=False))
        print(f"trial {trial + 1}: " + ", ".join(f"{mode} {1000 * values[-1]:.1f}" for mode, values in results.items()) + " ms/step")
    median = {mode: statistics.median(values) for mode, values in results.items()}
    print("median: " + ", ".join(f"{mode} {1000 * m:.1f}" for mode, m in median.items()) + " ms/step")
    print(f"ours/TRL precomputed {median['ours'] / median['TRL precomputed']:.3f}, ours/TRL live {median['ours'] / median['TRL live']:.3f}, "
          f"ours-live/TRL live {median['ours-live'] / median['TRL live']:.3f} (ratios of medians; below 1: ours is faster)")  # fmt: skip
    # The modes of one trial run seconds apart, so their ratio is less exposed to a busy machine.
    for ours, peer in (("ours", "TRL precomputed"), ("ours", "TRL live"), ("ours-live", "TRL live")):
        ratios = sorted(a / b for a, b in zip(results[ours], results[peer], strict=True))
        print(f"{ours}/{peer} per trial: median {statistics.median(ratios):.3f}, range {ratios[0]:.3f}-{ratios[-1]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
