"""The one training loop every training stage shares (pretrain today; SFT, LoRA, DPO build on it).

A method differs only in what it hands the loop:

- `loss_fn(model, batch) -> (loss, metrics)`: the objective (causal LM, completion-only, DPO, ...);
  its metrics are averaged over accumulation steps and logged under their own names
- `batches`: a resumable, seeded order over its data (`Batches`)
- `val_fn(model) -> metrics`: validation, with `val/loss` driving early stopping and "best"
- `extensions`: objects called at fixed points of the loop (train begin, gradients, step end,
  evaluation, save, train end) whose state is saved in checkpoints (`pipelines.core.extensions`);
  early stopping is one
- `schedule`: the run's phases (`pipelines.core.training.phases`): plain training has one; at a
  phase change of progressive growth or the multimodal stage the loop lets the schedule change
  the model and choose what trains, then starts a fresh optimizer over the trainable parameters
  and a re-warmed schedule

The loop owns the rest: AdamW with no-decay groups, warmup + cosine/linear schedule, gradient
accumulation, clipping, autocast in the precision the device supports (`auto`), progress bar, MLflow metrics, checkpoints and
exact resume, early stopping, optional gradient checkpointing, and two guards that turn a crash into
an actionable message:

- a NaN/inf loss or gradient norm skips that batch (no optimizer step, a warning) up to
  `cfg.skip_nonfinite` times in the whole run, then stops with `NonFiniteLossError` naming the step
  (the last good checkpoint is kept; the stage's MLflow run ends FAILED);
- running out of memory in a step stops with `TrainingOutOfMemoryError`, which names the
  micro-batch size, accumulation steps and sequence length in force and how to fit the step.

Over 700 lines, on purpose: the loop is read top to bottom as one file, as torchtune's recipes and
nanoGPT's `train.py` are (docs/development.md, "Reading the training loop"): `train` at the top,
one step, logging, evaluation, checkpoints and the end below it in the order they run. What
the methods share but the loop does not run (objectives, checkpoints' format, precision,
distribution, phases) is in its own module already.
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

from pipelines.core.errors import QllmError, StopRequested, clear_stop, request_stop, stop_requested, training_thread
from pipelines.core.extensions import Extension, Extensions
from pipelines.core.models.models import CONSTRUCTION
from pipelines.core.outputs import atomic_dir
from pipelines.core.params.training import TrainParams
from pipelines.core.training import distributed
from pipelines.core.training.checkpoint import CheckpointManager
from pipelines.core.training.phases import OnePhase, Phase, Schedule
from pipelines.core.training.randomness import StageRandom, draws

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

    draws = False
    """Batches drawn at random from torch's generators (GRPO's samples) set it: `train` then gives
    the run its own random stream (`pipelines.core.training.randomness`)."""

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

    def begin_step(self, step: int) -> None:
        """Called by the loop before it draws the micro-batches of optimizer step `step`: an order
        that changes with the step (`pipelines.core.training.curriculum`) overrides it."""

    def metrics(self, step: int) -> dict[str, float]:
        """Metrics of the data order, logged with the training metrics (none here)."""
        return {}

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only: biases, norm weights and embeddings (and other lookup tables, such as the
    memory extension's values) get no weight decay."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))}
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        (decay if parameter.ndim >= 2 and "embed" not in name and id(parameter) not in tables else no_decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


BNB_OPTIMIZERS = {"adamw_bnb_8bit": "AdamW8bit", "paged_adamw_8bit": "PagedAdamW8bit"}
"""bitsandbytes' 8-bit AdamW (moments in 8 bits, blockwise: 2 bytes a parameter instead of 8),
named as HF `Trainer` names them; paged: its state in unified memory that spills to the host (CUDA)."""


def build_optimizer(model: torch.nn.Module, cfg: TrainParams) -> torch.optim.Optimizer:
    """AdamW over `param_groups`; `train.optimizer: adamw_fused` asks for torch's fused kernel,
    `adamw_bnb_8bit` / `paged_adamw_8bit` for bitsandbytes' 8-bit AdamW."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer in BNB_OPTIMIZERS:
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise QllmError(f"train.optimizer {cfg.optimizer} needs bitsandbytes (pip install 'bitsandbytes>=0.48'); or use adamw_fused") from None
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if cfg.optimizer.startswith("paged") and device.type != "cuda":
            log.warning("train.optimizer %s: paging needs CUDA; on %s it is the plain 8-bit AdamW", cfg.optimizer, device.type)
        return getattr(bnb.optim, BNB_OPTIMIZERS[cfg.optimizer])(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    fused = cfg.optimizer == "adamw_fused"
    try:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused or None)
    except RuntimeError as exc:  # a device or dtype the fused kernel does not support
        raise QllmError(f"train.optimizer adamw_fused: {exc}; use train.optimizer: adamw") from exc


