"""Quantized backbones for adapter training (QLoRA): the base frozen in 4 or 8 bits, adapters in
full precision.

    lora:
      quantization: nf4        # none | nf4 | fp4 | int8 | fp8
      double_quant: true       # 4-bit: quantize the per-block scales too (QLoRA's double quantization)
      compute_dtype: auto      # auto: the stage's precision (bf16 where native, else fp32)

4- and 8-bit weights come from bitsandbytes through transformers' `BitsAndBytesConfig`, on CUDA
and, since bitsandbytes 0.48, on x86 CPUs too (its CPU backend; 0.50.2 is the version tested
here: NF4/FP4 and LLM.int8() matmuls run, dequantizing on the fly, so a CPU step is slower than
in bf16/fp32, see benchmarks/results/adapters.md). Before the adapters are added the base is prepared as
PEFT's `prepare_model_for_kbit_training` prepares it (frozen, layer norms in fp32, input gradients
on), less one cast: a 16-bit checkpoint's embedding and output head, frozen and left unquantized,
stay in their 16 bits instead of becoming an fp32 copy (`for_adapters`). `fp8` is CUDA-only (compute capability 8.9 or newer: Ada, Hopper), through
transformers' `FineGrainedFP8Config`; anywhere else it is a clear error, as is a missing or too old
bitsandbytes.

Quantization is deterministic, so a resumed run re-quantizes the base from its source and loads
only the adapter and optimizer state from the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipelines.core.errors import QllmError
from pipelines.core.models.models import device, load_model_and_tokenizer

QUANTIZATIONS = ("none", "nf4", "fp4", "int8", "fp8")
MIN_BNB_CPU = (0, 48)
"""bitsandbytes releases before 0.48 have no CPU backend for 4-/8-bit matmuls."""
FP8_CAPABILITY = (8, 9)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def compute_dtype(name: str, precision: str) -> torch.dtype:
    """`auto` follows the stage's resolved precision (`train.precision`)."""
    return DTYPES[precision if name == "auto" else name]


def from_params(params: Any, precision: str, section: str) -> Any:
    """The quantization config `params` asks for (its `quantization`, `double_quant` and
    `compute_dtype`: a `QuantizationParams`, an adapter's `base_quantization`, or a section with
    those keys), checked against this device and library; None for a full-precision base."""
    name = getattr(params, "quantization", "none")
    if name == "none":
        return None

    check(name, device(), section)
    return config(name, params.double_quant, compute_dtype(params.compute_dtype, precision))


def load(path: Any, qconfig: Any, section: str):
    """(model, tokenizer) of a base loaded straight into `qconfig`'s bits and kept in
    bitsandbytes' standard layout (`keep_standard_layout`)."""

    return_freed_weights()
    model, tokenizer = load_model_and_tokenizer(path, quantization=qconfig)
    release_checkpoint_pages()
    return autocast_outputs(keep_standard_layout(model)), tokenizer


FREED_AT_ONCE_BYTES = 4 * 2**20
"""Allocations this large or larger get their own mapping, returned to the system when freed: the
dequantized weights of a 0.5B-1.5B model's MLP and most of its attention, not its activations."""


