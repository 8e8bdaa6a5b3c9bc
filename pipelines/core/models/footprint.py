"""What a training stage will need, from the base's config.json alone, said before it loads anything.

    need = footprint.estimate(config, method="qlora", micro_batch=4, seq_len=1024, ...)
    footprint.check(need, "lora", micro_batches=800)   # QllmError if it cannot fit, a warning if it takes hours

A 1.5B-parameter base fine-tuned with 4 rows of 1,024 tokens on a laptop either fits or fails
after minutes of loading; here the stage says which, with the numbers, before it starts. The
estimate counts, in bytes:

- weights: fp32 on the CPU (4 per parameter; a bf16 stage keeps fp32 weights under autocast),
  or for QLoRA the decoder's linear weights in 4 bits plus their block scales (0.53 bytes per
  weight) and the rest in fp32;
- what training keeps per trainable parameter: its gradient and AdamW's two moments (12 bytes;
  6 with bitsandbytes' 8-bit AdamW, `train.optimizer: adamw_bnb_8bit`);
- activations: with gradient checkpointing each layer's input plus one layer's intermediates,
  without it every layer's;
- the logits and what the loss keeps of them (3 copies of rows x tokens x vocabulary in fp32; one
  chunk's worth with `train.loss_chunk_tokens`);
- the process's libraries (torch, transformers: about 0.5 GB).

It was checked against measured peaks at the shapes of Qwen2.5-0.5B and -1.5B (benchmarks/results/scale.md,
"Real sizes", issue 35): it is an estimate of the order of the need, good to within about 25%. Time: the step's
matrix FLOPs (6 per parameter and token for full training, 4 for a frozen base, plus 2 more when
checkpointing recomputes the forward) over what a quick product of two 1,024 x 1,024 matrices
reaches on this machine, times an efficiency measured on the same runs.

Only `check` acts on it: a need above the machine's whole memory is an error (the stage would be
killed or swap for hours), above what is free right now a warning; a long step a warning.
Nothing here stops a run for being slow.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from pipelines.core.errors import QllmError

log = logging.getLogger("qllm.footprint")

GB = 1e9
LIBRARIES = 0.5 * GB
NF4_BYTES = 0.53
"""Bytes per 4-bit weight with its block scales (double quantization)."""
EFFICIENCY = 1.0
"""A training step's FLOP/s over the quick probe's: 1.0-1.6 measured at the Qwen2.5-0.5B shape on a
2-core AMD EPYC capped to AVX2 (the model's matrices are larger than the probe's); 1.0 keeps the
time estimate on the long side (issue 35)."""
LONG_STAGE_SECONDS = 2 * 3600
METHODS = ("full", "lora", "qlora", "probe", "qprobe")


@dataclass(frozen=True)
class Need:
    method: str
    parameters: int
    weights: float
    trainable_state: float
    activations: float
    logits: float
    step_flops: float
    tokens_per_step: int

    @property
    def total(self) -> float:
        return self.weights + self.trainable_state + self.activations + self.logits + LIBRARIES

    def describe(self) -> str:
        state = "recorded gradients" if self.method in ("probe", "qprobe") else "gradients and optimizer"
        parts = (("weights", self.weights), (state, self.trainable_state), ("activations", self.activations),
                 ("logits", self.logits), ("libraries", LIBRARIES))  # fmt: skip
        return f"about {self.total / GB:.1f} GB (" + ", ".join(f"{name} {size / GB:.2f}" for name, size in parts) + ")"


def _get(config: dict, *keys: str, default=None):
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if default is not None:
        return default
    raise KeyError(keys[0])


def shape(config: dict) -> dict[str, int]:
    """The sizes that decide the need, from a transformers config.json (Llama, Qwen2, Mistral,
    Gemma, Phi-3 and the like); KeyError when one is missing."""
    hidden = int(_get(config, "hidden_size", "n_embd"))
    heads = int(_get(config, "num_attention_heads", "n_head"))
    return {
        "hidden": hidden,
        "intermediate": int(_get(config, "intermediate_size", default=4 * hidden)),
        "layers": int(_get(config, "num_hidden_layers", "n_layer")),
        "heads": heads,
        "kv_heads": int(_get(config, "num_key_value_heads", default=heads)),
        "head_dim": int(_get(config, "head_dim", default=hidden // heads)),
        "vocab": int(_get(config, "vocab_size")),
        "tied": bool(config.get("tie_word_embeddings", True)),
    }


def parameters(s: dict[str, int]) -> tuple[int, int]:
    """(every parameter, the decoder's linear weights) of a decoder of shape `s`."""
    attention = s["hidden"] * s["head_dim"] * (2 * s["heads"] + 2 * s["kv_heads"])
    linear = s["layers"] * (attention + 3 * s["hidden"] * s["intermediate"])
    embeddings = s["vocab"] * s["hidden"] * (1 if s["tied"] else 2)
    return linear + embeddings + s["layers"] * 2 * s["hidden"] + s["hidden"], linear


def method_for(adapter: bool, quantization: str = "none", probe: bool = False) -> str:
    """The `estimate` method of a stage: all weights, or adapters on a full-precision or a 4-bit
    base (`quantization` nf4/fp4), or (`probe`) probe_lora's gradients at such a base."""
    four_bit = adapter and quantization in ("nf4", "fp4")
    if probe:
        return "qprobe" if four_bit else "probe"
    return ("qlora" if four_bit else "lora") if adapter else "full"


def estimate(config: dict, *, method: str, micro_batch: int, seq_len: int, gradient_checkpointing: bool, loss_chunk_tokens: int = 0,
             lora_rank: int = 8, optimizer: str = "adamw_fused") -> Need:  # fmt: skip
    """The need of one training stage; `method`: `full` (sft), `lora` or `qlora` (every linear
    weight of the decoder adapted at rank `lora_rank`), or `probe`/`qprobe` (probe_lora at a frozen
    full-precision or 4-bit base: a gradient and an accumulated gradient of every linear weight in
    fp32, no optimizer)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    s = shape(config)
    total, linear = parameters(s)
    rest = total - linear
    weights = (linear * NF4_BYTES + rest * 4) if method in ("qlora", "qprobe") else total * 4
    if method == "full":
        trainable = total
    elif method in ("probe", "qprobe"):
        trainable = 0
    else:
        per_layer = s["hidden"] * 4 + s["head_dim"] * (s["heads"] * 2 + s["kv_heads"] * 2) + 3 * (s["hidden"] + s["intermediate"])
        trainable = s["layers"] * lora_rank * per_layer
    tokens = micro_batch * seq_len
    one_layer = tokens * (10 * s["hidden"] + 3 * s["intermediate"]) * 4 + micro_batch * s["heads"] * seq_len * seq_len * 4
    activations = (s["layers"] * tokens * s["hidden"] * 4 + one_layer) if gradient_checkpointing else s["layers"] * one_layer
    scored = min(loss_chunk_tokens, tokens) if loss_chunk_tokens else tokens
    logits = 3 * scored * s["vocab"] * 4
    per_token = (6 if method == "full" else 4) + (2 if gradient_checkpointing else 0)
    state = 4 + (2 if "8bit" in optimizer else 8)  # the gradient, then AdamW's two moments in fp32 or 8 bits
    recorded = linear * 8 if method in ("probe", "qprobe") else 0
    return Need(method, total, weights, trainable * state + recorded, activations, logits, per_token * total * tokens, tokens)


@functools.lru_cache(maxsize=4)
def matmul_flops_per_second(size: int = 1024, repeats: int = 3) -> float | None:
    """FLOP/s of a `size`-square fp32 product on this machine (about 0.1 s); None if it fails.
    Timed once per process: the stages a `qllm run` (or a test session) runs in one process share
    the figure, which only feeds a time estimate, instead of each multiplying 8.6 GFLOP again.

    Its operands come from a generator of its own: every training stage runs this before it trains,
    in a thread beside the stages already training, and a draw from torch's global generator there
    would shift the draws of a stage initialising its adapter at that moment
    (`pipelines.core.training.randomness`), making that stage's output depend on the timing."""
    try:
        import torch

        generator = torch.Generator().manual_seed(0)
        a, b = torch.randn(size, size, generator=generator), torch.randn(size, size, generator=generator)
        a @ b  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        return 2 * size**3 * repeats / (time.perf_counter() - start)
    except Exception:  # a probe, never a reason to stop
        log.info("footprint: could not time a matrix product; no time estimate")
        return None


def _memory() -> tuple[float, float] | None:
    """(total, available) bytes of the device the stage trains on: CUDA's if there is one."""
    try:
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            return float(total), float(free)
        import psutil

        memory = psutil.virtual_memory()
        return float(memory.total), float(memory.available)
    except Exception:
        return None


def advice(desc: str, method: str, cfg=None) -> str:
    """What would lower the need of stage `desc`, leaving out what its training config `cfg`
    already does."""
    tips = []
    if cfg is None or not cfg.gradient_checkpointing:
        tips.append(f"{desc}.train.gradient_checkpointing=true")
    if cfg is None or not cfg.loss_chunk_tokens:
        tips.append(f"{desc}.train.loss_chunk_tokens=1024 (sft, probe_lora, lora)")
    tips.append(f"a smaller {desc}.train.micro_batch_size or max_seq_len")
    if method == "full":
        tips.append("LoRA instead of all weights (the lora stage), or train.optimizer=adamw_bnb_8bit on a GPU")
    elif method in ("lora", "probe"):
        tips.append("a 4-bit base (quantization: nf4)")
    return "; ".join(tips)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def check(need: Need, desc: str, micro_batches: int, memory: tuple[float, float] | None = None, flops: float | None = None,
          tips: str | None = None) -> dict[str, float]:  # fmt: skip
    """Say before training whether `need` fits: a QllmError naming the numbers when it exceeds the
    machine's memory, a warning when it exceeds what is free now or when the stage would run for
    hours. `tips`: what to change (default: `advice` for the method). Returns the estimates, for
    the stage's metrics."""
    memory = memory if memory is not None else _memory()
    what = f"{desc} ({need.method}, {need.parameters / 1e9:.2f}B parameters, {need.tokens_per_step} tokens a micro-batch)"
    advice_text = tips if tips is not None else advice(desc, need.method)
    out = {"estimate/memory_gb": round(need.total / GB, 2)}
    if memory is not None:
        total, available = memory
        if need.total > total:
            raise QllmError(f"{what} needs {need.describe()}, more than this machine's {total / GB:.1f} GB; try {advice_text}")
        if need.total > available:
            log.warning("%s needs %s and %.1f GB are free now: it may swap or be killed; try %s", what, need.describe(), available / GB, advice_text)
    flops = flops if flops is not None else matmul_flops_per_second()
    if flops:
        seconds = need.step_flops / (flops * EFFICIENCY)
        out["estimate/seconds_per_micro_batch"] = round(seconds, 2)
        out["estimate/train_minutes"] = round(seconds * micro_batches / 60, 1)
        log.info("%s: %s, about %.1f s a micro-batch on this machine, so about %s for its %d micro-batches", what, need.describe(), seconds,
                 _duration(seconds * micro_batches), micro_batches)  # fmt: skip
        if seconds * micro_batches > LONG_STAGE_SECONDS:
            hours = math.ceil(seconds * micro_batches / 3600)
            log.warning("%s: about %.1f s a micro-batch, so about %d h for its %d micro-batches on this machine", what, seconds, hours, micro_batches)
    return out


def preflight(model_dir, cfg, *, method: str, seq_len: int, micro_batch: int, lora_rank: int, desc: str) -> dict[str, float]:
    """Before a stage loads `model_dir`: its need from the config alone (`estimate`), checked
    (`check`) for the `cfg.max_steps * cfg.grad_accum_steps` micro-batches of training config
    `cfg`. `seq_len` 0: the model's context. A model whose shape cannot be read (an adapter
    directory, an unknown architecture) trains without an estimate."""
    from transformers import AutoConfig

    try:
        if str(model_dir).lower().endswith(".gguf"):  # a GGUF base: its config from the file's metadata
            config = AutoConfig.from_pretrained(str(Path(model_dir).parent), gguf_file=Path(model_dir).name).to_dict()
        else:
            config = AutoConfig.from_pretrained(str(model_dir)).to_dict()
        need = estimate(config, method=method, micro_batch=micro_batch, seq_len=seq_len or int(config.get("max_position_embeddings", 2048)),
                        gradient_checkpointing=cfg.gradient_checkpointing, loss_chunk_tokens=cfg.loss_chunk_tokens, lora_rank=lora_rank,
                        optimizer=cfg.optimizer)  # fmt: skip
    except (KeyError, OSError, ValueError, TypeError) as exc:
        log.info("%s: no memory estimate for this model (%s)", desc, exc)
        return {}
    return check(need, desc, cfg.max_steps * cfg.grad_accum_steps, tips=advice(desc, method, cfg))