def lr_multiplier(step: int, cfg: TrainParams) -> float:
    """Linear warmup to 1, then cosine/linear decay to `min_lr_ratio` at `max_steps`."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def _check_resolved(precision: str, what: str) -> None:
    """`precision: auto` is resolved once, where a stage starts (`pipelines.core.run.stage`, with
    `precision.resolve`): the loop and its helpers take bf16, fp16 or fp32."""
    if precision == "auto":
        raise ValueError(f"{what} is 'auto': resolve it first (pipelines.core.training.precision.resolve), as stages do when they start")


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16/fp16 autocast (weights and optimizer stay fp32); a no-op for fp32."""
    _check_resolved(precision, "precision")
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


causal_lm_loss.causal_lm_loss = True  # the model's own cross-entropy: `chunked_loss.for_loop` may chunk its head


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
    schedule: Schedule | None = None,
    desc: str = "train",
) -> dict[str, Any]:
    """Train `model` for `cfg.max_steps` optimizer steps; returns summary metrics.

    With `checkpoints`, resumes from the newest valid checkpoint there (weights, optimizer,
    schedule, RNG, data position, loop state) and saves every `cfg.checkpoint_every` steps and at
    every new best validation loss. With early stopping on, the best weights are restored at the end.
    `tracker` is the stage's MLflow run, for the logger extensions `cfg.extensions` names
    (`pipelines.core.training.loggers`; `mlflow_metrics` flushes it before each checkpoint is written, so the
    tracking store holds every metric up to the checkpoint's step and a resumed run loses none).
    `extensions` run before those of `cfg.extensions` (`pipelines.core.extensions`). `schedule`: the
    run's phases (`pipelines.core.training.phases`; default `OnePhase`, plain training). With
    progressive growth (`progressive.Growth`) the model changes shape at the phase changes;
    checkpoints then hold every weight and the phase, and a resume grows the model first.

    A stop request (SIGTERM/SIGINT, in any thread: `pipelines.core.errors`) finishes the current step,
    saves a checkpoint and raises `TrainingInterrupted`; a rerun resumes from it. A second signal
    interrupts at once (the newest checkpoint stays).

    Under an initialised process group of W > 1 ranks (`pipelines.core.training.distributed`), the model is
    trained as DDP: each rank runs `cfg.grad_accum_steps / W` micro-batches of its shard of
    `batches` per step (the global batch stays the same); logged losses and validation metrics
    are averaged across ranks; only rank 0 logs to `tracker`, saves checkpoints and shows progress.
    With `cfg.strategy` "fsdp" a `fully_shard` copy of `model` is trained instead of DDP
    (`distributed.shard`); checkpoints gather its full weights and optimizer state on rank 0, and
    at the end every rank's `model` gets the full trained weights.
    """
    _check_resolved(cfg.precision, f"{desc}.train.precision")
    with training_thread(), _StopSignals() as stop_signals, _attention(model, cfg.attention, desc):
        return _train(model, loss_fn, batches, cfg, val_fn=val_fn, tracker=tracker, checkpoints=checkpoints, extensions=extensions,
                      schedule=schedule or OnePhase(), desc=desc, stop_signals=stop_signals)  # fmt: skip


