"""params/finetune.yaml end to end on a small base: the profile users run on a 0.5-8B model
(frozen-base probe, chunked loss, the QUBO allocation, an unmerged adapter) runs every stage and
each says what it needed: the estimate before it started, its peak memory and its pace."""

from __future__ import annotations

import json

import pytest
import yaml

from pipelines.core.params.files import deep_merge
from tests.chat_families import CHATML, save_base_model
from tests.conftest import REPO, make_project

TEXTS = ["Tovik lives in Pelora. Marela works as a baker.", "What is 3 plus 4? 7", "Answer with one word or number."] * 20
BASE = "models/base"
SMALL = {  # the profile's settings, at the tiny profile's step counts and sizes
    "base_model": {"name": BASE},
    **{name: {"max_seq_len": 128, "train": {"max_steps": 2, "micro_batch_size": 2, "grad_accum_steps": 1, "warmup_steps": 1}}
       for name in ("sft", "probe_lora", "lora")},
    "dpo": {"train": {"max_steps": 2, "micro_batch_size": 2, "grad_accum_steps": 1, "warmup_steps": 1}},
    "evaluate": {"max_new_tokens": 8},
}  # fmt: skip


@pytest.fixture(scope="module")
def project(tmp_path_factory, mlflow_template_db, prefect_server):
    profile = yaml.safe_load((REPO / "params" / "finetune.yaml").read_text())
    root = make_project(tmp_path_factory.mktemp("profile") / "project", mlflow_template_db, deep_merge(profile, SMALL))
    save_base_model(CHATML, TEXTS, root / BASE)
    from flows.pipeline import pipeline

    summary = pipeline(project_dir=str(root))
    assert {s["status"] for s in summary["stages"]} == {"ran"}
    return root


def metrics(project, name: str) -> dict:
    return json.loads((project / f"data/metrics/{name}.json").read_text())


def test_the_probe_records_at_the_frozen_base_and_lora_uses_its_allocation(project):
    probe = metrics(project, "probe_lora")
    assert probe["used"] is True and probe["frozen_base"] is True and probe["steps"] == 2
    assert (project / "data/probe_lora/scores.json").exists()
    assert not (project / "data/models/lora/merged").exists()  # merge: false, the adapter alone
    assert (project / "data/models/lora/adapter_config.json").exists()


def test_every_stage_says_what_it_needed(project):
    for name in ("sft", "probe_lora", "lora", "dpo"):
        stage = metrics(project, name)
        assert 0.5 <= stage["estimate/memory_gb"] < 2, name  # said before the model loaded
        assert stage["estimate/seconds_per_micro_batch"] >= 0, name
        assert stage["peak_rss_mb"] > 100, name
    assert metrics(project, "ref_logprobs")["tokens_per_second"] > 0
    evaluation = metrics(project, "evaluate")
    for model in ("sft", "lora", "dpo"):
        assert 0 < evaluation[model]["seconds_per_question"] < evaluation[model]["eval_seconds"], model
