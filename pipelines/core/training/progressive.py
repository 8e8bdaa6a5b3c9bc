"""Progressive stack-wise growth: a model-growth schedule the shared loop is handed.

    growth = progressive.Growth(params.progressive, cfg, model)   # cuts `model` to its first stack
    loop.train(model, loss_fn, batches, cfg, schedule=growth, ...)

The model starts as its first stack of decoder layers (`stacks[0]`) and gains a stack every
`steps_per_stack` steps until it has all `model.num_layers`; then an end-to-end phase trains the
whole rack (`rackwise`) or each stack in turn (`stackwise`). A new stack is

- `duplicate`: a copy of the top stack's layers (stacking: Gong et al., ICML 2019; G_stack,
  Du et al., NeurIPS 2024), or
- `identity`: the same copy with each block's attention and MLP output projections zeroed
  (LLaMA-Pro, Wu et al., ACL 2024), so that every new block adds nothing to the residual stream
  and the grown model computes exactly what the smaller one did.

With `trunk: frozen` only the new stack and the head (final norm, and the output projection when
it is not tied to the embedding) train while it is added: the embedding and the layers below are
frozen (no gradients, no optimizer state). Each phase starts a fresh AdamW over its trainable
parameters only, and the step-based learning-rate schedule is multiplied by a linear re-warm
over `rewarm_steps` after each growth (the schedule itself stays a function of the global step).

The loop asks `phase_at(step)` before each step; when it changes, `enter(model, phase)` grows the
model and sets what trains, and the loop builds the new optimizer and schedule. Checkpoints hold
every weight (a frozen trunk was trained in an earlier phase) and the phase, so a run resumes
exactly on either side of a growth point (the loop grows the model to the checkpoint's phase
before its weights are loaded).

While the trunk is frozen its output for a training sequence never changes: the time-step
activation cache (`ActivationCache`) keeps it per sequence and the decoder starts from it at the
first trainable layer, skipping the trunk's forward on later epochs. It is keyed by the sequence's
tokens (and, with a time-step objective, the time step) and cleared at every phase change.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipelines.core.errors import QllmError
from pipelines.core.params.pretraining import ActivationCacheParams, ProgressiveParams
from pipelines.core.params.training import TrainParams
from pipelines.core.training.phases import Phase, phase_at

log = logging.getLogger("qllm.progressive")


def phases(grow: ProgressiveParams, max_steps: int) -> list[Phase]:
    """The schedule's phases, in order (the config validated that they fill `max_steps`)."""
    stacks, per = grow.stacks, grow.steps_per_stack
    bounds = np.cumsum([0, *stacks]).tolist()
    out = []
    for i in range(len(stacks)):
        trainable = (bounds[i], bounds[i + 1]) if i and grow.trunk == "frozen" else None
        out.append(Phase(i, f"stack {i + 1}/{len(stacks)}", i * per, bounds[i + 1], trainable))
    start, rest = len(stacks) * per, max_steps - len(stacks) * per
    if rest <= 0 or grow.end_to_end.scope == "none":
        return out
    if grow.end_to_end.scope == "rackwise" or len(stacks) == 1:
        return [*out, Phase(len(out), "end-to-end", start, bounds[-1], None)]
    share = rest // len(stacks)
    for i in range(len(stacks)):
        if share == 0 and i < len(stacks) - 1:
            continue
        trainable = None if i == 0 else (bounds[i], bounds[i + 1])  # the bottom stack's turn includes the embedding
        out.append(Phase(len(out), f"end-to-end stack {i + 1}/{len(stacks)}", start + i * share, bounds[-1], trainable))
    return out


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder blocks of a Llama-style causal LM (`model.model.layers`)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise QllmError(f"progressive growth needs a decoder with `model.layers` (Llama-style); {type(model).__name__} has none")
    return layers


def _set_layer_count(model: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
    model.model.layers = torch.nn.ModuleList(layers)
    model.config.num_hidden_layers = len(layers)
    if isinstance(getattr(model.config, "layer_types", None), list):
        model.config.layer_types = (model.config.layer_types * len(layers))[: len(layers)]
    for index, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None)
        if attention is not None and hasattr(attention, "layer_idx"):
            attention.layer_idx = index  # the KV cache of generation addresses layers by index


