"""The DAG is defined once (dvc.yaml); code and config must not drift from it."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from pipelines.core import dag
from pipelines.core.config import Params

REPO = Path(__file__).resolve().parents[1]

# Core modules that move values and files around without shaping a stage's outputs: listing them
# as deps would rerun every stage on any edit. (config.py holds schemas; the values DVC must see are
# all spelled out in params.yaml, which tests/test_config.py enforces.)
# checkpoint: how training state is saved and resumed (stage.py hooks into it), never what a stage produces
# distributed: how many processes run a stage (torchrun, rank 0's duties); the same results on 1 or N
# precision: what `precision: auto` resolves to reaches training stages as data (data/device.json from
#   probe_device, which lists precision.py itself), so editing it reruns probe_device, and training only if that changes
# parallel: how many processes (or which Dask cluster) run a data stage's batches; the same bytes on 1 or N
# loggers: the metric loggers (MLflow, TensorBoard, system metrics): what is recorded about a run, not its outputs
# resources: measures a stage's peak memory for its metrics file
INFRASTRUCTURE = {
    f"core.{m}"
    for m in ("config", "params_file", "stage", "tracking", "outputs", "errors", "workspace", "dag", "checkpoint", "distributed", "parallel", "precision", "loggers", "resources")
}


def module_path(module: str) -> Path:
    """`lora` -> pipelines/lora.py, `core.models` -> pipelines/core/models.py."""
    return REPO / "pipelines" / f"{module.replace('.', '/')}.py"


def pipelines_imports(module: str) -> set[str]:
    """`pipelines.*` modules imported by `module` anywhere in its source (incl. function bodies),
    named relative to `pipelines` (`lora`, `core.models`)."""
    tree = ast.parse(module_path(module).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module in ("pipelines", "pipelines.core"):
                package = node.module.removeprefix("pipelines").lstrip(".")
                found |= {f"{package}.{alias.name}".lstrip(".") for alias in node.names}
            elif node.module.startswith("pipelines."):
                found.add(node.module.removeprefix("pipelines."))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("pipelines.") for a in node.names if a.name.startswith("pipelines.")}
    return found


def closure(module: str) -> set[str]:
    """What `module` imports, directly or not; not followed into infrastructure modules (config.py
    imports the extension registry only to validate `train.extensions`)."""
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        for dep in pipelines_imports(current) - seen:
            seen.add(dep)
            if dep not in INFRASTRUCTURE:
                todo.append(dep)
    return seen


CORE = sorted(f"core.{p.stem}" for p in (REPO / "pipelines/core").glob("*.py") if p.stem != "__init__")


STAGES = dag.stages(REPO)


@pytest.mark.parametrize("name", list(STAGES))
def test_stage_module_deps_and_params_match_dvc_yaml(name):
    spec = STAGES[name]
    assert spec.cmd == f"python -m pipelines.{name}"
    module = importlib.import_module(spec.module)
    assert name == module.NAME and callable(module.body) and callable(module.main)  # the stage contract
    assert spec.params[0] == name and name in Params.model_fields  # its own section, then keys of others it reads (ctx.param)
    for key in spec.params[1:]:
        section, *path = key.split(".")
        node = Params.model_fields[section].default
        for part in path:
            node = getattr(node, part)  # an existing key (AttributeError otherwise)
        assert path and f'ctx.param("{key}")' in inspect.getsource(module), f"{name} lists {key} in dvc.yaml but does not read it"
    code_deps = {d.removeprefix("pipelines/").removesuffix(".py").replace("/", ".") for d in spec.deps if d.endswith(".py")}
    assert f"pipelines/{name}.py" in spec.deps
    needed = (closure(name) - INFRASTRUCTURE) | {name} | ({"core.precision"} if name == "probe_device" else set())
    assert needed == code_deps, f"dvc.yaml deps of {name} should list exactly {sorted(needed)}"
    for path in spec.all_outs:
        assert path.startswith("data/")


def test_layout_stages_on_top_core_below():
    """pipelines/ holds exactly the dvc.yaml stages; the shared code is pipelines/core/, one level."""
    assert {p.stem for p in (REPO / "pipelines").glob("*.py")} - {"__init__"} == set(STAGES)
    assert [p.name for p in (REPO / "pipelines").iterdir() if p.is_dir() and p.name != "__pycache__"] == ["core"]
    assert not [p for p in (REPO / "pipelines/core").iterdir() if p.is_dir() and p.name != "__pycache__"]


@pytest.mark.parametrize("name", list(STAGES))
def test_a_stage_imports_only_the_core(name):
    assert {m for m in pipelines_imports(name) if not m.startswith("core.")} == set()


@pytest.mark.parametrize("module", CORE)
def test_the_core_never_imports_a_stage(module):
    assert {m for m in pipelines_imports(module) if not m.startswith("core.")} == set()


def test_every_params_section_belongs_to_a_stage():
    assert set(Params.model_fields) == set(STAGES)


def test_order_until_and_sources():
    order = dag.order(REPO)
    assert order[0] == "sample_data" and order[-1] == "register"
    for name in order:
        assert all(order.index(up) < order.index(name) for up in dag.upstream(REPO, name))
    assert dag.order(REPO, until="tokenize") == ["sample_data", "ingest", "prepare_data", "base_model", "train_tokenizer", "tokenize"]
    assert set(dag.upstream(REPO, "tokenize")) == {"prepare_data", "train_tokenizer"}
    assert "data/sources" in dag.source_paths(REPO) and "data/sample" not in dag.source_paths(REPO)
    with pytest.raises(dag.DagError, match="unknown stage 'nope'"):
        dag.order(REPO, until="nope")


def test_dvc_md5_matches_dvc(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("hello\n")
    (tmp_path / "f.txt").write_text("hello\n")
    assert dag.dvc_md5(tmp_path / "f.txt") == "b1946ac92492d2347c6235b4d2611184"  # md5 of "hello\n"
    assert dag.dvc_md5(tmp_path / "d").endswith(".dir")


def test_layers_import_one_way():
    """pipelines never imports Prefect, tasks or flows; tasks never import flows."""
    def imports(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
        return names

    for path in (REPO / "pipelines").rglob("*.py"):
        assert not imports(path) & {"prefect", "tasks", "flows"}, path.name
    for path in (REPO / "tasks").glob("*.py"):
        assert "flows" not in imports(path), path.name


def test_prefect_yaml_deploys_the_pipeline_flow():
    import yaml
    from prefect.flows import load_flow_from_entrypoint

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    entrypoints = {d["name"]: d["entrypoint"] for d in spec["deployments"]}
    assert "default" in entrypoints
    flow = load_flow_from_entrypoint(str(REPO / entrypoints["default"]))
    assert flow.name == "qllm-pipeline"
