"""BERTScore of answers against references, with a local encoder (nothing is downloaded)."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from pipelines.core.errors import QllmError
from pipelines.core.models.models import CONSTRUCTION, device
from pipelines.core.workspace import project_root


class BertScore:
    """BERTScore (Zhang et al., 2020) of answers against references, with a local encoder.

    Each text is embedded by the encoder's hidden state `layer` (0: the embeddings; None: the last)
    and each of its tokens matched to the most cosine-similar token of the other text: precision
    averages the answer's best matches, recall the reference's, F1 is their harmonic mean. As in
    bert-score by default: no idf weighting, special tokens ([CLS]/[SEP], <s>/</s>) matched against
    but not counted, byte-level BPE text (RoBERTa, GPT-2) encoded with a leading space, an empty
    text scoring 0, no baseline rescaling. Relative paths are relative to the project of `root`;
    nothing is downloaded."""

    def __init__(self, name: str, root: Path, layer: int | None = None):
        from transformers import AutoConfig, AutoModel, AutoTokenizer, GPT2Tokenizer, RobertaTokenizer
        from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES


        path = Path(name).expanduser()
        path = path if path.is_absolute() else project_root(root) / path
        where = f"evaluate.bertscore_model={name!r}"
        if not path.is_dir():
            raise QllmError(f"{where}: {path} is not a directory (a local save_pretrained encoder is needed; nothing is downloaded)")
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
            encoder = config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not config.is_encoder_decoder
            if encoder:
                self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
                with CONSTRUCTION:
                    self.model = AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32).to(device()).eval()
        except (OSError, ValueError, KeyError) as exc:
            raise QllmError(f"{where}: cannot load an encoder and its tokenizer from {path} ({exc})") from None
        if not encoder:
            raise QllmError(f"{where}: {path} holds a {config.model_type!r} model, not a BERT-like text encoder (bert, roberta, deberta, ...)")
        self.layer = config.num_hidden_layers if layer is None else layer
        if not 0 <= self.layer <= config.num_hidden_layers:
            raise QllmError(f"evaluate.bertscore_layer={layer}: {path} has {config.num_hidden_layers} layers (0: the embeddings)")
        self.max_length = min(self.tokenizer.model_max_length, getattr(config, "max_position_embeddings", 512))
        self.prefix_space = isinstance(self.tokenizer, (GPT2Tokenizer, RobertaTokenizer))
        self.lock = threading.Lock()  # one model, several evaluate workers: a fast tokenizer is not thread-safe

    @torch.no_grad()
    def embed(self, texts: list[str], batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per text: its tokens' unit-length embeddings and weights (0 for special tokens)."""
        texts = [" " + t.strip() if self.prefix_space and t.strip() else t.strip() for t in texts]
        out = []
        for start in range(0, len(texts), batch_size):
            encoded = self.tokenizer(texts[start : start + batch_size], padding=True, truncation=True, max_length=self.max_length,
                                     return_special_tokens_mask=True, return_tensors="pt")  # fmt: skip
            special = encoded.pop("special_tokens_mask")
            keep = encoded["attention_mask"].bool()
            hidden = self.model(**encoded.to(self.model.device), output_hidden_states=True).hidden_states[self.layer].float().cpu()
            out += [(torch.nn.functional.normalize(h[k], dim=-1), 1.0 - s[k].float()) for h, k, s in zip(hidden, keep, special, strict=True)]
        return out

    def scores(self, predictions: list[str], references: list[str], batch_size: int = 32) -> torch.Tensor:
        """(precision, recall, F1) of each answer against its reference: an (n, 3) tensor."""
        with self.lock:
            answers, refs = self.embed(predictions, batch_size), self.embed(references, batch_size)
        rows = []
        for (answer, a_weight), (ref, r_weight) in zip(answers, refs, strict=True):
            if not a_weight.sum() or not r_weight.sum():
                rows.append((0.0, 0.0, 0.0))
                continue
            similarity = answer @ ref.T
            precision = float(similarity.max(dim=1).values @ a_weight / a_weight.sum())
            recall = float(similarity.max(dim=0).values @ r_weight / r_weight.sum())
            rows.append((precision, recall, 2 * precision * recall / (precision + recall) if precision + recall else 0.0))
        return torch.tensor(rows, dtype=torch.float64).reshape(-1, 3)

    def metrics(self, predictions: list[str], references: list[str], batch_size: int = 32) -> dict[str, float]:
        """Mean `bertscore_precision`, `bertscore_recall`, `bertscore_f1` over the answers."""
        means = self.scores(predictions, references, batch_size).mean(dim=0).nan_to_num().tolist()
        return {f"bertscore_{k}": round(v, 4) for k, v in zip(("precision", "recall", "f1"), means, strict=True)}
