"""Shared fixtures: isolated environment, a migrated MLflow database, throwaway project copies."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

import pipelines  # noqa: F401  (first: it keys torch.compile's kernel cache by the CPU cap before torch fixes it)
from tests.waiting import DEADLINE, exited

REPO = Path(__file__).resolve().parents[1]
PROJECT_FILES = ["pipelines", "flows", "qllm", "params", "templates", "dvc.yaml", "params.yaml", ".dvcignore", ".gitignore", "data/sources"]
TEST_ENV = {
    "DVC_NO_ANALYTICS": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "MLFLOW_ENABLE_ASYNC_LOGGING": "false",
    # Prefect workers started here look for scheduled flow runs every 2 s, not every 10: each
    # deployment run otherwise waited 5 s on average, idle, before a worker took it
    "PREFECT_WORKER_QUERY_SECONDS": "2",
    # Every server the project starts in a test (a `qllm run`'s temporary Prefect API, `make serve`'s
    # services, docs/screenshots.py's) waits for its health check under the suite's deadline, not the
    # 120 s default a quiet machine meets (tests/waiting.py)
    "QLLM_SERVER_START_TIMEOUT": str(int(DEADLINE)),
}


if os.environ.get("PYTEST_XDIST_WORKER"):
    # One worker per core (`make test`): each worker's torch and the processes its tests start use
    # one thread, instead of every worker spreading over every core.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _absl_handler_writes_to_the_real_stderr() -> None:
    """absl (imported by TensorBoard) makes a logging handler on the `sys.stderr` of the moment it is
    first imported, and closes that stream whenever a later `logging.config.dictConfig` (Prefect's
    and MLflow's, on their first import) shuts old handlers down, unless it is `sys.stderr` then.
    Inside a test, `sys.stderr` may be DVC's colorama wrapper around pytest's capture file, which
    pytest swaps back afterwards: absl would then close pytest's capture file, and the run dies
    with `lost sys.stderr` (e.g. tests/stages/test_multimodal.py then tests/e2e/test_pipeline_e2e.py alone).
    Nothing attaches absl's handler to a logger here, so pointing it at the real stderr, which absl
    never closes, changes no output."""
    try:
        import absl.logging
    except ImportError:
        return
    absl.logging.get_absl_handler().python_handler.stream = sys.__stderr__


_absl_handler_writes_to_the_real_stderr()


LONGEST_FIRST = (
    "tests/e2e/test_real_smoke.py", "tests/stages/test_export.py",  # the slow set's longest (`make test-slow`); seconds in `make test`
    "tests/e2e/test_pipeline_e2e.py", "tests/flows/test_deployments.py", "tests/docs/test_screenshots.py", "tests/e2e/test_team.py",
    "tests/e2e/test_preference_methods.py", "tests/e2e/test_remote.py", "tests/e2e/test_concurrent_runs.py", "tests/core/training/test_stop_signals.py",
    "tests/e2e/test_mlflow_server.py", "tests/e2e/test_worker_image.py", "tests/e2e/test_resume_kill.py",
    "tests/qllm/test_cli_tools.py", "tests/e2e/test_finetune_mode.py", "tests/core/data/test_real_layouts.py", "tests/core/training/test_distributed.py",
    "tests/tools/test_gpu_check.py", "tests/qllm/test_local_api.py", "tests/core/evaluation/test_lm_eval.py", "tests/stages/test_multimodal.py",
)  # fmt: skip
"""The modules over 30 s in `make test` (`python -m tools.suite_time`, on the AVX2-only EPYC),
longest first, which `make test` starts first and the short ones after: the longest job first
balances the two workers best. pytest-xdist (`--dist loadscope --no-loadscope-reorder`) hands
modules to its workers in collection order; with its default reordering (most tests first) these
modules, which have few tests each, ran last and one of them alone at the end. The slow set's two
longest modules come first for the same reason (`make test-slow`: each a pipeline on a model that
answers); in `make test` they take seconds."""


def pytest_collection_modifyitems(config, items) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.path).relative_to(config.rootpath).as_posix(), len(rank)))  # stable: the rest keep their order


MODULE_SECONDS: dict[str, float] = {}
"""Each test module's time (its tests' setup, call and teardown: its worker's wall time under
`--dist loadscope`), summed from the reports the controller receives."""
SUITE_TIMES_ENV = "QLLM_SUITE_TIMES"
"""A path: the session writes each module's and test's seconds there as JSON (tools/suite_time.py)."""
TEST_SECONDS: dict[str, float] = {}
SESSION_STARTED = [0.0]


def pytest_sessionstart(session) -> None:
    SESSION_STARTED[0] = time.perf_counter()


def pytest_runtest_logreport(report) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # on an xdist worker: the controller sums the reports it receives
    module = report.nodeid.split("::", 1)[0]
    MODULE_SECONDS[module] = MODULE_SECONDS.get(module, 0.0) + report.duration
    TEST_SECONDS[report.nodeid] = TEST_SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_unconfigure(config) -> None:
    """The process (the session's, or an xdist worker's) ends next: its millions of objects are
    freed by reference count, without collector passes (`errors.exit_without_collecting`)."""
    gc.freeze()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The modules by time, slowest first (`--durations` lists the tests)."""
    if not MODULE_SECONDS or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    terminalreporter.write_sep("=", f"the {min(25, len(MODULE_SECONDS))} slowest of {len(MODULE_SECONDS)} modules (setup, tests, teardown)")
    for module, seconds in sorted(MODULE_SECONDS.items(), key=lambda item: -item[1])[:25]:
        terminalreporter.write_line(f"{seconds:9.1f}s {module}")
    if os.environ.get(SUITE_TIMES_ENV):
        from benchmarks.common import cpu

        outcomes = {kind: len(terminalreporter.stats.get(kind, [])) for kind in ("passed", "failed", "error", "skipped")}
        record = {"cpu": cpu(), "isa_cap": os.environ.get("ONEDNN_MAX_CPU_ISA"), "workers": getattr(config.option, "numprocesses", None) or 0,
                  "wall_seconds": round(time.perf_counter() - SESSION_STARTED[0], 1), "outcomes": outcomes,
                  "modules": MODULE_SECONDS, "tests": TEST_SECONDS}  # fmt: skip
        Path(os.environ[SUITE_TIMES_ENV]).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


