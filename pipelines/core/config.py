"""The params schemas: one typed section per stage (the same name as the stage module, the
`dvc.yaml` stage and the Prefect task), each a frozen pydantic model whose validators check values
and combinations; plus the plain-data helpers of params (`to_plain`, `flatten`, `digest`). Reading
`params.yaml`, overlays and `--set` overrides into them is `pipelines.core.params_file`.

The shipped `params.yaml` spells out every key, so DVC sees every value a stage depends on (a
test enforces it); the defaults here exist for users' own, shorter params files.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pipelines.core import extensions
from pipelines.core.errors import QllmError

PARAMS_FILE = "params.yaml"
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The seven linear projections of a Llama-style block: the default LoRA targets and probe candidates."""


class ParamsError(QllmError, ValueError):
    """A params file or override is invalid; the message names the file, key and expectation."""


def _shown(value: Any) -> str:
    """A value as params.yaml writes it (`true`, `null`, `discopop`)."""
    return json.dumps(value) if isinstance(value, (bool, type(None))) else str(value)


@dataclass(frozen=True)
class AppliesWhen:
    """Field metadata: the key acts only when `holds(section)` is true. Set to anything but its default
    where it does not hold, it is refused by `Section` with an error naming the key and `when`, so a
    setting that would change nothing never passes silently. Declared once, on the field:

        discopop_tau: Annotated[float, only_with("loss_type", "discopop")] = Field(0.05, gt=0)

    `keys`: the sub-keys of a nested block the condition governs (`("r",)` for `adapter.r`); empty,
    the whole field. `shows`: keys of the section whose values the error quotes; `hint`: what the
    error adds. tests/core/test_config.py walks every declared field of every section and checks the
    refusal."""

    when: str
    holds: Callable[[Any], bool]
    keys: tuple[str, ...] = ()
    shows: tuple[str, ...] = ()
    hint: str = ""


def only_with(key: str, *values: Any, keys: tuple[str, ...] = (), hint: str = "") -> AppliesWhen:
    """The field acts only when the section's `key` is one of `values`."""
    shown = [_shown(v) for v in values]
    listed = shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"
    return AppliesWhen(f"{key}: {listed}", lambda section: getattr(section, key) in values, keys, (key,), hint)


WHEN_ENABLED = only_with("enabled", True, hint="to switch a block off, give it whole: `{enabled: false}` "
                                              "(e.g. --set 'dpo.adapter={enabled: false}')")  # fmt: skip
"""The settings of a block switched by its own `enabled`."""


INERT_KEY = "inert_key"
"""The pydantic error type of a key set where it would change nothing; its context names the `key`
(dotted, within the section), the `deciding` keys and the key's `default`."""


def applies_when(info) -> list[AppliesWhen]:
    """The conditions declared on a field (`FieldInfo.metadata`)."""
    return [m for m in info.metadata if isinstance(m, AppliesWhen)]


def _leaves(value: Any, prefix: str) -> dict[str, Any]:
    """A value's leaves by dotted key: a nested section's keys, or the value itself under `prefix`."""
    if isinstance(value, BaseModel):
        return {key: leaf for name in type(value).model_fields for key, leaf in _leaves(getattr(value, name), f"{prefix}.{name}").items()}
    return {prefix: value}


class Section(BaseModel):
    """Base of every params section: frozen, no unknown keys, no bool-for-number mix-ups, and no key
    set where it would change nothing (`AppliesWhen`). What a key means is the string under it
    (`field_docs`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info) -> Any:
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and annotation in (int, float):
            raise ValueError(f"expected a number, got a boolean ({value})")
        return value

    @model_validator(mode="after")
    def _only_what_acts(self) -> Section:
        for name, info in type(self).model_fields.items():
            for condition in applies_when(info):
                if condition.holds(self):
                    continue
                default = info.get_default(call_default_factory=True)
                now, then = _leaves(getattr(self, name), name), _leaves(default, name)
                governed = [f"{name}.{key}" for key in condition.keys] if condition.keys else list(now)
                changed = [key for key in governed if now.get(key) != then.get(key)]
                if changed:
                    here = ", ".join(f"{key} is {_shown(getattr(self, key))}" for key in condition.shows)
                    message = (f"{changed[0]}: applies only with {condition.when}{f' (here {here})' if here else ''}, so here it "
                               f"would change nothing: leave it at its default ({_shown(then.get(changed[0]))})"
                               f"{f'; {condition.hint}' if condition.hint else ''}")  # fmt: skip
                    # the context lets `params_file.load` tell a key a later layer made inert from one given with its switch
                    raise PydanticCustomError(INERT_KEY, "{message}", {"message": message, "key": changed[0],
                                                                      "deciding": list(condition.shows), "default": then.get(changed[0])})  # fmt: skip
        return self


def field_docs(model: type[BaseModel]) -> dict[str, str]:
    """What each key of `model` means: the string under it in this file, cleaned as a docstring (a
    section inherits its bases' keys; where both say, the section's own wins). The params reference
    reads them (docs/hooks.py).

    pydantic can attach these to the fields as it builds each model (`use_attribute_docstrings`),
    but on Python < 3.13 it finds a class's source by asking `inspect.getmodule` about each frame of
    the import, and each asking scans all of `sys.modules`: 1.0 s of CPU in every process that
    imports this module after torch (2-core EPYC, capped to AVX2), and the scan read the deferred
    bitsandbytes' `__file__`, which ran it (1.3 s more; `pipelines.DEFERRED`). Only the docs need
    the text, so it is read from the source when they ask."""
    docs: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if cls.__module__ == __name__:
            docs.update(_docstrings_by_class().get(cls.__qualname__, {}))
    return {name: doc for name, doc in docs.items() if name in model.model_fields}


@functools.cache
def _docstrings_by_class() -> dict[str, dict[str, str]]:
    """For each class of this file, a string literal that follows an annotated name, by name (as
    pydantic's `use_attribute_docstrings` reads them)."""
    found: dict[str, dict[str, str]] = {}
    for node in ast.parse(Path(__file__).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef):
            docs, target = found.setdefault(node.name, {}), None
            for statement in node.body:
                value = statement.value if isinstance(statement, ast.Expr) else None
                if target and isinstance(value, ast.Constant) and isinstance(value.value, str):
                    docs[target] = inspect.cleandoc(value.value)
                target = statement.target.id if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) else None
    return found


# --------------------------------------------------------------------------------------- stages


class SampleImagesParams(Section):
    """Real images for the multimodal stage: scikit-learn's handwritten digits as PNG files with
    questions about them (`pipelines/core/data/digits.py`)."""

    enabled: bool = False
    """Also write `images/`, `image_chat_train.jsonl` and `image_chat_heldout.jsonl`."""
    heldout_fraction: float = Field(0.2, gt=0, lt=1)
    """Share of the images whose question is only asked in evaluation (never trained on)."""
    max_images: int = Field(0, ge=0)
    """Use at most this many of the 1,797 scans (0: all), e.g. for tests."""


class ToolArithmeticParams(Section):
    """Arithmetic a small model cannot do in its head, with demonstrations of calling the calculator
    (GRPO with tools: docs/grpo.md "Tools")."""

    enabled: bool = False
    """Add the questions to the sample chats (off: the chats are byte for byte what they were)."""
    train: Annotated[int, WHEN_ENABLED] = Field(120, ge=1)
    """Demonstrations per difficulty: the question, the calculator call, its answer, the final answer."""
    heldout: Annotated[int, WHEN_ENABLED] = Field(40, ge=1)
    """Held-out questions per difficulty (chat_heldout, with the calculator offered; ids
    `heldout-toolarith-d<digits>-N`, so `evaluate` reports exact match per difficulty)."""
    digits: Annotated[list[int], WHEN_ENABLED] = Field(default_factory=lambda: [2, 3, 4], min_length=1)
    """The difficulties: operands of this many digits, in products of two and sums of four."""
    calls: Annotated[bool, WHEN_ENABLED] = True
    """The demonstrations call the calculator and the held-out questions offer it. False: the same
    questions (same ids and answers) answered directly, with no tool anywhere: the baseline of a
    model doing the arithmetic in its head."""

    @field_validator("digits")
    @classmethod
    def _digits(cls, digits: list[int]) -> list[int]:
        if any(not 1 <= d <= 6 for d in digits) or len(set(digits)) != len(digits):
            raise ValueError(f"digits: distinct numbers from 1 to 6 (operands of that many digits), got {digits}")
        return digits


SYNTHETIC = only_with("corpus", "synthetic")
"""The invented world's settings, which `corpus: real_text` does not read."""


class SampleDataParams(Section):
    """The built-in synthetic world: entities with attributes plus small-number arithmetic."""

    enabled: bool = True
    """Write the sample data set to `data/sample/` (set false when you only use your own data)."""
    corpus: Literal["synthetic", "real_text"] = "synthetic"
    """`synthetic`: the invented world below (what measures held-out exact match). `real_text`: real
    language available offline, the CPython documentation for pretraining and the ChatterBot corpus
    for chats and preferences (`pipelines/core/data/real_text.py`; the settings below then do not apply but
    `seed`)."""
    seed: int = 0
    """Seed of the world and of every rendering choice; same seed, same bytes."""
    n_entities: Annotated[int, SYNTHETIC] = Field(60, ge=4, le=10_000)
    """Number of invented people; each has a city, a favourite colour, a pet and a job."""
    bios_per_entity: Annotated[int, SYNTHETIC] = Field(64, ge=1)
    """Pretraining documents per entity, each a different paraphrase and sentence order."""
    heldout_entity_fraction: Annotated[float, SYNTHETIC] = Field(0.3, gt=0, lt=1)
    """Share of entities whose questions are never trained on (held-out evaluation)."""
    max_operand: Annotated[int, SYNTHETIC] = Field(10, ge=2)
    """Arithmetic facts are `a + b` with `0 <= a, b < max_operand`."""
    sum_renderings: Annotated[int, SYNTHETIC] = Field(24, ge=1)
    """How often each sum is written in the pretraining text (in random wordings)."""
    arithmetic_heldout_fraction: Annotated[float, SYNTHETIC] = Field(0.2, gt=0, lt=1)
    """Share of arithmetic questions held out of SFT/DPO (their facts stay in pretraining)."""
    qa_in_pretrain: Annotated[bool, SYNTHETIC] = True
    """Also write plain `Question: … Answer: …` lines (training entities and arithmetic) into pretraining text."""
    qa_renderings: Annotated[int, SYNTHETIC, only_with("qa_in_pretrain", True)] = Field(1, ge=1)
    """With `qa_in_pretrain`, how often each training fact is asked in the pretraining text (in
    random wordings). Seeing the question form often enough in pretraining is what lets SFT
    answer about held-out people (benchmarks/RESULTS.md, issue 13)."""
    preference_errors: Annotated[Literal["copy", "confusion", "value"], SYNTHETIC] = "copy"
    """How each preference pair's rejected answer is wrong: `copy` (a weak model repeating the
    person's name or a number from the question), `confusion` (another true fact about the same
    person, e.g. the pet when asked for the city) or `value` (another value of the right kind: a
    different city, the sum off by a little). Measured in benchmarks/RESULTS.md: DPO generalises
    `copy` to held-out pairs without changing answers; `confusion` generalises but biases answer
    values; `value` needs knowledge DPO cannot add and barely generalises."""
    multi_turn_fraction: Annotated[float, SYNTHETIC] = Field(0.2, ge=0, le=1)
    """Share of SFT conversations with two question/answer turns."""
    system_prompt: Annotated[str, SYNTHETIC] = "Answer with one word or number."
    """System message of every chat; empty for none."""
    images: SampleImagesParams = SampleImagesParams()
    """Real digit images with questions, for the optional multimodal stage (docs/multimodal.md)."""
    tool_arithmetic: Annotated[ToolArithmeticParams, SYNTHETIC] = ToolArithmeticParams()
    """Multi-digit products and sums with calculator demonstrations, for GRPO with tools (off by default)."""


