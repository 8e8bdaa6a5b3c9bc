"""The champion/challenger gate of `register`, against a real MLflow registry."""

from __future__ import annotations

import shutil

import pytest

from pipelines import register
from pipelines.core.errors import QllmError
from pipelines.core.params.release import RegisterParams


@pytest.fixture
def client(tmp_path, mlflow_template_db):
    from mlflow import MlflowClient

    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_template_db, db)
    uri = f"sqlite:///{db}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_registered_model("qllm")
    return client


def add_version(client, params: RegisterParams, exact_match: float, tmp_source="/nonexistent/model") -> register.Decision:
    """Register a (model-less) version the way `register.run` does: gate, tag, alias."""
    version = client.create_model_version("qllm", source=str(tmp_source)).version
    decision = register.gate(client, params, exact_match)
    client.set_model_version_tag("qllm", version, "metric.exact_match", repr(exact_match))
    client.set_registered_model_alias("qllm", decision.alias, version)
    return decision


def holder(client, alias: str) -> str:
    return str(client.get_model_version_by_alias("qllm", alias).version)


def test_first_model_is_champion(client):
    decision = add_version(client, RegisterParams(), 0.10)
    assert decision.promoted and decision.alias == "champion" and "first model" in decision.reason
    assert holder(client, "champion") == "1"


def test_champion_kept_when_the_challenger_is_worse_and_replaced_when_better(client):
    params = RegisterParams(margin=0.02)
    add_version(client, params, 0.70)  # v1: champion
    worse = add_version(client, params, 0.71)  # v2: better, but not by the margin
    assert not worse.promoted and worse.alias == "challenger" and worse.champion_version == "1"
    assert worse.reason == "exact_match 0.7100 not >= 0.7200 (champion version 1: 0.7000, margin 0.02)"
    assert holder(client, "champion") == "1" and holder(client, "challenger") == "2"
    better = add_version(client, params, 0.75)  # v3: beats 0.70 + 0.02
    assert better.promoted and better.alias == "champion" and better.champion_value == 0.70  # the logged float64 read back: exact
    assert holder(client, "champion") == "3" and holder(client, "challenger") == "2"


def test_a_tie_passes_with_no_margin(client):
    add_version(client, RegisterParams(), 0.5)
    assert add_version(client, RegisterParams(), 0.5).promoted


def test_lower_is_better_metrics(client):
    params = RegisterParams(metric="exact_match", mode="min", margin=0.1)
    add_version(client, params, 1.0)
    assert not add_version(client, params, 0.95).promoted  # needs <= 0.9
    assert add_version(client, params, 0.8).promoted


def test_the_gate_metric_must_exist():
    evaluation = {"dpo": {"exact_match": 0.5, "questions": 10, "exact_match_by_group": {}}}
    assert register.model_metrics(evaluation, RegisterParams(), "evaluate.json") == {"exact_match": 0.5, "questions": 10.0}
    with pytest.raises(QllmError, match=r"register.metric: 'bleu' is not a finite number in evaluate.json\['dpo'\]; available: exact_match, questions"):
        register.model_metrics(evaluation, RegisterParams(metric="bleu"), "evaluate.json")
    with pytest.raises(QllmError, match=r"no entry for model 'sft' \(add it to evaluate.models"):
        register.model_metrics(evaluation, RegisterParams(model="sft"), "evaluate.json")


def test_aliases_must_differ():
    with pytest.raises(ValueError, match="alias and challenger_alias must differ"):
        RegisterParams(alias="x", challenger_alias="x")


def gated(client, params: RegisterParams, metrics: dict[str, float]) -> register.Decision:
    """Register a (model-less) version with `metrics` as `register.run` does: its tags, then `promote`."""
    version = client.create_model_version("qllm", source="/nonexistent/model").version
    for key, value in metrics.items():
        client.set_model_version_tag("qllm", version, f"metric.{key}", repr(value))
    return register.promote(client, params, version, metrics[params.metric], metrics)


def test_the_gate_can_require_several_metrics_at_once(client):
    """`register.require`: facts and retention at once. A version that beats the champion on the
    primary metric but misses a bound is the challenger; even the first version must meet them."""
    from pipelines.core.params.release import GateBound

    params = RegisterParams(metric="strict_match", require=[GateBound(metric="retention_loss", at_most=0.15), GateBound(metric="form_kept", at_least=0.9)])
    first = gated(client, params, {"strict_match": 0.7, "retention_loss": 0.21, "form_kept": 0.95})
    assert not first.promoted and first.alias == "challenger"
    assert first.reason == ("register.require: retention_loss 0.2100 does not meet retention_loss <= 0.15 (against the champion: first model: "
                            "no version of 'qllm' holds @champion)")  # fmt: skip
    kept = gated(client, params, {"strict_match": 0.6, "retention_loss": 0.12, "form_kept": 0.92})
    assert kept.promoted and holder(client, "champion") == "2"
    # better facts, but both bounds missed: both named
    worse = gated(client, params, {"strict_match": 0.8, "retention_loss": 0.2, "form_kept": 0.5})
    assert not worse.promoted and holder(client, "champion") == "2" and holder(client, "challenger") == "3"
    assert worse.reason.startswith("register.require: retention_loss 0.2000 does not meet retention_loss <= 0.15; form_kept 0.5000 does not meet "
                                   "form_kept >= 0.9 (against the champion: strict_match 0.8000 >= 0.6000")  # fmt: skip
    # the bound met exactly passes (<=, >=), and the champion comparison still decides
    assert gated(client, params, {"strict_match": 0.8, "retention_loss": 0.15, "form_kept": 0.9}).promoted and holder(client, "champion") == "4"
    assert not gated(client, params, {"strict_match": 0.5, "retention_loss": 0.0, "form_kept": 1.0}).promoted


def test_a_required_metric_must_exist_and_a_bound_must_bound():
    from pydantic import ValidationError

    from pipelines.core.params.release import GateBound

    evaluation = {"merge": {"exact_match": 0.5, "retention_loss": 0.1, "form_kept": None}}
    params = RegisterParams(model="merge", require=[GateBound(metric="retention_loss", at_most=0.15), GateBound(metric="retention_los", at_most=0.15)])
    with pytest.raises(QllmError, match=r"register.require.1.metric: 'retention_los' is not a finite number in evaluate.json\['merge'\]; "
                                        r"available: exact_match, retention_loss"):  # fmt: skip
        register.model_metrics(evaluation, params, "evaluate.json")
    with pytest.raises(QllmError, match=r"register.require.0.metric: 'form_kept' is not a finite number"):  # no base answer had a form: null
        register.model_metrics(evaluation, RegisterParams(model="merge", require=[GateBound(metric="form_kept", at_least=0.9)]), "evaluate.json")
    with pytest.raises(ValidationError, match="retention_loss: give at_least, at_most or both"):
        GateBound(metric="retention_loss")
    with pytest.raises(ValidationError, match="x: at_least 0.5 is above at_most 0.2: no value meets both"):
        GateBound(metric="x", at_least=0.5, at_most=0.2)
    assert GateBound(metric="x", at_least=0.1, at_most=0.2).describe() == "0.1 <= x <= 0.2"
