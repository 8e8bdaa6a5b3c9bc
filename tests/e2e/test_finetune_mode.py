"""Fine-tuning mode: the pipeline starts from your model (its tokenizer and chat template) instead
of pretraining one; DVC tracks the base by content (local) or resolved commit (hub)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from pipelines import base_model
from pipelines.core import dag
from pipelines.core.errors import QllmError
from pipelines.core.models import model_source
from pipelines.core.params.finetuning import BaseModelParams
from tests.chat_families import CHATML, SMOLLM2_TOOLS, save_base_model
from tests.conftest import ALWAYS_CHANGED, dvc_up_to_date, make_project, run

TEXTS = ["Tovik lives in Pelora. Marela works as a baker.", "What is 3 plus 4? 7", "Answer with one word or number."] * 20
BASE = "models/base"  # a save_pretrained directory inside the project, named relative to it
PRETRAIN_WORK = ("train_tokenizer", "pretrain")


@pytest.fixture(scope="module")
def project(tmp_path_factory, mlflow_template_db, prefect_server) -> Path:
    root = make_project(tmp_path_factory.mktemp("finetune") / "project", mlflow_template_db, {"base_model": {"name": BASE}})
    save_base_model(CHATML, TEXTS, root / BASE)
    return root


@pytest.fixture(scope="module")
def first(project) -> dict:
    from flows.pipeline import pipeline

    return pipeline(project_dir=str(project))


def test_pretraining_stages_do_no_work_and_the_base_is_used_everywhere(first, project):
    statuses = {s["name"]: s["status"] for s in first["stages"]}
    assert set(statuses.values()) == {"ran"} and list(statuses) == dag.order(project)
    record = json.loads((project / "data/base_model.json").read_text())
    assert record == {"name": BASE, "kind": "local", "md5": dag.dvc_md5(project / BASE)}
    # pretrain trained nothing: its output is a pointer to the base
    assert sorted(p.name for p in (project / "data/models/pretrain").iterdir()) == ["base_model.json"]
    assert json.loads((project / "data/metrics/pretrain.json").read_text())["trained"] is False
    # the tokenizer is the base's, chat template included (not a trained one)
    tokenizer_config = json.loads((project / "data/tokenizer/tokenizer_config.json").read_text())
    saved_template = tokenizer_config.get("chat_template") or (project / "data/tokenizer/chat_template.jinja").read_text()
    assert saved_template == CHATML.template
    assert json.loads((project / "data/metrics/train_tokenizer.json").read_text())["trained"] is False
    # sft trained on the assistant answers found without {% generation %} markers
    sft = json.loads((project / "data/metrics/sft.json").read_text())
    assert sft["data/train_dropped_no_target"] == 0 and sft["data/train_target_tokens"] > 0
    # the fine-tuned models keep the base's chat template; the LoRA adapter names the base as given
    sft_config = json.loads((project / "data/models/sft/tokenizer_config.json").read_text())
    assert (sft_config.get("chat_template") or (project / "data/models/sft/chat_template.jinja").read_text()) == CHATML.template
    assert json.loads((project / "data/models/lora/adapter_config.json").read_text())["base_model_name_or_path"] == BASE
    # evaluate compares the base model (row "pretrain") with the fine-tuned ones
    evaluation = json.loads((project / "data/metrics/evaluate.json").read_text())
    assert {"pretrain", "sft", "lora", "dpo"} <= set(evaluation) and evaluation["pretrain"]["questions"] > 0


def test_the_registered_version_names_its_base(first, project):
    from mlflow import MlflowClient

    uri = f"sqlite:///{project / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    version = client.get_model_version("qllm", first["model_version"])
    assert version.tags["qllm.base_model"] == BASE
    assert version.tags["qllm.base_model.md5"] == dag.dvc_md5(project / BASE)
    from pipelines.core.run import lineage

    trail = {s["stage"]: s for s in lineage.build(project)["stages"]}
    assert trail["base_model"]["params"] == {"name": BASE, "revision": None, "chat_template_path": None}
    assert trail["pretrain"]["deps"]["data/base_model.json"] == dag.dvc_md5(project / "data/base_model.json")


def test_unchanged_base_keeps_everything_cached_and_a_changed_one_reruns_downstream(first, project):
    from flows.pipeline import pipeline

    again = pipeline(project_dir=str(project))
    assert {s["name"] for s in again["stages"] if s["status"] == "ran"} == set(ALWAYS_CHANGED)
    assert dvc_up_to_date(run([sys.executable, "-m", "dvc", "status"], project).stdout)
    # new weights in the base directory (same path, same params): DVC sees it through data/base_model.json
    save_base_model(CHATML, TEXTS, project / BASE, seed=1)
    status = run([sys.executable, "-m", "dvc", "status"], project).stdout
    assert dvc_up_to_date(status)  # data/base_model.json is only rewritten when base_model runs
    third = pipeline(project_dir=str(project))
    ran = {s["name"] for s in third["stages"] if s["status"] == "ran"}
    assert ran >= {"train_tokenizer", "pretrain", "sft", "lora", "dpo", "evaluate"}
    assert not ran & {"sample_data", "ingest", "prepare_data"}


# ------------------------------------------------------------------------------------ the hub path


def fake_hub(cache: Path, repo: str, refs: dict[str, str], source: Path) -> None:
    """A Hugging Face cache holding `repo` at the given refs (what `snapshot_download` leaves)."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    for ref, commit in refs.items():
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
        if not (folder / "snapshots" / commit).exists():
            shutil.copytree(source, folder / "snapshots" / commit)


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    source = save_base_model(CHATML, TEXTS, tmp_path / "src")
    fake_hub(cache, "acme/tiny-chat", {"main": "a" * 40, "v1": "b" * 40}, source)
    return cache