SourceKind = Literal["text", "chat", "preference", "image_chat", "feedback"]
SourceFormat = Literal["jsonl", "json", "parquet", "csv", "text", "hf"]


class SourceParams(Section):
    """One input data set. `format` is inferred from the extension when omitted."""

    path: str
    """File, directory, or (with `format: hf`) a `datasets` path or hub name."""
    kind: SourceKind
    """What the records are: `text` (pretraining), `chat` (SFT), `preference` (DPO and the other
    paired methods), `image_chat` (image-text chats: a chat plus its `images`, one `<image>` tag
    each in the user turns) or `feedback` (KTO's unpaired completions labelled desirable or not)."""
    format: SourceFormat | None = None
    """jsonl, json, parquet, csv, text (a .txt/.md file or a directory of them) or hf."""
    split: Literal["auto", "train", "validation", "test"] = "auto"
    """Which split the records go to; `auto` splits them deterministically by content hash."""
    name: str | None = None
    """Name used in metrics and MLflow (default: the file name)."""
    columns: dict[str, str] = Field(default_factory=dict)
    """Rename source columns to the expected ones, e.g. `{text: body}`."""
    hf_split: str = "train"
    """Split to read when `format: hf`."""
    documents: Literal["blank_line", "line", "file"] = "blank_line"
    """How a plain text file (`format: text`) is cut into documents: at blank lines, one a line
    (LLaMA-Factory's `wiki_demo.txt`), or one a file."""


class IngestParams(Section):
    sources: list[SourceParams] = Field(min_length=1)
    """The data sets to read; add one entry per data set."""

    @model_validator(mode="after")
    def _unique_names(self) -> IngestParams:
        names = [s.name or Path(s.path).name for s in self.sources]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"two sources are named {', '.join(map(repr, duplicates))}; give each a distinct `name:`")
        return self


class PrepareDataParams(Section):
    normalize: Literal["NFKC", "NFC", "none"] = "NFKC"
    """Unicode normalisation form applied to every string (whitespace is always collapsed)."""
    min_chars: int = Field(1, ge=0)
    """Drop records shorter than this after normalisation (chat: all message contents summed;
    preference: prompt + chosen + rejected)."""
    max_chars: int = Field(20_000, ge=1)
    """Drop records longer than this (measured as for `min_chars`)."""
    dedup: bool = True
    """Drop exact duplicates (SHA-256 of the normalised content: text; all messages; prompt+chosen+rejected)."""
    near_dedup: bool = True
    """Drop near duplicates of `text` records (MinHash over word 3-grams with LSH banding)."""
    near_dedup_threshold: float = Field(0.9, gt=0, le=1)
    """Estimated Jaccard similarity of word 3-grams at or above which a text counts as a near duplicate.
    0.9 catches copies with a word changed near either end of a 50-word text; ~0.8 also catches
    one changed word in the middle."""
    validation_fraction: float = Field(0.05, ge=0, lt=1)
    """Share of `split: auto` records sent to validation (by content hash, so stable)."""
    seed: int = 0
    """Salt of the split hash: a different seed gives a different (still stable) split."""
    image_min_side: int = Field(4, ge=1)
    """Drop `image_chat` records with an image narrower or shorter than this many pixels (too small
    to show anything)."""
    image_max_side: int = Field(4096, ge=1)
    """Drop `image_chat` records with an image wider or higher than this many pixels (what a vision
    encoder resizes anyway, at a large cost in memory)."""

    @model_validator(mode="after")
    def _range(self) -> PrepareDataParams:
        if self.min_chars > self.max_chars:
            raise ValueError(f"min_chars ({self.min_chars}) must not exceed max_chars ({self.max_chars})")
        if self.image_min_side > self.image_max_side:
            raise ValueError(
                f"image_min_side ({self.image_min_side}) must not exceed image_max_side ({self.image_max_side})"
            )
        return self


class TrainTokenizerParams(Section):
    vocab_size: int = Field(2048, ge=300)
    """Target vocabulary size including the 256 byte symbols and the special tokens."""
    min_frequency: int = Field(2, ge=1)
    """Minimum pair frequency for a BPE merge."""
    mask_token: bool = False
    """Add `<|mask|>` after the trained vocabulary: the masked-diffusion objective
    (`pretrain.objective: masked_diffusion`) needs it."""


class TokenizeParams(Section):
    seq_len: int = Field(256, ge=8)
    """Length of the packed training sequences (documents joined with EOS)."""
    batch_size: int = Field(1000, ge=1)
    """Documents per batched tokenizer call."""


class MemoryParams(Section):
    """The memory extension: product-key memory layers (Lample et al. 2019; Berges et al. 2024,
    "Memory Layers at Scale") beside the MLP of chosen decoder layers (`pipelines/core/models/memory_model.py`)."""

    enabled: bool = False
    layers: list[int] = Field(default_factory=lambda: [1])
    """Decoder layers (0-based) that get a memory."""
    num_keys: int = Field(64, ge=2)
    """Sub-keys per half: the table has `num_keys**2` value rows."""
    heads: int = Field(2, ge=1)
    """Independent lookups per token (their reads are summed)."""
    key_dim: int = Field(32, ge=2)
    """Query/key size (even: two half-keys)."""
    topk: int = Field(8, ge=1)
    """Rows read per head and token."""

    @model_validator(mode="after")
    def _sizes(self) -> MemoryParams:
        if self.key_dim % 2:
            raise ValueError(f"key_dim must be even (two half-keys), got {self.key_dim}")
        if self.topk > self.num_keys:
            raise ValueError(f"topk ({self.topk}) must not exceed num_keys ({self.num_keys})")
        return self


