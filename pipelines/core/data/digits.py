"""A sample image world from real pictures that ship inside a package: handwritten digits.

scikit-learn's `load_digits` holds 1,797 real 8x8 scans of handwritten digits (UCI "Optical
Recognition of Handwritten Digits", 16 grey levels). Each becomes an 8x8 greyscale PNG in
`images/`, and a chat about it in the LLaMA-Factory layout the `image_chat` record kind reads:

    {"id": "digit-0007", "messages": [{"role": "user", "content": "<image>Which digit is this?"},
     {"role": "assistant", "content": "7"}, ...], "images": ["images/digit-0007.png"]}

A seeded `heldout_fraction` of the images (`split_images`) is only asked "Which digit is this?"
in `image_chat_heldout.jsonl` (`split: test`, what evaluate scores). Every training image gets
that question or a caption request ("Describe the image." -> "A handwritten 7."), and half of
them a second turn on parity ("Is it even?"). The same split is what the logistic-regression
baseline of `benchmarks/quality/multimodal.py` trains and tests on.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from pipelines.core.params.data import SampleImagesParams

IMAGES_DIR = "images"
FILES = {"train": "image_chat_train.jsonl", "heldout": "image_chat_heldout.jsonl"}
QUESTION = "Which digit is this?"
COUNT_KEYS = ("images", "image_chat_train", "image_chat_heldout")


def load() -> tuple[np.ndarray, np.ndarray]:
    """(images [n, 8, 8] uint8 0..255, digits [n]) of the scikit-learn digits."""
    from sklearn.datasets import load_digits

    data = load_digits()
    pixels = np.round(data.images * (255 / 16)).astype(np.uint8)
    return pixels, data.target.astype(np.int64)


def split_images(n: int, heldout_fraction: float, seed: int) -> np.ndarray:
    """True for the held-out images (a seeded choice of round(n * fraction) of them)."""
    order = np.random.default_rng(seed).permutation(n)
    heldout = np.zeros(n, dtype=bool)
    heldout[order[: max(1, round(n * heldout_fraction))]] = True
    return heldout


def png(pixels: np.ndarray) -> bytes:
    """A greyscale PNG of one scan (deterministic bytes)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(buffer, format="PNG", optimize=False, compress_level=9)
    return buffer.getvalue()


def _chat(digit: int, rng: np.random.Generator) -> list[dict[str, str]]:
    if rng.random() < 2 / 3:
        messages = [{"role": "user", "content": f"<image>{QUESTION}"}, {"role": "assistant", "content": str(digit)}]
    else:
        messages = [{"role": "user", "content": "<image>Describe the image."}, {"role": "assistant", "content": f"A handwritten {digit}."}]
    if rng.random() < 0.5:
        messages += [{"role": "user", "content": "Is it even?"}, {"role": "assistant", "content": "yes" if digit % 2 == 0 else "no"}]
    return messages


def write_images(out: Path, params: SampleImagesParams, seed: int) -> dict[str, int]:
    """Write `images/*.png` and the two JSONL files into `out`; returns `COUNT_KEYS` counts."""
    pixels, digits = load()
    if params.max_images:
        pixels, digits = pixels[: params.max_images], digits[: params.max_images]
    heldout = split_images(len(digits), params.heldout_fraction, seed)
    rng = np.random.default_rng(seed)
    (out / IMAGES_DIR).mkdir(parents=True, exist_ok=True)
    rows = {"train": [], "heldout": []}
    for index, (scan, digit) in enumerate(zip(pixels, digits.tolist(), strict=True)):
        name = f"{IMAGES_DIR}/digit-{index:04d}.png"
        (out / name).write_bytes(png(scan))
        if heldout[index]:
            messages = [{"role": "user", "content": f"<image>{QUESTION}"}, {"role": "assistant", "content": str(digit)}]
            rows["heldout"].append({"id": f"digit-{index:04d}", "messages": messages, "images": [name]})
        else:
            rows["train"].append({"id": f"digit-{index:04d}", "messages": _chat(digit, rng), "images": [name]})
    for split, records in rows.items():
        with open(out / FILES[split], "w", encoding="utf-8", newline="\n") as handle:
            handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in records)
    return {"images": len(digits), "image_chat_train": len(rows["train"]), "image_chat_heldout": len(rows["heldout"])}
