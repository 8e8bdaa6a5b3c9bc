"""A stage's or `qllm`'s own process ends without the collector's passes over what it imported
(`errors.exit_without_collecting`), and still runs its exit handlers and flushes its output; called
in-process (tests, notebooks, Prefect's engine), the same functions leave the collector alone."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipelines.core.errors import QllmError, stage_command

REPO = Path(__file__).resolve().parents[3]

PROCESS = """
import atexit, gc, sys
from pipelines.core.errors import QllmError, stage_command

atexit.register(lambda: print("atexit ran", flush=True))
fail = sys.argv[1] == "fail"
sys.argv = ["python -m pipelines.toy", "--root", "somewhere"]

def body(root):
    print("body saw", root)
    sys.stdout.write("unflushed tail")  # no newline, no flush: the normal exit flushes it
    if fail:
        raise QllmError("toy: bad input")

code = stage_command("toy", body)
print(" frozen:", gc.get_freeze_count() > 0)
raise SystemExit(code)
"""


@pytest.mark.parametrize("outcome", ["ok", "fail"])
def test_a_stage_command_line_freezes_the_collector_then_exits_as_usual(outcome, tmp_path):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(PROCESS), outcome], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == (0 if outcome == "ok" else 1), done.stderr
    assert done.stdout.splitlines() == ["body saw somewhere", "unflushed tail frozen: True", "atexit ran"], done.stdout
    if outcome == "fail":
        assert "error: toy: toy: bad input" in done.stderr


QLLM = """
import gc, sys
from qllm import cli

sys.argv = ["qllm", "compare", "--last", "2", "--project-dir", sys.argv[1]]
code = cli.main()
print("frozen:", gc.get_freeze_count() > 0)
raise SystemExit(code)
"""


def test_the_qllm_command_line_freezes_the_collector_and_keeps_its_exit_code(tmp_path):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(QLLM), str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"{tmp_path / 'mlflow.db'}: no MLflow database" in done.stderr, done.stderr
    assert done.stdout.strip() == "frozen: True"


def test_called_with_arguments_in_process_the_collector_is_left_alone(tmp_path, capsys):
    from qllm import cli

    before = gc.get_freeze_count()
    assert stage_command("toy", lambda root: None, ["--root", "."]) == 0

    def bad(root):
        raise QllmError("no")

    assert stage_command("toy", bad, ["--root", "."]) == 1
    assert cli.main(["compare", "--last", "2", "--project-dir", str(tmp_path)]) == 2
    assert gc.get_freeze_count() == before


@pytest.mark.parametrize("main_module, parent_task_run_id, freezes", [
    ("prefect.engine", None, True),  # a worker's flow-run process: it ends after the final state
    ("prefect.engine", "a-task-run", False),  # a subflow (a sweep's set): the process goes on
    ("qllm.cli", None, False),  # `qllm run`: its own main freezes at its exit
    (None, None, False),  # a test, a notebook
])  # fmt: skip
def test_a_flow_runs_final_state_freezes_the_collector_only_in_its_own_flow_run_process(main_module, parent_task_run_id, freezes, monkeypatch):
    import types

    from flows.pipeline import pipeline
    from flows.sweep import sweep

    for flow in (pipeline, sweep):
        for hooks in (flow.on_completion_hooks, flow.on_failure_hooks, flow.on_cancellation_hooks, flow.on_crashed_hooks):
            assert [hook.__name__ for hook in hooks] == ["_process_ends_with_the_run"], flow.name
    main = types.ModuleType("__main__")
    main.__spec__ = None if main_module is None else types.SimpleNamespace(name=main_module)
    monkeypatch.setitem(sys.modules, "__main__", main)
    before = gc.get_freeze_count()
    try:
        pipeline.on_completion_hooks[0](pipeline, types.SimpleNamespace(parent_task_run_id=parent_task_run_id), None)
        assert (gc.get_freeze_count() > before) == freezes
    finally:
        gc.unfreeze()  # this process goes on
