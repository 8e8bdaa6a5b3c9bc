"""Each preference method (and GRPO) through the tiny pipeline, and what a change of method or loss reruns.

One project for the module: the whole tiny pipeline runs once (in process, as `qllm run` does),
then each method runs as a pipeline with overrides (`qllm run --set dpo.method=...`, in a run
workspace that restores everything upstream from DVC's run-cache), and `dvc exp run -S` switches
the project itself to another method (`-m slow`): a method change reruns `ref_logprobs` (a
tokenization for the reference-free ones, a reference pass for KTO) or restores it from the
run-cache, a loss change never touches it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipelines.core import dag
from tests.conftest import copy_first_pipeline, run
from tests.waiting import DEADLINE

STAGES = list(dag.stages(Path(__file__).resolve().parents[2]))
ALWAYS = ["base_model", "probe_device"]


@pytest.fixture(scope="module")
def project(tmp_path_factory, first_tiny_pipeline, prefect_server) -> Path:
    """A tiny project after the first whole default run (a copy of the session's: `first_tiny_pipeline`)."""
    root, _ = copy_first_pipeline(first_tiny_pipeline, tmp_path_factory.mktemp("methods") / "project")
    run(["git", "add", "-A"], root)
    run(["git", "commit", "-qm", "tiny pipeline locked"], root)
    return root


def method_run(root: Path, *overrides: str) -> tuple[list[str], Path]:
    """The pipeline with `overrides`: the stages that ran, and the run workspace."""
    from flows.pipeline import pipeline

    summary = pipeline(overrides=list(overrides), project_dir=str(root))
    return [s["name"] for s in summary["stages"] if s["status"] == "ran"], Path(summary["workspace"])


def metrics(root: Path, stage: str) -> dict:
    return json.loads((root / f"data/metrics/{stage}.json").read_text())


@pytest.fixture(scope="module")
def simpo_run(project) -> tuple[list[str], Path]:
    """The pipeline with SimPO at beta 2.0 in a run workspace (what ran, the workspace): from then on
    ref_logprobs' SimPO encoding is in the project's run-cache. A fixture, so that the slow test
    below has it whether the default tests ran first (`make test-all`) or not (`make test-slow`)."""
    return method_run(project, "dpo.method=simpo", "dpo.loss_type=null", "dpo.beta=2.0")


def test_simpo_encodes_without_a_reference_pass(simpo_run):
    ran, workspace = simpo_run
    assert ran == [*ALWAYS, "ref_logprobs", "dpo", "merge", "export", "evaluate", "register"]
    ref = metrics(workspace, "ref_logprobs")
    assert ref["method"] == "simpo" and "tokens_per_second" not in ref  # no model ran
    assert json.loads((workspace / "data/ref_logprobs/meta.json").read_text())["reference"] is None
    evaluated = metrics(workspace, "evaluate")["dpo"]
    assert "preference_accuracy" in evaluated and "rewards/accuracies" not in evaluated  # no implicit reward without a reference


def test_kto_runs_its_reference_pass_on_the_split_pairs(project):
    ran, workspace = method_run(project, "dpo.method=kto", "dpo.loss_type=null", "dpo.beta=0.1")
    assert ran == [*ALWAYS, "ref_logprobs", "dpo", "merge", "export", "evaluate", "register"]
    ref = metrics(workspace, "ref_logprobs")
    assert ref["train"]["desirable"] == ref["train"]["undesirable"] == ref["train"]["pairs"] > 0
    dpo = metrics(workspace, "dpo")
    assert dpo["train_examples"] == 2 * ref["train"]["pairs"] and "heldout/kl" in dpo
    assert "rewards/accuracies" in metrics(workspace, "evaluate")["dpo"]  # KTO has a reference: its implicit rewards


def test_orpo_from_the_base(project):
    ran, workspace = method_run(project, "dpo.method=orpo", "dpo.loss_type=null", "dpo.start=base", "dpo.adapter={enabled: false}")
    assert ran == [*ALWAYS, "ref_logprobs", "dpo", "merge", "export", "evaluate", "register"]
    assert json.loads((workspace / "data/ref_logprobs/meta.json").read_text())["start"] == "data/models/pretrain"
    dpo = metrics(workspace, "dpo")
    assert dpo["start"] == "data/models/pretrain" and "heldout/nll_loss" in dpo and "heldout/log_odds_ratio" in dpo


def test_a_loss_change_restores_the_reference_pass_from_the_run_cache(project):
    ran, workspace = method_run(project, "dpo.loss_type=bco_pair")
    assert ran == [*ALWAYS, "dpo", "merge", "export", "evaluate", "register"]
    assert "heldout/rewards/margins" in metrics(workspace, "dpo")


@pytest.mark.timeout(2 * DEADLINE)  # a bound for a broken run: in the slow set its setup may make the session's first tiny pipeline
@pytest.mark.slow  # four stage processes under DVC (about 30 s of CPU, imitated); in the default suite: the method and loss decisions above, DVC's own run-cache restores of the runner's entries (test_remote), `dvc exp run` (test_pipeline_e2e)
def test_dvc_exp_run_switches_the_method_rerunning_only_what_it_must(project, simpo_run):
    """The project itself to SimPO at another beta: ref_logprobs' SimPO encoding comes back from the
    run-cache (the workspace run `simpo_run` made it), dpo and what follows run, nothing before them."""
    result = run([sys.executable, "-m", "dvc", "exp", "run", "-S", "dpo.method=simpo", "-S", "dpo.loss_type=null", "-S", "dpo.beta=2.5"], project, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert [n for n in STAGES if f"Running stage '{n}'" in output] == [*ALWAYS, "dpo", "merge", "export", "evaluate", "register"], output
    assert "Stage 'ref_logprobs' is cached - skipping run, checking out outputs" in output
    assert all(f"Stage '{n}' didn't change, skipping" in output for n in ("pretrain", "sft", "lora"))
    assert metrics(project, "ref_logprobs")["method"] == "simpo" and metrics(project, "dpo")["start"] == "data/models/sft"


REWARDS = """
def brevity(prompts, completions, answer, **kwargs):
    return [1.0 if len(c[0]["content"]) <= len(a) + 2 else 0.0 for c, a in zip(completions, answer)]
"""


def test_a_grpo_reward_or_beta_change_reruns_grpo_onward(project, tmp_path, monkeypatch):
    """GRPO reads the SFT model and the chats: a reward, weight or beta change reruns grpo, evaluate
    and register and nothing upstream; a user's reward module is loaded from the path."""
    assert metrics(project, "grpo")["steps"] == 4 and "grpo" in metrics(project, "evaluate")
    (tmp_path / "team_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    ran, workspace = method_run(project, "grpo.beta=0.04", "grpo.rewards=[{function: exact_match}, {function: 'team_rewards:brevity', weight: 0.5}]")
    assert ran == [*ALWAYS, "grpo", "merge", "export", "evaluate", "register"]
    grpo = metrics(workspace, "grpo")
    assert {"rewards/exact_match/mean", "rewards/brevity/mean"} <= set(grpo) and grpo["steps"] == 4
    assert "grpo" in metrics(workspace, "evaluate")
    sys.modules.pop("team_rewards", None)
