"""A LLaVA-style image-chat model: a vision tower built from config, a projector, the pipeline's Llama.

    model, processor = vision.build(language_model, tokenizer, params.vision)
    rows = vision.encode(processor, records, max_len)          # image chats -> training rows
    loss, _ = vision.image_chat_loss(model, batch)                # the shared loop's loss_fn

The model is transformers' `LlavaForConditionalGeneration`: a SigLIP vision transformer (built
from `multimodal.vision`, randomly initialised: no pretrained encoder can be downloaded here), a
two-layer MLP projector (LLaVA-1.5's) from its patch features to the language model's hidden size,
and the language model of `multimodal.base_model` with its weights. The tokenizer gains one
special token, `<image>` (`IMAGE_TOKEN`), whose embedding row is the mean of the others; a chat's
`<image>` placeholder stands for `image_tokens(config)` of them, one per patch, which the model
replaces with the projected patch features (LlavaProcessor expands the placeholder the same way,
so training rows and `processor(...)` at inference agree token for token: tested).

The output directory is a Hugging Face model plus processor:
`AutoModelForImageTextToText.from_pretrained(dir)` and `AutoProcessor.from_pretrained(dir)` load
it without this project.

Training is the shared loop (`pipelines.core.training.loop`) with a two-phase schedule (`pipelines.multimodal.Phases`,
handed to the loop like a growth schedule): LLaVA's feature alignment (the projector, and the
vision tower unless frozen, train; the language model is frozen), then instruction tuning (the
language model trains too, or stays frozen), each phase with a fresh AdamW and a re-warmed
learning rate; checkpoints hold every weight and the phase, so a run resumes exactly on either
side of the switch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipelines.core.data import chat_examples
from pipelines.core.data.chat_template import apply_template, normalize_answer, parse_messages, split_last_answer
from pipelines.core.data.images import (
    IMAGE_TOKEN,  # the placeholder in a user turn, and the special token the tokenizer gains
)
from pipelines.core.data.images import open_image as decode
from pipelines.core.errors import QllmError
from pipelines.core.models.models import seeded, stop_token_ids
from pipelines.core.params.finetuning import VisionParams


def image_tokens(config) -> int:
    """Tokens an image becomes: one per patch of the vision tower (SigLIP has no class token)."""
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2


def open_image(data: bytes):
    """A stored image (its file's bytes) as an RGB Pillow image (`images.ImageError` if it is none)."""
    with decode(data) as image:
        return image.convert("RGB")


def build(language_model, tokenizer, vision: VisionParams, projector_act: str = "gelu", seed: int = 0):
    """(LlavaForConditionalGeneration, LlavaProcessor) around a trained causal language model.

    The tokenizer gains `IMAGE_TOKEN` (the language model's embedding grows by one row, the mean
    of the others, drawn as transformers' mean resizing does); that row, the vision tower and the projector
    are seeded by `seed`."""
    from tokenizers import AddedToken
    from transformers import LlavaConfig, LlavaForConditionalGeneration, SiglipVisionConfig

    objective = getattr(language_model.config, "objective", "causal")
    if objective != "causal" or not hasattr(language_model, "model"):
        raise QllmError(f"multimodal.base_model: needs a causal decoder (a Llama-like *ForCausalLM); got {type(language_model).__name__} ({objective})")
    if vision.image_size % vision.patch_size:
        raise QllmError(f"multimodal.vision: image_size {vision.image_size} is not a multiple of patch_size {vision.patch_size}")
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    with seeded(seed):  # mean resizing draws the new row from a normal around the others' mean
        language_model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    vision_config = SiglipVisionConfig(
        hidden_size=vision.hidden_size, intermediate_size=vision.intermediate_size, num_hidden_layers=vision.num_layers,
        num_attention_heads=vision.num_heads, image_size=vision.image_size, patch_size=vision.patch_size, num_channels=3,
    )  # fmt: skip
    config = LlavaConfig(
        vision_config=vision_config, text_config=language_model.config, image_token_index=image_token_id,
        image_seq_length=(vision.image_size // vision.patch_size) ** 2, vision_feature_select_strategy="full",
        vision_feature_layer=-1, projector_hidden_act=projector_act, tie_word_embeddings=bool(language_model.config.tie_word_embeddings),
    )  # fmt: skip
    try:
        with seeded(seed):
            model = LlavaForConditionalGeneration(config)
    except (ValueError, KeyError) as exc:
        raise QllmError(f"multimodal.base_model: transformers cannot build a LLaVA model around {type(language_model).__name__}: {exc}") from None
    model.model.language_model.load_state_dict(language_model.model.state_dict())
    if not config.tie_word_embeddings:
        model.lm_head.load_state_dict(language_model.lm_head.state_dict())
    model.generation_config = language_model.generation_config
    return model, processor_for(tokenizer, vision)


def processor_for(tokenizer, vision: VisionParams):
    """The LlavaProcessor: SigLIP's image processor at the tower's size, and the tokenizer."""
    from transformers import LlavaProcessor

    try:  # transformers picks a torchvision backend when it is installed, else the PIL one
        from transformers import SiglipImageProcessorPil as ImageProcessor
    except ImportError:  # pragma: no cover - older transformers
        from transformers import SiglipImageProcessor as ImageProcessor
    image_processor = ImageProcessor(size={"height": vision.image_size, "width": vision.image_size})
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=vision.patch_size,
                          vision_feature_select_strategy="full", num_additional_image_tokens=0,
                          chat_template=tokenizer.chat_template, image_token=IMAGE_TOKEN)  # fmt: skip


def pixel_values(processor, images: list[bytes]) -> torch.Tensor:
    """[n, 3, H, W] float pixels of stored images, as the processor prepares them."""
    if not images:
        size = processor.image_processor.size
        return torch.zeros((0, 3, size["height"], size["width"]))
    return processor.image_processor([open_image(data) for data in images], return_tensors="pt")["pixel_values"]


def expand(messages: list[dict], per_image: int) -> list[dict]:
    """The messages with every `<image>` written as `per_image` image tokens (as LlavaProcessor does)."""
    return [{**m, "content": m["content"].replace(IMAGE_TOKEN, IMAGE_TOKEN * per_image)} for m in messages]


@dataclass
class ImageRows:
    """Training rows of image chats: one row per chat, its images' pixels alongside."""

    rows: list[chat_examples.Row]
    pixels: list[torch.Tensor]
    """Per row: [images, 3, H, W]."""
    stats: chat_examples.EncodeStats


def records(frame) -> list[tuple[list[dict], list[bytes]]]:
    """(messages, image bytes) of a prepared image_chat frame."""
    return [(parse_messages(m), [bytes(b) for b in images]) for m, images in zip(frame["messages"], frame["images"], strict=True)]


def read_chats(image_dir: Path, split: str) -> list[tuple[list[dict], list[bytes]]]:
    """(messages, image bytes) of `image_dir/<split>.parquet` (prepare_data's image_chat output)."""
    import pandas as pd

    path = Path(image_dir) / f"{split}.parquet"
    if not path.exists():
        raise QllmError(f"{path}: not found; run prepare_data (with image_chat sources in ingest.sources)")
    return records(pd.read_parquet(path, columns=["messages", "images"]))


def trained(model_dir: Path) -> bool:
    """Whether the multimodal stage's output `model_dir` holds a model (not the disabled README)."""
    return (Path(model_dir) / "config.json").exists()


def encode(processor, chats: list[tuple[list[dict], list[bytes]]], max_len: int, per_image: int, loss_on: str = "assistant") -> ImageRows:
    """Render and mask image chats (`chat_examples.encode`, loss on the answers); a chat longer
    than `max_len` tokens is dropped (counted), never truncated: a cut would leave image tokens
    without their image."""
    rows, pixels = [], []
    stats = chat_examples.EncodeStats()
    for messages, images in chats:
        examples, one = chat_examples.encode(processor.tokenizer, [expand(messages, per_image)], max_len, loss_on, overflow="drop")
        stats.dropped_too_long += one.dropped_too_long
        stats.dropped_no_target += one.dropped_no_target
        if not examples:
            continue
        rows.extend(chat_examples.unpacked(examples))
        pixels.append(pixel_values(processor, images))
        stats.examples += 1
        stats.target_tokens += one.target_tokens
        stats.tokens += one.tokens
        stats.lengths.extend(one.lengths)
    return ImageRows(rows, pixels, stats)


def build_rows(processor, image_dir: Path, max_len: int, per_image: int) -> tuple[dict[str, ImageRows], dict[str, float]]:
    """Training and validation rows of `image_dir/{train,validation}.parquet`, and their encoding
    counts as metrics (`data/<split>_examples`, ..., as `finetune.build_rows` names them)."""
    data, metrics = {}, {}
    for split in ("train", "validation"):
        data[split] = encode(processor, read_chats(image_dir, split), max_len, per_image)
        metrics |= data[split].stats.as_metrics(f"data/{split}_")
    return data, metrics


def collate(data: ImageRows, pad_id: int) -> Callable[[np.ndarray], dict[str, Any]]:
    """Right-padded rows with an attention mask (`chat_examples.collate`) plus `pixel_values`:
    the images of the batch's rows in row order, as the model matches image tokens to images."""
    base = chat_examples.collate(data.rows, pad_id, packed=False)

    def batch(indices: np.ndarray) -> dict[str, Any]:
        out = base(indices)
        images = [data.pixels[i] for i in np.sort(indices)]
        if any(len(p) for p in images):
            out["pixel_values"] = torch.cat(images)
        return out

    return batch


def image_chat_loss(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean cross-entropy over the answer tokens, the images fed through the vision tower."""
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "labels", "attention_mask", "pixel_values")}
    return model(**inputs, use_cache=False).loss, {}


@torch.no_grad()
def answer_losses(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """Per row: the mean cross-entropy of its answer tokens."""
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "pixel_values")}
    logits = model(**inputs, use_cache=False).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=chat_examples.IGNORE, reduction="none")
    counts = (labels != chat_examples.IGNORE).sum(1).clamp(min=1)
    return token.sum(1) / counts


# ------------------------------------------------------------------------- the two phases


# ---------------------------------------------------------------------------- evaluation


def chat_prompt(processor, question: str) -> str:
    """A one-turn user question about one image, rendered with the chat template for generation
    (`<image>` put in front when the question has no placeholder)."""
    content = question if IMAGE_TOKEN in question else IMAGE_TOKEN + question
    return apply_template(processor, [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)


def _prompts(processor, chats: list[tuple[list[dict], list[bytes]]]) -> tuple[list[str], list[str]]:
    texts, answers = [], []
    for messages, _ in chats:
        prompt, answer = split_last_answer(messages)
        texts.append(apply_template(processor, prompt, add_generation_prompt=True, tokenize=False))
        answers.append(answer)
    return texts, answers


@torch.no_grad()
def generate(model, processor, prompts: list[str], images: list[list[bytes]], max_new_tokens: int, device: torch.device) -> list[str]:
    """Greedy answers to chat-rendered prompts with their images (left-padded batch)."""

    tokenizer = processor.tokenizer
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        flat = [open_image(data) for row in images for data in row]
        inputs = processor(text=prompts, images=flat or None, return_tensors="pt", padding=True).to(device)
    finally:
        tokenizer.padding_side = side
    stops = stop_token_ids(tokenizer)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
    new = out[:, inputs["input_ids"].shape[1] :]
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in new]


def evaluate(model, processor, chats: list[tuple[list[dict], list[bytes]]], *, max_new_tokens: int = 8, batch_size: int = 32,
             seed: int = 0, device: torch.device | None = None) -> dict[str, Any]:  # fmt: skip
    """The held-out image questions: exact match of the greedy answer, and whether the image
    matters: the answer loss with each chat's own image vs with another chat's image (a seeded
    derangement). Chats with exactly one image count; returns the metrics and the per-question rows."""
    device = device or torch.device("cpu")
    chats = [c for c in chats if len(c[1]) == 1]
    if not chats:
        return {"image_questions": 0}
    was_training = model.training
    model.eval().to(device)
    texts, answers = _prompts(processor, chats)
    predictions = []
    for start in range(0, len(chats), batch_size):
        part = chats[start : start + batch_size]
        predictions += generate(model, processor, texts[start : start + batch_size], [c[1] for c in part], max_new_tokens, device)
    correct = [normalize_answer(p) == normalize_answer(a) for p, a in zip(predictions, answers, strict=True)]
    per_image = image_tokens(model.config)
    data = encode(processor, chats, max_len=1 << 30, per_image=per_image)
    order = np.random.default_rng(seed).permutation(len(chats))
    other = np.empty(len(chats), dtype=np.int64)
    other[order] = np.roll(order, 1)  # a derangement: no chat keeps its own image
    shuffled = ImageRows(data.rows, [data.pixels[i] for i in other], data.stats)
    right, wrong = [], []
    pad = processor.tokenizer.pad_token_id
    for source, out in ((data, right), (shuffled, wrong)):
        batches = collate(source, pad)
        for start in range(0, len(chats), batch_size):
            batch = batches(np.arange(start, min(start + batch_size, len(chats))))
            out += answer_losses(model, {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}).tolist()
    model.train(was_training)
    right_loss, wrong_loss = float(np.mean(right)), float(np.mean(wrong))
    return {
        "image_questions": len(chats),
        "image_exact_match": round(float(np.mean(correct)), 6),
        "image_answer_loss": round(right_loss, 6),
        "shuffled_image_answer_loss": round(wrong_loss, 6),
        "image_loss_gap": round(wrong_loss - right_loss, 6),
        "image_loss_right_lower_fraction": round(float(np.mean(np.array(right) < np.array(wrong))), 6),
        "rows": [{"question": json.dumps(c[0][:-1], ensure_ascii=False), "reference": a, "prediction": p, "correct": bool(k)}
                 for c, a, p, k in zip(chats, answers, predictions, correct, strict=True)],
    }  # fmt: skip
