"""The modules that left flows/ (issue 79) still import and run under their old names for one
release: registered deployments, plug-ins, scripts and old console scripts keep working."""

from __future__ import annotations

import json
import subprocess
import sys

from flows.moved import MOVED
from tests.conftest import REPO

PROBE = """
import importlib, json, sys, warnings
found = {}
for old, new in MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    found[old] = {"is_new": module is importlib.import_module(new), "same_entry": sys.modules[old] is module,
                  "warned": [str(w.message) for w in caught if w.category is DeprecationWarning and old in str(w.message)]}
from flows import generation, serve  # the `from package import name` form
found["from"] = generation.__name__ + " " + serve.__name__
print(json.dumps(found))
"""


def test_every_old_name_imports_the_new_module_with_a_deprecation_warning():
    assert set(MOVED) == {f"flows.{p.stem}" for p in (REPO / "flows").glob("*.py")} - {"flows.__init__", "flows.moved", "flows.pipeline", "flows.sweep", "flows.stages"}
    done = subprocess.run([sys.executable, "-c", f"MOVED = {MOVED!r}\n" + PROBE], cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    found = json.loads(done.stdout.splitlines()[-1])
    assert found.pop("from") == "qllm.serving.generation qllm.services.serve"
    for old, state in found.items():
        assert state["is_new"] and state["same_entry"], old
        assert state["warned"] == [f"{old} moved to {MOVED[old]}; the old name goes in the next release"], old


def test_python_dash_m_of_an_old_name_runs_the_new_module():
    """`python -m flows.cli` (what an old `qllm` console script imports: `flows.cli:main`) and a
    documented command of before, `python -m flows.lm_eval_task`."""
    cli = subprocess.run([sys.executable, "-m", "flows.cli", "--help"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0 and cli.stdout.startswith("usage: qllm"), cli.stderr[-2000:]
    old_script = subprocess.run([sys.executable, "-c", "import sys; from flows.cli import main; sys.argv = ['qllm', '--help']; sys.exit(main())"],
                                cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert old_script.returncode == 0 and old_script.stdout.startswith("usage: qllm"), old_script.stderr[-2000:]
    lm_eval = subprocess.run([sys.executable, "-m", "flows.lm_eval_task", "--help"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert lm_eval.returncode == 0 and "lm_eval" in lm_eval.stdout, lm_eval.stderr[-2000:]
    assert "flows.lm_eval_task moved to pipelines.core.evaluation.lm_eval" in lm_eval.stderr