def test_a_hub_model_is_recorded_by_the_commit_its_revision_resolves_to(hub, tmp_path):
    record = base_model.resolve(BaseModelParams(name="acme/tiny-chat"), tmp_path)
    assert record == {"name": "acme/tiny-chat", "kind": "hub", "revision": "a" * 40}
    pinned = base_model.resolve(BaseModelParams(name="acme/tiny-chat", revision="v1"), tmp_path)
    assert pinned["revision"] == "b" * 40  # another revision: another record, so DVC reruns downstream
    # a pointer to it loads the snapshot of that commit, with its tokenizer and chat template
    from pipelines.core.models.models import load_model_and_tokenizer

    pointer = tmp_path / "project/data/models/pretrain"
    pointer.mkdir(parents=True)
    (pointer / model_source.POINTER).write_text(json.dumps(pinned))
    model, tokenizer = load_model_and_tokenizer(pointer)
    assert tokenizer.chat_template == CHATML.template and model.config.vocab_size == len(tokenizer)
    assert model_source.display_name(pinned) == f"acme/tiny-chat@{'b' * 40}"


def test_a_hub_model_that_cannot_be_found_is_a_clear_error(hub, tmp_path):
    with pytest.raises(QllmError, match=r"base_model.name='acme/missing': cannot fetch it from the Hugging Face hub"):
        base_model.resolve(BaseModelParams(name="acme/missing"), tmp_path)
    with pytest.raises(QllmError, match=r"at revision 'v9'"):
        base_model.resolve(BaseModelParams(name="acme/tiny-chat", revision="v9"), tmp_path)


def test_bad_base_model_settings_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"revision: applies only with a base model named \(`name`\) \(here name is null\)"):
        BaseModelParams(revision="main")
    (tmp_path / "empty").mkdir()
    with pytest.raises(QllmError, match="no tokenizer"):
        base_model.resolve(BaseModelParams(name="empty"), tmp_path)
    source = save_base_model(CHATML, TEXTS, tmp_path / "local")
    with pytest.raises(QllmError, match="a revision applies to hub models"):
        base_model.resolve(BaseModelParams(name=str(source), revision="main"), tmp_path)


def test_a_chat_template_file_replaces_the_bases_wherever_its_tokenizer_is_taken(tmp_path):
    """`base_model.chat_template_path`: the file's text is recorded (so editing it reruns what
    follows), and the base's tokenizer carries it through a pointer and into data/tokenizer."""
    import pandas as pd

    from pipelines import train_tokenizer
    from pipelines.core.models.models import load_model_and_tokenizer

    save_base_model(CHATML, TEXTS, tmp_path / BASE)
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates/tools.jinja").write_text(SMOLLM2_TOOLS.template)
    params = BaseModelParams(name=BASE, chat_template_path="templates/tools.jinja")
    record = base_model.run(tmp_path, tmp_path / "data/base_model.json", params)
    assert record == {"name": BASE, "kind": "local", "md5": dag.dvc_md5(tmp_path / BASE), "chat_template": SMOLLM2_TOOLS.template}
    assert json.loads((tmp_path / "data/base_model.json").read_text()) == record
    pointer = tmp_path / "data/models/pretrain"
    pointer.mkdir(parents=True)
    (pointer / model_source.POINTER).write_text(json.dumps(record))
    assert load_model_and_tokenizer(pointer)[1].chat_template == SMOLLM2_TOOLS.template  # every stage that loads the base
    (tmp_path / "prepared/text").mkdir(parents=True)
    pd.DataFrame({"text": TEXTS[:3]}).to_parquet(tmp_path / "prepared/text/validation.parquet")
    train_tokenizer.use_base(tmp_path / BASE, tmp_path / "prepared", tmp_path / "data/tokenizer", record)
    saved = json.loads((tmp_path / "data/tokenizer/tokenizer_config.json").read_text()).get("chat_template") or (tmp_path / "data/tokenizer/chat_template.jinja").read_text()
    assert saved == SMOLLM2_TOOLS.template
    without = base_model.run(tmp_path, tmp_path / "data/base_model.json", BaseModelParams(name=BASE))
    assert "chat_template" not in without and load_model_and_tokenizer(tmp_path / BASE)[1].chat_template == CHATML.template

    with pytest.raises(ValueError, match=r"chat_template_path: applies only with a base model named \(`name`\) \(here name is null\)"):
        BaseModelParams(chat_template_path="templates/tools.jinja")
    with pytest.raises(QllmError, match=r"base_model.chat_template_path='templates/none.jinja': no such file"):
        base_model.run(tmp_path, tmp_path / "out.json", BaseModelParams(name=BASE, chat_template_path="templates/none.jinja"))
    (tmp_path / "templates/broken.jinja").write_text("{% for m in messages %}\n{{ m.content }}\n{% endfo %}")
    with pytest.raises(QllmError, match=r"templates/broken.jinja, line 3: not a Jinja chat template .*\(base_model.chat_template_path\)"):
        base_model.run(tmp_path, tmp_path / "out.json", BaseModelParams(name=BASE, chat_template_path="templates/broken.jinja"))
    assert not (tmp_path / "out.json").exists()


def test_default_mode_records_no_base_and_pretrains(tmp_path):
    assert base_model.resolve(BaseModelParams(), tmp_path) == {"name": None}
    params = yaml.safe_load((Path(__file__).resolve().parents[2] / "params.yaml").read_text())
    assert params["base_model"] == {"name": None, "revision": None, "chat_template_path": None}
