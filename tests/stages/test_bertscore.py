"""BERTScore in `evaluate` (`evaluate.bertscore_model`): a tiny local BERT encoder built here, the
scores against a hand computation, the stage's metrics and table, and the errors for bad encoders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from pydantic import ValidationError

from pipelines import evaluate
from pipelines.core.data import packed
from pipelines.core.errors import QllmError
from pipelines.core.evaluation import bertscore
from pipelines.core.params.release import EvaluateParams
from tests import numerics

REPO = Path(__file__).resolve().parents[2]
WORDS = ["tovik", "marela", "orvin", "lives", "live", "in", "pelora", "dunmar", "kestal", "the", "a", "is", "what", "where", "does",
         "plus", "1", "2", "3", "4", "5", "7", "8"]  # fmt: skip


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> Path:
    """A 3-layer BERT with random weights and a WordPiece vocabulary of the test sentences' words
    (plus letters for the rest), saved as a local `save_pretrained` directory."""
    from transformers import BertConfig, BertModel, BertTokenizer

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "?", *WORDS, *letters, *(f"##{c}" for c in letters)]
    tokenizer = BertTokenizer(vocab={t: i for i, t in enumerate(tokens)}, model_max_length=64)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokens), hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=64)  # fmt: skip
    path = tmp_path_factory.mktemp("bertscore") / "tiny-bert"
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def score_tolerance(encoder: Path, seq_len: int = 16) -> float:
    """How far two computations of a BERTScore of texts of up to `seq_len` tokens may be apart (each
    text alone or padded in a batch): a hidden state within the encoder's chain's rounding relative
    to its size (`model_roundings` on its config, the vocabulary's sum counted too: an overestimate),
    which moves a cosine of unit vectors by at most twice that; the cosine's own rounding (a dot
    product and two norms over the hidden size, a square root, the divisions), the weighted mean over
    up to `seq_len` tokens and F's 4; every score is at most 1 (tests/numerics.py)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(encoder)
    chain = numerics.tolerance(numerics.model_roundings(config, seq_len))
    return 2 * chain + numerics.tolerance(3 * config.hidden_size + 4 + seq_len + 4)


