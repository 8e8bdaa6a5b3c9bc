"""benchmarks/tiny_run.py: what it reads from `qllm run` and what it refuses (the runs themselves
take a minute each: RESULTS.md has them)."""

from __future__ import annotations

import pytest

from benchmarks import tiny_run


def test_the_pipelines_seconds_are_the_last_mlflow_run_line():
    output = "sample_data      ran     0.86\nregistered model version 1\nmlflow run 251ec801d9124b478a5d87dc024f4640  (23.3s)\n"
    assert tiny_run.pipeline_seconds(output) == 23.3
    assert tiny_run.pipeline_seconds("mlflow run ab12  (7s)\nmlflow run cd34  (15.7s)\n") == 15.7


def test_output_without_the_line_is_an_error_that_shows_it():
    with pytest.raises(SystemExit, match=r"printed no `mlflow run <id> \(<seconds>s\)` line:\nstage failed"):
        tiny_run.pipeline_seconds("stage failed")


def test_a_checkout_without_its_venv_and_zero_trials_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit, match=f"{tmp_path} has no .venv with qllm"):
        tiny_run.main([str(tmp_path), str(tmp_path)])
    (tmp_path / ".venv/bin").mkdir(parents=True)
    (tmp_path / ".venv/bin/qllm").touch()
    with pytest.raises(SystemExit):
        tiny_run.main([str(tmp_path), str(tmp_path), "--trials", "0"])
    assert "--trials must be at least 1" in capsys.readouterr().err