class ModelParams(Section):
    """Llama architecture built from config (`LlamaConfig`); vocab size comes from the tokenizer."""

    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(512, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(4, ge=1)
    """Grouped-query attention when smaller than `num_heads`."""
    rope_theta: float = Field(10_000.0, gt=0)
    tie_word_embeddings: bool = True
    memory: MemoryParams = MemoryParams()
    """The memory extension (`enabled: true`): the model is then a `QllmMemoryLlamaForCausalLM`."""

    @model_validator(mode="after")
    def _heads(self) -> ModelParams:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if self.memory.enabled and (bad := [i for i in self.memory.layers if not 0 <= i < self.num_layers]):
            raise ValueError(f"memory.layers {bad}: the model has layers 0..{self.num_layers - 1}")
        return self


DEFAULT_EXTENSIONS = ("mlflow_metrics", "tensorboard", "system_metrics")
"""`train.extensions` when params do not set it: the loggers of every training stage."""


class CurriculumParams(Section):
    """Sequence-length warmup (Li et al., NeurIPS 2022; DeepSpeed's curriculum scheduler, Composer's
    `SeqLengthWarmup`): early steps train on the first `length(step)` tokens of every sequence.
    `pipelines/core/training/curriculum.py` has the schedule."""

    strategy: Literal["none", "length"] = "none"
    """`length`: warm the sequence length up from `start_length` to `end_length` over `steps`."""
    start_length: Annotated[int, only_with("strategy", "length")] = Field(64, ge=1)
    end_length: Annotated[int | None, only_with("strategy", "length")] = None
    """null: the data's full sequence length (`tokenize.seq_len` for pretrain)."""
    steps: Annotated[int, only_with("strategy", "length")] = Field(200, ge=1)
    """Optimizer steps of the warmup; from then on every step sees full-length sequences."""
    schedule: Annotated[Literal["linear", "root"], only_with("strategy", "length")] = "linear"
    """How the length grows: linearly in the step, or with its square root (DeepSpeed's
    `fixed_root`: faster at first)."""
    step_size: Annotated[int, only_with("strategy", "length")] = Field(8, ge=1)
    """Lengths are multiples of this (rounded down, never below `start_length`)."""

    @model_validator(mode="after")
    def _lengths(self) -> CurriculumParams:
        if self.end_length is not None and self.end_length < self.start_length:
            raise ValueError(f"end_length ({self.end_length}) must be at least start_length ({self.start_length})")
        return self


class TrainParams(Section):
    """The shared training loop's settings (every training stage has its own copy)."""

    seed: int = 0
    max_steps: int = Field(1000, ge=1)
    """Optimizer steps (each of `micro_batch_size * grad_accum_steps` sequences)."""
    micro_batch_size: int = Field(16, ge=1)
    grad_accum_steps: int = Field(1, ge=1)
    lr: float = Field(1e-3, gt=0)
    """Peak learning rate."""
    min_lr_ratio: Annotated[float, only_with("schedule", "cosine", "linear")] = Field(0.1, ge=0, le=1)
    """Final learning rate as a share of `lr` (cosine/linear schedules)."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    """Applied to matrices only; biases, norms and embeddings are not decayed."""
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    max_grad_norm: float = Field(1.0, ge=0)
    """Gradient clipping threshold; 0 disables clipping."""
    optimizer: Literal["adamw", "adamw_fused", "adamw_bnb_8bit", "paged_adamw_8bit"] = "adamw_fused"
    """`adamw`: `torch.optim.AdamW` (one kernel per parameter); `adamw_fused`: the same update in
    one fused kernel over all parameters (CPU and CUDA; what HF `Trainer` uses by default,
    `adamw_torch_fused`), 3-5x faster an optimizer step on the CPU; results differ from `adamw` by
    float rounding only. `adamw_bnb_8bit`: bitsandbytes' 8-bit AdamW, its two moments in 8 bits
    (2 bytes a parameter instead of 8: for full fine-tuning of a 1.5B model 3 GB instead of 12);
    `paged_adamw_8bit`: the same, its state paged to host memory when the GPU runs short (CUDA;
    on a CPU the plain 8-bit one). HF `Trainer`'s names for both."""
    attention: Literal["model", "sdpa", "eager"] = "model"
    """The attention kernel while training: `model` keeps the model's own (transformers' default is
    SDPA); `eager` is the plain matmul-and-softmax one. On a CPU in bf16, PyTorch's SDPA backward is
    slow at short lengths: `eager` trained the sample model's rows of 32-128 tokens in 0.65-0.74 of
    the time, but took 1.2x at 256 and 2x at 512 tokens, and in fp32 it gains nothing
    (benchmarks/RESULTS.md). The saved model keeps its own kernel."""
    compile: bool = False
    """Compile the model's forward with `torch.compile` (TorchInductor; on a CPU it needs a C++
    compiler). The first steps pay the compilation (tens of seconds on a CPU) and every new
    sequence length may recompile; off by default because at the default sizes it does not pay
    back within a stage (benchmarks/RESULTS.md). Results differ from eager by float rounding."""
    loss_chunk_tokens: int = Field(0, ge=0)
    """Apply the output head and the cross-entropy to at most this many trained tokens at a time,
    recomputing each chunk's logits in the backward pass, so the logits of a large vocabulary
    (Qwen2.5: 151,936 tokens, 0.6 MB per token in fp32) are never held for the whole batch
    (`pipelines.core.training.chunked_loss`); only positions with a label are scored. The loss is the same
    up to float rounding. 0: the model's own loss over every position (the default: at the
    sample's 872-token vocabulary chunking saves nothing). Causal LM losses only; not with FSDP."""
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Autocast dtype. `auto`: bf16 on CUDA devices and CPUs with bf16 matrix units (AMX,
    AVX512-BF16), fp16 on older CUDA devices, fp32 elsewhere (`pipelines.core.training.precision`); the resolved
    value is logged and written to the stage's metrics. fp16 (CUDA only) adds a grad scaler; bf16 on
    a CPU without bf16 units is emulated, many times slower than fp32 (a warning says by how much)."""
    eval_every: int = Field(100, ge=0)
    """Validate every N steps (0: only at the end)."""
    eval_batches: int = Field(20, ge=0)
    """Validation micro-batches per evaluation (0: the whole validation set)."""
    log_every: int = Field(10, ge=1)
    """Log training metrics to MLflow every N steps."""
    checkpoint_every: int = Field(200, ge=0)
    """Save a resumable checkpoint every N steps (0: never)."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many recent checkpoints to keep (the best one is kept in addition)."""
    early_stopping_patience: int = Field(0, ge=0)
    """Stop after this many evaluations without a better validation loss (0: off)."""
    skip_nonfinite: int = Field(0, ge=0)
    """Batches with a NaN/inf loss or gradient norm to skip over the whole run (zeroed gradients, no
    optimizer or schedule step, a warning naming the step); one more stops training with an error
    naming the step. 0: the first one stops training. The count is reported as `skipped_nonfinite`."""
    gradient_checkpointing: bool = False
    """Recompute activations during backward instead of keeping them: much less memory for about a
    third more compute. Turn on when a step runs out of memory."""
    nproc: int = Field(1, ge=1)
    """Data-parallel processes on this machine: > 1 makes the stage run itself under
    `torchrun --nproc_per_node nproc` (DDP; gloo on CPU, nccl on CUDA). The global batch stays
    `micro_batch_size * grad_accum_steps`: each rank runs `grad_accum_steps / nproc` micro-batches
    per step, so `grad_accum_steps` must be divisible by `nproc`."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """How the `nproc` > 1 ranks share the model. `ddp`: every rank holds the whole model, gradients
    are averaged (all-reduce). `fsdp`: FSDP2 (`fully_shard` per decoder layer and at the root)
    shards parameters, gradients and AdamW state across the ranks, each layer gathered for its
    own forward/backward only: less accelerator memory per rank for more communication; the same
    loss curve as `ddp` and 1 process. Checkpoints and outputs hold the full (gathered) weights.
    Read whenever the stage runs on several processes: `nproc` > 1, or the stage started under
    `torchrun` by hand with `nproc` 1 (its world size is torchrun's, which params cannot know), so
    it is not refused with `nproc` 1; one process ignores it."""

    curriculum: CurriculumParams = CurriculumParams()
    """Sequence-length curriculum (`strategy: none | length`; pretrain only: its packed rows can be
    cut anywhere). The learning-rate schedule stays step-based; validation is at full length."""
    extensions: list[str | dict[str, Any]] = Field(default_factory=lambda: list(DEFAULT_EXTENSIONS))
    """Extensions of the training loop, run in this order (`pipelines.core.extensions`): a name, or
    `{name: ..., <setting>: ...}`. Built in: `mlflow_metrics` (the loop's metrics to the stage's MLflow
    run), `tensorboard` (event files under `tensorboard/<stage>/`; setting `log_dir`),
    `system_metrics` (MLflow system metrics: CPU, memory, GPU; settings `interval`, `max_interval`
    in seconds). Others as `package.module:Class`. The list replaces the default one: keep
    `mlflow_metrics` in it to log the loop's metrics to MLflow. `[]`: none."""

    @field_validator("extensions")
    @classmethod
    def _extensions(cls, entries: list[str | dict[str, Any]]) -> list[str | dict[str, Any]]:

        names = []
        for index, entry in enumerate(entries):
            try:
                name, settings = extensions.parse(entry, f"entry {index}")
                extensions.check_settings(extensions.resolve(name, f"entry {index}"), settings, f"entry {index} ({name})")
            except QllmError as exc:
                raise ValueError(str(exc)) from None
            names.append(name)
        if len(set(names)) != len(names):
            raise ValueError(f"an extension is listed twice: {names}")
        return entries

    @model_validator(mode="after")
    def _warmup(self) -> TrainParams:
        if self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must not exceed max_steps ({self.max_steps})")
        if self.grad_accum_steps % self.nproc:
            raise ValueError(
                f"grad_accum_steps ({self.grad_accum_steps}) must be divisible by nproc ({self.nproc}): each process runs "
                f"grad_accum_steps / nproc micro-batches of micro_batch_size per step, so the global batch stays the same"
            )
        return self


class ActivationCacheParams(Section):
    """The time-step activation cache of frozen-trunk phases (`pipelines/core/training/progressive.py`)."""

    enabled: bool = False
    """Keep the frozen trunk's output per training sequence and skip the trunk's forward when the
    sequence comes again (the next epoch). Results are the same as without it."""
    memory_mb: float = Field(256, ge=0)
    """Activations kept in memory; least recently used ones beyond this spill to disk."""
    disk_mb: float = Field(0, ge=0)
    """Activations spilled to a temporary file (0: none, the least recently used are dropped)."""


class EndToEndParams(Section):
    """Training after the last stack was added."""

    scope: Literal["none", "stackwise", "rackwise"] = "rackwise"
    """`rackwise`: the whole model together; `stackwise`: each stack in turn (bottom first, the
    others frozen), the steps split evenly; `none`: no end-to-end phase."""
    steps: int | None = Field(None, ge=0)
    """Steps of the end-to-end phase; null: the rest of `train.max_steps`."""


class ProgressiveParams(Section):
    """Progressive stack-wise growth (stacking, Gong et al. 2019; G_stack, NeurIPS 2024; LLaMA-Pro's
    identity blocks, Wu et al. 2024): start with the first stack of layers, add one stack every
    `steps_per_stack` steps. `pipelines/core/training/progressive.py` has the schedule."""

    enabled: bool = False
    stacks: list[int] = Field(default_factory=lambda: [2, 2])
    """Layers per stack, bottom first; they add up to `model.num_layers`."""
    steps_per_stack: int = Field(200, ge=1)
    """Optimizer steps each stack trains before the next one is added."""
    growth: Literal["duplicate", "identity"] = "duplicate"
    """A new stack is a copy of the top stack (`duplicate`) or such a copy with its attention and
    MLP output projections zeroed (`identity`: the grown model computes what the smaller one did)."""
    trunk: Literal["frozen", "trainable"] = "frozen"
    """While a new stack trains: `frozen` trains only the new stack and the head (final norm, and the
    output projection when it is not tied to the embedding); `trainable` trains everything."""
    rewarm_steps: int | None = Field(None, ge=0)
    """Learning-rate re-warm after each growth (a linear ramp over the step-based schedule); null:
    `train.warmup_steps`."""
    end_to_end: EndToEndParams = EndToEndParams()
    save_stacks: bool = False
    """Also write each stack's layers on its own: `stacks/stack-NN.safetensors` in the output."""
    activation_cache: ActivationCacheParams = ActivationCacheParams()

    @field_validator("stacks")
    @classmethod
    def _positive(cls, stacks: list[int]) -> list[int]:
        if not stacks or any(n < 1 for n in stacks):
            raise ValueError(f"expected one or more stacks of at least one layer each, got {stacks}")
        return stacks

    def check_fits(self, train: TrainParams) -> None:
        """The phases fill `train.max_steps`, and the loop settings allow a model that changes shape."""
        growth_steps = len(self.stacks) * self.steps_per_stack
        rest = train.max_steps - growth_steps
        if rest < 0 or (self.end_to_end.steps is not None and self.end_to_end.steps != rest):
            wanted = growth_steps + (self.end_to_end.steps or 0)
            raise ValueError(f"train.max_steps is {train.max_steps} but progressive needs {wanted} ({len(self.stacks)} stacks x "
                             f"{self.steps_per_stack} steps_per_stack + end_to_end.steps {self.end_to_end.steps}): set "
                             "train.max_steps to that, or end_to_end.steps to null (the rest)")  # fmt: skip
        if self.end_to_end.scope == "none" and rest:
            raise ValueError(f"progressive.end_to_end.scope is none but {rest} steps remain after the last stack: set "
                             f"train.max_steps to {growth_steps} or choose a scope")  # fmt: skip
        if train.nproc > 1 or train.compile or train.early_stopping_patience:
            raise ValueError("progressive growth changes the model during training: it needs train.nproc 1, train.compile false "
                             "and train.early_stopping_patience 0 (a best checkpoint of a smaller model cannot be restored)")  # fmt: skip


class DiffusionParams(Section):
    """The masked-diffusion objective (MDLM, LLaDA; `pipelines/core/training/diffusion.py`)."""

    time_steps: Literal["continuous", "discrete"] = "continuous"
    """`continuous`: t ~ U(eps, 1) per sequence; `discrete`: one of `num_time_steps` steps, with the
    mask fractions of `time_step_mask_fractions`."""
    eps: Annotated[float, only_with("time_steps", "continuous")] = Field(1e-3, gt=0, lt=1)
    """Smallest continuous time step (the 1/t weight stays bounded)."""
    sampling: Literal["antithetic", "iid"] = "antithetic"
    """Time steps of a batch: evenly spread from one draw (less variance), or independent."""
    num_time_steps: Annotated[int, only_with("time_steps", "discrete")] = Field(10, ge=1)
    time_step_mask_fractions: Annotated[dict[int, float], only_with("time_steps", "discrete")] = Field(default_factory=lambda: {0: 0.15, 5: 0.5, 9: 0.9})
    """Mask fraction at the listed discrete steps, interpolated linearly between them."""
    val_samples: int = Field(4, ge=1)
    """Time steps per validation sequence for the NELBO estimate (Monte Carlo, fixed seed)."""
    val_seed: int = 0
    unmask_steps: int = Field(16, ge=1)
    """Generation: unmasking steps (each keeps the most confident predictions, LLaDA's low-confidence remasking)."""
    block_length: int | None = Field(None, ge=1)
    """Generation: fill the answer in blocks of this many tokens, left to right (null: one block)."""

    @field_validator("time_step_mask_fractions")
    @classmethod
    def _fractions(cls, table: dict[int, float]) -> dict[int, float]:
        if not table or any(not 0 < v <= 1 for v in table.values()) or any(k < 0 for k in table):
            raise ValueError(f"expected time steps >= 0 with mask fractions in (0, 1], got {table}")
        return table


class PretrainParams(Section):
    model: ModelParams = ModelParams()
    train: TrainParams = TrainParams()
    objective: Literal["causal", "masked_diffusion"] = "causal"
    """`causal`: next-token prediction; `masked_diffusion`: predict masked tokens with bidirectional
    attention (MDLM/LLaDA; the model is then a `QllmDiffusionLlamaForMaskedDiffusion`)."""
    diffusion: Annotated[DiffusionParams, only_with("objective", "masked_diffusion")] = DiffusionParams()
    """The masked-diffusion objective's settings (`objective: masked_diffusion` only)."""
    progressive: ProgressiveParams = ProgressiveParams()
    """Grow the model stack by stack (`enabled: true`); off: the whole model trains from step 0."""
    continue_base: bool = False
    """With `base_model.name` set: continue pretraining the base on the text sources (its own
    tokenizer, the packed rows of `tokenize`, the shared loop and `train:` here), so that what only
    the text holds reaches the base before sft (LLaMA-Factory's `stage: pt`, axolotl's completion
    data sets). False: the base is used as it is (`model:` is then not read either)."""

    @model_validator(mode="after")
    def _progressive_fits(self) -> PretrainParams:
        if self.objective == "masked_diffusion" and self.model.memory.enabled:
            raise ValueError("objective masked_diffusion and model.memory together are not supported yet: enable one of them")
        if self.objective == "masked_diffusion" and self.train.curriculum.strategy != "none":
            raise ValueError("objective masked_diffusion with train.curriculum is not supported: the curriculum is for the causal objective")
        grow = self.progressive
        if not grow.enabled:
            return self
        if sum(grow.stacks) != self.model.num_layers:
            raise ValueError(f"progressive.stacks {grow.stacks} add up to {sum(grow.stacks)} layers but model.num_layers is "
                             f"{self.model.num_layers}: make them agree")  # fmt: skip
        if self.model.memory.enabled:
            raise ValueError("progressive growth and model.memory together are not supported yet: enable one of them")
        grow.check_fits(self.train)
        return self


class FinetuneParams(Section):
    """Instruction tuning on chat records: the `sft` section, and the part of `lora` and `probe_lora`
    that is the same procedure (one code path, `pipelines/core/training/finetune.py`)."""

    base_model: str = "data/models/pretrain"
    """The model to start from. The default is the pipeline's base: the model `pretrain` trained,
    or, with `base_model.name` set, that model (`pretrain` then writes a pointer to it). Another
    directory or hub name here is not a DVC dependency (a warning says so): set `base_model.name`
    instead."""
    loss_on: Literal["assistant", "all"] = "assistant"
    """Train on assistant tokens only (completion-only loss) or on every token."""
    packing: bool = True
    """Pack several examples per row, with no attention across examples."""
    max_seq_len: int = Field(0, ge=0)
    """Row length in tokens (0: the base model's context length)."""
    overflow: Literal["truncate", "drop"] = "truncate"
    """What to do with an example longer than `max_seq_len` (counted in the metrics)."""
    train: TrainParams = TrainParams()


QUANTIZED = ("nf4", "fp4", "int8", "fp8")
FOUR_BIT = ("nf4", "fp4")


class QuantizationParams(Section):
    """A quantized, frozen base under full-precision adapters (QLoRA; `pipelines/core/models/quantize.py`)."""

    quantization: Literal["none", "nf4", "fp4", "int8", "fp8"] = "none"
    """`nf4`/`fp4`: 4-bit (bitsandbytes; CUDA, and x86 CPUs from bitsandbytes 0.48); `int8`:
    LLM.int8(); `fp8`: CUDA compute capability 8.9+ only; `none`: the base as it is."""
    double_quant: Annotated[bool, only_with("quantization", *FOUR_BIT)] = True
    """4-bit only: quantize the per-block scales too (QLoRA's double quantization)."""
    compute_dtype: Annotated[Literal["auto", "bf16", "fp16", "fp32"], only_with("quantization", *QUANTIZED)] = "auto"
    """dtype the 4-bit weights are dequantized to for each matmul; `auto`: the stage's
    `train.precision` as resolved on this machine."""


class LoraAdapterParams(QuantizationParams):
    """A PEFT LoRA adapter: the `adapter` block of every stage that can train one (`lora`, `dpo`,
    `grpo`), the same keys in each. `enabled: false` trains all weights instead (`dpo`, `grpo`); the
    `lora` stage always trains an adapter."""

    enabled: bool = False
    """Train a LoRA adapter on the frozen model (the settings below) instead of all its weights."""
    r: Annotated[int, WHEN_ENABLED] = Field(4, ge=1)
    """The adapter's rank: every targeted module's (unless `rank_pattern` says otherwise). Under the
    lora stage's in-training allocations (`lora.allocation: adalora | qubo_in_loop`) the rank budget:
    the parameters of rank `r` on every module, allocated unevenly (AdaLoRA's `target_r`); with
    `quantum_opt`, the ranks come from that stage and `r` is not read."""
    lora_alpha: Annotated[float, WHEN_ENABLED] = Field(8.0, gt=0)
    """Scaling numerator: updates are scaled by alpha/r (alpha/sqrt(r) with `use_rslora`), r the rank
    above; an allocation keeps that scale at every module's rank."""
    lora_dropout: Annotated[float, WHEN_ENABLED] = Field(0.05, ge=0, lt=1)
    target_modules: Annotated[list[str], WHEN_ENABLED] = Field(default_factory=lambda: list(ALL_PROJECTIONS), min_length=1)
    """Module names (suffixes) to adapt; an entry that matches no module is an error."""
    rank_pattern: Annotated[dict[str, int], WHEN_ENABLED] = Field(default_factory=dict)
    """Per-module ranks, `{module name or regex: rank}` (PEFT semantics)."""
    alpha_pattern: Annotated[dict[str, float], WHEN_ENABLED] = Field(default_factory=dict)
    """Per-module alphas, `{module name or regex: alpha}`."""
    bias: Annotated[Literal["none", "all", "lora_only"], WHEN_ENABLED] = "none"
    use_rslora: Annotated[bool, WHEN_ENABLED] = False
    """Rank-stabilised scaling alpha/sqrt(r), which keeps update size comparable across ranks."""
    use_dora: Annotated[bool, WHEN_ENABLED] = False
    """DoRA (Liu et al. 2024; PEFT `use_dora`): each adapted weight split into a magnitude vector,
    trained, and a direction that LoRA updates. Slower a step than plain LoRA (the weight norm is
    recomputed every forward); `lora.allocation: uniform` or `quantum_opt` only."""
    init_lora_weights: Annotated[str, WHEN_ENABLED] = Field("default", pattern=r"^(default|gaussian|pissa|pissa_niter_[1-9][0-9]*|olora)$")
    """How the adapters start (PEFT `init_lora_weights`): `default` (A random, B zero: the model
    starts unchanged), `gaussian`, `pissa` (the principal singular vectors of each weight, the
    rest left in the base; `pissa_niter_N`: by N iterations of randomized SVD, much faster on large
    weights), `olora` (QR). With pissa/olora the saved adapter is converted to a plain LoRA of
    rank 2r against the original base, so it loads on that base like any other; not with a
    quantized base. `lora.allocation: uniform` or `quantum_opt` only."""
    layers_to_transform: Annotated[list[int], WHEN_ENABLED] = Field(default_factory=list)
    """Decoder layers to adapt (PEFT `layers_to_transform`); negative indices count from the end
    (`[-1]`: the last layer only); empty: every layer. `lora.allocation: uniform` only."""
    trainable_tokens: Annotated[list[str], WHEN_ENABLED] = Field(default_factory=lambda: ["<|im_start|>", "<|im_end|>"])
    """Tokens whose embedding rows are trained too (PEFT `trainable_token_indices`): the chat
    markers a pretrained base has never seen, so the model can learn to end its turn."""
    merge: Annotated[bool, WHEN_ENABLED] = True
    """Also write the adapter merged into the base as a full model (`<out>/merged/`)."""
    quantization: Annotated[Literal["none", "nf4", "fp4", "int8", "fp8"], WHEN_ENABLED] = "none"
    """QLoRA: the frozen base quantized under the adapter. `nf4`/`fp4`: 4-bit (bitsandbytes; CUDA, and
    x86 CPUs from bitsandbytes 0.48); `int8`: LLM.int8(); `fp8`: CUDA compute capability 8.9+ only;
    `none`: the base as it is."""

    @model_validator(mode="before")
    @classmethod
    def _the_switch_is_enabled(cls, data: Any) -> Any:
        if isinstance(data, str):
            raise ValueError(f"the adapter is a block now, the same in lora, dpo and grpo: write `adapter: {{enabled: {json.dumps(data == 'lora')}}}` "
                             f"(enabled: true for a LoRA adapter, false for all weights) instead of `adapter: {data}`")  # fmt: skip
        return data


def _adapter_moved(data: Any, section: str) -> Any:
    """Refuse the old `<section>.lora` block, with where its keys go now."""
    if isinstance(data, dict) and "lora" in data:
        raise ValueError(f"lora: the adapter's settings are in {section}.adapter now, the same block as lora.adapter, with "
                         f"`enabled: true` for a LoRA adapter (was `{section}.adapter: lora`): move {section}.lora's keys there")  # fmt: skip
    return data


class SftParams(FinetuneParams):
    """Full fine-tuning (`sft`): the shared fine-tuning procedure, plus growing the model."""

    progressive: ProgressiveParams = ProgressiveParams()
    """Grow the model beyond the base, stack by stack (LLaMA-Pro's block expansion with `growth:
    identity`): `stacks[0]` is the base model's layer count."""


class AdaptiveParams(Section):
    """Ranks allocated while training (`lora.allocation: adalora | qubo_in_loop`;
    `pipelines/core/quantum/rank_allocation.py`): SVD-form adapters on `adapter.target_modules`, starting at
    rank `init_r`, masked down to the budget of rank `adapter.r` on every module."""

    init_r: int = Field(12, ge=1)
    """Rank every module starts with (at least `adapter.r`, the budget it is masked down to)."""
    tinit: int = Field(10, ge=0)
    """Steps before the first re-allocation (all `init_r` components train)."""
    tfinal: int = Field(30, ge=0)
    """Last steps with the allocation fixed."""
    every: int = Field(10, ge=1)
    """Steps between re-allocations (AdaLoRA's `deltaT`; the QUBO is re-solved this often)."""
    beta1: float = Field(0.85, gt=0, lt=1)
    """Smoothing of the importance (sensitivity) of each rank component."""
    beta2: float = Field(0.85, gt=0, lt=1)
    """Smoothing of its uncertainty."""
    orth_reg_weight: float = Field(0.5, ge=0)
    """AdaLoRA's penalty keeping P and Q orthogonal."""
    lam: float = Field(0.02, ge=0)
    """qubo_in_loop: weight of the redundancy penalty (as `quantum_opt.lam`)."""
    ranks: list[int] = Field(default_factory=lambda: [2, 4, 6, 8, 10, 12], min_length=1)
    """qubo_in_loop: the ranks a module may get (0, no adapter, always can)."""
    solver: Literal["sa", "tabu", "milp", "exact"] = "sa"
    """qubo_in_loop: the QUBO solver of each re-allocation."""
    timeout: float = Field(5.0, gt=0)
    """qubo_in_loop: seconds a solve may take (`qubo.allocate_ranks`): milp and exact stop at it, tabu
    fits its reads into it; sa runs all `num_reads` and warns past it, so its allocation is the same
    on every machine."""
    num_reads: Annotated[int, only_with("solver", "sa", "tabu")] = Field(300, ge=0)
    """qubo_in_loop: samples per solve for sa/tabu (0: the library default, 1000 for sa). 300 found
    the allocation 1000 reads found in 23 of the 24 solves of the default run on two worlds (the
    other: a different allocation of equal objective) in a third of the time (RESULTS, issue 22)."""
    reference_timeout: float = Field(1.0, ge=0)
    """qubo_in_loop: seconds for the MILP reference the last solve's gaps are logged against: to
    its best allocation and to its proven bound on the optimum (0: no gaps). Only the last solve,
    whose allocation the adapter keeps: one reference per solve cost 12 s of the default lora
    stage (the 12 solves), on the pipeline's critical path."""

    @model_validator(mode="before")
    @classmethod
    def _budget_is_the_rank(cls, data: Any) -> Any:
        if isinstance(data, dict) and "budget_rank" in data:
            raise ValueError("budget_rank: the rank budget is lora.adapter.r now (the parameters of rank r on every module, allocated "
                             f"unevenly), so that r means the rank under every allocation: write lora.adapter.r: {data['budget_rank']}")  # fmt: skip
        return data



IN_TRAINING = ("adalora", "qubo_in_loop")
"""The lora stage's allocations made while training: SVD-form (AdaLoRA) adapters masked down to the budget."""
PLAIN_LORA_ONLY = ("bias", "use_rslora", "use_dora", "init_lora_weights", "quantization")
"""Adapter keys of plain LoRA (PEFT's `LoraConfig`), which the in-training allocations' SVD-form adapters do not have."""
LORA_STAGE_ADAPTER = {"enabled": True, "r": 8, "lora_alpha": 16.0}
"""The lora stage's own defaults of the adapter block (LitGPT's per-method defaults): always an adapter,
and the rank budget 8 of the in-training allocation at the update scale 16 / 8. An `adapter` mapping
given to the section changes these where it says."""


class LoraParams(FinetuneParams):
    """LoRA instruction tuning: the `sft` procedure (the fields above) with an `adapter`."""

    adapter: Annotated[
        LoraAdapterParams,
        only_with("allocation", "uniform", "adalora", "qubo_in_loop", keys=("r", "target_modules")),
        only_with("allocation", "uniform", "quantum_opt", keys=PLAIN_LORA_ONLY),
        only_with("allocation", "uniform", keys=("rank_pattern", "alpha_pattern", "layers_to_transform")),
    ] = LoraAdapterParams(**LORA_STAGE_ADAPTER)
    """The adapter (the same block as `dpo.adapter` and `grpo.adapter`): its rank (the budget, under
    the in-training allocations), targets, a quantized base, merging. `quantum_opt` chooses the
    modules and their ranks itself, so `r` and `target_modules` are not read there; the in-training
    allocations train SVD-form adapters, which have no `bias`, rsLoRA, DoRA, PiSSA/OLoRA or
    quantized base, and allocate per module, so only `uniform` reads `rank_pattern`, `alpha_pattern`
    and `layers_to_transform`."""
    allocation: Literal["quantum_opt", "uniform", "adalora", "qubo_in_loop"] = "qubo_in_loop"
    """`qubo_in_loop` (the QUBO re-solved during training; the measured winner, tied with AdaLoRA)
    and `adalora` (PEFT's AdaLoRA): ranks allocated while training within the parameters of rank
    `adapter.r` on every module, as `adaptive` says; `quantum_opt`: target modules and per-module
    ranks from the `quantum_opt` stage (its `data/quantum_opt/allocation.json`); `uniform`: rank
    `adapter.r` on every `adapter.target_modules` entry. Every allocation scales a module's update
    by `adapter.lora_alpha` over the uniform rank of its budget (`adapter.r`, or quantum_opt's
    budget), whatever rank the module gets."""
    adaptive: Annotated[
        AdaptiveParams,
        only_with("allocation", *IN_TRAINING),
        only_with("allocation", "qubo_in_loop", keys=("lam", "ranks", "solver", "timeout", "num_reads", "reference_timeout")),
    ] = AdaptiveParams()
    """The in-training allocations' settings (`allocation: adalora | qubo_in_loop`; the QUBO's own
    ones, `qubo_in_loop` only)."""

    @model_validator(mode="before")
    @classmethod
    def _adapter_keys_moved(cls, data: Any) -> Any:
        if isinstance(data, dict):
            moved = sorted(set(data) & set(LoraAdapterParams.model_fields))
            if moved:
                raise ValueError(f"{', '.join(moved)}: the adapter settings are under lora.adapter now (as under dpo.adapter): "
                                 f"write lora.adapter.{moved[0]}, not lora.{moved[0]}")  # fmt: skip
            if isinstance(data.get("adapter"), dict):
                if data["adapter"].get("enabled") is False:
                    raise ValueError("adapter.enabled: the lora stage trains an adapter (it must be true); to train all weights, use the sft stage")
                data = {**data, "adapter": {**LORA_STAGE_ADAPTER, **data["adapter"]}}
        return data

    @model_validator(mode="after")
    def _adapter_and_budget(self) -> LoraParams:
        if not self.adapter.enabled:  # an adapter given as a built block
            raise ValueError("adapter.enabled: the lora stage trains an adapter (it must be true); to train all weights, use the sft stage")
        if self.allocation in IN_TRAINING:
            adaptive = self.adaptive
            if adaptive.tinit + adaptive.tfinal >= self.train.max_steps:
                raise ValueError(f"adaptive.tinit ({adaptive.tinit}) + adaptive.tfinal ({adaptive.tfinal}) must leave steps of train.max_steps "
                                 f"({self.train.max_steps}) to re-allocate in")  # fmt: skip
            if self.adapter.r > adaptive.init_r:
                raise ValueError(f"adapter.r ({self.adapter.r}), the rank budget of the {self.allocation} allocation, must not exceed "
                                 f"adaptive.init_r ({adaptive.init_r}), the rank every module starts at: the budget is reached by masking")  # fmt: skip
            if self.allocation == "qubo_in_loop" and (max(adaptive.ranks) > adaptive.init_r or min(adaptive.ranks) < 1):
                raise ValueError(f"adaptive.ranks {adaptive.ranks} must lie in 1..adaptive.init_r ({adaptive.init_r})")
        return self


class ProbeLoraParams(FinetuneParams, QuantizationParams):
    """A short SFT run that records every candidate LoRA module's gradients (for `quantum_opt`)."""

    target_modules: list[str] = Field(
        default_factory=lambda: list(ALL_PROJECTIONS), min_length=1
    )
    """Candidate modules (name suffixes); every matching linear layer of every block is probed."""
    ranks: list[int] = Field(default_factory=lambda: [4, 8, 16], min_length=1)
    """Candidate ranks r for which the captured gradient energy v[m][r] is reported."""
    frozen_base: bool = False
    """Record the gradients at the base without training it (no optimizer: the weights plus two
    fp32 copies of the probed modules' weights, where training the probe takes a full fine-tuning's
    memory). A quantized base is always probed frozen. False: the probe trains as SFT would."""
    redundancy: Literal["detrended", "energy"] = "detrended"
    """How two modules' redundancy is measured over the probe's steps: `detrended`, the correlation of
    the step-to-step changes of their log gradient energies; `energy`, of the energies themselves
    (the first version: dominated by the common downward trend of all energies, mean 0.93)."""

    @field_validator("ranks")
    @classmethod
    def _positive_ranks(cls, ranks: list[int]) -> list[int]:
        if any(r < 1 for r in ranks) or len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks must be distinct positive integers, got {ranks}")
        return sorted(ranks)


class QuantumOptParams(Section):
    """LoRA rank allocation as a QUBO over the probe's scores (see pipelines/core/quantum/qubo.py)."""

    solver: Literal["exact", "sa", "tabu", "milp", "dwave", "qaoa", "greedy"] = "sa"
    """`sa`/`tabu` (dwave-samplers), `milp` (scipy, exact), `exact` (enumeration, small only),
    `dwave` (D-Wave Leap: extra `dwave` + DWAVE_API_TOKEN), `qaoa` (extra `qaoa`, <= max_qubits),
    `greedy` (the value-per-parameter heuristic, redundancy ignored: the classical baseline)."""
    fallback: Literal["sa"] | None = None
    """Solve with `sa` (logged) when the chosen backend is unavailable or too small."""
    lam: float = Field(0.1, ge=0)
    """Weight λ of the redundancy penalty between correlated modules. Values are shares of one
    gradient energy (Σ v <= 1) while the penalty sums over M·(M−1)/2 pairs. 0.1 had the lowest
    chat *validation* loss over {0, 0.02, 0.1} averaged over two worlds (benchmarks/RESULTS.md,
    issue 22); with the detrended redundancy it leaves part of the budget unspent (65,536 of
    94,208 parameters on the default world)."""
    budget_rank: Annotated[int, only_with("budget", 0)] = Field(8, ge=1)
    """Budget B = the trainable parameters of rank `budget_rank` on every candidate module. The lora
    stage scales every module's update by `lora.adapter.lora_alpha` over this rank (with `budget`:
    over the uniform rank of that many parameters), whatever rank the module gets."""
    budget: int = Field(0, ge=0)
    """An absolute parameter budget instead (0: use `budget_rank`)."""
    seed: int = 0
    timeout: float = Field(60.0, gt=0)
    """Seconds a solver may take (`qubo.allocate_ranks`): milp, exact, qaoa and Leap stop at it, tabu fits
    its reads into it; sa runs all `num_reads` and warns past it, so its allocation is the same on
    every machine."""
    reference_timeout: float = Field(15.0, ge=0)
    """Seconds for the MILP reference optimum the gap is measured against (0: skip it). With
    dense redundancy HiGHS rarely proves optimality; its best point at the limit is then used."""
    max_qubits: Annotated[int, only_with("solver", "qaoa")] = Field(16, ge=1)
    """QAOA refuses problems with more binary variables (statevector simulation is 2^n)."""
    num_reads: Annotated[int, only_with("solver", "sa", "tabu")] = Field(0, ge=0)
    """Samples drawn by sa/tabu (0: the library default)."""


class RefLogprobsParams(Section):
    """Reference log-probabilities for DPO under the SFT model, computed once and cached.

    DPO starts from the same model; with `dpo.adapter: lora` the reference is therefore the LoRA
    base with its adapters disabled."""

    max_length: int = Field(0, ge=0)
    """Longest prompt + completion in tokens (0: the model's context length)."""
    max_prompt_length: int = Field(0, ge=0)
    """Longest prompt in tokens (0: no limit beyond `max_length`)."""
    on_invalid: Literal["drop", "error"] = "drop"
    """A pair with an empty or identical chosen/rejected, no user turn, or too long: drop it
    (counted per reason in the metrics) or stop with an error naming the example."""
    batch_size: int = Field(32, ge=1)
    """Pairs per forward pass."""
    quantization: Literal["none", "nf4", "fp4", "int8", "fp8"] = "none"
    """The SFT model quantized as `dpo.adapter.quantization` quantizes it (QLoRA DPO): the reference
    must be the model DPO starts from, so the two must be equal (checked)."""
    double_quant: Annotated[bool, only_with("quantization", *FOUR_BIT)] = True
    compute_dtype: Annotated[Literal["auto", "bf16", "fp16", "fp32"], only_with("quantization", *QUANTIZED)] = "auto"
    """As in `dpo.adapter`; `auto` here is fp32 (the reference pass scores in fp32)."""


PREFERENCE_METHODS = ("dpo", "kto", "orpo", "simpo")
DPO_LOSS_TYPES = Literal["sigmoid", "hinge", "ipo", "ipo_sum", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero", "apo_down", "discopop"]


class DpoParams(Section):
    """Preference optimisation (DPO and its losses, KTO, ORPO, SimPO) from the cached reference.

    dpo and kto need the reference log-probabilities (`ref_logprobs`); orpo and simpo are
    reference-free, and `ref_logprobs` then only encodes the pairs (no model is loaded)."""

    method: Literal["dpo", "kto", "orpo", "simpo"] = "dpo"
    """dpo: paired, with a reference (`loss_type` picks the loss); kto: unpaired desirable/undesirable
    examples (paired data split in two), with a reference; orpo and simpo: paired, reference-free."""
    start: Literal["sft", "base"] = "sft"
    """The model the policy starts from, and dpo's and kto's reference: the SFT model, or the base
    (`data/models/pretrain`, or the model `base_model.name` names; ORPO's NLL term does the SFT)."""
    beta: float = Field(0.1, gt=0)
    """dpo/kto: strength of the implicit KL penalty (higher: stay closer to the reference); simpo:
    the reward scale (the paper uses 2-2.5); orpo: lambda, the odds-ratio term's weight."""
    loss_type: Annotated[DPO_LOSS_TYPES | None, only_with("method", "dpo", hint="kto, orpo and simpo have their own loss: set dpo.loss_type=null")] = None
    """method dpo's loss, TRL's names: sigmoid (DPO), hinge, ipo (TRL 1.16's, per-token), ipo_sum
    (IPO on summed log-ratios), robust, exo_pair, nca_pair, bco_pair, sppo_hard, apo_zero, apo_down,
    discopop (docs/preference.md); null: sigmoid. kto, orpo and simpo have their own loss: with them it
    must be null (as TRL's KTO, ORPO and CPO configs take none of these)."""
    label_smoothing: Annotated[float, AppliesWhen(
        "method dpo with loss_type sigmoid, robust or exo_pair, or method simpo",
        lambda s: s.method == "simpo" or (s.method == "dpo" and s.dpo_loss_type in ("sigmoid", "robust", "exo_pair")),
        shows=("method", "loss_type"), hint="kto's and orpo's losses have no label smoothing")] = Field(0.0, ge=0, lt=0.5)
    """The assumed share of flipped preference labels: dpo's sigmoid (conservative DPO), robust and
    exo_pair (needs > 0), and simpo; kto and orpo have none (it must be 0)."""
    discopop_tau: Annotated[float, only_with("loss_type", "discopop")] = Field(0.05, gt=0)
    """loss_type discopop: the temperature of its log-ratio modulation (TRL's default)."""
    simpo_gamma: Annotated[float, only_with("method", "simpo")] = Field(0.5, ge=0)
    """simpo: the target reward margin gamma (TRL's `simpo_gamma`)."""
    desirable_weight: Annotated[float, only_with("method", "kto")] = Field(1.0, gt=0)
    """kto: weight of the desirable examples' losses (TRL's guidance on imbalance is checked)."""
    undesirable_weight: Annotated[float, only_with("method", "kto")] = Field(1.0, gt=0)
    """kto: weight of the undesirable examples' losses."""
    sft_weight: Annotated[float, only_with("method", "dpo", "simpo", hint="orpo's loss already holds the NLL of the chosen answers with weight 1 "
                                                                       "(beta weighs the odds ratio); kto's has no NLL term (TRL's KTO has none)")] = Field(0.0, ge=0)
    """dpo and simpo: add this times the per-token NLL of the chosen answers to the loss (RPO; TRL's
    `rpo_alpha`, or CPO's `cpo_alpha` for simpo): keeps the policy generating what it is rewarded
    for, limiting drift. orpo's loss has the NLL itself (weight 1, its odds-ratio term weighted by
    `beta`) and kto none: with them it must be 0."""
    adapter: LoraAdapterParams = LoraAdapterParams()
    """A LoRA adapter on the policy (`enabled: true`; the same block as `lora.adapter`), or all its
    weights trained (`enabled: false`)."""
    train: TrainParams = TrainParams()

    @model_validator(mode="before")
    @classmethod
    def _lora_moved(cls, data: Any) -> Any:
        return _adapter_moved(data, "dpo")

    @model_validator(mode="after")
    def _no_loss_chunks(self) -> DpoParams:
        if self.train.loss_chunk_tokens:
            raise ValueError("train.loss_chunk_tokens: dpo does not chunk its loss (its loss is per-sequence log-probabilities, not a token cross-entropy); set it to 0")
        return self

    @model_validator(mode="after")
    def _exo_needs_smoothing(self) -> DpoParams:
        # what each setting applies to is declared on it (`AppliesWhen`); this is a value a loss needs
        if self.method == "dpo" and self.dpo_loss_type == "exo_pair" and not self.label_smoothing:
            raise ValueError("loss_type exo_pair needs label_smoothing > 0 (the EXO paper uses 1e-3)")
        return self

    @property
    def dpo_loss_type(self) -> str:
        """Method dpo's loss type (`loss_type`, null: sigmoid)."""
        return self.loss_type or "sigmoid"

    @property
    def needs_reference(self) -> bool:
        return self.method in ("dpo", "kto")


BUILT_IN_REWARDS = ("exact_match", "strict_match", "format", "environment")
"""The reward functions `pipelines.core.training.rewards` has built in."""
REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "answer", "id", "source", "split",
                    "candidates", "environments")
"""What a reward function is called with: TRL's arguments and the records' columns (the prepared
chat records' `id`, `source`, `split`, and `answer`, the reference), `candidates` (the answers of
the question's group), and in episodes with `grpo.tools.environment`, `environments` (each
completion's environment instance, as TRL's)."""


def user_reward(name: str, where: str):
    """None for a built-in reward's name; else the user's `package.module:function`, imported and
    checked against how it will be called (`REWARD_ARGUMENTS`); a `QllmError` naming `where` if it
    is neither. Used when params load and by `pipelines.core.training.rewards.load`."""
    if name in BUILT_IN_REWARDS:
        return None
    if name == "flexible_match":
        raise QllmError(f"{where}: flexible_match is evaluate's lenient score: as a reward, an answer naming every candidate (\"Pelora, Dunmar or "
                        "Kestwick\") scores 1 and the policy learns to list them; use strict_match, the same score that gives 0 when another "
                        "candidate answer of the question's group is named")  # fmt: skip
    if ":" not in name:
        if Path(name).is_dir() or name.count("/") == 1:
            raise QllmError(f"{where}: {name!r} looks like a reward model (a directory or hub id): grpo takes reward functions only, not TRL's "
                            "reward models; load the model in a `package.module:function` of your own and return its scores")  # fmt: skip
        raise QllmError(f"{where}: {name!r} is neither a built-in reward ({', '.join(BUILT_IN_REWARDS)}) nor `package.module:function`")
    fn = extensions.user_function(name, where, required=("prompts", "completions"), given=REWARD_ARGUMENTS, what="reward function")
    if any(c.__name__ == "Module" and c.__module__.startswith("torch.nn") for c in type(fn).__mro__):
        raise QllmError(f"{where}: {name!r} is a torch module (a reward model): grpo takes reward functions only, not TRL's reward models; "
                        "call the model in a function of your own and return its scores")  # fmt: skip
    return fn


class RewardParams(Section):
    """One reward function of `grpo.rewards` and its weight."""

    function: str = Field(min_length=1)
    """A built-in reward (`exact_match`, `strict_match`, `format`, `environment`: the environment's `reward()`) or a user's `package.module:function` (importable
    from the project, e.g. a module next to params.yaml; plain or `async def`), called as TRL calls one
    (`prompts`, `completions`, `completion_ids`, `trainer_state`, `log_extra`, `log_metric`, and the
    records' columns `answer`, `id`, `source`, `split`, and `candidates`). Reward models are refused."""
    weight: float = 1.0
    """The function's weight in the summed reward (TRL's `reward_weights`)."""

    @field_validator("function")
    @classmethod
    def _loads(cls, name: str) -> str:
        try:
            user_reward(name, "function")
        except QllmError as exc:
            raise ValueError(str(exc)) from None
        return name

    @property
    def name(self) -> str:
        """What its metrics are logged under (`rewards/<name>/mean`): the function's own name, as TRL's."""
        return self.function.rpartition(":")[2]


BUILT_IN_TOOLS = ("calculator", "lookup")


def user_tool(name: str, where: str):
    """None for a built-in tool the params can name; else the user's `package.module:function`,
    imported and described as a JSON schema (`extensions.describe`); a `QllmError` naming `where`
    if it is neither. Used when params load and by `pipelines.core.training.tools.load`."""
    if name == "calculator":
        return None
    if name == "lookup":
        raise QllmError(f"{where}: the lookup tool answers from a table the data provides, and no params key gives one yet; "
                        "write a `package.module:function` tool that holds your table")  # fmt: skip
    if ":" not in name:
        raise QllmError(f"{where}: {name!r} is neither a built-in tool ({', '.join(BUILT_IN_TOOLS)}) nor `package.module:function`")
    fn = extensions.import_callable(name, where, what="tool function")
    extensions.describe(fn, where)
    return fn


WITH_TOOLS = AppliesWhen("tools listed in `functions` or an `environment`", lambda s: s.enabled, shows=("functions", "environment"))
"""Episode settings, which one-turn rollouts (no tool) do not read."""


class ToolsParams(Section):
    """Tools the model may call: multi-turn episodes in GRPO's rollouts, and in evaluate's answers to
    the held-out questions that offer tools (docs/grpo.md "Tools")."""

    functions: list[str] = []
    """`calculator` (built in: exact arithmetic) or a user's `package.module:function` with type hints and a
    Google-style docstring (its JSON schema is made from them, as TRL's tools); each is imported and described when
    params load. Empty: one-turn rollouts, as without tools."""
    max_turns: Annotated[int, WITH_TOOLS] = Field(3, ge=2)
    """The model's turns per episode, its calls and its answer; an episode still calling tools at the last one is truncated."""
    timeout_seconds: Annotated[float, WITH_TOOLS] = Field(5.0, gt=0)
    """A call running longer is abandoned and the model reads a time-out error."""
    style: Annotated[Literal["auto", "hermes", "llama3"], WITH_TOOLS] = "auto"
    """How calls are written: `hermes` (`<tool_call>` blocks: Qwen2.5, Hermes), `llama3` (one JSON object: Llama 3.1),
    or `auto`, from the chat template."""
    environment: str | None = None
    """A user's environment class, `package.module:Class`, for tools with a state: a new instance per episode
    (constructed with no arguments), `reset(record)` on the question's record if it has one, its public methods
    the tools (beside `functions`; type hints and docstrings, as a function tool's), and `reward()`, if it has
    one, the episode's own reward, which the `environment` reward function reads (docs/grpo.md "Environments").
    None: each call runs the named function, with no state."""

    @field_validator("functions")
    @classmethod
    def _load(cls, names: list[str]) -> list[str]:
        loaded = []
        for i, name in enumerate(names):
            try:
                fn = user_tool(name, f"functions[{i}]")
            except QllmError as exc:
                raise ValueError(str(exc)) from None
            loaded.append(name if fn is None else fn.__name__)
        if len(set(loaded)) != len(loaded):
            raise ValueError(f"functions: two tools share a name ({', '.join(sorted({n for n in loaded if loaded.count(n) > 1}))})")
        return names

    @field_validator("environment")
    @classmethod
    def _environment(cls, name: str | None) -> str | None:
        if name is not None:
            try:
                extensions.environment_tools(name, "environment")
            except QllmError as exc:
                raise ValueError(str(exc)) from None
        return name

    @property
    def enabled(self) -> bool:
        """Episodes with tools: `functions` or an `environment` given."""
        return bool(self.functions or self.environment)


class GrpoParams(Section):
    """Reinforcement learning with verifiable rewards (GRPO and its Dr. GRPO and DAPO losses, as
    TRL's `GRPOTrainer`) from the SFT model, on the chat records' questions (docs/grpo.md)."""

    enabled: bool = True
    """Train the GRPO model. Off: the stage writes only a README (no cost)."""
    rewards: list[RewardParams] = Field(default_factory=lambda: [RewardParams(function="exact_match")], min_length=1)
    """Reward functions and weights; each is checked (imported, signature) when params load."""
    group_size: int = Field(8, ge=2)
    """Completions sampled per prompt (TRL's `num_generations`); the advantages are normalised
    within each group. `train.micro_batch_size` counts completions and must be a multiple of it."""
    max_completion_length: int = Field(16, ge=1)
    """Tokens a completion may have; one that reaches it without a stop token is truncated. With
    tools, each of the model's turns, and the tools' answers between two turns (cut to fit, saying so)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the rollouts (TRL's default 1.0)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling of the rollouts (1.0: off)."""
    beta: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the reference (the SFT model); 0, TRL's default, loads no
    reference. With > 0, the reference log-probabilities are computed once per generation."""
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = "dapo"
    """How the per-token loss is averaged (TRL's names; docs/grpo.md): grpo per completion then
    over completions, dr_grpo over completions x max_completion_length, dapo (TRL's default) over
    the generation batch's completion tokens, bnpo over the micro-batch's."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide the centred rewards by the group's standard deviation (GRPO), the batch's, or not at
    all (Dr. GRPO)."""
    epsilon: float = Field(0.2, gt=0, lt=1)
    """The ratio clipping range's lower side (and upper, unless `epsilon_high` is set)."""
    epsilon_high: float | None = Field(None, gt=0)
    """The upper side (DAPO's clip-higher uses 0.28); None: `epsilon`."""
    num_iterations: int = Field(1, ge=1)
    """Optimizer steps per generation (GRPO's mu): more than 1 reuses each batch of completions,
    with the ratio to the policy that generated them clipped."""
    mask_truncated_completions: bool = False
    """Leave truncated completions (no stop token within `max_completion_length`) out of the loss (DAPO)."""
    log_completions_every: int = Field(10, ge=0)
    """Log a table of sample completions with their rewards to MLflow every N steps (0: never)."""
    adapter: LoraAdapterParams = LoraAdapterParams()
    """A LoRA adapter on the policy (`enabled: true`; the same block as `lora.adapter`), or all its
    weights trained (`enabled: false`)."""
    tools: ToolsParams = ToolsParams()
    train: TrainParams = TrainParams()

    @model_validator(mode="before")
    @classmethod
    def _lora_moved(cls, data: Any) -> Any:
        return _adapter_moved(data, "grpo")

    @model_validator(mode="after")
    def _environment_reward(self) -> GrpoParams:
        listed = [f"rewards[{i}]" for i, spec in enumerate(self.rewards) if spec.function == "environment"]
        if listed and self.tools.environment is None:
            raise ValueError(f"{listed[0]}: `environment` is the episode's reward from its environment's `reward()`, and "
                             "`tools.environment` names none; set it, or list another reward")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _batches_hold_groups(self) -> GrpoParams:
        names = [r.name for r in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"rewards: two functions share a name ({', '.join(names)}), so their metrics would too")
        if self.train.micro_batch_size % self.group_size:
            raise ValueError(f"train.micro_batch_size ({self.train.micro_batch_size}) counts completions and must be a multiple of group_size "
                             f"({self.group_size}), so that each micro-batch holds whole groups")  # fmt: skip
        if self.train.loss_chunk_tokens:
            raise ValueError("train.loss_chunk_tokens: grpo does not chunk its loss (it scores its completions' tokens itself); set it to 0")
        if self.train.nproc > 1:
            raise ValueError("train.nproc: grpo runs in one process (its rollouts are generated where it trains); set it to 1")
        return self


class VisionParams(Section):
    """The vision tower of the multimodal model: a SigLIP vision transformer built from config."""

    image_size: int = Field(16, ge=1)
    """Side in pixels every image is resized to."""
    patch_size: int = Field(4, ge=1)
    """Side of a patch: an image becomes (image_size / patch_size)^2 tokens of the language model."""
    hidden_size: int = Field(64, ge=1)
    intermediate_size: int = Field(128, ge=1)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(2, ge=1)

    @model_validator(mode="after")
    def _fits(self) -> VisionParams:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} must be a multiple of patch_size {self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}")
        return self


class MultimodalParams(Section):
    """The optional LLaVA-style image-chat stage (`pipelines/multimodal.py`, docs/multimodal.md)."""

    enabled: bool = False
    """Train the multimodal model. Off: the stage writes only a README (no cost)."""
    base_model: str = "data/models/sft"
    """The language model: this pipeline's SFT model (or `data/models/pretrain`)."""
    vision: VisionParams = VisionParams()
    projector_act: str = "gelu"
    """Activation between the projector's two linear layers (LLaVA-1.5's MLP projector)."""
    vision_tower: Literal["trainable", "frozen"] = "trainable"
    """LLaVA freezes a pretrained tower; this one is built from config (nothing can be downloaded),
    so by default it learns with the projector."""
    alignment_steps: int = Field(400, ge=0)
    """Phase 1, feature alignment: the first steps train the projector (and the tower), the
    language model is frozen."""
    language_model: Literal["full", "frozen"] = "full"
    """Phase 2, instruction tuning: the language model trains too (`full`) or stays frozen."""
    instruction_lr: float = Field(1e-3, gt=0)
    """Peak learning rate of phase 2 (phase 1 uses `train.lr`), re-warmed over `train.warmup_steps`."""
    max_seq_len: int = Field(0, ge=0)
    """Longest chat in tokens, image tokens included (0: the language model's context); longer
    chats are dropped and counted, never cut (an image's tokens must stay whole)."""
    train: TrainParams = TrainParams()

    @model_validator(mode="after")
    def _no_loss_chunks(self) -> MultimodalParams:
        if self.train.loss_chunk_tokens:
            raise ValueError("train.loss_chunk_tokens: multimodal does not chunk its loss (its loss is the image chat's); set it to 0")
        return self


ModelStage = Literal["pretrain", "sft", "lora", "dpo", "grpo"]


class EvaluateParams(Section):
    models: list[ModelStage] = Field(default_factory=lambda: ["pretrain", "sft", "lora", "dpo", "grpo"], min_length=1)
    """Models to evaluate on the same held-out sets (outputs of these stages)."""
    tools: ToolsParams = ToolsParams()
    """The tools a held-out question that offers them (its chat's `tools`) is answered with: a greedy
    episode (calls, results, answer), the answer scored as any other, each episode in
    predictions.jsonl and `tool_calls_correct` among the metrics. Empty: one-turn answers (a model
    that writes a call has answered with the call)."""
    max_new_tokens: int = Field(16, ge=1)
    """Greedy decoding length for exact-match answers."""
    batch_size: int = Field(32, ge=1)
    """Questions decoded together (left-padded)."""
    max_questions: int = Field(0, ge=0)
    """Evaluate at most this many held-out questions (0: all)."""
    eval_batches: int = Field(0, ge=0)
    """Validation batches for loss/perplexity (0: the whole validation set)."""
    general_text_tokens: int = Field(0, ge=0)
    """What fine-tuning costs the model outside the task: `general_loss`/`general_perplexity` on the
    first this many tokens of real text the sample never shows (CPython's own documentation,
    `pydoc_data`, in rows of `tokenize.seq_len`; with `sample_data.corpus: real_text` that text is
    the training text, so it is not held out). 0: off."""
    workers: int = Field(1, ge=1)
    """Models evaluated at once (threads; each holds its model in memory). On a CPU the cores are
    already shared by one model's kernels; raise it on an accelerator with memory to spare."""
    bertscore_model: str | None = Field(None, min_length=1)
    """BERTScore of the answers against the references (`bertscore_f1`, `_precision`, `_recall`)
    with this local `save_pretrained` directory of a BERT-like encoder (bert, roberta, deberta, ...;
    relative to the project). Never downloaded. None: no BERTScore. The path is a param (changing
    it reruns evaluate); the encoder's files are not a dvc.yaml dependency."""
    bertscore_layer: Annotated[int | None, AppliesWhen("bertscore_model set", lambda s: s.bertscore_model is not None, shows=("bertscore_model",))] = Field(None, ge=0)
    """The encoder's hidden state that embeds the tokens (0: the embeddings, n: after layer n);
    None: the last. bert-score's defaults: 17 for roberta-large, 9 for bert-base-uncased."""


GgufType = Literal["f16", "q8_0", "bf16", "f32", "q4_k_m", "q4_k_s", "q5_k_m", "q6_k"]


class ExportParams(Section):
    """The optional GGUF export for llama.cpp and Ollama (`pipelines/export.py`, docs/export.md)."""

    enabled: bool = False
    """Write GGUF files. Off: the stage writes only a README (no cost)."""
    model: ModelStage | None = None
    """Which stage's model to export (adapters merged first); null: the one `register.model` registers
    (then register attaches the files to the registry version)."""
    types: list[GgufType] = Field(default_factory=lambda: ["f16", "q8_0"], min_length=1)
    """One GGUF file per type: f16, q8_0, bf16, f32 are written by the `gguf` package; the K-quants
    (q4_k_m, q4_k_s, q5_k_m, q6_k) by llama.cpp's quantizer from the f16 file, which needs llama-cpp-python."""
    modelfile: bool = True
    """Also write an Ollama Modelfile: the chat template in Ollama's template language, its stop tokens, greedy decoding."""
    modelfile_type: Annotated[GgufType, only_with("modelfile", True)] = "q8_0"
    """The file the Modelfile's FROM names (one of `types`)."""
    system: Annotated[str | None, only_with("modelfile", True)] = None
    """The Modelfile's default system prompt (SYSTEM); null: none (the sample chats' is "Answer with one word or number.")."""
    temperature: Annotated[float | None, only_with("modelfile", True)] = Field(None, ge=0)
    """The Modelfile's `PARAMETER temperature`; null: what the model's generation_config.json says
    (0 where it decodes greedily, as the pipeline's models do; else its temperature)."""

    @model_validator(mode="after")
    def _modelfile_type_written(self) -> ExportParams:
        if len(set(self.types)) != len(self.types):
            raise ValueError(f"types: each type once (got {self.types})")
        if self.modelfile and self.modelfile_type not in self.types:
            raise ValueError(f"modelfile_type {self.modelfile_type!r} is not among types {self.types}: the Modelfile's FROM names one of the files written")
        return self


class RegisterParams(Section):
    model: ModelStage | Literal["multimodal"] = "dpo"
    """Which stage's model to register (`multimodal`: the image-chat model, gated on its entry in
    evaluate.json, where `exact_match` is the held-out image questions')."""
    model_name: str = Field("qllm", min_length=1)
    """Registered model name in the MLflow model registry (no quotes, backslashes, `/` or control
    characters: MLflow's search filters and `models:/` URIs are built from it)."""
    alias: str = Field("champion", min_length=1)
    """Alias the new version gets when it passes the gate (at least the champion's metric + margin)."""
    challenger_alias: str = Field("challenger", min_length=1)
    """Alias the new version gets when it does not pass the gate (the champion keeps its alias)."""
    metric: str = Field("exact_match", min_length=1)
    """The gate's primary metric: a key of the model's entry in data/metrics/evaluate.json."""
    mode: Literal["max", "min"] = "max"
    """Whether a higher (`max`, e.g. exact_match) or lower (`min`, e.g. val_loss) metric is better."""
    margin: float = Field(0.0, ge=0)
    """How much better than the champion (in the metric's units) a new version must be."""

    @field_validator("model_name")
    @classmethod
    def _searchable(cls, name: str) -> str:
        if any(c in name for c in "'\"\\/") or any(ord(c) < 32 for c in name):
            raise ValueError(f"{name!r}: a registered model's name may not hold quotes, backslashes, '/' or control characters "
                             "(MLflow's search filters and models:/ URIs are built from it)")  # fmt: skip
        return name

    @model_validator(mode="after")
    def _distinct_aliases(self) -> RegisterParams:
        if self.alias == self.challenger_alias:
            raise ValueError(f"alias and challenger_alias must differ (both {self.alias!r})")
        return self


# `register` (the stage) shadows the ABC `register` classmethod pydantic models inherit; instance
# attribute lookup returns the field, which is all we use, so the warning is noise.
warnings.filterwarnings("ignore", message='Field name "register" in "Params" shadows', category=UserWarning)


WITH_A_BASE = AppliesWhen("a base model named (`name`)", lambda s: s.name is not None, shows=("name",))


class BaseModelParams(Section):
    """Where the fine-tuning stages start from (docs/fine-tuning.md)."""

    name: str | None = None
    """None: the model `pretrain` trains here from scratch. Otherwise a hub id (`Qwen/Qwen2.5-0.5B`)
    or a `save_pretrained` directory (relative to the project): `train_tokenizer` then takes its
    tokenizer, `pretrain` trains nothing, and sft, probe_lora, lora, dpo, evaluate and register
    use it with its own tokenizer and chat template."""
    revision: Annotated[str | None, WITH_A_BASE] = None
    """Hub only: a branch, tag or commit; resolved to the commit it names (in data/base_model.json),
    so a new revision reruns everything downstream. None: the hub's default branch."""
    chat_template_path: Annotated[str | None, WITH_A_BASE] = None
    """A Jinja chat template file (relative to the project) that replaces the base's own in every
    stage, as TRL's `chat_template_path` does: for a base whose template cannot render tools
    (SmolLM2's: `templates/smollm2-tools.jinja`, its own rendering plus Qwen2.5's Hermes-style
    tools). Its text is recorded in data/base_model.json, so editing it reruns what follows.
    None: the base's own template."""


class ProbeDeviceParams(Section):
    """`probe_device` has no settings: it records the machine (see `pipelines/probe_device.py`)."""


class Params(Section):
    """The whole `params.yaml`: one section per stage."""

    sample_data: SampleDataParams = SampleDataParams()
    ingest: IngestParams
    prepare_data: PrepareDataParams = PrepareDataParams()
    train_tokenizer: TrainTokenizerParams = TrainTokenizerParams()
    tokenize: TokenizeParams = TokenizeParams()
    probe_device: ProbeDeviceParams = ProbeDeviceParams()
    base_model: BaseModelParams = BaseModelParams()
    pretrain: PretrainParams = PretrainParams()
    sft: SftParams = SftParams()
    probe_lora: ProbeLoraParams = ProbeLoraParams()
    quantum_opt: QuantumOptParams = QuantumOptParams()
    lora: LoraParams = LoraParams()
    ref_logprobs: RefLogprobsParams = RefLogprobsParams()
    dpo: DpoParams = DpoParams()
    grpo: GrpoParams = GrpoParams()
    multimodal: MultimodalParams = MultimodalParams()
    export: ExportParams = ExportParams()
    evaluate: EvaluateParams = EvaluateParams()
    register: RegisterParams = RegisterParams()

    @model_validator(mode="before")
    @classmethod
    def _renamed_sections(cls, data: Any) -> Any:
        if isinstance(data, dict) and "generate" in data:
            raise ValueError("generate: the stage that writes the sample data is called sample_data now "
                             "(`qllm generate` asks a model): rename the section to sample_data")  # fmt: skip
        return data

    @model_validator(mode="after")
    def _curriculum_in_pretrain_only(self) -> Params:
        for name in ("sft", "probe_lora", "lora", "dpo"):
            if getattr(self, name).train.curriculum.strategy != "none":
                raise ValueError(
                    f"{name}.train.curriculum.strategy: the sequence-length curriculum is for pretrain (packed rows, which can be "
                    "cut anywhere); a cut chat or preference pair would lose its answer: set it to none"
                )
        return self

    @model_validator(mode="after")
    def _continue_needs_a_base(self) -> Params:
        pretrain = self.pretrain
        if not pretrain.continue_base:
            return self
        if self.base_model.name is None:
            raise ValueError("pretrain.continue_base is true but base_model.name is null: there is no base to continue; name one, or set "
                             "continue_base: false to pretrain a model here from scratch")  # fmt: skip
        for key, on in (("objective", pretrain.objective != "causal"), ("progressive.enabled", pretrain.progressive.enabled),
                        ("model.memory.enabled", pretrain.model.memory.enabled)):  # fmt: skip
            if on:
                raise ValueError(f"pretrain.{key}: continued pretraining trains the base as it is (causal, every layer, its own "
                                 f"architecture); set pretrain.continue_base: false or turn {key} off")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _mask_token_for_masked_diffusion(self) -> Params:
        if self.pretrain.objective == "masked_diffusion" and not self.train_tokenizer.mask_token and self.base_model.name is None:
            raise ValueError("pretrain.objective is masked_diffusion but train_tokenizer.mask_token is false: the objective needs the "
                             "tokenizer's <|mask|> token; set train_tokenizer.mask_token: true")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _grpo_needs_a_causal_model(self) -> Params:
        if self.grpo.enabled and self.pretrain.objective == "masked_diffusion" and self.base_model.name is None:
            raise ValueError("grpo.enabled: GRPO samples completions left to right and scores their tokens' log-probabilities, which a "
                             "masked-diffusion model (pretrain.objective: masked_diffusion) does not give; set grpo.enabled: false")  # fmt: skip
        if not self.grpo.enabled and self.register.model == "grpo":
            raise ValueError("register.model is grpo but grpo.enabled is false: there is no GRPO model to register")
        return self

    @model_validator(mode="after")
    def _sft_progressive_fits(self) -> Params:
        if self.sft.progressive.enabled:
            try:
                self.sft.progressive.check_fits(self.sft.train)
            except ValueError as exc:
                raise ValueError(f"sft.progressive: {exc}") from None
        return self

    @model_validator(mode="after")
    def _reference_quantized_like_the_policy(self) -> Params:
        policy = self.dpo.adapter.quantization
        if policy != self.ref_logprobs.quantization:
            raise ValueError(
                f"ref_logprobs.quantization is {self.ref_logprobs.quantization!r} but DPO starts from the SFT model quantized as "
                f"{policy!r} (dpo.adapter.quantization); the reference must be the model DPO starts from: set both to the same value"
            )
        return self


def to_plain(model: BaseModel) -> dict[str, Any]:
    """A JSON-safe dict of a params model."""
    return model.model_dump(mode="json")


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten nested params to dotted keys (`pretrain.train.lr`) for MLflow."""
    if isinstance(data, BaseModel):
        data = to_plain(data)
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    if isinstance(data, list) and data and all(isinstance(item, dict) for item in data):
        out = {}
        for index, item in enumerate(data):
            out.update(flatten(item, f"{prefix}{index}."))
        return out
    return {prefix.rstrip("."): data}


def digest(data: Any) -> str:
    """Stable SHA-256 of JSON-able data (used to name run workspaces and checkpoint dirs)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()
