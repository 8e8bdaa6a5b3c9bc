"""Each preference method through the tiny pipeline with `dvc exp run -S`, and what each change reruns.

One project for the module: `dvc repro` runs the whole tiny pipeline once, then every test is an
experiment on top of the previous one (DVC leaves each in the workspace), as a user would switch
methods: a loss change reruns only `dpo` and what follows; a method change reruns `ref_logprobs`
too (a tokenization for the reference-free ones, a reference pass for KTO); switching back is
restored from DVC's run-cache.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipelines.core import dag
from tests.conftest import make_project, run

STAGES = list(dag.stages(Path(__file__).resolve().parents[2]))
ALWAYS = ["base_model", "probe_device"]


@pytest.fixture(scope="module")
def project(tmp_path_factory, mlflow_template_db) -> Path:
    root = make_project(tmp_path_factory.mktemp("methods") / "project", mlflow_template_db)
    run([sys.executable, "-m", "dvc", "repro", "-q"], root)
    run(["git", "add", "-A"], root)
    run(["git", "commit", "-qm", "tiny pipeline locked"], root)
    return root


def experiment(root: Path, *settings: str) -> tuple[list[str], str]:
    command = [sys.executable, "-m", "dvc", "exp", "run"]
    for setting in settings:
        command += ["-S", setting]
    result = run(command, root, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return [n for n in STAGES if f"Running stage '{n}'" in output], output


def metrics(root: Path, stage: str) -> dict:
    return json.loads((root / f"data/metrics/{stage}.json").read_text())


def test_a_dpo_loss_change_reruns_only_dpo_and_what_follows(project):
    ran, output = experiment(project, "dpo.loss_type=bco_pair")
    assert ran == [*ALWAYS, "dpo", "evaluate", "register"], output
    assert "heldout/rewards/margins" in metrics(project, "dpo")


def test_simpo_encodes_without_a_reference_pass(project):
    ran, output = experiment(project, "dpo.method=simpo", "dpo.beta=2.0")
    assert ran == [*ALWAYS, "ref_logprobs", "dpo", "evaluate", "register"], output
    ref = metrics(project, "ref_logprobs")
    assert ref["method"] == "simpo" and "tokens_per_second" not in ref  # no model ran
    assert json.loads((project / "data/ref_logprobs/meta.json").read_text())["reference"] is None
    evaluated = metrics(project, "evaluate")["dpo"]
    assert "preference_accuracy" in evaluated and "rewards/accuracies" not in evaluated  # no implicit reward without a reference


def test_kto_runs_its_reference_pass_on_the_split_pairs(project):
    ran, output = experiment(project, "dpo.method=kto", "dpo.beta=0.1")
    assert ran == [*ALWAYS, "ref_logprobs", "dpo", "evaluate", "register"], output
    ref = metrics(project, "ref_logprobs")
    assert ref["train"]["desirable"] == ref["train"]["undesirable"] == ref["train"]["pairs"] > 0
    dpo = metrics(project, "dpo")
    assert dpo["train_examples"] == 2 * ref["train"]["pairs"] and "heldout/kl" in dpo
    assert "rewards/accuracies" in metrics(project, "evaluate")["dpo"]  # KTO has a reference: its implicit rewards


def test_orpo_from_the_base(project):
    ran, output = experiment(project, "dpo.method=orpo", "dpo.start=base", "dpo.adapter=none")
    assert ran == [*ALWAYS, "ref_logprobs", "dpo", "evaluate", "register"], output
    assert json.loads((project / "data/ref_logprobs/meta.json").read_text())["start"] == "data/models/pretrain"
    dpo = metrics(project, "dpo")
    assert dpo["start"] == "data/models/pretrain" and "heldout/nll_loss" in dpo and "heldout/log_odds_ratio" in dpo


def test_switching_back_restores_the_first_reference_pass_from_the_run_cache(project):
    ran, output = experiment(project, "dpo.method=dpo", "dpo.start=sft", "dpo.adapter=lora", "dpo.beta=1.0", "dpo.loss_type=apo_zero")
    assert ran == [*ALWAYS, "dpo", "evaluate", "register"], output  # ref_logprobs: as in the first run, from the run-cache
    assert metrics(project, "ref_logprobs")["method"] == "dpo"