def return_freed_weights() -> bool:
    """Have glibc give each large allocation its own mapping, returned when freed, for the rest of
    this process; False where the C library has no `mallopt` (not glibc).

    A 4-bit layer dequantizes its weight at every forward and backward (3-17 MB in fp32 at
    Qwen2.5-0.5B's shape) and frees it right after. glibc serves allocations over its mmap
    threshold with a mapping of their own, but raises the threshold to the size of the largest
    such block freed (up to 32 MB): after the first, every dequantized weight came from the heap,
    and with the activations allocated after it kept above it, stayed resident when freed: 46 MB a
    layer of a 0.5B fp32 forward: the stage's peak was 2.39-2.77 GB in three runs, 0.70-0.82x LoRA's.
    A fixed threshold (it also stops the raising) gives each one back as it is freed; the cost is
    the page faults of mapping it again (benchmarks/results/scale.md, "QLoRA's memory")."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    M_MMAP_THRESHOLD = -3
    return bool(mallopt(M_MMAP_THRESHOLD, FREED_AT_ONCE_BYTES))


MADV_PAGEOUT = 21
"""Linux 5.4+: reclaim the given pages now, keeping their content (written back or swapped if dirty)."""


def release_checkpoint_pages(maps: Path | str = "/proc/self/maps") -> int:
    """Give back the pages of the memory-mapped checkpoint files that loading read; returns the bytes
    of mappings advised.

    safetensors are memory-mapped: quantizing reads every weight, so a bf16 1.5B checkpoint leaves
    3.1 GB of file pages resident, and they stay mapped while the weights left unquantized
    (embeddings, norms) are still views into the file, until `for_adapters` casts them to fp32,
    which then raised the stage's peak resident memory by that cast on top of the whole file
    (5.3 GB where training needs 2.9). The pages are clean file cache the kernel could drop anyway;
    `madvise(MADV_PAGEOUT)` drops them now (an access reads them back from the file; content kept
    either way). Where the call is unsupported (not Linux, an old kernel) nothing happens."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return 0
    try:
        lines = Path(maps).read_text().splitlines()
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    advised = 0
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or not fields[-1].endswith(".safetensors"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_PAGEOUT) == 0:
            advised += end - start
    return advised


HALF = (torch.bfloat16, torch.float16)
QUANTIZED_PARAMETERS = ("Params4bit", "Int8Params")
"""bitsandbytes' classes of quantized weights, which PEFT's preparation leaves as they are too."""


def for_adapters(model: torch.nn.Module, qconfig: Any, gradient_checkpointing: bool) -> torch.nn.Module:
    """Before adapters go on. A full-precision base moves to this process's device. A quantized one
    (`from_pretrained` already placed it) is prepared as PEFT's `prepare_model_for_kbit_training`
    does (every weight frozen, 16-bit norms and biases cast to fp32, activation checkpointing on)
    except for the embedding and output head, which keep the 16 bits they were
    loaded in (`hold_embeddings`): PEFT casts them to fp32 too, a full copy of the largest matrix
    left unquantized (Qwen2.5-0.5B's tied 151,936 x 896 embedding: 0.55 GB in fp32 against 0.27 in
    bf16, 1.5B's 0.93 against 0.47), which is what kept QLoRA near LoRA's memory."""
    if qconfig is None:

        return model.to(device())
    model.requires_grad_(False)
    held = hold_embeddings(model)
    for parameter in model.parameters():
        if parameter.dtype in HALF and type(parameter).__name__ not in QUANTIZED_PARAMETERS and id(parameter) not in held:
            parameter.data = parameter.data.to(torch.float32)
    if gradient_checkpointing:  # non-reentrant, as the training loop sets it (PEFT's reentrant default needs input gradients on)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


HEAD_BLOCK_BYTES = 32 * 2**20
"""The output head's 16-bit weight meets fp32 activations this many bytes of rows at a time."""


def hold_embeddings(model: torch.nn.Module) -> set[int]:
    """Keep a 16-bit input embedding and output head (tied or not) in their dtype while the rest of
    the model computes in fp32; returns the ids of the weights kept. The embedding's output is cast
    to fp32 (the same numbers: a 16-bit value is exact in fp32); the head's product upcasts
    `HEAD_BLOCK_BYTES` of rows at a time (`_upcast_rows`), and under an autocast of its own dtype it
    uses the weight as it is, where an fp32 head was cast whole at every use. Nothing is kept where
    the checkpoint is fp32 or the head is not a plain `Linear` (another kind could not compute
    against a 16-bit weight)."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding is None or embedding.weight.dtype not in HALF:
        return set()
    weights = {id(embedding.weight)}
    if head is not None and head.weight.dtype in HALF:
        if type(head) is not torch.nn.Linear:
            if head.weight is embedding.weight:
                return set()  # tied to a head that would meet fp32 activations with it
        else:
            head.forward = _head_forward.__get__(head)
            weights.add(id(head.weight))
    embedding._qllm_held = embedding.register_forward_hook(_as_float32)
    return weights


def embeddings_in_float32(model: torch.nn.Module) -> None:
    """Undo `hold_embeddings`: the embedding and head in fp32 again, for PEFT's trainable tokens,
    which write fp32 rows into the embedding (their memory is PEFT's: a copy of the embedding at
    every forward)."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    hook = getattr(embedding, "_qllm_held", None)
    if hook is None:
        return
    hook.remove()
    del embedding._qllm_held
    if head is not None and "forward" in vars(head):
        del head.forward
    for module in (embedding, head):
        if module is not None and module.weight.dtype in HALF:
            module.weight.data = module.weight.data.to(torch.float32)


