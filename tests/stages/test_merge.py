"""The merge stage on tiny models: every candidate merged and scored on the validation split, the
chosen one written as a model whose weights are its formula on the inputs (an unmerged LoRA
adapter among them), its table and picture, the same bytes twice; the choice rule by hand; bad
params refused by name; the stage through its tracker."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pipelines import merge
from pipelines.core.data import replay
from pipelines.core.evaluation import retention
from pipelines.core.models import adapters, merging
from pipelines.core.models.models import load_for_inference, load_model_and_tokenizer, save_pretrained
from pipelines.core.params import files as params_file
from pipelines.core.params.base import ParamsError
from pipelines.core.params.finetuning import LoraAdapterParams
from pipelines.core.params.release import MergeCandidate, MergeParams
from tests import merging_reference, numerics
from tests.conftest import BASE_ANSWER, REPO

PARENTS = {**merge.PARENTS}
CANDIDATES = [
    MergeCandidate(method="linear", models=["pretrain", "sft"], weights=[0.5, 0.5]),
    MergeCandidate(method="task_arithmetic", models=["sft", "lora"], weights=[1.0, 0.5]),
    MergeCandidate(method="ties", models=["sft", "dpo", "grpo"], density=0.5),
    MergeCandidate(method="dare", models=["sft", "dpo"], drop_rate=0.5),
]


@pytest.fixture(scope="module")
def project(tiny_base, tmp_path_factory):
    """A project's data as the stages before merge leave it: pretrain (the tiny base), sft, dpo and
    grpo (seeded moves of it), lora as an adapter alone (`lora.adapter.merge: false`) on
    data/models/pretrain, the chats, and the base's answers to the general prompts with pretrain as
    the base (its own NLL of them on the validation third in meta.json)."""
    root = tmp_path_factory.mktemp("merge_project")
    models = root / "data/models"
    shutil.copytree(tiny_base / "model", models / "pretrain")
    model, tokenizer = load_model_and_tokenizer(models / "pretrain")
    generator = torch.Generator().manual_seed(0)

    def save_moved(name: str, start: dict, scale: float) -> dict:
        state = {k: v + scale * torch.randn(v.shape, generator=generator) for k, v in start.items()}
        merging.load_into(model, state)
        save_pretrained(model, tokenizer, models / name)
        return state

    pretrain = merging.parameters(model, "pretrain")
    sft = save_moved("sft", pretrain, 0.05)
    save_moved("dpo", sft, 0.02)
    save_moved("grpo", sft, 0.02)
    merging.load_into(model, pretrain)
    peft = adapters.wrap(LoraAdapterParams(enabled=True, r=4, lora_alpha=8.0, target_modules=["q_proj", "v_proj"], trainable_tokens=[]))(model, tokenizer)
    with torch.no_grad():
        for name, parameter in peft.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    adapters.save("data/models/pretrain", merge=False)(peft, tokenizer, models / "lora")
    shutil.copytree(tiny_base / "chat", root / "data/prepared/chat")

    base, tokenizer = load_model_and_tokenizer(models / "pretrain")
    rows = [{**p, "answer": BASE_ANSWER[p["family"]], "form": None} for p in retention.load_prompts()]
    chosen = [row for row in rows if row["split"] == "validation"]
    nll = retention.answer_nll(base.eval(), tokenizer, retention.messages_of(chosen), [row["answer"] for row in chosen], 66)
    answers = root / "data/base_answers"
    answers.mkdir(parents=True)
    (answers / replay.ANSWERS).write_text("".join(json.dumps(row) + "\n" for row in rows))
    (answers / replay.META).write_text(json.dumps({"base": "pretrain", "max_new_tokens": 8, "nll": {"validation": nll}}))
    (root / "data/no_base_answers").mkdir()
    (root / "data/no_base_answers/README.md").write_text("no base model\n")
    return root


def run(root, out: str, params: MergeParams, answers: str = "data/base_answers") -> dict:
    dirs = {name: root / "data/models" / name for name in ("pretrain", "sft", "lora", "dpo", "grpo")}
    return merge.run(root, dirs, None, root / "data/prepared/chat", root / answers, root / out, params, PARENTS)


@pytest.fixture(scope="module")
def merged(project):
    params = MergeParams(candidates=CANDIDATES, max_retention_loss=1.0, max_new_tokens=4, batch_size=66, seed=5)
    return params, run(project, "out/merge", params)


def test_the_chosen_merge_is_its_formula_on_the_inputs(project, merged):
    from transformers import AutoModelForCausalLM

    params, metrics = merged
    out = project / "out/merge"
    table = json.loads((out / merge.CANDIDATES_FILE).read_text())
    assert table == {k: metrics[k] for k in table} and 1 <= table["chosen"] <= 4
    chosen = params.candidates[table["chosen"] - 1]
    assert table["chosen_label"] == chosen.label()
    # the inputs as the stage reads them: the adapter merged into pretrain, each model's parameters
    states = {name: merging.parameters(load_for_inference(project / "data/models" / name, project)[0], name)
              for name in ("pretrain", "sft", "lora", "dpo", "grpo")}  # fmt: skip
    saved = AutoModelForCausalLM.from_pretrained(out)
    assert saved.lm_head.weight is saved.model.embed_tokens.weight  # tied, as the inputs
    written = merging.parameters(saved, "merge")
    for candidate in params.candidates:  # whichever was chosen: each candidate's formula checked where it is the chosen one
        if candidate != chosen:
            continue
        in_float64 = {m: {k: v.double() for k, v in s.items()} for m, s in states.items()}
        for name, tensor in written.items():
            value, magnitude, n = merging_reference.expected(candidate, in_float64, PARENTS, name, seed=params.seed)
            bound = numerics.unit_roundoff(torch.float32) * value.abs() + numerics.tolerance(n, torch.float64, magnitude, worst=True)
            numerics.assert_within(tensor, value, bound, f"{candidate.label()} {name}")
    # and every candidate's merge is what the module computes: the chosen one written as merged, bit for bit
    assert all(torch.equal(written[k], v) for k, v in merging.merge(chosen, states, PARENTS, "pretrain", params.seed).items())


def test_every_candidate_and_model_is_scored_on_the_validation_split(project, merged):
    params, metrics = merged
    assert metrics["validation_questions"] == 3 and metrics["retention_measured"] is True  # tiny_base's 3 validation chats
    assert [row["model"] for row in metrics["models"]] == ["pretrain", "sft", "lora", "dpo", "grpo"]
    assert [row["candidate"] for row in metrics["candidates"]] == [1, 2, 3, 4]
    assert [row["label"] for row in metrics["candidates"]] == [c.label() for c in CANDIDATES]
    ties = {"method": "ties", "models": ["sft", "dpo", "grpo"], "weights": [1.0, 1.0, 1.0], "density": 0.5, "scale": 1.0}
    assert {k: metrics["candidates"][2][k] for k in ties} == ties
    assert "drop_rate" not in metrics["candidates"][2] and "density" not in metrics["candidates"][3]  # only the settings a method reads
    for row in metrics["candidates"] + metrics["models"]:
        assert 0 <= row["strict_match"] <= 1 and 0 <= row["exact_match"] <= 1 and isinstance(row["retention_loss"], float)
    # pretrain is the base here: its retention loss is its NLL of its own answers minus the same (meta.json's), 0 up to the two
    # computations' roundings (another model object, the same batches) and the rounding to 6 decimals
    (pretrain,) = [row for row in metrics["models"] if row["model"] == "pretrain"]
    assert abs(pretrain["retention_loss"]) <= 1e-5
    assert sum(row["chosen"] for row in metrics["candidates"]) == 1 and metrics["candidates"][metrics["chosen"] - 1]["chosen"]
    assert metrics["chosen"] - 1 == merge.choose(metrics["candidates"], params.max_retention_loss)[0]


def test_the_picture_and_the_same_bytes_twice(project, merged):
    params, _ = merged
    out = project / "out/merge"
    assert (out / merge.PICTURE).read_bytes().startswith(b"\x89PNG")
    again = run(project, "out/again", params)
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(project / "out/again").as_posix() for p in (project / "out/again").rglob("*") if p.is_file())
    assert {"model.safetensors", "config.json", "tokenizer.json", merge.CANDIDATES_FILE, merge.PICTURE} <= set(files)
    for name in files:
        assert (out / name).read_bytes() == (project / "out/again" / name).read_bytes(), name
        assert str(project).encode() not in (out / name).read_bytes(), name  # no absolute path
    assert again["chosen"] == merged[1]["chosen"]


def test_without_a_base_model_the_choice_is_on_facts_alone(project):
    params = MergeParams(candidates=CANDIDATES[:1] + CANDIDATES[3:], max_new_tokens=4, batch_size=66)
    metrics = run(project, "out/facts", params, answers="data/no_base_answers")
    assert metrics["retention_measured"] is False and "no base model" in metrics["rule"] and "retention_loss" not in metrics
    assert all("retention_loss" not in row for row in metrics["candidates"] + metrics["models"])
    assert [row["model"] for row in metrics["models"]] == ["pretrain", "sft", "dpo"]  # what the two candidates read
    assert (project / "out/facts" / merge.PICTURE).read_bytes().startswith(b"\x89PNG")


def test_the_choice_rule():
    def rows(*pairs):
        return [{"strict_match": s, "retention_loss": r} for s, r in pairs]

    # the best facts among those within the retention bound (0.8 is better, but loses too much)
    index, rule = merge.choose(rows((0.5, 0.1), (0.8, 0.3), (0.6, 0.15)), 0.15)
    assert index == 2 and "at most 0.15" in rule
    # equal facts: the lower retention loss; then the first listed
    assert merge.choose(rows((0.6, 0.1), (0.6, 0.05), (0.6, 0.05)), 0.15)[0] == 1
    # none within the bound: the lowest retention loss, whatever its facts
    index, rule = merge.choose(rows((0.9, 0.4), (0.2, 0.2), (0.5, 0.3)), 0.15)
    assert index == 1 and rule.startswith("no candidate has a retention loss of at most 0.15")
    # no retention measure: the best facts, ties to the first
    assert merge.choose([{"strict_match": 0.2}, {"strict_match": 0.7}, {"strict_match": 0.7}], 0.15) == (
        1, "the best validation strict match (no base model: no retention measure, chosen on facts alone)")  # fmt: skip


def test_the_models_a_candidate_needs():
    params = MergeParams(candidates=[MergeCandidate(method="ties", models=["dpo", "grpo"]), MergeCandidate(method="linear", models=["base", "lora"])])
    # the deltas' anchor and parents (dpo and grpo start from sft), the carrier (sft), in the pipeline's order
    assert merge.needed(params, merge.PARENTS) == ["base", "pretrain", "sft", "lora", "dpo", "grpo"]
    only = MergeParams(candidates=[MergeCandidate(method="dare", models=["dpo"])])
    assert merge.needed(only, {**merge.PARENTS, "dpo": merge.DPO_STARTS["base"]}) == ["pretrain", "sft", "dpo"]


SEVEN = ",".join(["{method: linear, models: [pretrain, sft]}"] * 7)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([f"merge.candidates=[{SEVEN}]"], "merge.candidates: at most 6 candidates (got 7)"),
        (["merge.candidates=[{method: linear, models: [pretrain, rlhf]}]"], "merge.candidates.0.models.1: Input should be 'base', 'pretrain', 'sft', 'lora', 'dpo' or 'grpo'"),
        (["merge.candidates=[{method: linear, models: [pretrain, sft], density: 0.5}]"], "merge.candidates.0.density: applies only with method: ties (here method is linear)"),
        (["merge.candidates=[{method: ties, models: [sft, dpo], drop_rate: 0.5}]"], "merge.candidates.0.drop_rate: applies only with method: dare or dare_ties (here method is ties)"),
        (["merge.candidates=[{method: linear, models: [pretrain, sft]}]", "merge.seed=3"], "merge.seed: applies only with a candidate of method dare or dare_ties"),
        (["merge.candidates=[{method: ties, models: [pretrain, sft]}]"], "models: pretrain has no delta to merge with ties"),
        (["merge.candidates=[{method: linear, models: [sft]}]"], "models: linear averages at least two models"),
        (["merge.candidates=[{method: task_arithmetic, models: [sft, dpo], weights: [1.0]}]"], "weights: one per model (2 models ['sft', 'dpo'], 1 weights)"),
        (["grpo.enabled=false", "merge.candidates=[{method: dare, models: [sft, grpo]}]"], "merge.candidates.0.models: grpo, but grpo.enabled is false"),
        (["merge.candidates=[{method: linear, models: [base, sft]}]"], "merge.candidates.0.models: base is the model base_model.name loads, and base_model.name is null"),
        (["merge.max_retention_loss=0.3"], "merge.max_retention_loss: applies only with a base model"),
        (["merge.enabled=false", "register.model=merge"], "register.model is merge but merge.enabled is false"),
    ],
)
def test_nonsense_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ParamsError) as refused:
        params_file.load(REPO, overrides=overrides)
    assert message in str(refused.value)


def test_the_stage_writes_a_readme_when_off_and_logs_its_table_and_picture(project, tmp_path, mlflow_template_db):
    from mlflow import MlflowClient

    from pipelines.core.run import stage
    from tests.conftest import make_project

    root = make_project(tmp_path / "off", mlflow_template_db, {"merge": {"enabled": False}})
    stage.execute(merge.NAME, merge.body, root)
    assert [p.name for p in (root / "data/models/merge").iterdir()] == ["README.md"]
    assert json.loads((root / "data/metrics/merge.json").read_text())["enabled"] is False

    root = make_project(tmp_path / "on", mlflow_template_db)
    shutil.copytree(project / "data", root / "data", dirs_exist_ok=True)
    stage.execute(merge.NAME, merge.body, root)
    metrics = json.loads((root / "data/metrics/merge.json").read_text())
    assert metrics["enabled"] is True and len(metrics["candidates"]) == 2  # the tiny profile's two
    assert metrics["retention_measured"] is True and isinstance(metrics["retention_loss"], float)
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    run_id = metrics["mlflow_run_id"]
    logged = {a.path for a in client.list_artifacts(run_id)} | {a.path for a in client.list_artifacts(run_id, "plots")}
    assert {"plots/tradeoff.png", "candidates.json", "candidates_table.json"} <= logged
    assert client.get_run(run_id).data.metrics["candidates.0.strict_match"] == metrics["candidates"][0]["strict_match"]
