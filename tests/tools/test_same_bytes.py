"""tools.same_bytes: what it compares of two runs (the whole runs are its own command)."""

from __future__ import annotations

import yaml

from tools import same_bytes


def run_dir(root, model_bytes: bytes, metrics: str):
    (root / "data/models/pretrain").mkdir(parents=True)
    (root / "data/models/pretrain/model.safetensors").write_bytes(model_bytes)
    (root / "data/models/pretrain/config.json").write_text("{}")
    (root / "data/metrics").mkdir()
    (root / "data/metrics/pretrain.json").write_text(metrics)
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"pretrain": {"cmd": "x", "outs": ["data/models/pretrain"],
                                                                           "metrics": [{"data/metrics/pretrain.json": {"cache": False}}]}}}))
    md5 = "a" if model_bytes == b"one" else "b"
    (root / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": {"pretrain": {"cmd": "x", "outs": [
        {"path": "data/models/pretrain", "md5": f"{md5}.dir"}, {"path": "data/metrics/pretrain.json", "md5": metrics}]}}}))
    return root


def test_outputs_leave_out_the_metrics_files_and_differing_names_the_files(tmp_path):
    before = run_dir(tmp_path / "before", b"one", '{"seconds": 1}')
    after = run_dir(tmp_path / "after", b"two", '{"seconds": 2}')
    assert same_bytes.outputs(before) == {"data/models/pretrain": "a.dir"}  # the metrics file holds timings: not compared
    assert same_bytes.outputs(after) == {"data/models/pretrain": "b.dir"}
    assert same_bytes.differing(before / "data/models/pretrain", after / "data/models/pretrain") == ["model.safetensors"]
    (after / "data/models/pretrain/extra.txt").write_text("only here")
    assert same_bytes.differing(before / "data/models/pretrain", after / "data/models/pretrain") == ["extra.txt", "model.safetensors"]
