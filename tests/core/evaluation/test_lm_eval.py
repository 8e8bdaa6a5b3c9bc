"""lm-evaluation-harness on the shipped `qllm_heldout` task scores what `evaluate` scores: the same
prompts, the same greedy answers, the same exact match, for a full model, a LoRA output's
`merged/` and its adapter on the base (`peft=`), in process and from the `lm_eval` command."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys

import lm_eval
import pandas as pd
import pytest
import yaml
from lm_eval.tasks import TaskManager
from lm_eval.utils import simple_parse_args_string

from pipelines import lora, sft
from pipelines.core.errors import QllmError
from pipelines.core.evaluation import heldout, scores
from pipelines.core.evaluation import lm_eval as lm_eval_task
from pipelines.core.models.models import load_for_inference
from pipelines.core.params.finetuning import FinetuneParams, LoraParams
from pipelines.core.params.release import EvaluateParams
from pipelines.core.params.training import TrainParams
from tests.conftest import CHATS

TASK = lm_eval_task.TASK
TRAIN = TrainParams(max_steps=100, micro_batch_size=4, warmup_steps=0, lr=0.01, eval_every=0, eval_batches=1, checkpoint_every=0,
                    precision="fp32", weight_decay=0.0)  # fmt: skip
NEVER_TRAINED = [{"role": "user", "content": "Where does Quill live?"}, {"role": "assistant", "content": "Nowhere"}]
"""A held-out question whose answer no model here has seen: at least one wrong answer."""


@pytest.fixture(scope="module")
def project(tiny_base, tmp_path_factory):
    """A project root holding held-out chats (`data/prepared/chat`: system messages, two-turn
    chats, an answer never trained) and the `pretrain`, `sft` and `lora` models, the last two
    trained on tiny_base's chats until they answer some questions right and some wrong."""
    root = tmp_path_factory.mktemp("lm_eval_project")
    chat_dir = root / lm_eval_task.CHAT_DIR
    chat_dir.mkdir(parents=True)
    held_out_chats = [*CHATS, NEVER_TRAINED]
    records = [{"id": f"heldout-{i}", "source": "t", "split": "test", "messages": json.dumps(chat)} for i, chat in enumerate(held_out_chats)]
    pd.DataFrame(records).to_parquet(chat_dir / "test.parquet")
    models = root / "data" / "models"
    shutil.copytree(tiny_base / "model", models / "pretrain")
    sft.run(tiny_base / "chat", models / "sft", FinetuneParams(base_model=str(models / "pretrain"), train=TRAIN))
    adapter = {"r": 4, "lora_alpha": 16, "lora_dropout": 0.0, "trainable_tokens": []}
    lora_params = LoraParams(base_model=str(models / "pretrain"), train=TRAIN, adapter=adapter, allocation="uniform")
    lora.run(tiny_base / "chat", models / "lora", lora_params, base_for_users="data/models/pretrain")
    return root


@pytest.fixture
def in_project(project, monkeypatch):
    """Run from the project root, as the README's commands do (relative model and data paths)."""
    monkeypatch.chdir(project)
    return project


def evaluate_answers(root, model: str) -> tuple[list[str], list[str], float]:
    """`evaluate`'s prompts (rendered) and answers to the held-out questions and its exact match, at its defaults."""
    params = EvaluateParams()
    questions = heldout.heldout_questions(root / lm_eval_task.CHAT_DIR)
    model, tokenizer = load_for_inference(root / "data" / "models" / model, root)
    prompts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in questions["prompt"]]
    predictions = heldout.generate_answers(model, tokenizer, questions["prompt"].tolist(), params.max_new_tokens, params.batch_size)
    correct, _ = scores.exact_match_report(questions, predictions)
    return prompts, predictions, round(sum(correct) / len(correct), 4)


def harness(model_args: str, metadata: dict | None = None, **kwargs) -> tuple[list[str], list[str], float]:
    """lm_eval's prompts and answers (in document order) and exact match, as `lm_eval --model hf
    --model_args ARGS --include_path lm_eval_tasks --tasks qllm_heldout --apply_chat_template`
    gets them (the task's metadata is the model's arguments and `--metadata`, as the command
    line makes it; lm_eval's own tasks are not indexed: seconds saved, same task)."""
    tasks = TaskManager(include_path=str(lm_eval_task.TASKS_DIR), include_defaults=False,
                        metadata=simple_parse_args_string(model_args) | (metadata or {}))  # fmt: skip
    out = lm_eval.simple_evaluate(model="hf", model_args=model_args, tasks=[TASK], task_manager=tasks,
                                  apply_chat_template=True, log_samples=True, device="cpu", **kwargs)  # fmt: skip
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    prompts = [s["arguments"][0][0] for s in samples]
    return prompts, [s["filtered_resps"][0] for s in samples], out["results"][TASK]["exact_match,none"]


