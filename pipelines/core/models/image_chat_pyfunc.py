"""The multimodal model as an MLflow pyfunc: what `register` logs when `register.model: multimodal`.

MLflow's transformers flavour has no image-text-to-text task, so the saved model directory (model
plus processor) is logged as an artifact of a `PythonModel` that answers questions about images:

    import mlflow, pandas as pd
    model = mlflow.pyfunc.load_model("models:/qllm-vision@champion")
    model.predict(pd.DataFrame({"image": [open("digit.png", "rb").read()], "question": ["Which digit is this?"]}))
    # -> ["7"]

`image` holds the image file's bytes (or a path to it); `question` the user's text (an `<image>`
placeholder is put in front when it has none). Loading needs this project installed (the class
is pickled by reference), as `mlflow.transformers` needs transformers.
"""

from __future__ import annotations

from pathlib import Path

import mlflow.pyfunc

MAX_NEW_TOKENS = 16


def signature():
    """Inputs `image` (bytes) and `question` (string), one answer per row, and the `max_new_tokens` param."""
    import pandas as pd
    from mlflow.models import infer_signature

    example = pd.DataFrame({"image": [b"\x89PNG"], "question": ["Which digit is this?"]})
    return infer_signature(example, ["7"], params={"max_new_tokens": MAX_NEW_TOKENS})


class ImageChatModel(mlflow.pyfunc.PythonModel):
    """Greedy answers of a LLaVA-style model directory to (image, question) rows."""

    def load_context(self, context) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        directory = context.artifacts["model"]
        self.model = AutoModelForImageTextToText.from_pretrained(directory).eval()
        self.processor = AutoProcessor.from_pretrained(directory)

    def predict(self, context, model_input, params=None) -> list[str]:
        from pipelines.core.models import vision

        max_new_tokens = int((params or {}).get("max_new_tokens", MAX_NEW_TOKENS))
        images = [value if isinstance(value, (bytes, bytearray)) else Path(value).read_bytes() for value in model_input["image"]]
        prompts = [vision.chat_prompt(self.processor, question) for question in model_input["question"]]
        return vision.generate(self.model, self.processor, prompts, [[bytes(i)] for i in images], max_new_tokens, self.model.device)
