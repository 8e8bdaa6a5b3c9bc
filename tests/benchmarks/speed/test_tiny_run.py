"""benchmarks/speed/tiny_run.py: what it reads from `qllm run` and what it refuses (the runs themselves
take a minute each: benchmarks/results/suite.md has them)."""

from __future__ import annotations

import pytest

from benchmarks.speed import tiny_run


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


def test_then_without_arguments_is_refused(tmp_path, capsys):
    (tmp_path / ".venv/bin").mkdir(parents=True)
    (tmp_path / ".venv/bin/qllm").touch()
    with pytest.raises(SystemExit):
        tiny_run.main([str(tmp_path), str(tmp_path), "--then", " "])
    assert "--then needs the arguments of the second `qllm run`" in capsys.readouterr().err


def test_the_table_has_each_runs_values_medians_and_the_ratios_of_the_medians():
    times = {"before": [[(20.0, 10.0), (8.0, 4.0)], [(22.0, 12.0), (9.0, 5.0)], [(21.0, 11.0), (7.0, 3.0)]],
             "after": [[(19.0, 9.0), (6.0, 2.0)], [(21.0, 11.0), (6.4, 2.4)], [(20.0, 10.0), (5.6, 2.0)]]}  # fmt: skip
    assert tiny_run.table(times, ["--set", "dpo.beta=0.2"]).splitlines() == [
        "| | `qllm run`, wall (median) | its pipeline (median) | `qllm run --set dpo.beta=0.2`, wall (median) | its pipeline (median) |",
        "|---|---|---|---|---|",
        "| before | 20.0, 22.0, 21.0 s (21.0) | 10.0, 12.0, 11.0 s (11.0) | 8.0, 9.0, 7.0 s (8.0) | 4.0, 5.0, 3.0 s (4.0) |",
        "| after | 19.0, 21.0, 20.0 s (20.0) | 9.0, 11.0, 10.0 s (10.0) | 6.0, 6.4, 5.6 s (6.0) | 2.0, 2.4, 2.0 s (2.0) |",
        "| after/before | **0.95x** | **0.91x** | **0.75x** | **0.50x** |",
    ]
    assert tiny_run.table({name: [trial[:1] for trial in trials] for name, trials in times.items()}, None).splitlines()[0] == (
        "| | `qllm run`, wall (median) | its pipeline (median) |")
