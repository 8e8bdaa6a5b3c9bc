"""The one training loop every training stage shares (pretrain today; SFT, LoRA, DPO build on it).

A method differs only in what it hands the loop:

- `loss_fn(model, batch) -> (loss, metrics)`: the objective (causal LM, completion-only, DPO, ...);
  its metrics are averaged over accumulation steps and logged under their own names
- `batches`: a resumable, seeded order over its data (`Batches`)
- `val_fn(model) -> metrics`: validation, with `val/loss` driving early stopping and "best"
- `extensions`: objects called at fixed points of the loop (train begin, gradients, step end,
  evaluation, save, train end) whose state is saved in checkpoints (`pipelines.core.extensions`);
  early stopping is one

The loop owns the rest: AdamW with no-decay groups, warmup + cosine/linear schedule, gradient
accumulation, clipping, autocast in the precision the device supports (`auto`), progress bar, MLflow metrics, checkpoints and
exact resume, early stopping, optional gradient checkpointing, and two guards that turn a crash into
an actionable message:

- a NaN/inf loss or gradient norm skips that batch (no optimizer step, a warning) up to
  `cfg.skip_nonfinite` times in the whole run, then stops with `NonFiniteLossError` naming the step
  (the last good checkpoint is kept; the stage's MLflow run ends FAILED);
- running out of memory in a step stops with `TrainingOutOfMemoryError`, which names the
  micro-batch size, accumulation steps and sequence length in force and how to fit the step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipelines.core import distributed
from pipelines.core.checkpoint import CheckpointManager, rng_state, set_rng_state
from pipelines.core.config import TrainParams
from pipelines.core.errors import QllmError, StopRequested, clear_stop, request_stop, stop_requested, training_thread
from pipelines.core.extensions import Extension, Extensions
from pipelines.core.precision import resolve as resolve_precision

log = logging.getLogger("qllm.training")

LossFn = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, dict[str, Any]]]


class NonFiniteLossError(QllmError):
    """Training produced a NaN/inf loss or gradient norm (more often than `skip_nonfinite` allows)."""


class TrainingInterrupted(StopRequested):
    """SIGTERM or SIGINT during training: the step in progress was finished and checkpointed."""


class _StopSignals:
    """The stop request while training (`pipelines.core.errors`).

    In the main thread (`python -m pipelines.<stage>`, `dvc repro`), SIGTERM/SIGINT -> `request_stop`
    (only the main thread can install handlers); the previous handlers come back afterwards. In a
    worker thread (a Prefect task: `qllm run`, a deployment) the process's entry point turns signals
    into the same process-wide request (the CLI's handler; Prefect's SIGTERM bridge, caught by the
    pipeline flow); `train` registers the thread (`training_thread`), so that a second signal
    interrupts it at once.
    """

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}

    @property
    def received(self) -> str | None:
        """Why training was asked to stop ("SIGTERM", ...), if it was."""
        return stop_requested()

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, request_stop)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._previous:
            clear_stop()


class TrainingOutOfMemoryError(QllmError):
    """A training step ran out of accelerator or host memory."""


@dataclass
class TrainState:
    """Loop state saved in checkpoints."""

    step: int = 0
    tokens: int = 0
    best_val_loss: float = math.inf
    best_step: int = -1
    evals_without_improvement: int = 0
    stop: bool = False
    skipped_nonfinite: int = 0
    """Batches skipped so far for a non-finite loss or gradient norm (counts towards `skip_nonfinite`)."""
    history: dict[str, list[list[float]]] = field(default_factory=lambda: {"train": [], "eval": []})
    """`train`: [step, train/loss, lr] per logged step; `eval`: [step, val/loss] per evaluation
    (kept in checkpoints, so a resumed run's curves are complete)."""


class Batches:
    """Seeded, resumable micro-batch order over `n` examples.

    Each epoch is a fresh permutation drawn from `seed + epoch`, so the order depends only on
    (seed, epoch, position): a resumed run continues exactly where the killed one stopped. The
    last partial batch of an epoch is dropped to keep every micro-batch the same size.

    Sharded over `world` ranks (`shard`), every rank walks the same order and takes every
    `world`-th micro-batch, starting at its `rank`: together the ranks see exactly the micro-batches
    one process would, and the position (the resume point) is the same on every rank.
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
        self.rank, self.world = 0, 1

    def shard(self, rank: int, world: int) -> None:
        """Take micro-batches `rank`, `rank + world`, ... of the shared order (see the class docstring)."""
        self.rank, self.world = rank, world

    def _permutation(self) -> np.ndarray:
        if self._order is None or self._order[0] != self.epoch:
            order = np.random.default_rng(self.seed + self.epoch).permutation(self.n) if self.shuffle else np.arange(self.n)
            self._order = (self.epoch, order)
        return self._order[1]

    def __iter__(self) -> Iterator[Any]:
        return self

    def _draw(self) -> np.ndarray:
        if self.position + self.batch_size > self.n:
            self.epoch += 1
            self.position = 0
        indices = self._permutation()[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return indices

    def __next__(self) -> Any:
        drawn = [self._draw() for _ in range(self.world)]  # one micro-batch per rank, in rank order
        return self.collate(drawn[self.rank])

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
    """bf16/fp16 autocast (weights and optimizer stay fp32); a no-op for fp32; `auto` as resolved
    for this device (`pipelines.core.precision`)."""
    if precision == "auto":
        precision = resolve_precision(precision)
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "fp16" and device.type != "cuda":
        raise QllmError("precision fp16 needs a CUDA device; use bf16 on CPU")
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def causal_lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
    """Next-token cross-entropy over every position (labels = inputs; the model shifts them)."""
    labels = batch.get("labels", batch["input_ids"])
    extra = {k: v for k, v in batch.items() if k in ("attention_mask", "position_ids")}
    output = model(input_ids=batch["input_ids"], labels=labels, use_cache=False, **extra)  # no KV cache in training
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


def gradient_norm(parameters: list[torch.nn.Parameter]) -> torch.Tensor:
    """Total L2 norm of the gradients, computed before clipping so a non-finite step can be skipped
    before any extension or the optimizer sees its gradients."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6: the foreach kernels clip_grad_norm_ uses
        norm = torch.nn.utils.get_total_norm(grads)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: the norm of the whole gradient
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach()) for g in grads]))


