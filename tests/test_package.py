"""What importing the `pipelines` package sets up for the whole process (pipelines/__init__.py):
imports without the collector's full passes, and bitsandbytes deferred to its first use. (Its torch.compile
cache per CPU cap: tests/core/training/test_loop.py.)"""

from __future__ import annotations

import gc
import importlib.machinery
import json
import subprocess
import sys
import textwrap

import pytest

from pipelines.core import startup
from tests.conftest import REPO

BIG = """
import gc
made = [[i] for i in range(300_000)]  # container objects: they count toward the collector's thresholds
during = gc.get_threshold()
{nested}
"""

PROBE = """
import gc, json, sys
sys.path[:0] = [{tmp!r}, {repo!r}]
full = []
gc.callbacks.append(lambda phase, info: full.append(phase) if phase == "start" and info["generation"] == 2 else None)
{first}
default = gc.get_threshold()
import big
print(json.dumps({{"full_passes": len(full), "during": big.during, "inner": getattr(big, "inner_seen", None),
                   "after": gc.get_threshold(), "default": default, "enabled": gc.isenabled()}}))
"""


def _probe(tmp_path, first: str) -> dict:
    (tmp_path / "big.py").write_text(BIG.format(nested="import inner\ninner_seen = inner.during"))
    (tmp_path / "inner.py").write_text(BIG.format(nested=""))
    code = textwrap.dedent(PROBE.format(tmp=str(tmp_path), repo=str(REPO), first=first))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout)


def test_an_import_makes_no_full_collection_and_the_thresholds_come_back_after_the_outermost(tmp_path):
    plain = _probe(tmp_path, first="")
    assert plain["full_passes"] >= 1  # 600,000 containers: full passes without the finder
    assert plain["during"] == plain["after"] == plain["default"]
    hooked = _probe(tmp_path, first="import pipelines")
    assert hooked["full_passes"] == 0
    assert hooked["during"][:2] == hooked["default"][:2] and hooked["during"][2] > 1_000_000  # young generations as before
    assert hooked["inner"] == hooked["during"]  # a nested import leaves them to the outermost
    assert hooked["after"] == hooked["default"] and hooked["enabled"]


def test_an_import_that_fails_gives_the_thresholds_back(tmp_path, monkeypatch):
    (tmp_path / "broken_at_import.py").write_text("import gc\nseen = gc.get_threshold()\nraise RuntimeError(seen)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = gc.get_threshold()
    with pytest.raises(RuntimeError) as raised:
        import broken_at_import  # noqa: F401
    assert raised.value.args[0][2] > 1_000_000 and gc.get_threshold() == before
    assert "broken_at_import" not in sys.modules


def test_a_module_that_sets_the_thresholds_itself_keeps_them(tmp_path, monkeypatch):
    (tmp_path / "sets_its_own.py").write_text("import gc\ngc.set_threshold(500, 5, 5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = gc.get_threshold()
    try:
        import sets_its_own  # noqa: F401

        assert gc.get_threshold() == (500, 5, 5)
    finally:
        gc.set_threshold(*before)


def test_only_a_modules_own_file_loader_is_wrapped_never_a_shared_one():
    """Built-in and frozen modules share one loader (a class): wrapping it would change every later
    import of theirs; a file loader serves one module."""
    finder = next(f for f in sys.meta_path if isinstance(f, startup.ImportsWithoutFullCollections))
    # first when installed; finders of single names added since (Prefect's aliases) may sit before it
    assert sys.meta_path.index(finder) < sys.meta_path.index(importlib.machinery.BuiltinImporter) < sys.meta_path.index(importlib.machinery.PathFinder)
    builtin = finder.find_spec("xxsubtype")
    assert builtin.loader is importlib.machinery.BuiltinImporter and isinstance(vars(builtin.loader)["exec_module"], staticmethod)
    source = finder.find_spec("tests.hold_training", [str(REPO / "tests")])
    assert isinstance(source.loader, importlib.machinery.SourceFileLoader) and "exec_module" in vars(source.loader)
    startup.imports_without_full_collections()
    assert sum(isinstance(f, startup.ImportsWithoutFullCollections) for f in sys.meta_path) == 1  # installed once


DEFERRED_PROBE = """
import importlib.util, json, sys
import pipelines
import bitsandbytes  # as PEFT imports it, whenever it is installed (peft.helpers)
state = {"class": type(sys.modules["bitsandbytes"]).__name__, "torch": "torch" in sys.modules}
import bitsandbytes  # an import statement reads only the module's identity, as does find_spec
state["again"] = type(sys.modules["bitsandbytes"]).__name__
state["found"] = importlib.util.find_spec("bitsandbytes").name
import inspect, peft
state["file"] = bitsandbytes.__file__ == importlib.util.find_spec("bitsandbytes").origin
inspect.getmodule(eval(compile("sys._getframe()", "<no module>", "eval")))  # a frame of no file: scans every module's __file__
state["scanned"] = type(sys.modules["bitsandbytes"]).__name__
import pipelines.core.params.project  # the params schemas, after PEFT (as pytest workers and probes import them)
state["schemas"] = type(sys.modules["bitsandbytes"]).__name__
state["version"] = bitsandbytes.__version__  # the first use runs it
state["after"] = type(sys.modules["bitsandbytes"]).__name__
state["inductor"] = "torch._inductor.compile_fx" in sys.modules  # what running it costs
state["linear4bit"] = bitsandbytes.nn.Linear4bit.__name__
print(json.dumps(state))
"""


def test_bitsandbytes_stays_unexecuted_until_it_is_used():
    from importlib.metadata import version

    done = subprocess.run([sys.executable, "-c", DEFERRED_PROBE], cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    state = json.loads(done.stdout.splitlines()[-1])
    assert state["class"] == state["again"] == "DeferredModule" and not state["torch"]
    assert state["found"] == "bitsandbytes" and state["file"]
    assert state["scanned"] == state["schemas"] == "DeferredModule"
    assert state["version"] == version("bitsandbytes") and state["after"] == "module" and state["inductor"]
    assert state["linear4bit"] == "Linear4bit"


THREADS_PROBE = """
import json, sys, threading
sys.path[:0] = [{tmp!r}, {repo!r}]
import pipelines
from pipelines.core import startup
startup.DEFERRED = frozenset({{"slow_to_run"}})
import slow_to_run
assert type(slow_to_run).__name__ == "DeferredModule"
start, seen, errors = threading.Barrier(8), [], []
def use():
    start.wait()
    try:
        seen.append(slow_to_run.VALUE)
    except Exception as error:
        errors.append(repr(error))
threads = [threading.Thread(target=use) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps({{"seen": seen, "errors": errors, "runs": open({runs!r}).read()}}))
"""


def test_threads_using_a_deferred_module_at_once_run_it_once_and_all_see_it_whole(tmp_path):
    runs = tmp_path / "runs"
    runs.write_text("")
    (tmp_path / "slow_to_run.py").write_text(f"import time\nopen({str(runs)!r}, 'a').write('ran\\n')\ntime.sleep(0.3)\nVALUE = 42\n")
    code = THREADS_PROBE.format(tmp=str(tmp_path), repo=str(REPO), runs=str(runs))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    state = json.loads(done.stdout)
    assert state["errors"] == [] and state["seen"] == [42] * 8
    assert state["runs"] == "ran\n"
