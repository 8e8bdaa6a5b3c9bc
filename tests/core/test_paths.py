"""`pipelines.core.paths`: how paths are named in messages and records."""

from __future__ import annotations

from pathlib import Path

from pipelines.core import paths


def test_a_path_in_the_project_is_named_relative_to_it_with_slashes(tmp_path):
    assert paths.named(tmp_path / "data" / "models" / "sft", tmp_path) == "data/models/sft"
    assert paths.named(tmp_path, tmp_path) == "."


def test_a_path_outside_the_project_is_named_as_given(tmp_path):
    outside = tmp_path.parent / "elsewhere" / "model"
    assert paths.named(outside, tmp_path / "project") == str(outside)
    assert paths.named(Path("relative/model"), tmp_path) == "relative/model"