@pytest.fixture(scope="session", autouse=True)
def isolated_env(tmp_path_factory):
    """No telemetry, no network lookups, and Prefect/MLflow state in a temporary home."""
    home = tmp_path_factory.mktemp("home")
    saved = dict(os.environ)
    os.environ.update(TEST_ENV)
    os.environ["PREFECT_HOME"] = str(home / "prefect")
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    os.environ.pop("PREFECT_API_URL", None)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def no_leaked_tracking_uri():
    """`mlflow.set_tracking_uri` exports MLFLOW_TRACKING_URI, which `tracking.tracking_uri` honours:
    a test that sets it must not send the next tests' runs to its store."""
    yield
    if os.environ.get("MLFLOW_TRACKING_URI") or os.environ.get("MLFLOW_REGISTRY_URI"):
        import mlflow

        mlflow.set_tracking_uri(None)
        mlflow.set_registry_uri(None)
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        os.environ.pop("MLFLOW_REGISTRY_URI", None)


@pytest.fixture(scope="session")
def mlflow_template_db(tmp_path_factory) -> Path:
    """An MLflow SQLite database with every migration applied (done once: it takes seconds)."""
    return migrated_mlflow_db(tmp_path_factory.mktemp("mlflow") / "mlflow.db")


def migrated_mlflow_db(path: Path) -> Path:
    """An empty MLflow SQLite store at `path`, its tables made (MLflow migrates on first use)."""
    from mlflow import MlflowClient

    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


ALWAYS_CHANGED = ("probe_device", "base_model")
"""Stages DVC reruns every time (`always_changed`: they read the machine and the base model;
unchanged bytes leave everything downstream cached)."""


def dvc_up_to_date(status_output: str) -> bool:
    """`dvc status` reports nothing stale but the `ALWAYS_CHANGED` stages."""
    text = status_output.strip()
    if text == "Data and pipelines are up to date.":
        return True
    entries = [line for line in text.splitlines() if line.strip()]
    names = [line.rstrip(":") for line in entries if not line[0].isspace()]
    details = {line.strip() for line in entries if line[0].isspace()}
    return set(names) <= set(ALWAYS_CHANGED) and details == {"always changed"}


def run(cmd: list[str], cwd: Path, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, check=check, capture_output=True, text=True, **kwargs)