@dataclass
class _Progress:
    """What changes while a run trains: the phase in force with its optimizer, schedule and
    trainable parameters, the loop's state, and the window of the throughput metrics."""

    phase: Phase
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    trainable: list[torch.nn.Parameter]
    state: TrainState = field(default_factory=TrainState)
    last: dict[str, float] = field(default_factory=dict)
    """The latest logged metrics (training and validation)."""
    window_tokens: int = 0
    window_start: float = field(default_factory=time.perf_counter)
    start_step: int = 0


@dataclass(frozen=True)
class _Run:
    """What setup builds for one training run, fixed while it trains; `now` is what changes."""

    model: torch.nn.Module
    loss_fn: LossFn
    batches: Batches
    cfg: TrainParams
    val_fn: Callable[[torch.nn.Module], dict[str, float]] | None
    checkpoints: CheckpointManager | None
    desc: str
    stop_signals: _StopSignals
    parallel: distributed.Parallel
    hooks: Extensions
    scaler: torch.amp.GradScaler
    oom: _OutOfMemoryGuard
    random: StageRandom
    """The run's own random stream (dropout, sampling): `pipelines.core.training.randomness`."""
    schedule: Schedule
    """The run's phases (`pipelines.core.training.phases`)."""
    now: _Progress
    started: float = field(default_factory=time.perf_counter)


