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
from flows import cli

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
    from flows import cli

    before = gc.get_freeze_count()
    assert stage_command("toy", lambda root: None, ["--root", "."]) == 0

    def bad(root):
        raise QllmError("no")

    assert stage_command("toy", bad, ["--root", "."]) == 1
    assert cli.main(["compare", "--last", "2", "--project-dir", str(tmp_path)]) == 2
    assert gc.get_freeze_count() == before