def truncate(model: torch.nn.Module, layers: int) -> None:
    """Keep the first `layers` decoder blocks (the first stack of a freshly built model)."""
    _set_layer_count(model, list(decoder_layers(model))[:layers])


def zero_output_projections(block: torch.nn.Module) -> None:
    """LLaMA-Pro's identity block: attention `o_proj` and MLP `down_proj` (weights and biases) at zero."""
    found = False
    for name, module in block.named_modules():
        if name.endswith(("o_proj", "down_proj")) and isinstance(module, torch.nn.Linear):
            found = True
            with torch.no_grad():
                module.weight.zero_()
                if module.bias is not None:
                    module.bias.zero_()
    if not found:
        raise QllmError(f"progressive growth identity: {type(block).__name__} has no o_proj/down_proj linear layers to zero")


def grow(model: torch.nn.Module, new_layers: int, source: range, growth: str) -> None:
    """Add `new_layers` blocks on top, copies of the top `new_layers` blocks of `source` (the top
    stack; all of it, repeated, if the new stack is taller), zeroed output projections for `identity`."""
    layers = list(decoder_layers(model))
    added = []
    for i in range(new_layers):
        block = copy.deepcopy(layers[source[(len(source) - new_layers + i) % len(source)]])
        if growth == "identity":
            zero_output_projections(block)
        added.append(block)
    _set_layer_count(model, layers + added)


def head_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The head: the final norm, and the output projection unless it is the (tied) input embedding."""
    head = list(model.model.norm.parameters())
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if output is not None and output.weight is not embedding.weight:
        head += list(output.parameters())
    return head


class Growth:
    """The growth schedule of one run (a `phases.Schedule`): phases, model surgery, what trains,
    the re-warm, the cache."""

    changes_model = True

    def __init__(self, grow: ProgressiveParams, cfg: TrainParams, model: torch.nn.Module, desc: str = "pretrain",
                 trained: bool = False) -> None:  # fmt: skip
        """`model`: built whole from config (pretrain: cut to its first stack here), or, with
        `trained`, a trained model that is the first stack and grows from there (sft)."""
        self.params, self.cfg, self.desc = grow, cfg, desc
        self.phases = phases(grow, cfg.max_steps)
        self.bounds = np.cumsum([0, *grow.stacks]).tolist()
        self.rewarm = cfg.warmup_steps if grow.rewarm_steps is None else grow.rewarm_steps
        have, expected = len(decoder_layers(model)), grow.stacks[0] if trained else self.bounds[-1]
        if have != expected:
            what = "the first stack: the trained model to grow" if trained else "all stacks: the model built from config"
            raise QllmError(f"{desc}.progressive.stacks {grow.stacks}: the model has {have} layers; expected {expected} ({what})")
        if not trained:
            truncate(model, self.phases[0].layers)  # trained from its first stack
        self.current = -1
        self.cache = ActivationCache(grow.activation_cache, desc) if grow.activation_cache.enabled else None
        if self.cache is not None:
            self.cache.attach(model)

    def phase_at(self, step: int) -> Phase:
        return phase_at(self.phases, step)

    def lr_factor(self, phase: Phase, steps_into_phase: int) -> float:
        """The re-warm ramp after a growth point (1 in the first phase and once warmed)."""
        if phase.index == 0 or self.rewarm == 0:
            return 1.0
        return min(1.0, (steps_into_phase + 1) / self.rewarm)

    def enter(self, model: torch.nn.Module, phase: Phase) -> None:
        """Grow `model` to the phase's layers (copying the top stack) and set what trains."""
        while len(decoder_layers(model)) < phase.layers:
            have = len(decoder_layers(model))
            stack = self.bounds.index(have)  # the next stack to add
            below = range(self.bounds[stack - 1], have)
            grow(model, self.params.stacks[stack], below, self.params.growth)
            log.info("%s: grew to %d layers (stack %d, %s)", self.desc, len(decoder_layers(model)), stack + 1, self.params.growth)
        if phase.trainable is None:
            for parameter in model.parameters():
                parameter.requires_grad_(True)
        else:
            for parameter in model.parameters():
                parameter.requires_grad_(False)
            lo, hi = phase.trainable
            for layer in list(decoder_layers(model))[lo:hi]:
                layer.requires_grad_(True)
            for parameter in head_parameters(model):
                parameter.requires_grad_(True)
        self.current = phase.index
        if self.cache is not None:
            self.cache.reset(phase.trainable[0] if phase.trainable else 0)

    def metrics(self) -> dict[str, float]:
        phase = self.phases[self.current]
        out = {"train/stack_phase": float(phase.index), "train/layers": float(phase.layers)}
        if self.cache is not None:
            out |= self.cache.metrics()
        return out

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()


