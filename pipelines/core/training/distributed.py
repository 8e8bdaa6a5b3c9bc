"""Data-parallel training under `torchrun`: process group, rank-0 duties, the self-launcher.

    torchrun --nproc_per_node 2 -m pipelines.pretrain     # any training stage, unchanged
    qllm run --set pretrain.train.nproc=2                  # the stage launches that itself

torchrun (`torch.distributed.run`) does the process management; this module only reads what it
sets (`WORLD_SIZE`, `RANK`, `LOCAL_RANK`), opens the process group (`gloo` on CPU, `nccl` on CUDA)
and answers "am I rank 0?" for the code that must run once: MLflow calls, checkpoints, outputs,
metrics files, the progress bar. The training loop (`pipelines.core.training.loop`) wraps the model in DDP,
shards the data and averages the logged metrics across ranks.

`train.nproc > 1` with no `WORLD_SIZE` in the environment makes `stage.execute` call `launch`:
it runs `python -m torch.distributed.run --nproc_per_node N -m pipelines.<stage>` as a subprocess
and waits for it (so it also works from `qllm run`, which runs stages in threads). The rank-0
process opens the stage's MLflow run (child of the same parent run) and writes the metrics file,
which `launch` reads back.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipelines.core.errors import QllmError

WORLD_ENV = "WORLD_SIZE"


def under_launcher() -> bool:
    """Started by torchrun (or anything else that sets `WORLD_SIZE`)."""
    return WORLD_ENV in os.environ


def setup() -> None:
    """Open the default process group from torchrun's environment (idempotent; a no-op for a
    world of 1). CUDA ranks get their own device (`LOCAL_RANK`), so `cuda` means theirs."""
    if dist.is_initialized() or int(os.environ.get(WORLD_ENV, "1")) <= 1:
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0 (or not distributed): the process that logs, checkpoints and writes outputs."""
    return rank() == 0


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def local_accum_steps(grad_accum_steps: int, world: int, desc: str) -> int:
    """Accumulation steps per rank that keep the global batch (`micro_batch_size *
    grad_accum_steps` sequences per optimizer step) the same on `world` ranks."""
    if grad_accum_steps % world:
        raise QllmError(
            f"{desc}: train.grad_accum_steps ({grad_accum_steps}) must be divisible by the number of processes ({world}): "
            f"each of the {world} ranks runs grad_accum_steps / {world} micro-batches of train.micro_batch_size per step, "
            f"so that the global batch stays the same (e.g. --set {desc}.train.grad_accum_steps={grad_accum_steps * world})"
        )
    return grad_accum_steps // world