def git_identity(root: Path) -> None:
    """The committer the suite's git repositories use (`git config` in `root`)."""
    run(["git", "config", "user.email", "tests@example.com"], root)
    run(["git", "config", "user.name", "tests"], root)


def init_dvc(root: Path, analytics_off: bool = True) -> None:
    """`dvc init` (and `dvc config core.analytics false`) in `root`, a git repository, in this
    process: the same files, staged the same way, without CLI processes importing DVC (1 s each)."""
    from dvc.repo import Repo

    with Repo.init(str(root)) as repo:
        if analytics_off:
            with repo.config.edit() as config:
                config["core"]["analytics"] = "false"


def make_project(dest: Path, mlflow_db: Path, params_overlay: dict | None = None, tiny: bool = True) -> Path:
    """A git + DVC copy of this project (code, dvc.yaml, params, sources) with its own MLflow DB.

    With `tiny`, params.yaml is the shipped one merged with params/tiny.yaml (and `params_overlay`),
    so the whole pipeline runs in seconds in the project itself (no run workspace).
    """
    from pydantic import ValidationError

    from pipelines.core.params.files import Layers, deep_merge

    dest.mkdir(parents=True, exist_ok=True)
    for name in PROJECT_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    layers = [("params.yaml", yaml.safe_load((REPO / "params.yaml").read_text()))]
    if tiny:
        layers.append(("params/tiny.yaml", yaml.safe_load((REPO / "params" / "tiny.yaml").read_text())))
    if params_overlay:
        layers.append(("the test's overlay", params_overlay))
    try:  # as `qllm run --params tiny.yaml --params <overlay>` merges them: a key the overlay made inert back at its default
        merged = Layers()
        for source, layer in layers:
            merged.merge(source, layer)
        params = merged.data
    except ValidationError:  # a test of bad params: written as given, for the run to refuse
        params = functools.reduce(deep_merge, (layer for _, layer in layers[1:]), layers[0][1])
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.copy2(mlflow_db, dest / "mlflow.db")
    run(["git", "init", "-q"], dest)
    git_identity(dest)
    init_dvc(dest)
    shutil.copy2(REPO / ".dvcignore", dest / ".dvcignore")
    run(["git", "add", "-A"], dest)
    run(["git", "commit", "-qm", "project"], dest)
    return dest


@pytest.fixture
def project(tmp_path, mlflow_template_db) -> Path:
    """A fresh tiny-profile project in a temporary directory."""
    return make_project(tmp_path / "project", mlflow_template_db)


