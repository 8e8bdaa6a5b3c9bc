"""Chat with a trained model: one prompt in, the model's answer out.

    qllm generate --model models:/qllm@champion --prompt "Where does Tovik live?"
    qllm generate --model data/models/sft --prompt "What is 2 plus 3?" --temperature 0.8 --seed 1

The prompt is a user turn rendered with the model's chat template (`add_generation_prompt=True`);
generation stops at `<|im_end|>` or end of text (`models.stop_token_ids`). Temperature 0 is
greedy decoding (deterministic); a positive temperature samples, seeded by `seed`.

`model` is a registered version (`models:/NAME@ALIAS`, `models:/NAME/VERSION`, loaded with
`mlflow.transformers.load_model` from the project's registry) or a model directory the pipeline
wrote: a full model, a LoRA output with `merged/`, or a PEFT adapter (merged into its base).

With an image (`qllm generate --model data/models/multimodal --image digit.png --prompt "Which digit
is this?"`) the model is the multimodal stage's (a directory, or its registered pyfunc version):
`load_image_model` and `generate_about_image`; the image goes where the prompt's `<image>` is, or
in front of it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pipelines.core.data.chat_template import apply_template, render_prompt
from pipelines.core.errors import QllmError


def load(model: str, root: Path | str = ".") -> tuple[Any, Any]:
    """(model, tokenizer) for a `models:/` URI or a model directory.

    Args:
        model: `models:/NAME@ALIAS`, `models:/NAME/VERSION`, or a model directory (absolute, or
            relative to `root`).
        root: the project (its `mlflow.db` holds the registry; adapters' base paths resolve here).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub from a local model
    root = Path(root).resolve()
    if model.startswith("models:/"):
        return _load_registered(model, root)
    from pipelines.core.models.models import load_for_inference

    path = _local_dir(model, root)
    if not path.is_dir():
        raise QllmError(
            f"{model}: no such model directory{_in(root)} (expected a `save_pretrained` directory or models:/NAME@ALIAS)"
        )
    return load_for_inference(path, root)


def _load_registered(uri: str, root: Path) -> tuple[Any, Any]:
    import mlflow.transformers

    import pipelines.core.models.diffusion_model  # noqa: F401  (the pipeline's own model classes, known to the Auto classes)
    import pipelines.core.models.memory_model  # noqa: F401
    from qllm.registry import lineage

    client = lineage.open_client(root)  # the project's registry: tracking.tracking_uri(root)
    version = lineage.model_version(client, uri)  # clear errors for unknown names, aliases, versions
    # Where the version's files are, resolved by this client: no process-wide MLflow URI to set
    # (mlflow.set_tracking_uri would also export MLFLOW_TRACKING_URI to everything after it).
    location = client.get_model_version_download_uri(version.name, version.version)
    components = mlflow.transformers.load_model(location, return_type="components")
    return components["model"], components["tokenizer"]


def generate(
    model: Any,
    tokenizer: Any,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    system: str | None = None,
) -> str:
    """The model's answer to `prompt` as a user turn (the assistant turn, without its end marker).

    Args:
        model: a causal LM.
        tokenizer: its tokenizer, with a chat template.
        prompt: the user message.
        max_new_tokens: at most this many generated tokens.
        temperature: 0 for greedy decoding; above 0, sampling at this temperature.
        seed: seeds the sampling (ignored when greedy).
        system: an optional system message before the prompt.

    Returns:
        The generated text, special tokens removed, surrounding whitespace stripped.
    """
    _check_decoding(max_new_tokens, temperature)
    if not getattr(tokenizer, "chat_template", None):
        raise QllmError(
            "the model's tokenizer has no chat template (train it with the pipeline's train_tokenizer stage)"
        )
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    text = render_prompt(tokenizer, messages)  # as evaluate renders its prompts (a fixed date for Llama 3.1+ templates)
    encoded = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(model.device)
    return decode(model, tokenizer, encoded, max_new_tokens, temperature, seed)


def _check_decoding(max_new_tokens: int, temperature: float) -> None:
    if max_new_tokens < 1:
        raise QllmError(f"max_new_tokens must be at least 1 (got {max_new_tokens})")
    if temperature < 0:
        raise QllmError(f"temperature must be 0 (greedy) or positive (got {temperature})")


def decode(model: Any, tokenizer: Any, encoded: Any, max_new_tokens: int, temperature: float, seed: int) -> str:
    """Generate after `encoded` (greedy, or sampled at `temperature` seeded by `seed`) up to the end
    of the turn; the new text, special tokens removed."""
    import torch

    from pipelines.core.models.models import stop_token_ids

    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    model.eval()
    with torch.no_grad():
        if temperature > 0:
            torch.manual_seed(seed)
        output = model.generate(**encoded, max_new_tokens=max_new_tokens, eos_token_id=stop_token_ids(tokenizer),
                                pad_token_id=tokenizer.pad_token_id, **sampling)  # fmt: skip
    return tokenizer.decode(output[0, encoded["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def is_image_model(model: str, root: Path | str = ".") -> bool:
    """Whether `model` (a directory or `models:/` URI) is an image-text model (the multimodal stage's)."""
    import json

    root = Path(root).resolve()
    if model.startswith("models:/"):
        from qllm.registry import lineage

        client = lineage.open_client(root)
        version = lineage.model_version(client, model)
        return version.tags.get("qllm.stage") == "multimodal"
    config = _local_dir(model, root) / "config.json"
    try:
        return "vision_config" in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):  # no or no valid config: `load` says what is wrong with the directory
        return False


def _local_dir(model: str, root: Path) -> Path:
    """A model directory: absolute, or relative to the project `root` (never the current directory)."""
    from pipelines.core.paths import project_path

    return project_path(model, root)


def _in(root: Path) -> str:
    """` in ROOT` for a message about a relative path, when root is not the current directory."""
    return "" if root == Path.cwd().resolve() else f" in {root}"


def load_image_model(model: str, root: Path | str = ".") -> tuple[Any, Any]:
    """(model, processor) of the multimodal stage's output directory or its registered version."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = Path(root).resolve()
    if model.startswith("models:/"):
        import mlflow.pyfunc

        from qllm.registry import lineage

        client = lineage.open_client(root)
        version = lineage.model_version(client, model)
        location = client.get_model_version_download_uri(version.name, version.version)
        wrapped = mlflow.pyfunc.load_model(location).unwrap_python_model()
        return wrapped.model, wrapped.processor
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = _local_dir(model, root)
    if not (path / "config.json").exists():
        raise QllmError(f"{model}: no such model directory{_in(root)} (expected the multimodal stage's output, e.g. data/models/multimodal)")
    return AutoModelForImageTextToText.from_pretrained(path), AutoProcessor.from_pretrained(path)


def generate_about_image(
    model: Any,
    processor: Any,
    image: Path | str | None,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    system: str | None = None,
) -> str:
    """The image-text model's answer to `prompt` about `image` (an image file; None: no image).

    The prompt's `<image>` placeholder marks where the image goes (in front when it has none);
    decoding as in `generate`."""
    from pipelines.core.models import vision

    _check_decoding(max_new_tokens, temperature)
    images = None
    if image is not None:
        try:
            images = [vision.open_image(Path(image).read_bytes())]
        except (OSError, ValueError) as exc:  # missing, unreadable, or not an image Pillow can decode (images.ImageError)
            raise QllmError(f"{image}: cannot read the image ({exc})") from None
        if vision.IMAGE_TOKEN not in prompt:
            prompt = vision.IMAGE_TOKEN + prompt
    elif vision.IMAGE_TOKEN in prompt:
        raise QllmError(f"the prompt has an {vision.IMAGE_TOKEN} placeholder but no --image was given")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    text = apply_template(processor, messages, add_generation_prompt=True, tokenize=False)
    encoded = processor(text=[text], images=images, return_tensors="pt").to(model.device)
    return decode(model, processor.tokenizer, encoded, max_new_tokens, temperature, seed)