@dataclass
class _Step:
    """What one optimizer step measured."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    metrics: dict[str, float]
    tokens: int


@contextlib.contextmanager
def _attention(model: torch.nn.Module, kernel: str, desc: str) -> Iterator[None]:
    """`train.attention`: the model's attention kernel while it trains, its own one restored after
    (so what is saved, and everything after training, is as before)."""
    if kernel == "model":
        yield
        return
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT; DDP and compile wrap it later
    own = lm.config._attn_implementation
    try:
        lm.set_attn_implementation(kernel)
    except (AttributeError, ValueError, ImportError) as exc:
        raise QllmError(f"{desc}.train.attention: {type(lm).__name__} cannot use the {kernel!r} attention kernel ({exc}); use model") from None
    try:
        yield
    finally:
        lm.set_attn_implementation(own)


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
    schedule: Schedule,
    desc: str,
    stop_signals: _StopSignals,
) -> dict[str, Any]:
    run = _setup(model, loss_fn, batches, cfg, val_fn, tracker, checkpoints, extensions, desc, stop_signals, schedule)
    try:
        _resume(run)
        run.hooks.call("on_train_begin", run.now.state)
        progress = _progress_bar(run)
        try:
            while run.now.state.step < cfg.max_steps and not run.now.state.stop:
                if (phase := run.schedule.phase_at(run.now.state.step)) is not run.now.phase:
                    _enter_phase(run, phase)
                step = _step(run)
                if step is None:  # a non-finite batch, skipped
                    continue
                _log(run, step, progress)
                best = _evaluate(run, step) if _evaluation_due(run) else False
                _checkpoint_or_stop(run, best)
                progress.update(1)
        finally:
            progress.close()
        return _finish(run)
    finally:
        run.hooks.close()
        run.schedule.close()


def _setup(model, loss_fn, batches, cfg, val_fn, tracker, checkpoints, extensions, desc, stop_signals, schedule: Schedule) -> _Run:
    """The parallel plan, the extensions (given, then `train.extensions`, then early stopping), the
    optimizer, schedule and grad scaler, and the model in training mode."""
    from pipelines.core import extensions as extension_api

    parallel = distributed.Parallel(model, cfg.grad_accum_steps, cfg.strategy, desc)
    if parallel.world > 1:
        batches.shard(distributed.rank(), parallel.world)
        tracker = tracker if parallel.main else None  # rank 0 alone talks to MLflow
    context = extension_api.ExtensionContext(stage=desc, tracker=tracker, root=getattr(tracker, "root", None))
    early = [EarlyStopping(cfg.early_stopping_patience)] if cfg.early_stopping_patience else []
    hooks = Extensions([*extensions, *extension_api.build(cfg.extensions, context, f"{desc}.train.extensions"), *early], desc)
    if parallel.fsdp and hooks.active["on_gradients"]:
        names = ", ".join(e.name for e in hooks.active["on_gradients"])
        raise QllmError(f"{desc}: train.strategy fsdp does not support extensions that read gradients ({names}: they see the unsharded "
                        f"model, whose gradients stay empty); use --set {desc}.train.strategy=ddp")  # fmt: skip
    if cfg.gradient_checkpointing:
        activation_checkpointing(model, True, desc)  # before FSDP's copy, which inherits it
    net = parallel.prepare()
    model.train()
    net.train()
    if cfg.compile:
        net.compile()  # in place: the state dict keeps its names, so checkpoints and outputs do not change
    if schedule.changes_model:
        if parallel.world > 1 or cfg.compile:
            raise QllmError(f"{desc}: its phase schedule changes the model while it trains: it needs one process and no compile")
        if checkpoints is not None:
            checkpoints.all_weights = True  # a frozen part was trained in an earlier phase
    phase = schedule.phases[0]
    schedule.enter(model, phase)
    optimizer = build_optimizer(net, cfg)
    now = _Progress(phase=phase, optimizer=optimizer, scheduler=_schedule(optimizer, cfg, schedule, phase),
                    trainable=[p for p in net.parameters() if p.requires_grad])  # fmt: skip
    return _Run(
        model=model, loss_fn=loss_fn, batches=batches, cfg=cfg, val_fn=val_fn, checkpoints=checkpoints, desc=desc,
        stop_signals=stop_signals, parallel=parallel, hooks=hooks, scaler=torch.amp.GradScaler(parallel.device.type, enabled=cfg.precision == "fp16"),
        oom=_OutOfMemoryGuard(desc, cfg, optimizer), random=StageRandom(cfg.seed, active=draws(model, loss_fn, batches)),
        schedule=schedule, now=now,
    )  # fmt: skip


def _schedule(optimizer: torch.optim.Optimizer, cfg: TrainParams, schedule: Schedule, phase: Phase) -> torch.optim.lr_scheduler.LambdaLR:
    """The step-based schedule, counted from the phase's first step, times the phase's factor (a re-warm)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(phase.start + step, cfg) * schedule.lr_factor(phase, step))


def _enter_phase(run: _Run, phase) -> None:
    """A phase change: the schedule changes the model (grows it, sets what trains); a fresh
    optimizer over the trainable parameters and a re-warmed schedule from here."""
    run.schedule.enter(run.model, phase)
    run.now.phase = phase
    run.now.optimizer = build_optimizer(run.parallel.net, run.cfg)
    run.now.scheduler = _schedule(run.now.optimizer, run.cfg, run.schedule, phase)
    run.now.trainable = [p for p in run.parallel.net.parameters() if p.requires_grad]
    run.oom.optimizer = run.now.optimizer
    trainable = sum(p.numel() for p in run.now.trainable)
    log.info("%s: step %d, %s: %d layers, %d trainable parameters", run.desc, run.now.state.step, phase.name, phase.layers, trainable)
    run.hooks.call("on_log", run.now.state, {"train/layers": float(phase.layers), "train/trainable_parameters": float(trainable)}, run.now.state.step)


def _snapshot(run: _Run) -> dict[str, Any]:
    """Everything but the weights that a checkpoint holds for an exact resume."""
    return {
        "optimizer": run.parallel.optimizer_state(run.now.optimizer),
        "scheduler": run.now.scheduler.state_dict(),
        "scaler": run.scaler.state_dict(),
        "rng": run.random.state_dict(),
        "batches": run.batches.state_dict(),
        "loop": asdict(run.now.state),
        "extensions": run.hooks.state_dict(),
        "phase": run.now.phase.index,
    }