def mean_across_ranks(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Each value averaged over the ranks (every rank must pass the same keys)."""
    if world_size() <= 1 or not values:
        return values
    keys = sorted(values)
    tensor = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    tensor /= world_size()
    return {**values, **dict(zip(keys, tensor.tolist(), strict=True))}


def sum_across_ranks(value: float, device: torch.device) -> float:
    if world_size() <= 1:
        return value
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return float(tensor.item())


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when it is true on one (a stop signal must stop all ranks at one step)."""
    if world_size() <= 1:
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def launch(module: str, root: Path, nproc: int, env: dict[str, str] | None = None) -> None:
    """Run `python -m <module> --root <root>` on `nproc` local processes under torchrun and wait;
    `env`: variables the processes get on top of this one's (the MLflow parent run, say).

    Extra torchrun flags (multi-node: `--nnodes 2 --node_rank 0 --master_addr HOST
    --master_port PORT`) come from `$QLLM_TORCHRUN_ARGS`. Raises `QllmError` when a rank fails.
    """
    import shlex

    env = {**os.environ, **(env or {})}
    extra = shlex.split(env.get("QLLM_TORCHRUN_ARGS", ""))
    if not any(flag.startswith(("--standalone", "--rdzv", "--master", "--nnodes")) for flag in extra):
        extra = ["--standalone", *extra]  # a free local port: parallel stages never collide
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *extra, "-m", module, "--root", str(root)]
    completed = subprocess.run(command, env=env, cwd=root, check=False)
    if completed.returncode != 0:
        raise QllmError(f"{module}: distributed run on {nproc} processes failed (exit status {completed.returncode}): {shlex.join(command)}")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def wrap(model: torch.nn.Module) -> Any:
    """DDP over the default group (CPU: no device ids; CUDA: this rank's device)."""
    device = next(model.parameters()).device
    ids = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks FSDP shards one by one: modules whose class name ends with
    `DecoderLayer` (Llama's `model.model.layers[i]`, found the same way under a PEFT wrapper)."""
    return [module for module in model.modules() if type(module).__name__.endswith("DecoderLayer")]


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """An FSDP2 (`fully_shard`) copy of `model` over the default group: each decoder layer is its own
    unit (its parameters gathered for its forward/backward only), the root holds the rest
    (embeddings, final norm, head). Parameters, gradients and optimizer state become DTensors
    sharded across the ranks. `model` itself is left as it was: the training loop copies the
    trained weights back into it (`gather_into`)."""
    import copy

    from torch.distributed.fsdp import fully_shard

    net = copy.deepcopy(model)
    for layer in decoder_layers(net):
        fully_shard(layer)
    fully_shard(net)
    return net


def _options(everywhere: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # full (unsharded) tensors; cpu_offload gathers them on rank 0 alone (the others get {})
    return StateDictOptions(full_state_dict=True, cpu_offload=not everywhere)


def gather_into(net: torch.nn.Module, model: torch.nn.Module, everywhere: bool = False) -> None:
    """Copy the full weights of the FSDP module `net` into the plain `model`: on rank 0, or on every
    rank with `everywhere`. A collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    full = get_model_state_dict(net, options=_options(everywhere))
    if full:  # strict=False: a tied weight may be listed under one of its names only
        model.load_state_dict(full, strict=False)


def full_optimizer_state(net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state of the FSDP module `net`, unsharded and keyed by parameter name, on rank 0
    ({} elsewhere). A collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(net, optimizer, options=_options(everywhere=False))


def load_full_state(net: torch.nn.Module, model: torch.nn.Module, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any]) -> None:
    """Resume the FSDP module `net` from full state that every rank has loaded: the weights of
    `model` and a `full_optimizer_state`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(net, model.state_dict(), options=options)
    set_optimizer_state_dict(net, optimizer, optimizer_state, options=options)


class Parallel:
    """What differs between one process, DDP and FSDP, behind one interface, so that the training
    loop does not branch on the strategy.

    `model` is what the caller gave and gets back; `net` is what the loss runs and the optimizer
    updates: `model` itself (one process), `model` wrapped in DDP, or an FSDP-sharded copy (whose
    full weights are gathered back into `model` at checkpoints and at the end).
    """

    def __init__(self, model: torch.nn.Module, grad_accum_steps: int, strategy: str, desc: str) -> None:
        self.world = world_size()
        self.main = is_main()
        self.fsdp = self.world > 1 and strategy == "fsdp"
        self.ddp = self.world > 1 and not self.fsdp
        self.device = next(model.parameters()).device
        self.accum = grad_accum_steps if self.world == 1 else local_accum_steps(grad_accum_steps, self.world, desc)
        self.model = model
        self.net = model

    def prepare(self) -> torch.nn.Module:
        """Make `net`: FSDP shards a copy (the full model waits in host memory), DDP wraps `model`."""
        if self.fsdp:
            self.net = shard(self.model)
            if self.device.type != "cpu":
                self.model.to("cpu")  # the accelerator holds shards only
        elif self.ddp:
            self.net = wrap(self.model)
        return self.net

    def gradient_sync(self, micro: int) -> Any:
        """The context of micro-batch `micro`: gradients are averaged (and sharded) across ranks once
        per step, at the last micro-batch."""
        last = micro == self.accum - 1
        if self.fsdp:
            self.net.set_requires_gradient_sync(last)
        return self.net.no_sync() if self.ddp and not last else contextlib.nullcontext()

    def eval_model(self) -> torch.nn.Module:
        """What validation runs mid-training: under FSDP every rank runs the sharded forward."""
        return self.net if self.fsdp else self.model

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """For a checkpoint: the whole optimizer state (FSDP: gathered on rank 0, a collective)."""
        return full_optimizer_state(self.net, optimizer) if self.fsdp else optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Resume: `model` holds the checkpoint's weights; FSDP also loads them into its shards."""
        if self.fsdp:
            load_full_state(self.net, self.model, optimizer, state)
        else:
            optimizer.load_state_dict(state)

    def gather(self, everywhere: bool = False) -> None:
        """FSDP: the full trained weights into rank 0's `model` (every rank's with `everywhere`); a
        collective. Nothing to do otherwise: `net` trains `model` itself."""
        if self.fsdp:
            if everywhere:
                self.model.to(self.device)
            gather_into(self.net, self.model, everywhere=everywhere)

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        return mean_across_ranks(values, self.device)

    def total(self, value: int) -> int:
        return int(sum_across_ranks(value, self.device))

    def any(self, flag: bool) -> bool:
        return any_rank(flag, self.device)
