"""The one training loop every training stage shares (pretrain today; SFT, LoRA, DPO build on it).

A method differs only in what it hands the loop:

- `loss_fn(model, batch) -> (loss, metrics)`: the objective (causal LM, completion-only, DPO, ...);
  its metrics are averaged over accumulation steps and logged under their own names
- `batches`: a resumable, seeded order over its data (`Batches`)
- `val_fn(model) -> metrics`: validation, with `val/loss` driving early stopping and "best"
- `callbacks`: functions called at fixed points with the loop state: `"gradients"` (after
  backward and unscaling, before clipping: the raw gradients of the step are in `.grad`),
  `"step_end"`, `"eval"`

The loop owns the rest: AdamW with no-decay groups, warmup + cosine/linear schedule, gradient
accumulation, clipping, bf16 autocast (AMX on CPU), progress bar, MLflow metrics, checkpoints and
exact resume, early stopping, and refusing to continue on a non-finite loss.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipelines.checkpoint import CheckpointManager, rng_state, set_rng_state
from pipelines.config import TrainParams
from pipelines.errors import QllmError

log = logging.getLogger("qllm.training")

LossFn = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, dict[str, Any]]]
Callback = Callable[[str, "TrainState", dict[str, float]], None]


class NonFiniteLossError(QllmError):
    """Training produced a NaN/inf loss or gradient norm."""


@dataclass
class TrainState:
    """Loop state saved in checkpoints."""

    step: int = 0
    tokens: int = 0
    best_val_loss: float = math.inf
    best_step: int = -1
    evals_without_improvement: int = 0
    stop: bool = False
    history: dict[str, list[list[float]]] = field(default_factory=lambda: {"train": [], "eval": []})
    """`train`: [step, train/loss, lr] per logged step; `eval`: [step, val/loss] per evaluation
    (kept in checkpoints, so a resumed run's curves are complete)."""


class Batches:
    """Seeded, resumable micro-batch order over `n` examples.

    Each epoch is a fresh permutation drawn from `seed + epoch`, so the order depends only on
    (seed, epoch, position): a resumed run continues exactly where the killed one stopped. The
    last partial batch of an epoch is dropped to keep every micro-batch the same size.
    """

    def __init__(self, n: int, batch_size: int, seed: int, collate: Callable[[np.ndarray], Any], shuffle: bool = True):
        if n <= 0:
            raise QllmError("no training examples")
        self.n = n
        self.batch_size = min(batch_size, n)
        self.seed = seed
        self.collate = collate
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order: tuple[int, np.ndarray] | None = None

    def _permutation(self) -> np.ndarray:
        if self._order is None or self._order[0] != self.epoch:
            order = np.random.default_rng(self.seed + self.epoch).permutation(self.n) if self.shuffle else np.arange(self.n)
            self._order = (self.epoch, order)
        return self._order[1]

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self.position + self.batch_size > self.n:
            self.epoch += 1
            self.position = 0
        indices = self._permutation()[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return self.collate(indices)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only: biases, norm weights and embeddings get no weight decay."""
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        (decay if parameter.ndim >= 2 and "embed" not in name else no_decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: TrainParams) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def lr_multiplier(step: int, cfg: TrainParams) -> float:
    """Linear warmup to 1, then cosine/linear decay to `min_lr_ratio` at `max_steps`."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16/fp16 autocast (weights and optimizer stay fp32); a no-op for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "fp16" and device.type != "cuda":
        raise QllmError("precision fp16 needs a CUDA device; use bf16 on CPU")
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def causal_lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
    """Next-token cross-entropy over every position (labels = inputs; the model shifts them)."""
    labels = batch.get("labels", batch["input_ids"])
    extra = {k: v for k, v in batch.items() if k in ("attention_mask", "position_ids")}
    output = model(input_ids=batch["input_ids"], labels=labels, **extra)
    return output.loss, {}


@torch.no_grad()
def mean_loss(model: torch.nn.Module, loss_fn: LossFn, batches: list[Any], device: torch.device, precision: str) -> float:
    """Average loss over fixed batches in eval mode (no dropout, no gradients)."""
    was_training = model.training
    model.eval()
    total = 0.0
    for batch in batches:
        with autocast(device, precision):
            loss, _ = loss_fn(model, to_device(batch, device))
        total += float(loss)
    model.train(was_training)
    return total / max(1, len(batches))


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, dict):
        return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return batch


def _batch_tokens(batch: Any) -> int:
    if isinstance(batch, dict):
        if "num_tokens" in batch:
            return int(batch["num_tokens"])
        return int(batch["input_ids"].numel())
    return 0


def early_stopping(patience: int) -> Callback:
    """Stop after `patience` evaluations without a new best validation loss."""

    def callback(event: str, state: TrainState, metrics: dict[str, float]) -> None:
        if event == "eval" and patience and state.evals_without_improvement >= patience:
            log.info("early stopping at step %d: no better val/loss for %d evaluations (best %.4f at step %d)",
                     state.step, patience, state.best_val_loss, state.best_step)
            state.stop = True

    return callback


def train(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: Batches,
    cfg: TrainParams,
    *,
    val_fn: Callable[[torch.nn.Module], dict[str, float]] | None = None,
    tracker=None,
    checkpoints: CheckpointManager | None = None,
    callbacks: list[Callback] = (),
    desc: str = "train",
) -> dict[str, Any]:
    """Train `model` for `cfg.max_steps` optimizer steps; returns summary metrics.

    With `checkpoints`, resumes from the newest valid checkpoint there (weights, optimizer,
    schedule, RNG, data position, loop state) and saves every `cfg.checkpoint_every` steps and at
    every new best validation loss. With early stopping on, the best weights are restored at the end.
    """
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    optimizer = build_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    trainable = [p for p in model.parameters() if p.requires_grad]
    state = TrainState()
    callbacks = [*callbacks, early_stopping(cfg.early_stopping_patience)]

    def snapshot() -> dict[str, Any]:
        return {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "rng": rng_state(),
            "batches": batches.state_dict(),
            "loop": asdict(state),
        }

    if checkpoints is not None and (latest := checkpoints.latest_valid()) is not None:
        saved = checkpoints.load(latest.path, model)
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        scaler.load_state_dict(saved["scaler"])
        batches.load_state_dict(saved["batches"])
        set_rng_state(saved["rng"])
        state = TrainState(**saved["loop"])
        log.info("%s: resumed from step %d (%s)", desc, state.step, latest.path)

    model.train()
    progress = tqdm(total=cfg.max_steps, initial=state.step, desc=desc, unit="step", disable=None, mininterval=1.0, dynamic_ncols=True)
    window_tokens, window_start = 0, time.perf_counter()
    started, start_step = time.perf_counter(), state.step
    last: dict[str, float] = {}
    while state.step < cfg.max_steps and not state.stop:
        loss_sum = torch.zeros((), device=device)
        extra: dict[str, float] = {}
        for _ in range(cfg.grad_accum_steps):
            batch = to_device(next(batches), device)
            with autocast(device, cfg.precision):
                loss, metrics = loss_fn(model, batch)
            scaler.scale(loss / cfg.grad_accum_steps).backward()
            loss_sum += loss.detach()
            for key, value in metrics.items():
                extra[key] = extra.get(key, 0.0) + float(value) / cfg.grad_accum_steps
            window_tokens += _batch_tokens(batch)
        scaler.unscale_(optimizer)
        for callback in callbacks:
            callback("gradients", state, {})
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, max_norm)
        train_loss = loss_sum / cfg.grad_accum_steps
        if not (torch.isfinite(train_loss) and torch.isfinite(grad_norm)):
            raise NonFiniteLossError(
                f"{desc}: non-finite loss ({float(train_loss)}) or gradient norm ({float(grad_norm)}) at step {state.step + 1}; "
                "the last good checkpoint is kept. Try a lower learning rate or precision fp32."
            )
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1

        if state.step % cfg.log_every == 0 or state.step == cfg.max_steps:
            elapsed = time.perf_counter() - window_start
            last = {
                "train/loss": float(train_loss),
                "train/lr": scheduler.get_last_lr()[0],
                "train/grad_norm": float(grad_norm),
                "train/tokens_per_sec": window_tokens / max(elapsed, 1e-9),
                **extra,  # the objective's own metrics, under the names it chose (e.g. rewards/chosen)
            }
            state.tokens += window_tokens
            window_tokens, window_start = 0, time.perf_counter()
            state.history["train"].append([state.step, last["train/loss"], last["train/lr"]])
            if tracker is not None:
                tracker.log_metrics(last, step=state.step)
            progress.set_postfix(loss=f"{last['train/loss']:.4f}", tok_s=f"{last['train/tokens_per_sec']:.0f}", refresh=False)
        for callback in callbacks:
            callback("step_end", state, last)

        is_best = False
        eval_due = cfg.eval_every and state.step % cfg.eval_every == 0
        if val_fn is not None and (eval_due or state.step == cfg.max_steps):
            val = val_fn(model)
            if tracker is not None:
                tracker.log_metrics(val, step=state.step)
            state.history["eval"].append([state.step, val["val/loss"]])
            if val["val/loss"] < state.best_val_loss:
                state.best_val_loss, state.best_step, state.evals_without_improvement = val["val/loss"], state.step, 0
                is_best = True
            else:
                state.evals_without_improvement += 1
            log.info("%s step %d/%d: train/loss %.4f, val/loss %.4f", desc, state.step, cfg.max_steps, float(train_loss), val["val/loss"])
            last |= val
            for callback in callbacks:
                callback("eval", state, val)
        if checkpoints is not None and (is_best or (cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0)):
            checkpoints.save(state.step, model, snapshot(), best=is_best)
        progress.update(1)
    progress.close()
    state.tokens += window_tokens

    if cfg.early_stopping_patience and checkpoints is not None and state.best_step > 0 and state.best_step != state.step:
        best = checkpoints.latest_valid(step=state.best_step)
        if best is not None:
            checkpoints.load(best.path, model)
            log.info("%s: restored the best weights (step %d, val/loss %.4f)", desc, state.best_step, state.best_val_loss)

    seconds = time.perf_counter() - started
    steps_run = state.step - start_step
    return {
        "steps": state.step,
        "tokens": state.tokens,
        "train_loss": last.get("train/loss", float("nan")),
        "best_val_loss": state.best_val_loss,
        "best_step": state.best_step,
        "train_seconds": round(seconds, 3),
        "steps_per_second": round(steps_run / max(seconds, 1e-9), 4),
        "stopped_early": state.stop,
        "history": state.history,
        **{k: v for k, v in last.items() if k.startswith("val/")},
    }


TRAINING_LOG = "training_log.csv"
EVAL_LOG = "eval_log.csv"


def write_history(history: dict[str, list[list[float]]], out: Path) -> None:
    """The loss curves next to the saved model, like the Trainer's `trainer_state.json`:
    `training_log.csv` (step, train_loss, lr) and `eval_log.csv` (step, val_loss); `evaluate`
    plots them and `dvc plots show` renders them."""
    import csv

    for name, header, rows in ((TRAINING_LOG, ["step", "train_loss", "lr"], history["train"]), (EVAL_LOG, ["step", "val_loss"], history["eval"])):
        with open(out / name, "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(header)
            writer.writerows([int(row[0]), *(f"{v:.6g}" for v in row[1:])] for row in rows)