def save_stacks(model: torch.nn.Module, stacks: list[int], out: Path) -> None:
    """Each stack's decoder blocks as `stacks/stack-NN.safetensors` (names relative to the stack:
    `0.self_attn.q_proj.weight`, ...), with `stacks/stacks.json` listing their layer ranges."""
    import json

    from safetensors.torch import save_file

    folder = out / "stacks"
    folder.mkdir()
    layers, start, listing = list(decoder_layers(model)), 0, []
    for index, size in enumerate(stacks):
        tensors = {f"{i}.{name}": t.detach().contiguous() for i, layer in enumerate(layers[start : start + size]) for name, t in layer.state_dict().items()}
        save_file(tensors, str(folder / f"stack-{index:02d}.safetensors"))
        listing.append({"stack": index, "file": f"stack-{index:02d}.safetensors", "layers": [start, start + size]})
        start += size
    (folder / "stacks.json").write_text(json.dumps({"stacks": listing}, indent=2) + "\n")


def load_stack(model: torch.nn.Module, path: Path | str, first_layer: int) -> None:
    """Load one saved stack into `model`'s decoder blocks from `first_layer` on (a stack reused in another model)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    layers = decoder_layers(model)
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        index, _, rest = name.partition(".")
        by_layer.setdefault(int(index), {})[rest] = tensor
    if first_layer + len(by_layer) > len(layers):
        raise QllmError(f"{path}: a stack of {len(by_layer)} layers does not fit from layer {first_layer} of a {len(layers)}-layer model")
    for index, state in sorted(by_layer.items()):
        layers[first_layer + index].load_state_dict(state)


class ActivationCache:
    """The frozen trunk's output per training sequence: least recently used in memory up to
    `memory_mb`, spilled to a temporary file up to `disk_mb` (then dropped).

    `attach` hooks the model's decoder: in training mode, while the first `start` layers (and the
    embedding) are frozen, a forward given `input_ids` looks each sequence up (key: its tokens and
    `time_step`, which a time-step objective sets per batch), computes the misses through the
    trunk alone, and runs only the layers from `start` on, from the cached activations. The
    arithmetic is the model's own forward split in two, so training gives the same weights
    with and without the cache.
    """

    def __init__(self, params: ActivationCacheParams, desc: str = "pretrain") -> None:
        self.memory_limit = int(params.memory_mb * 2**20)
        self.disk_limit = int(params.disk_mb * 2**20)
        self.desc = desc
        self.start = 0
        self.time_step: int | None = None
        self.memory: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.memory_bytes = 0
        self.disk: OrderedDict[bytes, tuple[int, tuple[int, ...], torch.dtype]] = OrderedDict()
        self.disk_bytes = 0
        self._file = None
        self._free: list[tuple[int, int]] = []  # (offset, size) slots of dropped spills
        self._end = 0
        self.hits = self.misses = 0
        self._inside = False
        self._handles: list[Any] = []
        self._saved: tuple[torch.nn.ModuleList, int] | None = None

    # -- storage -------------------------------------------------------------------------------
    def key(self, row: torch.Tensor) -> bytes:
        digest = hashlib.blake2b(row.cpu().numpy().tobytes(), digest_size=16)
        digest.update(str((row.shape[-1], self.time_step)).encode())
        return digest.digest()

    def get(self, key: bytes) -> torch.Tensor | None:
        if key in self.memory:
            self.memory.move_to_end(key)
            return self.memory[key]
        if key in self.disk:
            offset, shape, dtype = self.disk.pop(key)
            nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            self._file.seek(offset)
            tensor = torch.frombuffer(bytearray(self._file.read(nbytes)), dtype=dtype).reshape(shape)
            self._free.append((offset, nbytes))
            self.disk_bytes -= nbytes
            self.put(key, tensor)
            return tensor
        return None

    def put(self, key: bytes, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().cpu().contiguous()
        size = tensor.numel() * tensor.element_size()
        if key in self.memory:  # the same sequence twice in one batch
            return
        if size > self.memory_limit:
            self._spill(key, tensor)
            return
        self.memory[key] = tensor
        self.memory_bytes += size
        while self.memory_bytes > self.memory_limit:
            old_key, old = self.memory.popitem(last=False)
            self.memory_bytes -= old.numel() * old.element_size()
            self._spill(old_key, old)

    def _spill(self, key: bytes, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if size > self.disk_limit:
            return
        while self.disk_bytes + size > self.disk_limit:
            old_key, (offset, shape, dtype) = self.disk.popitem(last=False)
            old_size = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            self._free.append((offset, old_size))
            self.disk_bytes -= old_size
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="qllm-activations-")  # noqa: SIM115 (lives across calls; gone when closed, even after a crash)
        offset = next((o for o, s in self._free if s == size), None)
        if offset is None:
            offset, self._end = self._end, self._end + size
        else:
            self._free.remove((offset, size))
        self._file.seek(offset)
        self._file.write(tensor.view(torch.uint8).numpy().tobytes() if tensor.dtype == torch.bfloat16 else tensor.numpy().tobytes())
        self.disk[key] = (offset, tuple(tensor.shape), tensor.dtype)
        self.disk_bytes += size

    def reset(self, start: int) -> None:
        """A new phase: the trunk is the first `start` layers (0: nothing is frozen, no caching)."""
        self.start = start
        self.memory.clear()
        self.disk.clear()
        self.memory_bytes = self.disk_bytes = self._end = 0
        self._free.clear()
        if self._file is not None:
            self._file.close()
            self._file = None

    def metrics(self) -> dict[str, float]:
        seen = self.hits + self.misses
        return {"train/activation_cache_hit_rate": self.hits / seen if seen else 0.0,
                "train/activation_cache_mb": (self.memory_bytes + self.disk_bytes) / 2**20}  # fmt: skip

    def close(self) -> None:
        self.reset(0)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- the split forward --------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> None:
        decoder = model.model
        self._handles.append(decoder.register_forward_pre_hook(self._before, with_kwargs=True))
        self._handles.append(decoder.register_forward_hook(self._after, always_call=True))

    def _before(self, decoder: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        full = mask is None or (mask.dim() == 4 and bool(mask.all()))  # causal, or bidirectional without padding (masked diffusion)
        if (self._inside or self.start == 0 or not decoder.training or input_ids is None or not full
                or kwargs.get("position_ids") is not None or kwargs.get("use_cache")):  # fmt: skip
            return None
        hidden = self.trunk_output(decoder, input_ids, mask)
        kwargs = {**kwargs, "input_ids": None, "inputs_embeds": hidden, "use_cache": False}
        self._saved = (decoder.layers, decoder.config.num_hidden_layers)
        decoder.layers = torch.nn.ModuleList(list(decoder.layers)[self.start :])
        decoder.config.num_hidden_layers = len(decoder.layers)
        return (), kwargs

    def _after(self, decoder: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._saved is not None and not self._inside:
            decoder.layers, decoder.config.num_hidden_layers = self._saved
            self._saved = None

    def trunk_output(self, decoder: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The output of the first `start` layers for each row, from the cache or computed. The key is
        the row's tokens: under masked diffusion with discrete time steps those are the masked tokens,
        a function of (row, time step)."""
        keys = [self.key(row) for row in input_ids]
        found = [self.get(key) for key in keys]
        missing = [i for i, tensor in enumerate(found) if tensor is None]
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        if missing:
            computed = self._run_trunk(decoder, input_ids[missing], None if mask is None else mask[missing])
            for i, tensor in zip(missing, computed, strict=True):
                found[i] = tensor
                self.put(keys[i], tensor)
        return torch.stack([tensor.to(input_ids.device) for tensor in found])

    def _run_trunk(self, decoder: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        layers, count, norm = decoder.layers, decoder.config.num_hidden_layers, decoder.norm
        self._inside = True
        try:
            decoder.config.num_hidden_layers = self.start
            decoder.norm = torch.nn.Identity()
            with torch.no_grad():
                return decoder(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state.detach()
        finally:
            decoder.layers, decoder.config.num_hidden_layers, decoder.norm = layers, count, norm
            self._inside = False
