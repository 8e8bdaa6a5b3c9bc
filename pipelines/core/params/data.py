"""Params of the data stages: the sample world (`sample_data`), users' sources (`ingest`),
`prepare_data`, `train_tokenizer` and `tokenize`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from pipelines.core.params.base import WHEN_ENABLED, Section, only_with


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
    validation_entity_fraction: Annotated[float, SYNTHETIC] = Field(0.0, ge=0, lt=1)
    """Share of entities, drawn from the training people, whose facts stay in the biographies but
    whose questions are in no QA line, SFT chat, preference pair or GRPO prompt: the validation
    people, on whom settings are chosen (`chat_validation.jsonl`, ids `validation-...`; ingest it
    with `split: validation`). The held-out people are only reported, never chosen on. 0: none."""
    max_operand: Annotated[int, SYNTHETIC] = Field(10, ge=2)
    """Arithmetic facts are `a + b` with `0 <= a, b < max_operand`."""
    sum_renderings: Annotated[int, SYNTHETIC] = Field(24, ge=1)
    """How often each sum is written in the pretraining text (in random wordings)."""
    arithmetic_heldout_fraction: Annotated[float, SYNTHETIC] = Field(0.2, gt=0, lt=1)
    """Share of arithmetic questions held out of SFT/DPO (their facts stay in pretraining)."""
    arithmetic_validation_fraction: Annotated[float, SYNTHETIC] = Field(0.0, ge=0, lt=1)
    """Share of arithmetic questions, drawn from the training sums, set aside as the validation
    people are (in `chat_validation.jsonl`, never in training chats, QA lines or pairs). 0: none."""
    qa_in_pretrain: Annotated[bool, SYNTHETIC] = True
    """Also write plain `Question: … Answer: …` lines (training entities and arithmetic) into pretraining text."""
    qa_renderings: Annotated[int, SYNTHETIC, only_with("qa_in_pretrain", True)] = Field(1, ge=1)
    """With `qa_in_pretrain`, how often each training fact is asked in the pretraining text (in
    random wordings). Seeing the question form often enough in pretraining is what lets SFT
    answer about held-out people (benchmarks/results/quality.md, issue 13)."""
    preference_errors: Annotated[Literal["copy", "confusion", "value"], SYNTHETIC] = "copy"
    """How each preference pair's rejected answer is wrong: `copy` (a weak model repeating the
    person's name or a number from the question), `confusion` (another true fact about the same
    person, e.g. the pet when asked for the city) or `value` (another value of the right kind: a
    different city, the sum off by a little). Measured in benchmarks/results/preference-rl.md: DPO generalises
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