def clip_gradients(parameters: list[torch.nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale the gradients down to `max_norm` given their `total_norm` (as `clip_grad_norm_` does)."""
    if hasattr(torch.nn.utils, "clip_grads_with_norm_"):  # torch >= 2.6
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm)
        return
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in parameters:
        if p.grad is not None:
            p.grad.detach().mul_(coefficient.to(p.grad.device))


def activation_checkpointing(model: torch.nn.Module, on: bool, desc: str) -> None:
    """Switch Hugging Face activation (gradient) checkpointing on or off; PEFT models forward it.

    Non-reentrant checkpointing, which also works when the inputs need no gradient (a frozen base
    under LoRA). transformers >= 5.x names it `activation_checkpointing_*`, earlier versions
    `gradient_checkpointing_*`.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs) if on else model.activation_checkpointing_disable()
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs) if on else model.gradient_checkpointing_disable()
    else:
        raise QllmError(f"{desc}: gradient_checkpointing needs a Hugging Face model ({type(model).__name__} has no activation checkpointing)")


def _is_out_of_memory(exc: BaseException) -> bool:
    """`torch.OutOfMemoryError` (CUDA), and the RuntimeErrors other backends raise (MPS, CPU allocator)."""
    message = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in message or "can't allocate memory" in message


def out_of_memory_message(desc: str, cfg: TrainParams, batch: Any, step: int, cause: BaseException) -> str:
    """What ran out of memory, with what in force, and the ways to fit the step."""
    tensor = batch.get("input_ids") if isinstance(batch, dict) else batch
    shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else None
    in_force = f"micro_batch_size {cfg.micro_batch_size}, grad_accum_steps {cfg.grad_accum_steps}"
    if shape is not None:
        in_force += f", batch input_ids shape {shape} (sequence length {shape[-1]})"
    cause_line = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:200]
    fixes = []
    if cfg.micro_batch_size > 1:
        # the largest proper divisor, so that the global batch stays exactly the same
        smaller = next(d for d in range(cfg.micro_batch_size // 2, 0, -1) if cfg.micro_batch_size % d == 0)
        fixes.append(
            f"a smaller micro-batch with more accumulation steps keeps the global batch of "
            f"{cfg.micro_batch_size * cfg.grad_accum_steps} sequences (e.g. --set {desc}.train.micro_batch_size={smaller} "
            f"--set {desc}.train.grad_accum_steps={cfg.grad_accum_steps * cfg.micro_batch_size // smaller})"
        )
    if not cfg.gradient_checkpointing:
        fixes.append(f"gradient checkpointing (--set {desc}.train.gradient_checkpointing=true: activations are recomputed in backward, about a third slower)")
    fixes.append("shorter sequences")
    return f"{desc}: out of memory at step {step} ({cause_line}) with {in_force}. To fit the step: " + "; or ".join(fixes) + "."


class _OutOfMemoryGuard:
    """`with guard:` turns an out-of-memory error in the block into `TrainingOutOfMemoryError`,
    raised by `guard.check()` outside the `except`, so the failed step's tensors (held by the
    original traceback) are freed for whatever runs next in this process."""

    def __init__(self, desc: str, cfg: TrainParams, optimizer: torch.optim.Optimizer) -> None:
        self.desc, self.cfg, self.optimizer = desc, cfg, optimizer
        self.batch: Any = None  # the batch in force, for the message
        self.step = 0
        self.message: str | None = None

    def __enter__(self) -> _OutOfMemoryGuard:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if isinstance(exc, RuntimeError) and _is_out_of_memory(exc):  # torch.OutOfMemoryError is a RuntimeError
            self.message = out_of_memory_message(self.desc, self.cfg, self.batch, self.step, exc)
            return True
        return False

    def check(self) -> None:
        if self.message is not None:
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingOutOfMemoryError(self.message)


class EarlyStopping(Extension):
    """Stop after `patience` evaluations without a new best validation loss (`train.early_stopping_patience`;
    its count is loop state, `TrainState.evals_without_improvement`, so it resumes with the loop)."""

    name = "early_stopping"

    def __init__(self, patience: int) -> None:
        self.patience = patience

    def on_evaluate(self, state: TrainState, metrics: dict[str, float]) -> None:
        if self.patience and state.evals_without_improvement >= self.patience:
            log.info("early stopping at step %d: no better val/loss for %d evaluations (best %.4f at step %d)",
                     state.step, self.patience, state.best_val_loss, state.best_step)
            state.stop = True


def train(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: Batches,
    cfg: TrainParams,
    *,
    val_fn: Callable[[torch.nn.Module], dict[str, float]] | None = None,
    tracker=None,
    checkpoints: CheckpointManager | None = None,
    extensions: Sequence[Extension] = (),
    desc: str = "train",
) -> dict[str, Any]:
    """Train `model` for `cfg.max_steps` optimizer steps; returns summary metrics.

    With `checkpoints`, resumes from the newest valid checkpoint there (weights, optimizer,
    schedule, RNG, data position, loop state) and saves every `cfg.checkpoint_every` steps and at
    every new best validation loss. With early stopping on, the best weights are restored at the end.
    `tracker` (`log_metrics`, `flush`) is flushed before each checkpoint is written, so the tracking
    store holds every metric up to the checkpoint's step and a resumed run loses none.

    A stop request (SIGTERM/SIGINT, in any thread: `pipelines.core.errors`) finishes the current step,
    saves a checkpoint and raises `TrainingInterrupted`; a rerun resumes from it. A second signal
    interrupts at once (the newest checkpoint stays).

    Under an initialised process group of W > 1 ranks (`pipelines.core.distributed`), the model is
    trained as DDP: each rank runs `cfg.grad_accum_steps / W` micro-batches of its shard of
    `batches` per step (the global batch stays the same); logged losses and validation metrics
    are averaged across ranks; only rank 0 logs to `tracker`, saves checkpoints and shows progress.
    With `cfg.strategy` "fsdp" a `fully_shard` copy of `model` is trained instead of DDP
    (`distributed.shard`); checkpoints gather its full weights and optimizer state on rank 0, and
    at the end every rank's `model` gets the full trained weights.
    """
    if cfg.precision == "auto":  # stages resolve it before (pipelines.core.stage); direct callers get the same choice
        cfg = cfg.model_copy(update={"precision": resolve_precision(cfg.precision, desc)})
    with training_thread(), _StopSignals() as stop_signals:
        return _train(model, loss_fn, batches, cfg, val_fn=val_fn, tracker=tracker, checkpoints=checkpoints, extensions=extensions,
                      desc=desc, stop_signals=stop_signals)  # fmt: skip


def _train(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: Batches,
    cfg: TrainParams,
    *,
    val_fn: Callable[[torch.nn.Module], dict[str, float]] | None,
    tracker,
    checkpoints: CheckpointManager | None,
    extensions: Sequence[Extension],
    desc: str,
    stop_signals: _StopSignals,
) -> dict[str, Any]:
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    world = distributed.world_size()
    main = distributed.is_main()
    accum = cfg.grad_accum_steps if world == 1 else distributed.local_accum_steps(cfg.grad_accum_steps, world, desc)
    if world > 1:
        batches.shard(distributed.rank(), world)
        tracker = None if not main else tracker  # rank 0 alone talks to MLflow
    fsdp = world > 1 and cfg.strategy == "fsdp"
    if fsdp and extensions:
        raise QllmError(f"{desc}: train.strategy fsdp does not support training extensions (they see the unsharded model, "
                        f"whose gradients stay empty); use --set {desc}.train.strategy=ddp")  # fmt: skip
    net = model  # what the loss runs and the optimizer updates (DDP wraps it below)
    if fsdp:  # FSDP trains a sharded copy; `model` gets its full weights back at checkpoints and at the end
        if cfg.gradient_checkpointing:
            activation_checkpointing(model, True, desc)  # before the copy, which inherits it
        net = distributed.shard(model)
        if device.type != "cpu":
            model.to("cpu")  # the full copy waits in host memory: the accelerator holds shards only
    optimizer = build_optimizer(net, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    trainable = [p for p in net.parameters() if p.requires_grad]
    state = TrainState()
    hooks = Extensions([*extensions, *([EarlyStopping(cfg.early_stopping_patience)] if cfg.early_stopping_patience else [])], desc)

    def snapshot() -> dict[str, Any]:
        return {
            "optimizer": distributed.full_optimizer_state(net, optimizer) if fsdp else optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "rng": rng_state(),
            "batches": batches.state_dict(),
            "loop": asdict(state),
            "extensions": hooks.state_dict(),
        }

    if checkpoints is not None and (latest := checkpoints.latest_valid()) is not None:
        saved = checkpoints.load(latest.path, model)  # every rank reads it
        if fsdp:
            distributed.load_full_state(net, model, optimizer, saved["optimizer"])
        else:
            optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        scaler.load_state_dict(saved["scaler"])
        batches.load_state_dict(saved["batches"])
        set_rng_state(saved["rng"])
        state = TrainState(**saved["loop"])
        hooks.load_state_dict(saved.get("extensions", {}))
        log.info("%s: resumed from step %d (%s)", desc, state.step, latest.path)

    if cfg.gradient_checkpointing and not fsdp:
        activation_checkpointing(model, True, desc)
    model.train()
    net.train()
    if world > 1 and not fsdp:
        net = distributed.wrap(model)  # what the loss runs; `model` is saved and evaluated

    def save_checkpoint(best: bool) -> None:
        """Rank 0 writes; under FSDP every rank first takes part in gathering the full weights
        (into rank 0's `model`) and the full optimizer state."""
        if fsdp:
            distributed.gather_into(net, model)
        if main:
            hooks.call("on_save", state, best)
        snap = snapshot() if fsdp or main else None
        if main:
            if tracker is not None:
                tracker.flush()
            checkpoints.save(state.step, model, snap, best=best)
    hooks.call("on_train_begin", state)
    progress = tqdm(total=cfg.max_steps, initial=state.step, desc=desc, unit="step", disable=None if main else True, mininterval=1.0, dynamic_ncols=True)
    window_tokens, window_start = 0, time.perf_counter()
    started, start_step = time.perf_counter(), state.step
    last: dict[str, float] = {}
    oom = _OutOfMemoryGuard(desc, cfg, optimizer)
    while state.step < cfg.max_steps and not state.stop:
        loss_sum = torch.zeros((), device=device)
        extra: dict[str, float] = {}
        step_tokens = 0
        oom.step = state.step + 1
        with oom:
            for micro in range(accum):
                batch = oom.batch = to_device(next(batches), device)
                # DDP (FSDP) averages (and shards) gradients across ranks once per step, at the last micro-batch
                sync = net.no_sync() if world > 1 and not fsdp and micro < accum - 1 else contextlib.nullcontext()
                if fsdp:
                    net.set_requires_gradient_sync(micro == accum - 1)
                with sync:
                    with autocast(device, cfg.precision):
                        loss, metrics = loss_fn(net, batch)
                    scaler.scale(loss / accum).backward()
                loss_sum += loss.detach()
                for key, value in metrics.items():
                    extra[key] = extra.get(key, 0.0) + float(value) / accum
                step_tokens += _batch_tokens(batch)
            scaler.unscale_(optimizer)
            grad_norm = gradient_norm(trainable)
        oom.check()
        train_loss = loss_sum / accum
        if world > 1:  # every rank then takes the same skip decision (the gradient norm is already global)
            train_loss = torch.tensor(distributed.mean_across_ranks({"loss": float(train_loss)}, device)["loss"])
            extra = distributed.mean_across_ranks(extra, device)
            step_tokens = int(distributed.sum_across_ranks(step_tokens, device))
        if not (torch.isfinite(train_loss) and torch.isfinite(grad_norm)):
            state.skipped_nonfinite += 1
            what = f"{desc}: non-finite loss ({float(train_loss)}) or gradient norm ({float(grad_norm)}) at step {state.step + 1}"
            if state.skipped_nonfinite > cfg.skip_nonfinite:
                allowed = f"non-finite batch {state.skipped_nonfinite} of this run; " if cfg.skip_nonfinite else ""
                raise NonFiniteLossError(
                    f"{what} ({allowed}skip_nonfinite is {cfg.skip_nonfinite}); the last good checkpoint is kept. "
                    f"Try a lower learning rate or precision fp32, or --set {desc}.train.skip_nonfinite=N to skip up to N such batches."
                )
            log.warning("%s: batch skipped (no optimizer step), %d of at most %d", what, state.skipped_nonfinite, cfg.skip_nonfinite)
            if tracker is not None:
                tracker.log_metrics({"train/skipped_nonfinite": state.skipped_nonfinite}, step=state.step + 1)
            optimizer.zero_grad(set_to_none=True)
            scaler.update()  # resets the scaler's per-step state (and lowers the fp16 loss scale)
            continue
        window_tokens += step_tokens
        hooks.call("on_gradients", state)
        if cfg.max_grad_norm > 0:
            clip_gradients(trainable, cfg.max_grad_norm, grad_norm)
        with oom:
            scaler.step(optimizer)  # the first step allocates AdamW's moments: it can run out of memory too
        oom.check()
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
        hooks.call("on_step_end", state, last)

        is_best = False
        eval_due = cfg.eval_every and state.step % cfg.eval_every == 0
        if val_fn is not None and (eval_due or state.step == cfg.max_steps):
            val = distributed.mean_across_ranks(val_fn(net if fsdp else model), device)  # FSDP: every rank runs the sharded forward
            if tracker is not None:
                tracker.log_metrics(val, step=state.step)
            state.history["eval"].append([state.step, val["val/loss"]])
            if val["val/loss"] < state.best_val_loss:
                state.best_val_loss, state.best_step, state.evals_without_improvement = val["val/loss"], state.step, 0
                is_best = True
            else:
                state.evals_without_improvement += 1
            if main:
                log.info("%s step %d/%d: train/loss %.4f, val/loss %.4f", desc, state.step, cfg.max_steps, float(train_loss), val["val/loss"])
            last |= val
            hooks.call("on_evaluate", state, val)
        saved = checkpoints is not None and bool(is_best or (cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0))
        if saved:
            save_checkpoint(is_best)
        progress.update(1)
        stop = stop_signals.received is not None
        if world > 1:  # a signal stops every rank after the same step
            stop = distributed.any_rank(stop, device)
        if stop and state.step < cfg.max_steps:
            progress.close()
            name = stop_signals.received or "a stop signal on another rank"
            if checkpoints is None:
                raise TrainingInterrupted(f"{desc}: {name} at step {state.step}; no checkpoint directory, so a rerun starts over")
            if not saved:
                save_checkpoint(False)
            raise TrainingInterrupted(f"{desc}: {name} at step {state.step}: checkpoint saved in {checkpoints.directory}; "
                                      "rerun the same command to resume from it")  # fmt: skip
    progress.close()
    state.tokens += window_tokens
    if fsdp:  # every rank gets the full trained weights back in `model`
        model.to(device)
        distributed.gather_into(net, model, everywhere=True)
    if cfg.gradient_checkpointing:
        activation_checkpointing(model, False, desc)  # hand the model back as it came (generation, saving)

    if cfg.early_stopping_patience and checkpoints is not None and state.best_step > 0 and state.best_step != state.step:
        distributed.barrier()  # rank 0 has written the best checkpoint
        best = checkpoints.latest_valid(step=state.best_step)
        if best is not None:
            checkpoints.load(best.path, model)
            log.info("%s: restored the best weights (step %d, val/loss %.4f)", desc, state.best_step, state.best_val_loss)

    seconds = time.perf_counter() - started
    steps_run = state.step - start_step
    if val_fn is not None and not any(k.startswith("val/") for k in last):
        last |= distributed.mean_across_ranks(val_fn(model), device)  # resumed from a checkpoint at max_steps: nothing ran, the metrics still count
    train_loss = last.get("train/loss", state.history["train"][-1][1] if state.history["train"] else float("nan"))
    summary = {
        "steps": state.step,
        "tokens": state.tokens,
        "train_loss": train_loss,
        "best_val_loss": state.best_val_loss,
        "best_step": state.best_step,
        "train_seconds": round(seconds, 3),
        "steps_per_second": round(steps_run / max(seconds, 1e-9), 4),
        "stopped_early": state.stop,
        "skipped_nonfinite": state.skipped_nonfinite,
        "history": state.history,
        **{k: v for k, v in last.items() if k.startswith("val/")},
    }
    hooks.call("on_train_end", state, summary)
    return summary


TRAINING_LOG = "training_log.csv"
EVAL_LOG = "eval_log.csv"


def finish(result: dict[str, Any], out: Path, save: Callable[[Path], None]) -> dict[str, Any]:
    """The end of every training stage: rank 0 writes `out` atomically (`save(tmp)`, the stage's
    own files, then the loss history); every rank returns `train`'s summary without the history,
    plus the training throughput `tokens_per_second`."""
    from pipelines.core.models import CONSTRUCTION
    from pipelines.core.outputs import atomic_dir

    history = result.pop("history")
    if distributed.is_main():  # under torchrun, rank 0 alone writes the output
        with atomic_dir(out) as tmp, CONSTRUCTION:  # saving may merge adapters: builds modules
            save(tmp)
            write_history(history, tmp)
    return {**result, "tokens_per_second": round(result["tokens"] / max(result["train_seconds"], 1e-9))}


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
