"""The multimodal branch: the digit image world, the LLaVA-style model (image token, forward with
images, processor agreement), its two training phases, exact resume across them, save/load with
the Auto classes, the image-matters metric, `qllm generate --image`, and the whole pipeline with
`params/multimodal.yaml` through evaluate and register."""

from __future__ import annotations

import functools
import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipelines import multimodal
from pipelines.core.data import digits
from pipelines.core.extensions import ExtensionError, Hook
from pipelines.core.models import vision
from pipelines.core.models.models import load_model_and_tokenizer
from pipelines.core.params.data import SampleImagesParams
from pipelines.core.params.finetuning import MultimodalParams, VisionParams
from pipelines.core.training import loop
from tests import numerics

REPO = Path(__file__).resolve().parents[2]
TINY_VISION = VisionParams(image_size=8, patch_size=4, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2)


def png(value: int, size: int = 8) -> bytes:
    """A greyscale square: a dark or light half tells the image apart (what the tiny model learns)."""
    from PIL import Image

    pixels = np.zeros((size, size), dtype=np.uint8)
    pixels[:, : size // 2] = 255 if value else 0
    pixels[:, size // 2 :] = 0 if value else 255
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(buffer, format="PNG")
    return buffer.getvalue()


def write_prepared(directory: Path, splits: dict[str, list[tuple[list[dict], list[bytes]]]]) -> Path:
    """Prepared image_chat files as prepare_data writes them (messages JSON, images list<binary>)."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, chats in splits.items():
        table = pa.table({
            "id": pa.array([f"{split}-{i}" for i in range(len(chats))], pa.string()),
            "source": pa.array(["t"] * len(chats), pa.string()),
            "split": pa.array([split] * len(chats), pa.string()),
            "messages": pa.array([json.dumps(m) for m, _ in chats], pa.string()),
            "images": pa.array([images for _, images in chats], pa.list_(pa.binary())),
        })  # fmt: skip
        pq.write_table(table, directory / f"{split}.parquet")
    return directory


def two_class_chats(n: int, seed: int = 0) -> list[tuple[list[dict], list[bytes]]]:
    """Which half is light? Answer 1 (left) or 2 (right), from the image alone."""
    rng = np.random.default_rng(seed)
    chats = []
    for value in rng.integers(0, 2, n).tolist():
        messages = [{"role": "user", "content": "<image>What is 1 plus 2?"}, {"role": "assistant", "content": "1" if value else "2"}]
        chats.append((messages, [png(value)]))
    return chats


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory) -> Path:
    return write_prepared(tmp_path_factory.mktemp("image_chat"), {"train": two_class_chats(48), "validation": two_class_chats(8, 1), "test": two_class_chats(16, 2)})


def mm_params(base: Path, phases: dict | None = None, **train) -> MultimodalParams:
    cfg = {"max_steps": 6, "micro_batch_size": 4, "lr": 0.01, "warmup_steps": 1, "eval_every": 3, "log_every": 1, "checkpoint_every": 2,
           "precision": "fp32", "extensions": []} | train  # fmt: skip
    return MultimodalParams(**{"enabled": True, "base_model": str(base), "vision": TINY_VISION, "alignment_steps": 3, "instruction_lr": 0.005,
                               "train": cfg} | (phases or {}))  # fmt: skip


def test_digit_world_writes_real_scans_with_questions(tmp_path):
    counts = digits.write_images(tmp_path, SampleImagesParams(enabled=True, max_images=40), seed=0)
    assert counts == {"images": 40, "image_chat_train": 32, "image_chat_heldout": 8}
    scans, labels = digits.load()
    train = [json.loads(line) for line in (tmp_path / digits.FILES["train"]).read_text().splitlines()]
    heldout = [json.loads(line) for line in (tmp_path / digits.FILES["heldout"]).read_text().splitlines()]
    assert {r["id"] for r in train}.isdisjoint({r["id"] for r in heldout})
    for record in heldout:
        index = int(record["id"].split("-")[1])
        assert record["messages"] == [{"role": "user", "content": "<image>Which digit is this?"}, {"role": "assistant", "content": str(labels[index])}]
        image = vision.open_image((tmp_path / record["images"][0]).read_bytes())
        assert np.array_equal(np.asarray(image)[:, :, 0], scans[index])  # the real scan, 8x8, 16 grey levels
    for record in train:
        assert record["messages"][0]["content"].startswith("<image>") and len(record["images"]) == 1
    again = tmp_path / "again"
    digits.write_images(again, SampleImagesParams(enabled=True, max_images=40), seed=0)
    for name in (*digits.FILES.values(), "images/digit-0007.png"):
        assert (again / name).read_bytes() == (tmp_path / name).read_bytes()


@pytest.fixture(scope="module")
def built(tiny_base):
    lm, tokenizer = load_model_and_tokenizer(tiny_base / "model")
    reference = [p.detach().clone() for p in lm.parameters()]
    model, processor = vision.build(lm, tokenizer, TINY_VISION)
    return model, processor, reference, tiny_base


def test_build_adds_the_image_token_and_keeps_the_language_model(built):
    model, processor, reference, base = built
    tokenizer = processor.tokenizer
    assert tokenizer.convert_tokens_to_ids(vision.IMAGE_TOKEN) == model.config.image_token_id == len(tokenizer) - 1
    assert vision.image_tokens(model.config) == 4 and processor.patch_size == 4
    lm, _ = load_model_and_tokenizer(base / "model")
    embedding = model.get_input_embeddings().weight
    assert embedding.shape[0] == len(tokenizer) and torch.equal(embedding[:-1], lm.get_input_embeddings().weight)
    text = torch.tensor([tokenizer("What is 1 plus 2?")["input_ids"]])
    with torch.no_grad():  # no image: the language model's own logits (for its vocabulary), up to the order of its sums
        expected = lm(input_ids=text).logits
        numerics.assert_close_as(model(input_ids=text).logits[..., :-1], expected, n=numerics.model_roundings(lm.config, text.shape[1]))


def test_training_rows_match_the_processor_and_the_image_changes_the_logits(built):
    model, processor, _, _ = built
    chat = two_class_chats(1)[0]
    rows = vision.encode(processor, [chat], max_len=128, per_image=vision.image_tokens(model.config))
    prompt = processor.apply_chat_template(chat[0][:1], add_generation_prompt=True, tokenize=False)
    from_processor = processor(text=[prompt], images=[vision.open_image(chat[1][0])], return_tensors="pt")
    n = from_processor["input_ids"].shape[1]
    assert rows.rows[0].input_ids[:n].tolist() == from_processor["input_ids"][0].tolist()  # token for token, image tokens included
    assert torch.equal(rows.pixels[0], from_processor["pixel_values"])  # the processor's own normalisation of the same image
    batch = vision.collate(rows, processor.tokenizer.pad_token_id)(np.array([0]))
    with torch.no_grad():
        light_left = model(**{k: v for k, v in batch.items() if k != "num_tokens"}).logits
        other = batch | {"pixel_values": vision.pixel_values(processor, [png(0 if chat[0][1]["content"] == "1" else 1)])}
        light_right = model(**{k: v for k, v in other.items() if k != "num_tokens"}).logits
        tol = numerics.tolerance(numerics.model_roundings(model.config.text_config, batch["input_ids"].shape[1]), magnitude=float(light_left.abs().max()))
        assert not numerics.within(light_left[0, -1], light_right[0, -1], tol)
        with pytest.raises(ValueError, match="[Ii]mage"):  # image tokens without their image: refused, not silently misaligned
            model(input_ids=batch["input_ids"], pixel_values=torch.cat([batch["pixel_values"]] * 2))


def test_a_chat_longer_than_max_len_is_dropped_not_cut(built):
    model, processor, _, _ = built
    rows = vision.encode(processor, two_class_chats(3), max_len=8, per_image=4)
    assert rows.rows == [] and rows.stats.dropped_too_long == 3


def train_stage(base: Path, image_dir: Path, out: Path, checkpoints: Path | None = None, stop_at: int | None = None, watch=None,
                phases: dict | None = None, **train):  # fmt: skip
    """multimodal.run with a hook at every step end (`stop_at` raises there, as a kill would)."""

    def hook(state, metrics):
        if watch is not None:
            watch(state)
        if state.step == stop_at:
            raise RuntimeError("killed")

    original = loop.train
    loop.train = functools.partial(original, extensions=[Hook("on_step_end", hook)])
    try:
        return multimodal.run(image_dir, out, mm_params(base, phases, **train), checkpoint_dir=checkpoints)
    finally:
        loop.train = original


def test_alignment_freezes_the_language_model_then_instruction_tuning_trains_it(tiny_base, image_dir, tmp_path):
    seen = {}

    def watch(state):
        model = watch.model
        seen[state.step] = {"lm": model.model.language_model.layers[0].self_attn.q_proj.weight.detach().clone(),
                            "projector": model.model.multi_modal_projector.linear_1.weight.detach().clone(),
                            "tower": model.model.vision_tower.embeddings.patch_embedding.weight.detach().clone(),
                            "lm_trains": model.model.language_model.layers[0].self_attn.q_proj.weight.requires_grad}  # fmt: skip

    build = vision.build

    def keep(*args, **kw):
        model, processor = build(*args, **kw)
        watch.model = model
        return model, processor

    vision.build = keep
    try:
        metrics = train_stage(tiny_base / "model", image_dir, tmp_path / "out", watch=watch)
    finally:
        vision.build = build
    assert metrics["steps"] == 6 and metrics["data/train_examples"] == 48 and metrics["image_tokens"] == 4
    assert [seen[s]["lm_trains"] for s in range(1, 7)] == [False] * 3 + [True] * 3
    assert torch.equal(seen[1]["lm"], seen[3]["lm"]) and not torch.equal(seen[3]["lm"], seen[6]["lm"])  # frozen, then trained
    for part in ("projector", "tower"):
        assert not torch.equal(seen[1][part], seen[3][part])  # the tower is built from config: it learns too
    history = (tmp_path / "out" / loop.TRAINING_LOG).read_text().splitlines()
    assert len(history) == 7  # header + steps 1..6


def test_resume_across_the_phase_switch_is_exact(tiny_base, image_dir, tmp_path):
    from safetensors.torch import load_file

    straight = train_stage(tiny_base / "model", image_dir, tmp_path / "straight", tmp_path / "ckpt-straight")
    expected = load_file(tmp_path / "straight" / "model.safetensors")
    for stop_at in (3, 5):  # the last checkpoint before the kill: step 2 (alignment) and step 4 (instruction tuning)
        with pytest.raises(ExtensionError):
            train_stage(tiny_base / "model", image_dir, tmp_path / f"out{stop_at}", tmp_path / f"ckpt{stop_at}", stop_at=stop_at)
        resumed = train_stage(tiny_base / "model", image_dir, tmp_path / f"out{stop_at}", tmp_path / f"ckpt{stop_at}")
        got = load_file(tmp_path / f"out{stop_at}" / "model.safetensors")
        assert got.keys() == expected.keys()
        for name in expected:
            assert torch.equal(got[name], expected[name]), (stop_at, name)
        assert resumed["val/loss"] == straight["val/loss"]


@pytest.fixture(scope="module")
def trained(tiny_base, image_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mm") / "model"
    # the tiny base is an untrained Llama: it needs ~90 steps of instruction tuning to read the image
    train_stage(tiny_base / "model", image_dir, out, phases={"alignment_steps": 0, "instruction_lr": 0.01}, max_steps=120, eval_every=60,
                checkpoint_every=0, log_every=20)  # fmt: skip
    return out


def test_the_image_matters_after_training_and_the_model_loads_with_the_auto_classes(trained, image_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(trained)
    processor = AutoProcessor.from_pretrained(trained)
    assert type(model).__name__ == "LlavaForConditionalGeneration" and type(processor).__name__ == "LlavaProcessor"
    metrics = vision.evaluate(model, processor, vision.read_chats(image_dir, "test"), max_new_tokens=4)
    rows = metrics.pop("rows")
    assert metrics["image_questions"] == len(rows) == 16
    # with the right image the answer is far more likely than with another chat's image
    assert metrics["image_loss_gap"] > 0.5 and metrics["shuffled_image_answer_loss"] > metrics["image_answer_loss"]
    assert metrics["image_exact_match"] >= 0.75
    assert metrics["image_loss_right_lower_fraction"] >= 0.3  # (two classes: about half the shuffled images show the same answer)
    assert all(set(row) == {"question", "reference", "prediction", "correct"} for row in rows)


def test_qllm_generate_answers_about_an_image_and_says_what_is_wrong(trained, tiny_base, tmp_path, capsys):
    from qllm import cli

    image = tmp_path / "left.png"
    image.write_bytes(png(1))
    assert cli.main(["generate", "--model", str(trained), "--image", str(image), "--prompt", "What is 1 plus 2?", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip() == "1"
    image.write_bytes(png(0))
    assert cli.main(["generate", "--model", str(trained), "--image", str(image), "--prompt", "What is 1 plus 2?", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip() == "2"
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    assert cli.main(["generate", "--model", str(trained), "--image", str(bad), "--prompt", "Which?"]) == 2
    assert f"{bad}: cannot read the image" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(tiny_base / "model"), "--image", str(image), "--prompt", "Which?"]) == 2
    assert "a text-only model cannot look at --image" in capsys.readouterr().err


def test_disabled_stage_writes_a_readme_and_loads_nothing(tmp_path, mlflow_template_db):
    from pipelines.core.run import stage
    from tests.conftest import make_project

    root = make_project(tmp_path / "project", mlflow_template_db)
    stage.execute(multimodal.NAME, multimodal.body, root)
    out = root / "data/models/multimodal"
    assert sorted(p.name for p in out.iterdir()) == ["README.md"] and not vision.trained(out)
    assert json.loads((root / "data/metrics/multimodal.json").read_text())["enabled"] is False


def test_the_multimodal_branch_runs_end_to_end(tmp_path, mlflow_template_db, monkeypatch, capsys):
    """params/multimodal.yaml over the tiny profile: digit images -> ingest -> prepare_data -> the
    multimodal stage -> evaluate (its image metrics) -> register (a pyfunc) -> qllm generate --image."""
    import yaml

    from pipelines.core import dag
    from pipelines.core.outputs import read_json
    from pipelines.core.run import repro
    from qllm import cli
    from qllm.serving import generation
    from tests.conftest import make_project

    overlay = yaml.safe_load((REPO / "params" / "multimodal.yaml").read_text())
    root = make_project(tmp_path / "project", mlflow_template_db, overlay)
    try:
        outcomes = {name: repro.reproduce(root, name).status for name in dag.stages(REPO)}
    finally:
        repro.close(root)
    assert set(outcomes.values()) == {"ran"}, outcomes
    prepared = read_json(root / "data/metrics/prepare_data.json")["image_chat"]
    assert prepared["out"]["test"] == 12 and prepared["out"]["train"] + prepared["out"]["validation"] == 48
    trained_metrics = read_json(root / "data/metrics/multimodal.json")
    assert trained_metrics["enabled"] is True and trained_metrics["steps"] == 8
    evaluated = read_json(root / "data/metrics/evaluate.json")["multimodal"]
    assert evaluated["questions"] == 8 and 0 <= evaluated["exact_match"] <= 1  # evaluate.max_questions: 8 in the tiny profile
    assert {"image_answer_loss", "shuffled_image_answer_loss", "image_loss_gap"} <= set(evaluated)
    for path in (root / "data/models/multimodal").rglob("*"):  # same bytes in any directory: no absolute path in the output
        assert path.is_dir() or str(root).encode() not in path.read_bytes(), path
    assert json.loads((root / "data/models/multimodal/config.json").read_text())["text_config"]["_name_or_path"] == "data/models/sft"
    registered = read_json(root / "data/register/registered.json")
    assert registered["stage"] == "multimodal" and registered["model_name"] == "qllm-vision"
    image = root / "data/sample/images/digit-0000.png"
    local = generation.generate_about_image(*generation.load_image_model("data/models/multimodal", root), image, "Which digit is this?", max_new_tokens=4)
    from_registry = generation.generate_about_image(*generation.load_image_model("models:/qllm-vision@champion", root), image,
                                                    "Which digit is this?", max_new_tokens=4)  # fmt: skip
    assert from_registry == local
    assert cli.main(["generate", "--model", "models:/qllm-vision@champion", "--project-dir", str(root), "--image", str(image),
                     "--prompt", "Which digit is this?", "--max-new-tokens", "4"]) == 0  # fmt: skip
    # From another directory holding decoys at the same relative paths (a disabled stage's placeholder
    # README, as in a checkout after `make run`, and another image): --project-dir decides, not the cwd.
    decoy = tmp_path / "elsewhere"
    (decoy / "data/models/multimodal").mkdir(parents=True)
    (decoy / "data/models/multimodal/README.md").write_text("multimodal.enabled is false\n")
    (decoy / "data/sample/images").mkdir(parents=True)
    (decoy / "data/sample/images/digit-0000.png").write_bytes(b"not an image")
    monkeypatch.chdir(decoy)
    capsys.readouterr()
    assert cli.main(["generate", "--model", "data/models/multimodal", "--image", "data/sample/images/digit-0000.png", "--project-dir",
                     str(root), "--prompt", "Which digit is this?", "--max-new-tokens", "4"]) == 0, capsys.readouterr().err  # fmt: skip
    assert capsys.readouterr().out.strip() == local
    monkeypatch.chdir(root)
    import mlflow.pyfunc

    from pipelines.core.run import tracking

    with tracking.fluent_uris(tracking.tracking_uri(root)):
        pyfunc = mlflow.pyfunc.load_model("models:/qllm-vision@champion")
    answers = pyfunc.predict(pd.DataFrame({"image": [image.read_bytes()], "question": ["Which digit is this?"]}), params={"max_new_tokens": 4})
    assert answers == [local]
    # over HTTP: MLflow's model server, the image base64-encoded (the signature's binary column)
    import base64

    from tests.conftest import mlflow_model_server, post_json

    request = {"dataframe_split": {"columns": ["image", "question"], "data": [[base64.b64encode(image.read_bytes()).decode(), "Which digit is this?"]]},
               "params": {"max_new_tokens": 4}}  # fmt: skip
    with mlflow_model_server("models:/qllm-vision@champion", root, tmp_path / "serve.log") as url:
        status, body = post_json(url, json.dumps(request).encode())
        assert (status, body) == (200, {"predictions": [local]})
        status, body = post_json(url, json.dumps({"dataframe_split": {"columns": ["question"], "data": [["Which digit is this?"]]}}).encode())
        assert status == 400 and "image" in body["message"], body