def _as_float32(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.to(torch.float32)


def _head_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    autocast = torch.is_autocast_enabled(x.device.type)
    dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
    if self.weight.dtype == dtype:  # under autocast: only x is cast, as for any Linear
        return torch.nn.functional.linear(x, self.weight, self.bias)
    with torch.autocast(x.device.type, enabled=False):
        out = _UpcastRows.apply(x.to(dtype), self.weight, max(1, HEAD_BLOCK_BYTES // (self.weight.shape[1] * 4)))
        return out if self.bias is None else out + self.bias.to(dtype)


class _UpcastRows(torch.autograd.Function):
    """`x @ weight.T` for a frozen `weight` of another dtype than `x`, `rows` of it converted to
    x's dtype at a time, in the forward and in the backward (the gradient of `x` only)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.rows = rows
        out = x.new_empty((*x.shape[:-1], weight.shape[0]))
        for start in range(0, weight.shape[0], rows):
            out[..., start:start + rows] = x @ weight[start:start + rows].to(x.dtype).t()
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        grad_x = grad.new_zeros((*grad.shape[:-1], weight.shape[1]))
        for start in range(0, weight.shape[0], ctx.rows):
            grad_x += grad[..., start:start + ctx.rows] @ weight[start:start + ctx.rows].to(grad.dtype)
        return grad_x, None, None


def autocast_outputs(model: torch.nn.Module) -> torch.nn.Module:
    """Under autocast, a 4-bit layer that computes in the autocast dtype returns that dtype, as
    torch's `Linear` does. bitsandbytes' `Linear4bit` casts its input to its compute dtype and its
    output back to the input's dtype: with the residual stream in fp32, every activation after a
    4-bit layer (attention, the MLP's products, what backward keeps of them) was fp32 where LoRA's
    are bf16. Its input is cast before it instead (the product is the same: it ran in that dtype)."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:  # fp8 (transformers' own layers) needs no bitsandbytes
        return model
    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.register_forward_pre_hook(_autocast_input)
    return model


def _autocast_input(module: torch.nn.Module, args: tuple):
    x = args[0]
    if torch.is_autocast_enabled(x.device.type) and module.compute_dtype == torch.get_autocast_dtype(x.device.type):
        return (x.to(module.compute_dtype), *args[1:])
    return None


def check(quantization: str, device: torch.device, section: str = "lora.adapter") -> None:
    """A clear `QllmError` when this device or library cannot do `quantization`."""
    if quantization == "none":
        return
    if quantization == "fp8":
        if device.type != "cuda":
            raise QllmError(f"{section}.quantization: fp8 needs a CUDA device of compute capability 8.9 or newer (Ada, Hopper); this machine trains on {device.type}; use nf4 or int8")
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) < FP8_CAPABILITY:
            raise QllmError(f"{section}.quantization: fp8 needs compute capability 8.9 or newer; {torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}; use nf4 or int8")
        return
    try:
        import bitsandbytes
    except ImportError:
        raise QllmError(f"{section}.quantization: {quantization} needs bitsandbytes (pip install 'bitsandbytes>=0.48'); or set {section}.quantization: none") from None
    if device.type == "cpu" and _version(bitsandbytes.__version__) < MIN_BNB_CPU:
        raise QllmError(
            f"{section}.quantization: bitsandbytes {bitsandbytes.__version__} has no CPU backend for {quantization} "
            "(4-/8-bit on CPU needs bitsandbytes >= 0.48: pip install -U 'bitsandbytes>=0.48')"
        )


def keep_standard_layout(model: torch.nn.Module) -> torch.nn.Module:
    """Stop bitsandbytes from repacking 4-bit weights for its AVX512-BF16 CPU inference kernel.

    On such CPUs a `Linear4bit` run in eval mode without gradients (validation, generation)
    rewrites its weight into a CPU-only layout for good. Training steps after a validation then
    run another kernel than a run resumed from a checkpoint (which loads the standard layout), so
    resuming would not be exact, and dequantizing the repacked weight gives garbage. Kept in the
    standard layout, train, eval and resume all use one kernel. (The repacking also fails outright
    on layers narrower than 64 inputs, so without it tiny test models quantize too.)"""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def config(quantization: str, double_quant: bool, dtype: torch.dtype) -> Any:
    """transformers' quantization config for `from_pretrained`, or None for `none`."""
    if quantization == "none":
        return None
    if quantization == "fp8":
        from transformers import FineGrainedFP8Config

        return FineGrainedFP8Config()
    from transformers import BitsAndBytesConfig

    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantization, bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=dtype)


def linear_weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes held by the decoder's linear weights (quantized or not, block scales included) and by
    every other parameter (embeddings, norms, adapters)."""
    linear = other = 0
    seen: set[int] = set()
    for name, module in model.named_modules():
        if "lm_head" in name or ".lora_" in name:  # the output head (kept in full precision) and the adapters are not the backbone
            continue
        weight = getattr(module, "weight", None)
        if weight is None or id(weight) in seen or not _is_linear(module):
            continue
        seen.add(id(weight))
        linear += weight.numel() * weight.element_size() + _quant_state_bytes(weight)
    for parameter in model.parameters():
        if id(parameter) not in seen:
            seen.add(id(parameter))
            other += parameter.numel() * parameter.element_size()
    return {"linear_weight_bytes": linear, "other_parameter_bytes": other}


def embedding_dtype(model: torch.nn.Module) -> str:
    """The dtype the input embedding is held in (`bf16`, `fp16`, `fp32`): the checkpoint's 16 bits
    under a quantized base (`hold_embeddings`), fp32 where it was cast."""
    dtype = model.get_input_embeddings().weight.dtype
    return {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype).removeprefix("torch."))


def _is_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) or type(module).__name__ in ("Linear4bit", "Linear8bitLt", "FP8Linear")


def _quant_state_bytes(weight: torch.Tensor) -> int:
    """Per-block scales of a 4-bit weight (bitsandbytes keeps them beside the packed weight)."""
    state = getattr(weight, "quant_state", None)
    if state is None:
        scb = getattr(weight, "SCB", None)
        return int(scb.numel() * scb.element_size()) if isinstance(scb, torch.Tensor) else 0
    total = state.absmax.numel() * state.absmax.element_size()
    nested = getattr(state, "state2", None)
    if nested is not None:
        total += nested.absmax.numel() * nested.absmax.element_size() + nested.code.numel() * nested.code.element_size()
    return int(total)


def dequantized(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every quantized linear layer replaced by a plain one holding its
    dequantized weight (what the adapters were trained against), for merging."""
    if hasattr(model, "dequantize") and getattr(model, "is_quantized", False):
        return model.dequantize()
    return model


def describe(qconfig: Any) -> dict[str, Any]:
    """What an adapter trained on a quantized base records about that base (`QUANTIZATION_FILE`):
    enough to quantize the base again exactly (`from_description`)."""
    if getattr(qconfig, "load_in_4bit", False):
        dtype = {v: k for k, v in DTYPES.items()}.get(qconfig.bnb_4bit_compute_dtype, "fp32")
        return {"quantization": qconfig.bnb_4bit_quant_type, "double_quant": bool(qconfig.bnb_4bit_use_double_quant), "compute_dtype": dtype}
    if getattr(qconfig, "load_in_8bit", False):
        return {"quantization": "int8"}
    return {"quantization": "fp8"}