def _resume(run: _Run) -> None:
    """Continue from the newest valid checkpoint, if there is one (every rank reads it)."""
    if run.checkpoints is None or (latest := run.checkpoints.latest_valid()) is None:
        return
    if len(run.schedule.phases) > 1:  # the model takes the phase's shape (and trainable set) before its weights
        state = run.checkpoints.read_state(latest.path)
        phase = run.schedule.phases[int(state.get("phase", state.get("growth", {}).get("phase", 0)))]  # ("growth": before issue 37)
        if phase is not run.now.phase:
            _enter_phase(run, phase)
    saved = run.checkpoints.load(latest.path, run.model)
    run.parallel.load_optimizer_state(run.now.optimizer, saved["optimizer"])
    run.now.scheduler.load_state_dict(saved["scheduler"])
    run.scaler.load_state_dict(saved["scaler"])
    run.batches.load_state_dict(saved["batches"])
    run.random.load_state_dict(saved["rng"])
    run.now.state = TrainState(**saved["loop"])
    run.hooks.load_state_dict(saved.get("extensions", {}))
    run.now.start_step = run.now.state.step
    log.info("%s: resumed from step %d (%s)", run.desc, run.now.state.step, latest.path)


def _progress_bar(run: _Run):
    from tqdm.auto import tqdm

    return tqdm(total=run.cfg.max_steps, initial=run.now.state.step, desc=run.desc, unit="step", disable=None if run.parallel.main else True,
                mininterval=1.0, dynamic_ncols=True)  # fmt: skip


def _step(run: _Run) -> _Step | None:
    """One optimizer step: forward/backward over the micro-batches, the gradient extensions,
    clipping, the optimizer and schedule. A non-finite loss or gradient norm skips the step
    (None) or, past `skip_nonfinite`, raises."""
    cfg, parallel, oom = run.cfg, run.parallel, run.oom
    loss_sum = torch.zeros((), device=parallel.device)
    metrics: dict[str, float] = {}
    tokens = 0
    oom.step = run.now.state.step + 1
    with run.random.step():  # a run that draws random numbers draws them from its own stream
        run.batches.begin_step(run.now.state.step)
        with oom:
            for micro in range(parallel.accum):
                batch = oom.batch = to_device(next(run.batches), parallel.device)
                with parallel.gradient_sync(micro):
                    with autocast(parallel.device, cfg.precision):
                        loss, extra = run.loss_fn(parallel.net, batch)
                    run.scaler.scale(loss / parallel.accum).backward()
                loss_sum += loss.detach()
                for key, value in extra.items():
                    metrics[key] = metrics.get(key, 0.0) + float(value) / parallel.accum
                tokens += _batch_tokens(batch)
            run.scaler.unscale_(run.now.optimizer)
            grad_norm = gradient_norm(run.now.trainable)
    oom.check()
    loss = loss_sum / parallel.accum
    if parallel.world > 1:  # every rank then takes the same skip decision (the gradient norm is already global)
        loss = torch.tensor(parallel.mean({"loss": float(loss)})["loss"])
        metrics, tokens = parallel.mean(metrics), parallel.total(tokens)
    if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
        _skip_nonfinite(run, loss, grad_norm)
        return None
    run.hooks.call("on_gradients", run.now.state)
    if cfg.max_grad_norm > 0:
        clip_gradients(run.now.trainable, cfg.max_grad_norm, grad_norm)
    with oom:
        run.scaler.step(run.now.optimizer)  # the first step allocates AdamW's moments: it can run out of memory too
    oom.check()
    run.scaler.update()
    run.now.scheduler.step()
    run.hooks.call("on_optimizer_step", run.now.state)
    run.now.optimizer.zero_grad(set_to_none=True)
    run.now.state.step += 1
    run.now.window_tokens += tokens
    return _Step(loss=loss, grad_norm=grad_norm, metrics=metrics, tokens=tokens)