def shared_tmp(tmp_path_factory) -> Path:
    """A directory every xdist worker of this session shares (`pytest-N`); without xdist, the
    session's own temporary directory."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


FIRST_PIPELINE = "first-tiny-pipeline"
"""Under `shared_tmp`: a tiny project right after its first whole run (`project/`), that run's
summary (`summary.json`), and the lock the workers take to make or read it."""


def copy_project(source: Path, dest: Path) -> Path:
    """A copy of a project that has run, as if it had run at `dest`: its files, git and DVC's cache
    and run-cache as they are (their paths are relative), and the absolute paths MLflow keeps
    (runs' and models' artifact locations, datasets' sources, in mlflow.db and in the logged
    models' MLmodel files) moved from `source` to `dest`."""
    import sqlite3

    shutil.copytree(source, dest, symlinks=True)
    old, new = str(source), str(dest)
    with contextlib.closing(sqlite3.connect(dest / "mlflow.db")) as db, db:
        for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
            for column in [row[1] for row in db.execute(f'PRAGMA table_info("{table}")')]:
                db.execute(f'UPDATE "{table}" SET "{column}" = replace("{column}", ?, ?) WHERE typeof("{column}") = \'text\' AND instr("{column}", ?) > 0',
                           (old, new, old))  # fmt: skip
    for path in (dest / "mlartifacts").rglob("MLmodel"):
        path.write_text(path.read_text(encoding="utf-8").replace(old, new), encoding="utf-8")
    return dest


def _moved(summary_json: str, source: Path, dest: Path) -> str:
    """A run summary's JSON with the project's path `source` written as `dest`."""
    return summary_json.replace(json.dumps(str(source))[1:-1], json.dumps(str(dest))[1:-1])


def _keep_first_pipeline(shared: Path, project: Path, summary: dict) -> None:
    copy_project(project, shared / "project")
    (shared / "summary.json").write_text(_moved(json.dumps(summary), project, shared / "project"))


def publish_first_pipeline(tmp_path_factory, project: Path, summary: dict) -> bool:
    """Keep a copy of `project`, just after its first whole default run (`summary`), for the
    modules that need no more than such a project (`first_tiny_pipeline`), unless one is kept
    already or another worker is making one. Whether this call kept it."""
    from filelock import FileLock, Timeout

    shared = shared_tmp(tmp_path_factory) / FIRST_PIPELINE
    shared.mkdir(exist_ok=True)
    try:
        with FileLock(shared / "lock", timeout=0):
            if (shared / "summary.json").exists():
                return False
            _keep_first_pipeline(shared, project, summary)
            return True
    except Timeout:
        return False


@pytest.fixture(scope="session")
def first_tiny_pipeline(request, tmp_path_factory, mlflow_template_db) -> Path:
    """The shared directory of a tiny project after its first whole default run, made once per
    session: tests/e2e/test_pipeline_e2e.py publishes its own first run there (it runs first);
    when no worker has, the first to ask runs one while the others wait. Take copies of it
    (`copy_first_pipeline`), never the project itself."""
    from filelock import FileLock

    shared = shared_tmp(tmp_path_factory) / FIRST_PIPELINE
    shared.mkdir(exist_ok=True)
    with FileLock(shared / "lock"):
        if not (shared / "summary.json").exists():
            from flows.pipeline import pipeline

            request.getfixturevalue("prefect_server")  # the run's flow and tasks report to it
            project = make_project(tmp_path_factory.mktemp("first_pipeline") / "project", mlflow_template_db)
            _keep_first_pipeline(shared, project, pipeline(project_dir=str(project)))
    return shared


def copy_first_pipeline(shared: Path, dest: Path) -> tuple[Path, dict]:
    """A project at `dest` where the first whole default tiny run has run (`first_tiny_pipeline`),
    and that run's summary, its paths moved to `dest`."""
    copy_project(shared / "project", dest)
    return dest, json.loads(_moved((shared / "summary.json").read_text(), shared / "project", dest))


def assert_stopped_by_itself(worker_log: Path) -> None:
    """A Prefect worker `qllm.services.serve.stop` ended shut down on the SIGTERM (its log ends with
    Prefect's "stopped!"), not by the SIGKILL that follows 15 s later."""
    last = worker_log.read_text(errors="replace").rstrip().splitlines()[-1]
    assert re.fullmatch(r"Worker '.+' stopped!", last), f"{worker_log} ends with {last!r}"


@pytest.fixture(scope="session")
def prefect_server():
    """One temporary Prefect API for every flow run in the session (instead of one per flow)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=DEADLINE):  # it polls the server's health: a bound for a broken start
        yield


CHATS = [
    [{"role": "system", "content": "Answer with one word."}, {"role": "user", "content": f"Where does {name} live?"}, {"role": "assistant", "content": city}]
    for name, city in [("Tovik", "Pelora"), ("Marela", "Dunmar"), ("Sanit", "Pelora"), ("Orvin", "Kestal"), ("Lumi", "Dunmar"), ("Pera", "Kestal")]
] + [
    [{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": str(a + b)},
     {"role": "user", "content": f"And {b} plus {a}?"}, {"role": "assistant", "content": str(a + b)}]
    for a, b in [(1, 2), (3, 4), (2, 5), (6, 1)]
]


PAIRS = [
    ("Where does Tovik live?", "Pelora", "Dunmar"), ("Where does Marela live?", "Dunmar", "Kestal"),
    ("Where does Orvin live?", "Kestal", "Pelora"), ("What is 1 plus 2?", "3", "4"),
    ("What is 3 plus 4?", "7", "8"), ("What is 2 plus 5?", "7", "6"),
]


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """A trained tokenizer, a tiny random Llama saved as a model directory, and prepared chats."""
    import json

    import pandas as pd

    from pipelines.core.models.models import build_llama, save_pretrained
    from pipelines.core.params.pretraining import ModelParams
    from pipelines.train_tokenizer import train

    root = tmp_path_factory.mktemp("tiny_base")
    texts = [m["content"] for chat in CHATS for m in chat] * 20 + ["Tovik lives in Pelora. Marela lives in Dunmar."] * 20
    tokenizer = train(iter(texts), vocab_size=320, min_frequency=2)
    model = build_llama(ModelParams(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2), tokenizer, max_positions=128, seed=0)
    save_pretrained(model, tokenizer, root / "model", max_length=128)
    preference_dir = root / "preference"
    preference_dir.mkdir()
    for split, pairs in {"train": PAIRS, "validation": PAIRS[:2], "test": PAIRS[2:]}.items():
        frame = pd.DataFrame({"id": [f"{split}-{i}" for i in range(len(pairs))], "source": "t", "split": split,
                              "prompt": [json.dumps([{"role": "user", "content": q}]) for q, _, _ in pairs],
                              "chosen": [c for _, c, _ in pairs], "rejected": [r for _, _, r in pairs]})
        frame.to_parquet(preference_dir / f"{split}.parquet")
    chat_dir = root / "chat"
    chat_dir.mkdir()
    for split, chats in {"train": CHATS, "validation": CHATS[:3], "test": CHATS[3:5]}.items():
        frame = pd.DataFrame({"id": [f"{split}-{i}" for i in range(len(chats))], "source": "t", "split": split,
                              "messages": [json.dumps(c) for c in chats]})
        frame.to_parquet(chat_dir / f"{split}.parquet")
    return root


TOY_DVC_YAML = """\
stages:
  a:
    cmd: python -m toy.a
    deps: [src/a.txt]
    params: [a]
    outs: [data/a]
  b:
    cmd: python -m toy.b
    deps: [data/a]
    params: [b]
    outs: [data/b.txt]
    metrics:
      - data/metrics/b.json:
          cache: false
"""


@pytest.fixture
def toy(tmp_path):
    """A git + DVC project with a two-stage toy DAG (`a` -> `b`) and no stage code: tests pass
    the stage bodies to `repro.reproduce(..., execute=...)`."""
    from pipelines.core.run import repro

    root = tmp_path / "toy"
    (root / "src").mkdir(parents=True)
    (root / "src/a.txt").write_text("x")
    (root / "dvc.yaml").write_text(TOY_DVC_YAML)
    (root / "params.yaml").write_text("a:\n  n: 2\nb:\n  m: 1\n")
    run(["git", "init", "-q"], root)
    init_dvc(root, analytics_off=False)
    yield root
    repro.close(root)


def record_dpo_losses(monkeypatch, factory: str = "dpo_loss") -> list[tuple[float, dict]]:
    """Patch `pipelines.dpo.<factory>` (a function returning a loss function: `dpo_loss`, or
    `with_replay` for the loss with the replay term) so that every loss it computes (training
    steps, validation, held-out) is appended, as `(loss, metrics)`, to the list returned."""
    from pipelines import dpo

    seen: list[tuple[float, dict]] = []
    real = getattr(dpo, factory)

    def recording(*args, **kwargs):
        fn = real(*args, **kwargs)

        def loss_fn(model, batch):
            loss, metrics = fn(model, batch)
            seen.append((float(loss.detach()), metrics))
            return loss, metrics

        return loss_fn

    monkeypatch.setattr(dpo, factory, recording)
    return seen


def load_with_remote_code(model_dir: Path, input_ids: list[list[int]]) -> tuple[str, bool, float]:
    """Load a saved model with `trust_remote_code=True` in a fresh interpreter that cannot import the
    pipeline (`-I`, an empty environment): (class name, whether `pipelines` got imported, sum of its
    logits for `input_ids`)."""
    code = ("import torch, sys; from transformers import AutoModelForCausalLM as A; "
            f"m = A.from_pretrained({str(model_dir)!r}, trust_remote_code=True).eval(); "
            f"print(type(m).__name__, 'pipelines' in sys.modules, m(input_ids=torch.tensor({input_ids})).logits.sum().item())")  # fmt: skip
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd=model_dir.parent, timeout=300,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    name, imported, total = done.stdout.split()
    return name, imported == "True", float(total)


@contextlib.contextmanager
def mlflow_model_server(model_uri: str, root: Path, log: Path) -> Iterator[str]:
    """`mlflow models serve -m MODEL_URI --env-manager local` on 127.0.0.1 (a free port) against
    the project's registry, as the docs say to run it; yields its `/invocations` URL."""
    from qllm.services.local_api import free_port, wait_http

    port = free_port()
    env = os.environ | {"MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", "HF_HUB_OFFLINE": "1",
                        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # it starts `uvicorn` from PATH
    with open(log, "wb") as out:
        server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "models", "serve", "-m", model_uri, "--env-manager", "local",
                                   "--workers", "1", "--host", "127.0.0.1", "--port", str(port)], cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/ping", server, "mlflow models serve", DEADLINE, hint=f"; see {log}")
        yield f"http://127.0.0.1:{port}/invocations"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        exited(server, "mlflow models serve stopping on SIGTERM", log=log)


def post_json(url: str, body: bytes) -> tuple[int, dict]:
    """(HTTP status, the JSON answer) of a POST of `body`; an error status is returned, not raised."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


TORCH_RANDOM_FUNCTIONS = ("rand", "randn", "randint", "randperm", "multinomial", "normal", "bernoulli", "poisson", "rand_like", "randn_like", "randint_like")
TENSOR_RANDOM_METHODS = ("uniform_", "normal_", "random_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_", "multinomial", "bernoulli")


@contextlib.contextmanager
def draws_outside_construction() -> Iterator[list[str]]:
    """Record every draw from torch's global generator made while the drawing thread does not hold
    `models.CONSTRUCTION`: the rule of `pipelines.core.training.randomness` that keeps each stage a
    function of its seed when stages train in threads of one process. Each record names the thread,
    the function and the project's frames that led to it. Draws with a `generator=` of their own,
    dropout with p = 0 or out of training, and attention without dropout are not draws.

    Python-level calls only (torch's functions, tensor methods, `F.dropout` and attention as looked
    up when called), which is how the project, transformers and PEFT reach torch's generator."""
    import threading
    import traceback

    import torch
    import torch.nn.functional as F

    from pipelines.core.models.models import CONSTRUCTION

    records: list[str] = []
    guard = threading.Lock()

    def record(name: str) -> None:
        if CONSTRUCTION._is_owned():
            return
        frames = [f"{Path(f.filename).relative_to(REPO)}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-2]
                  if f.filename.startswith(str(REPO) + os.sep) and not f.filename.startswith(str(REPO / "tests"))]  # fmt: skip
        with guard:
            records.append(f"{threading.current_thread().name}: {name} <- " + " <- ".join(reversed(frames[-4:])))

    def dropout_draws(args, kwargs) -> bool:
        p, training = kwargs.get("p", args[1] if len(args) > 1 else 0.5), kwargs.get("training", args[2] if len(args) > 2 else True)
        return p > 0 and training

    def attention_draws(args, kwargs) -> bool:
        return kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0) > 0

    def spied(owner, name: str, draws=lambda args, kwargs: True):
        original = getattr(owner, name)

        @functools.wraps(original)
        def spy(*args, **kwargs):
            if kwargs.get("generator") is None and draws(args, kwargs):
                record(f"{getattr(owner, '__name__', owner)}.{name}")
            return original(*args, **kwargs)

        return spy

    patched = [(torch, name, spied(torch, name)) for name in TORCH_RANDOM_FUNCTIONS]
    patched += [(torch.Tensor, name, spied(torch.Tensor, name)) for name in TENSOR_RANDOM_METHODS]
    patched += [(F, "dropout", spied(F, "dropout", dropout_draws)), (F, "scaled_dot_product_attention", spied(F, "scaled_dot_product_attention", attention_draws))]
    saved = [(owner, name, vars(owner).get(name)) for owner, name, _ in patched]
    for owner, name, spy in patched:
        setattr(owner, name, spy)
    try:
        yield records
    finally:
        for owner, name, original in saved:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


BASE_ANSWER = {"code": "```python\ndef f(x):\n    return x * x\n```", "lists": "- apples\n- pears\n- plums", "explanations": "Light scatters. Blue scatters most.",
          "short_facts": "Paris.", "translation": "Bonjour.", "word_problems": "Tom has 7 apples."}  # fmt: skip


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    """A `base_answers` output written by hand: one answer per family of the general prompts (`BASE_ANSWER`)."""
    import json

    from pipelines.core.data import replay
    from pipelines.core.evaluation import retention

    out = tmp_path_factory.mktemp("base_answers")
    rows = [{**p, "answer": BASE_ANSWER[p["family"]], "form": None} for p in retention.load_prompts()]
    (out / replay.ANSWERS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / replay.META).write_text(json.dumps({"base": "b", "max_new_tokens": 8, "nll": {}}))
    return out