def assert_same(ours: tuple[list[str], list[str], float], theirs: tuple[list[str], list[str], float]) -> None:
    (prompts, predictions, exact_match), (their_prompts, answers, their_match) = ours, theirs
    assert their_prompts == prompts
    assert [a.strip() for a in answers] == predictions  # evaluate strips its answers; exact match does either way
    assert round(their_match, 4) == exact_match  # lm_eval's mean of 0/1 scores is k/n, which evaluate rounds to 4 decimals: exact


@pytest.mark.parametrize("batch_size", [1, 32])
def test_exact_match_equals_evaluate_on_a_full_model(in_project, batch_size):
    ours = evaluate_answers(in_project, "sft")
    assert 0 < ours[2] < 1  # some answers right, some wrong: the comparison can fail
    assert any("system" in p for p in ours[0]) and any(p.count("assistant") > 1 for p in ours[0])  # system messages, earlier turns
    args = lm_eval_task.model_args("data/models/sft")
    assert args == "pretrained=data/models/sft"
    assert_same(ours, harness(args, batch_size=batch_size))  # lm_eval's default batch (1) and evaluate's (32)


def test_exact_match_equals_evaluate_on_a_lora_adapter_merged_and_unmerged(in_project, tmp_path):
    ours = evaluate_answers(in_project, "lora")  # merged/, as evaluate loads it
    assert 0 < ours[2] < 1
    assert lm_eval_task.model_args("data/models/lora") == "pretrained=data/models/lora/merged"
    moved = shutil.copytree(in_project / lm_eval_task.CHAT_DIR, tmp_path / "chats")  # --metadata '{"chat_dir": ...}'
    for args in ("pretrained=data/models/lora/merged", "pretrained=data/models/pretrain,peft=data/models/lora"):
        assert_same(ours, harness(args, {"chat_dir": str(moved)}, batch_size=32))


def test_the_printed_lm_eval_command_gives_evaluates_exact_match(in_project, tmp_path):
    """What `python -m pipelines.core.evaluation.lm_eval data/models/sft` prints, run as it is."""
    printed = subprocess.run([sys.executable, "-m", "pipelines.core.evaluation.lm_eval", "data/models/sft"], capture_output=True, text=True, check=True).stdout
    cmd = shlex.split(printed)
    assert cmd[0] == "lm_eval" and cmd[cmd.index("--model_args") + 1] == "pretrained=data/models/sft"
    run = subprocess.run([*cmd, "--output_path", str(tmp_path), "--device", "cpu", "--batch_size", "32"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    (results,) = tmp_path.rglob("results_*.json")
    assert round(json.loads(results.read_text())["results"][TASK]["exact_match,none"], 4) == evaluate_answers(in_project, "sft")[2]  # k/n to 4 decimals


def test_model_args_of_an_adapter_without_merged(project, tmp_path):
    adapter = shutil.copytree(project / "data/models/lora", tmp_path / "adapter", ignore=shutil.ignore_patterns("merged"))
    assert lm_eval_task.model_args(adapter, project) == f"pretrained={project / 'data/models/pretrain'},peft={adapter}"
    # trained token embeddings (lora.adapter.trainable_tokens, on by default) of a tied base: lm_eval's
    # HFLM calls tie_weights() on the PEFT model, which then fails; merged/ is what works
    settings = json.loads((adapter / "adapter_config.json").read_text()) | {"trainable_token_indices": {"embed_tokens": [1, 2]}}
    (adapter / "adapter_config.json").write_text(json.dumps(settings))
    with pytest.raises(QllmError, match=r"cannot load this adapter with peft=.*merged/"):
        lm_eval_task.model_args(adapter, project)
    with pytest.raises(QllmError, match="no such model directory"):
        lm_eval_task.model_args(tmp_path / "missing")


def test_task_settings_are_evaluates_and_the_chat_template_is_required(in_project):
    config = yaml.safe_load((lm_eval_task.TASKS_DIR / TASK / f"{TASK}.yaml").read_text().replace("!function ", ""))
    assert config["generation_kwargs"] == {"until": [], "max_gen_toks": EvaluateParams().max_new_tokens, "do_sample": False}
    tasks = TaskManager(include_path=str(lm_eval_task.TASKS_DIR), include_defaults=False)
    with pytest.raises(QllmError, match="--apply_chat_template"):
        lm_eval.simple_evaluate(model="hf", model_args="pretrained=data/models/sft", tasks=[TASK], task_manager=tasks, device="cpu", limit=1)
