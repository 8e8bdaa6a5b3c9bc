"""The multimodal stage on real images: held-out digit accuracy through the chat interface beside a
logistic regression on the same pixels and split, the right-vs-shuffled image loss gap, training time.

    python -m benchmarks.quality.multimodal --base <project>/data/models/sft [--seeds 0,1,2] [--precisions auto,fp32]
                                            [--set multimodal.alignment_steps=100 ...]

The images and records are the pipeline's own: `sample_data.images` writes the 1,797 scikit-learn
digit scans and their chats (`pipelines/core/data/digits.py`, seed 0: 359 held-out images), `ingest`
and `prepare_data` read and split them (in a temporary directory). Per precision and seed, the
multimodal stage trains with params.yaml's `multimodal` section (plus `--set` overrides) on the
SFT model `--base` (what `qllm run` wrote), then `vision.evaluate` asks every held-out image
"Which digit is this?" (greedy, exact match) and compares the answer loss with the right image
against a shuffled one. The baseline: scikit-learn's `LogisticRegression` on the 64 pixels of
the training images (train + validation chats), tested on the same held-out images.

Prints one JSON line per run and a summary (mean +- std over seeds).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, mean_sd, record
from pipelines import ingest, multimodal, prepare_data
from pipelines.core.data import digits
from pipelines.core.models import vision
from pipelines.core.params import files as params_file
from pipelines.core.params.data import IngestParams, PrepareDataParams, SampleImagesParams
from pipelines.core.training import precision


def prepared(scratch: Path) -> Path:
    """The digit sample through ingest and prepare_data: `scratch/prepared/image_chat`."""
    sample = scratch / "sample"
    sample.mkdir()
    digits.write_images(sample, SampleImagesParams(enabled=True), seed=0)
    sources = [{"path": f"sample/{digits.FILES['train']}", "kind": "image_chat"},
               {"path": f"sample/{digits.FILES['heldout']}", "kind": "image_chat", "split": "test"}]  # fmt: skip
    ingest.run(scratch, scratch / "ingested", IngestParams(sources=sources), progress=False)
    prepare_data.run(scratch / "ingested", scratch / "prepared", PrepareDataParams())
    return scratch / "prepared" / "image_chat"


def baseline() -> dict:
    """Logistic regression on the pixels of the training images, accuracy on the held-out ones."""
    from sklearn.linear_model import LogisticRegression

    pixels, labels = digits.load()
    heldout = digits.split_images(len(labels), SampleImagesParams().heldout_fraction, seed=0)
    features = pixels.reshape(len(labels), -1) / 255.0
    started = time.perf_counter()
    model = LogisticRegression(max_iter=5000).fit(features[~heldout], labels[~heldout])
    return {"accuracy": round(float((model.predict(features[heldout]) == labels[heldout]).mean()), 4), "train_images": int((~heldout).sum()),
            "test_images": int(heldout.sum()), "seconds": round(time.perf_counter() - started, 2)}  # fmt: skip


def one_run(image_dir: Path, params, seed: int, requested: str, scratch: Path) -> dict:
    train = params.train.model_copy(update={"seed": seed, "precision": precision.resolve(requested), "extensions": [], "checkpoint_every": 0})
    run_params = params.model_copy(update={"train": train})
    out = scratch / f"model-{requested}-{seed}"
    started = time.perf_counter()
    metrics = multimodal.run(image_dir, out, run_params)
    seconds = time.perf_counter() - started
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model, processor = AutoModelForImageTextToText.from_pretrained(out), AutoProcessor.from_pretrained(out)
    started = time.perf_counter()
    result = vision.evaluate(model, processor, vision.read_chats(image_dir, "test"), max_new_tokens=8)
    result.pop("rows")
    return {"precision": train.precision, "seed": seed, "train_seconds": round(seconds, 1), "eval_seconds": round(time.perf_counter() - started, 1),
            "val_loss": round(metrics["val/loss"], 4), **result}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, type=Path, help="the SFT model directory (a qllm run's data/models/sft)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--precisions", default="auto,fp32", help="comma-separated: auto, bf16, fp32")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="params override, e.g. multimodal.alignment_steps=100")
    args = parser.parse_args(argv)
    params, _ = params_file.load(REPO, overrides=args.set)
    params = params.multimodal.model_copy(update={"enabled": True, "base_model": str(args.base.resolve())})
    print(json.dumps({"baseline": "logistic_regression", **baseline()}), flush=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        image_dir = prepared(scratch)
        for requested in args.precisions.split(","):
            for seed in [int(s) for s in args.seeds.split(",")]:
                runs.append(record(one_run(image_dir, params, seed, requested, scratch)))
    for name in sorted({r["precision"] for r in runs}):
        group = [r for r in runs if r["precision"] == name]

        def of(key: str, group=group) -> str:
            return mean_sd(r[key] for r in group)

        print(f"{name} ({len(group)} seeds): accuracy {of('image_exact_match')}, answer loss right {of('image_answer_loss')}, "
              f"shuffled {of('shuffled_image_answer_loss')}, gap {of('image_loss_gap')}, train s {of('train_seconds')}")  # fmt: skip
    print(f"set: {args.set or 'params.yaml defaults'}; {(params.vision.image_size // params.vision.patch_size) ** 2} tokens per image")


if __name__ == "__main__":
    main()
