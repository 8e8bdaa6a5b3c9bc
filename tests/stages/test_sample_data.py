"""The sample_data stage: atomic replacement of data/sample/, the disabled mode, the stage body.

    .venv/bin/python -m pytest tests/test_generate.py -q
"""

from __future__ import annotations

import logging
import shutil

import pytest

from pipelines import sample_data
from pipelines.core import dag
from pipelines.core.data.sample_world import COUNT_KEYS, FILES
from pipelines.core.errors import QllmError
from pipelines.core.params.data import SampleDataParams
from pipelines.core.run import stage
from tests.conftest import REPO

SMALL = SampleDataParams(n_entities=8, bios_per_entity=2, max_operand=3)


def test_run_writes_every_sample_file(tmp_path):
    counts = sample_data.run(tmp_path / "sample", SMALL)
    assert sorted(p.name for p in (tmp_path / "sample").iterdir()) == sorted(name for key, name in FILES.items() if key != "chat_validation")  # no validation people by default
    assert counts["chat_heldout"] == 3 * (4 * counts["heldout_entities"] + counts["heldout_arithmetic_pairs"])
    assert (counts["entities"], counts["heldout_entities"], counts["arithmetic_pairs"]) == (8, 2, 9)


def test_run_disabled_writes_only_a_readme(tmp_path):
    counts = sample_data.run(tmp_path / "sample", SMALL.model_copy(update={"enabled": False}))
    assert [p.name for p in (tmp_path / "sample").iterdir()] == ["README.md"]
    assert "sample_data.enabled" in (tmp_path / "sample" / "README.md").read_text(encoding="utf-8")
    assert counts == dict.fromkeys(COUNT_KEYS, 0)


def test_run_replaces_the_old_output_and_leaves_no_temporaries(tmp_path):
    out = tmp_path / "sample"
    out.mkdir()
    (out / "stale.txt").write_text("from an older run", encoding="utf-8")
    (tmp_path / ".tmp-sample-killed").mkdir()  # what a killed run leaves behind
    sample_data.run(out, SMALL)
    assert not (out / "stale.txt").exists()
    assert (out / "pretrain.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sample"]


def test_run_turns_an_impossible_world_into_a_user_error(tmp_path):
    out = tmp_path / "sample"
    sample_data.run(out, SMALL)
    before = (out / "pretrain.txt").read_bytes()
    with pytest.raises(QllmError, match="sample_data: n_entities=100000"):
        sample_data.run(out, SMALL.model_copy(update={"n_entities": 100_000}))
    # The failed run leaves the previous output untouched and no temporary behind.
    assert (out / "pretrain.txt").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sample"]


def test_body_writes_under_the_root_and_returns_the_counts(tmp_path, caplog):
    log = logging.getLogger("qllm.sample_data.test")
    shutil.copy(REPO / "dvc.yaml", tmp_path)  # the stage's paths come from it
    ctx = stage.StageContext(name="sample_data", root=tmp_path, params=SMALL, tracker=None, log=log)
    with caplog.at_level(logging.INFO, logger=log.name):
        counts = sample_data.body(ctx)
    assert set(counts) == set(COUNT_KEYS)
    assert (tmp_path / dag.stages(tmp_path)["sample_data"].outs[0] / "chat_train.jsonl").exists()
    assert f"chat_train={counts['chat_train']}" in caplog.text