def _skip_nonfinite(run: _Run, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
    """Skip a batch with a non-finite loss or gradient norm (no optimizer or schedule step), or
    raise once more than `skip_nonfinite` were skipped."""
    state, cfg, desc = run.now.state, run.cfg, run.desc
    state.skipped_nonfinite += 1
    what = f"{desc}: non-finite loss ({float(loss)}) or gradient norm ({float(grad_norm)}) at step {state.step + 1}"
    if state.skipped_nonfinite > cfg.skip_nonfinite:
        allowed = f"non-finite batch {state.skipped_nonfinite} of this run; " if cfg.skip_nonfinite else ""
        raise NonFiniteLossError(
            f"{what} ({allowed}skip_nonfinite is {cfg.skip_nonfinite}); the last good checkpoint is kept. "
            f"Try a lower learning rate or precision fp32, or --set {desc}.train.skip_nonfinite=N to skip up to N such batches."
        )
    log.warning("%s: batch skipped (no optimizer step), %d of at most %d", what, state.skipped_nonfinite, cfg.skip_nonfinite)
    run.hooks.call("on_log", state, {"train/skipped_nonfinite": state.skipped_nonfinite}, state.step + 1)
    run.now.optimizer.zero_grad(set_to_none=True)
    run.scaler.update()  # resets the scaler's per-step state (and lowers the fp16 loss scale)


def _log(run: _Run, step: _Step, progress) -> None:
    """Every `log_every` steps (and the last): the training metrics to the history, the progress
    bar and the loggers; then the step-end extensions."""
    state = run.now.state
    if state.step % run.cfg.log_every == 0 or state.step == run.cfg.max_steps:
        elapsed = time.perf_counter() - run.now.window_start
        run.now.last = {
            "train/loss": float(step.loss),
            "train/lr": run.now.scheduler.get_last_lr()[0],
            "train/grad_norm": float(step.grad_norm),
            "train/tokens_per_sec": run.now.window_tokens / max(elapsed, 1e-9),
            **step.metrics,  # the objective's own metrics, under the names it chose (e.g. rewards/chosen)
            **run.batches.metrics(state.step),  # the data order's (e.g. the curriculum's length)
            **run.schedule.metrics(),  # the phase schedule's (layers, cache); none for plain training
        }
        state.tokens += run.now.window_tokens
        run.now.window_tokens, run.now.window_start = 0, time.perf_counter()
        state.history["train"].append([state.step, run.now.last["train/loss"], run.now.last["train/lr"]])
        run.hooks.call("on_log", state, run.now.last, state.step)
        progress.set_postfix(loss=f"{run.now.last['train/loss']:.4f}", tok_s=f"{run.now.last['train/tokens_per_sec']:.0f}", refresh=False)
    run.hooks.call("on_step_end", state, run.now.last)


def _evaluation_due(run: _Run) -> bool:
    cfg = run.cfg
    return run.val_fn is not None and (bool(cfg.eval_every and run.now.state.step % cfg.eval_every == 0) or run.now.state.step == cfg.max_steps)


def _evaluate(run: _Run, step: _Step) -> bool:
    """Validate (averaged across ranks), log, track the best loss; True for a new best."""
    state = run.now.state
    val = run.parallel.mean(run.val_fn(run.parallel.eval_model()))
    run.hooks.call("on_log", state, val, state.step)
    state.history["eval"].append([state.step, val["val/loss"]])
    best = val["val/loss"] < state.best_val_loss
    if best:
        state.best_val_loss, state.best_step, state.evals_without_improvement = val["val/loss"], state.step, 0
    else:
        state.evals_without_improvement += 1
    if run.parallel.main:
        log.info("%s step %d/%d: train/loss %.4f, val/loss %.4f", run.desc, state.step, run.cfg.max_steps,
                 float(step.loss), val["val/loss"])  # fmt: skip
    run.now.last |= val
    run.hooks.call("on_evaluate", state, val)
    return best


def _save_checkpoint(run: _Run, best: bool) -> None:
    """Rank 0 writes; under FSDP every rank first takes part in gathering the full weights (into
    rank 0's `model`) and the full optimizer state."""
    run.parallel.gather()
    main = run.parallel.main
    if main:
        run.hooks.call("on_save", run.now.state, best)
    snapshot = _snapshot(run) if run.parallel.fsdp or main else None
    if main:
        run.checkpoints.save(run.now.state.step, run.model, snapshot, best=best)


def _checkpoint_or_stop(run: _Run, best: bool) -> None:
    """Checkpoint at a new best and every `checkpoint_every` steps; on a stop request (on any
    rank), checkpoint if not done and raise `TrainingInterrupted`."""
    state, cfg, checkpoints = run.now.state, run.cfg, run.checkpoints
    saved = checkpoints is not None and bool(best or (cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0))
    if saved:
        _save_checkpoint(run, best)
    stop = run.parallel.any(run.stop_signals.received is not None)  # a signal stops every rank after the same step
    if not stop or state.step >= cfg.max_steps:
        return
    name = run.stop_signals.received or "a stop signal on another rank"
    if checkpoints is None:
        raise TrainingInterrupted(f"{run.desc}: {name} at step {state.step}; no checkpoint directory, so a rerun starts over")
    if not saved:
        _save_checkpoint(run, False)
    raise TrainingInterrupted(f"{run.desc}: {name} at step {state.step}: checkpoint saved in {checkpoints.directory}; "
                              "rerun the same command to resume from it")  # fmt: skip


def _finish(run: _Run) -> dict[str, Any]:
    """The trained weights in `model` on every rank (FSDP gathers them), the best ones back under
    early stopping, the model handed back as it came; the summary, after the train-end extensions."""
    state, cfg, model = run.now.state, run.cfg, run.model
    state.tokens += run.now.window_tokens
    run.parallel.gather(everywhere=True)
    if cfg.gradient_checkpointing:
        activation_checkpointing(model, False, run.desc)  # hand the model back as it came (generation, saving)
    if cfg.early_stopping_patience and run.checkpoints is not None and state.best_step > 0 and state.best_step != state.step:
        distributed.barrier()  # rank 0 has written the best checkpoint
        best = run.checkpoints.latest_valid(step=state.best_step)
        if best is not None:
            run.checkpoints.load(best.path, model)
            log.info("%s: restored the best weights (step %d, val/loss %.4f)", run.desc, state.best_step, state.best_val_loss)
    seconds = time.perf_counter() - run.started
    last = run.now.last
    if run.val_fn is not None and not any(k.startswith("val/") for k in last):
        last |= run.parallel.mean(run.val_fn(model))  # resumed from a checkpoint at max_steps: nothing ran, the metrics still count
    summary = {
        "steps": state.step,
        "tokens": state.tokens,
        "train_loss": last.get("train/loss", state.history["train"][-1][1] if state.history["train"] else float("nan")),
        "best_val_loss": state.best_val_loss,
        "best_step": state.best_step,
        "train_seconds": round(seconds, 3),
        "steps_per_second": round((state.step - run.now.start_step) / max(seconds, 1e-9), 4),
        "stopped_early": state.stop,
        "skipped_nonfinite": state.skipped_nonfinite,
        "history": state.history,
        **{k: v for k, v in last.items() if k.startswith("val/")},
    }
    run.hooks.call("on_train_end", state, summary)
    return summary


TRAINING_LOG = "training_log.csv"
EVAL_LOG = "eval_log.csv"


def finish(result: dict[str, Any], out: Path, save: Callable[[Path], None]) -> dict[str, Any]:
    """The end of every training stage: rank 0 writes `out` atomically (`save(tmp)`, the stage's
    own files, then the loss history); every rank returns `train`'s summary without the history,
    plus the training throughput `tokens_per_second`."""

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
