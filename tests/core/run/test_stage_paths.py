"""Stages take their paths from dvc.yaml (`ctx.input`, `ctx.output`), never from constants of their own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pipelines.core import dag
from pipelines.core.errors import QllmError
from pipelines.core.models import model_source
from pipelines.core.params import files as params_file
from pipelines.core.params.project import Params
from pipelines.core.run.stage import StageContext

REPO = Path(__file__).resolve().parents[3]
STAGES = dag.stages(REPO)

# String literals starting with "data/" that a stage module may hold: each one is not a path.
ALLOWED_DATA_LITERALS = {
    # metric names: finetune.build_rows counts the training data as `data/<split>_...`
    "data/train_rows",
    "data/train_examples",
    "data/train_truncated",
}


def context(name: str, root: Path = REPO) -> StageContext:
    return StageContext(name=name, root=root, params=None, tracker=None)


def test_input_and_output_resolve_to_the_paths_dvc_yaml_declares():
    sft = context("sft")
    assert sft.input("chat") == REPO / "data/prepared/chat"
    assert sft.input("models/pretrain") == sft.input("pretrain") == sft.input("data/models/pretrain") == REPO / "data/models/pretrain"
    assert sft.input("device.json") == REPO / "data/device.json"
    assert sft.output() == sft.output("sft") == sft.output("models/sft") == REPO / "data/models/sft"
    assert context("register").input("metrics/evaluate.json") == REPO / "data/metrics/evaluate.json"
    assert context("ingest").inputs() == [REPO / "data/sample", REPO / "data/sources"]


def test_an_unknown_name_says_what_the_stage_declares():
    sft = context("sft")
    with pytest.raises(QllmError) as error:
        sft.input("text")
    assert str(error.value) == "stage sft: no input 'text' in dvc.yaml deps (declared: data/device.json, data/models/pretrain, data/prepared/chat, data/base_answers)"
    with pytest.raises(QllmError, match=re.escape("stage sft: no input 'sft.py' in dvc.yaml deps")):
        sft.input("sft.py")  # code is not an input
    with pytest.raises(QllmError, match=re.escape("stage sft: no input 'prepared' in dvc.yaml deps")):
        sft.input("prepared")  # a whole path component at the end, not a prefix
    with pytest.raises(QllmError) as error:
        sft.output("metrics/sft.json")  # metrics are written by the stage runner, not by the body
    assert str(error.value) == "stage sft: no output 'metrics/sft.json' in dvc.yaml outs (declared: data/models/sft)"


def test_keys_of_other_sections_come_only_as_dvc_yaml_lists_them():
    from pipelines.core.run import stage

    params = params_file.load(REPO)[0]
    listed = stage.listed_params(params, STAGES["quantum_opt"])
    assert listed == {"lora.allocation": params.lora.allocation}
    ctx = StageContext(name="quantum_opt", root=REPO, params=None, tracker=None, listed=listed)
    assert ctx.param("lora.allocation") == listed["lora.allocation"]
    with pytest.raises(QllmError) as error:
        ctx.param("lora.train.lr")
    assert str(error.value) == "stage quantum_opt: params key 'lora.train.lr' is not listed under params in dvc.yaml (listed: quantum_opt, lora.allocation)"
    assert stage.listed_params(params, STAGES["sft"]) == {}


def test_an_ambiguous_name_or_a_missing_one_among_several_outputs_is_an_error(tmp_path):
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n  s:\n    cmd: python -m pipelines.s\n    deps: [pipelines/s.py, data/a/x, data/b/x]\n    outs: [data/o1, data/o2]\n"
    )
    s = context("s", tmp_path)
    assert s.input("a/x") == tmp_path / "data/a/x" and s.output("o2") == tmp_path / "data/o2"
    with pytest.raises(QllmError) as error:
        s.input("x")
    assert str(error.value) == "stage s: input 'x' is ambiguous, it matches data/a/x, data/b/x in dvc.yaml deps (declared: data/a/x, data/b/x)"
    with pytest.raises(QllmError) as error:
        s.output()
    assert str(error.value) == "stage s: which output? dvc.yaml outs has 2, so name one (declared: data/o1, data/o2)"


def _stage_modules() -> list[Path]:
    return sorted((REPO / "pipelines").glob("*.py"))


def test_no_stage_module_spells_out_a_data_path():
    """Every path a stage reads or writes is in dvc.yaml only; a "data/..." literal in a stage
    module is a second copy that nothing checks (use ctx.input / ctx.output)."""
    offenders = []
    for path in _stage_modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            literal = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""
            if literal.startswith("data/") and literal not in ALLOWED_DATA_LITERALS:
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {literal!r}")
    assert not offenders, "stage modules must take their paths from dvc.yaml (ctx.input/ctx.output):\n" + "\n".join(offenders)


def _requested(path: Path) -> list[tuple[str, str | None, int]]:
    """Every `ctx.input("...")`/`ctx.output(...)` call with a literal (or no) name in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        is_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("input", "output")
        if not (is_call and isinstance(node.func.value, ast.Name) and node.func.value.id == "ctx"):
            continue
        if not node.args:
            found.append((node.func.attr, None, node.lineno))
        elif isinstance(node.args[0], ast.Constant):
            found.append((node.func.attr, node.args[0].value, node.lineno))
    return found


@pytest.mark.parametrize("name", list(STAGES))
def test_every_path_a_stage_asks_for_is_in_its_dvc_yaml_stage(name):
    """Without running the stage: each literal name in its `ctx.input`/`ctx.output` calls resolves
    to exactly one declared path, and every stage body writes its output through `ctx.output`."""
    ctx = context(name)
    requests = _requested(REPO / "pipelines" / f"{name}.py")
    for kind, wanted, line in requests:
        try:
            getattr(ctx, kind)(wanted)
        except QllmError as exc:
            pytest.fail(f"pipelines/{name}.py:{line}: {exc}")
    assert any(kind == "output" for kind, _, _ in requests), f"pipelines/{name}.py never calls ctx.output()"


def test_paths_named_outside_the_stage_modules_are_those_of_dvc_yaml():
    """The core and the params name a few dvc.yaml paths too: they must be the declared ones."""
    assert STAGES["base_model"].outs == (model_source.RECORD,)  # core reads the record where base_model writes it
    for reader in ("train_tokenizer", "pretrain"):
        assert model_source.RECORD in STAGES[reader].deps
    params, _ = params_file.load(REPO)
    for name in ("sft", "probe_lora", "lora"):  # the base model a fine-tuning stage starts from is its dependency
        assert context(name).input(getattr(params, name).base_model) == REPO / getattr(params, name).base_model
        assert Params.model_fields[name].default.base_model == getattr(params, name).base_model
