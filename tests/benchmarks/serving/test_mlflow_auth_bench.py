"""benchmarks/serving/mlflow_auth.py: the order of its arms, what it prints and what it refuses (the arms
start the team's servers, a minute each: benchmarks/results/suite.md, issue 54's third part, has them)."""

from __future__ import annotations

import pytest

from benchmarks.serving import mlflow_auth
from qllm.services import serve


def test_the_arms_alternate_and_the_ratio_is_of_the_medians(monkeypatch, capsys):
    calls = []
    costs = {0: [(0.40, 0.36), (0.38, 0.35), (0.45, 0.37)], serve.MLFLOW_AUTH_CACHE_SECONDS: [(0.030, 0.020), (0.050, 0.030), (0.020, 0.025)]}

    def one_arm(work, cache_seconds, requests):
        calls.append((work.name, cache_seconds, requests))
        return costs[cache_seconds][sum(1 for _, seconds, _ in calls if seconds == cache_seconds) - 1]

    monkeypatch.setattr(mlflow_auth, "one_arm", one_arm)
    assert mlflow_auth.main(["--requests", "5", "--trials", "3"]) == 0
    on = serve.MLFLOW_AUTH_CACHE_SECONDS
    assert calls == [("0-off", 0, 5), ("0-on", on, 5), ("1-on", on, 5), ("1-off", 0, 5), ("2-off", 0, 5), ("2-on", on, 5)]
    out = capsys.readouterr().out
    assert "median, cache off: 400 ms a request, server CPU 360 ms" in out
    assert "median, cache on: 30 ms a request, server CPU 25 ms" in out
    assert f"on/off: {0.030 / 0.40:.3f}x the time, {0.025 / 0.36:.3f}x the server CPU" in out


@pytest.mark.parametrize("option", ["--requests", "--trials"])
def test_zero_requests_or_trials_are_refused(option, capsys):
    with pytest.raises(SystemExit):
        mlflow_auth.main([option, "0"])
    assert f"{option} must be at least 1" in capsys.readouterr().err