def by_hand(encoder: Path, candidate: str, reference: str, layer: int) -> tuple[float, float, float]:
    """BERTScore of one pair written out: each text encoded alone, token by token loops."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(encoder), AutoModel.from_pretrained(encoder).eval()

    def tokens(text: str) -> tuple[list[torch.Tensor], list[bool]]:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[layer][0]
        return list(hidden), [i not in (tokenizer.cls_token_id, tokenizer.sep_token_id) for i in ids[0].tolist()]

    (c, c_counted), (r, r_counted) = tokens(candidate), tokens(reference)
    cos = torch.nn.functional.cosine_similarity
    best_c = [max(float(cos(x, y, dim=0)) for y in r) for x, counted in zip(c, c_counted, strict=True) if counted]
    best_r = [max(float(cos(x, y, dim=0)) for x in c) for y, counted in zip(r, r_counted, strict=True) if counted]
    precision, recall = sum(best_c) / len(best_c), sum(best_r) / len(best_r)
    return precision, recall, 2 * precision * recall / (precision + recall)


def test_identical_answers_score_one_and_different_ones_less(encoder):
    scorer = bertscore.BertScore(str(encoder), Path("/nonexistent"))  # an absolute path: the root is not consulted
    assert scorer.layer == 3  # the last by default
    same = scorer.scores(["Tovik lives in Pelora", "7"], ["Tovik lives in Pelora", "7"])
    assert same.flatten().tolist() == pytest.approx([1.0] * 6, abs=score_tolerance(encoder))
    different = scorer.scores(["Marela lives in Dunmar", "8", "", "Pelora"], ["Tovik lives in Pelora", "7", "Kestal", ""])
    assert (different[:2] < 1 - score_tolerance(encoder)).all() and (different[:2] > -1).all()  # below 1 beyond rounding
    assert different[2:].tolist() == [[0.0, 0.0, 0.0]] * 2  # an empty answer or reference scores 0
    metrics = scorer.metrics(["Tovik lives in Pelora", "8"], ["Tovik lives in Pelora", "7"])
    assert set(metrics) == {"bertscore_precision", "bertscore_recall", "bertscore_f1"}
    assert metrics["bertscore_f1"] == pytest.approx((1 + float(different[1, 2])) / 2, abs=score_tolerance(encoder) + 0.5e-4)  # and its 4 decimals
    assert scorer.metrics([], [])["bertscore_f1"] == 0.0


@pytest.mark.parametrize("layer", [None, 1, 0])
def test_scores_match_a_hand_computation(encoder, layer):
    scorer = bertscore.BertScore(str(encoder), Path("/nonexistent"), layer)
    pairs = [("Marela lives in Dunmar", "Tovik lives in Pelora"), ("where does orvin live?", "Orvin lives in Kestal.")]
    got = scorer.scores([c for c, _ in pairs], [r for _, r in pairs], batch_size=2)  # padded together
    for row, (candidate, reference) in zip(got.tolist(), pairs, strict=True):
        assert row == pytest.approx(by_hand(encoder, candidate, reference, 3 if layer is None else layer), abs=score_tolerance(encoder))


def test_bad_encoders_name_the_key_and_the_path(encoder, tiny_base, tmp_path):
    with pytest.raises(QllmError, match=r"evaluate.bertscore_model='encoders/missing': .*/encoders/missing is not a directory"):
        bertscore.BertScore("encoders/missing", tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(QllmError, match=r"evaluate.bertscore_model='empty': cannot load an encoder .*/empty"):
        bertscore.BertScore("empty", tmp_path)
    with pytest.raises(QllmError, match=r"evaluate.bertscore_model=.*/model holds a 'llama' model, not a BERT-like text encoder"):
        bertscore.BertScore(str(tiny_base / "model"), tmp_path)
    with pytest.raises(QllmError, match=r"evaluate.bertscore_layer=4: .*tiny-bert has 3 layers"):
        bertscore.BertScore(str(encoder), tmp_path, layer=4)
    with pytest.raises(ValidationError, match="bertscore_layer: applies only with bertscore_model set"):
        EvaluateParams(bertscore_layer=2)


def test_evaluate_stage_reports_bertscore(encoder, tiny_base, tmp_path, mlflow_template_db):
    """`python -m pipelines.evaluate` with `bertscore_model` (relative to the project): the metrics
    file and the comparison table get `bertscore_f1`, the mean of the answers' scores."""
    from pipelines.core.models.models import load_tokenizer

    project = tmp_path / "project"
    shutil.copytree(tiny_base / "model", project / "data/models/pretrain")
    shutil.copytree(tiny_base / "chat", project / "data/prepared/chat")
    shutil.copytree(encoder, project / "encoders/tiny-bert")
    shutil.copy2(REPO / "dvc.yaml", project / "dvc.yaml")
    shutil.copy2(mlflow_template_db, project / "mlflow.db")
    stream = np.array(load_tokenizer(tiny_base / "model")("Tovik lives in Pelora. Marela lives in Dunmar. " * 8)["input_ids"], dtype=np.int32)
    (project / "data/tokenized").mkdir()
    packed.write(project / "data/tokenized", {"validation": packed.pack(stream, 16)[0]}, {})
    (project / "params.yaml").write_text(
        "ingest:\n  sources:\n    - {path: data/sources/docs.txt, kind: text}\n"
        "evaluate:\n  models: [pretrain]\n  max_new_tokens: 4\n  bertscore_model: encoders/tiny-bert\n  bertscore_layer: 2\n"
    )
    assert evaluate.main(["--root", str(project)]) == 0

    metrics = json.loads((project / "data/metrics/evaluate.json").read_text())["pretrain"]
    predictions = [json.loads(line) for line in (project / "data/evaluate/pretrain/predictions.jsonl").read_text().splitlines()]
    f1 = [by_hand(encoder, p["prediction"], p["reference"], 2)[2] if p["prediction"] else 0.0 for p in predictions]
    assert metrics["bertscore_f1"] == pytest.approx(sum(f1) / len(f1), abs=score_tolerance(encoder) + 0.5e-4) and any(f1), predictions  # 4 decimals
    assert 0 <= metrics["bertscore_precision"] <= 1 and 0 <= metrics["bertscore_recall"] <= 1
    table = pd.read_csv(project / "data/evaluate/comparison.csv")
    assert list(table.columns[:7]) == ["model", "exact_match", "flexible_match", "strict_match", "bleu", "rougeL", "bertscore_f1"]
    assert table.loc[0, "bertscore_f1"] == metrics["bertscore_f1"]
