"""No pickle from disk: nothing under pipelines/, flows/, qllm/ can unpickle a file.

Unpickling runs whatever code the file names, so a checkpoint, model or data file from elsewhere
would be a way in. Weights are safetensors, checkpoint state is loaded with
`torch.load(weights_only=True)`, data is Parquet/JSON/NumPy without objects. The scan reads the
code's syntax tree (not a grep): aliases (`import torch as t`, `from numpy import load`) are
followed and comments or docstrings that mention a pattern do not count.
"""

from __future__ import annotations

import ast
import json
import pickle
from pathlib import Path

import pytest
import torch

from pipelines.core.training.checkpoint import CheckpointManager

REPO = Path(__file__).resolve().parents[3]
SCANNED = ("pipelines", "flows", "qllm")
PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "joblib", "dill", "shelve"}


def _constant(node: ast.AST | None):
    return node.value if isinstance(node, ast.Constant) else ...


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted origin for every import in the file (`np` -> `numpy`)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str:
    """`np.load` -> `numpy.load` (names resolved through the file's imports); "" if not a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ".".join(reversed(parts)) if parts else ""
    return ".".join([aliases.get(node.id, node.id), *reversed(parts)])


def unsafe_loads(source: str, filename: str = "<source>") -> list[str]:
    """`file:line: what` for every way `source` could unpickle data from disk."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    found = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PICKLE_MODULES:
                    report(node, f"imports {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PICKLE_MODULES:
            report(node, f"imports from {node.module}")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func, aliases)
            keywords = {k.arg: k.value for k in node.keywords}
            splat = None in keywords  # **kwargs could carry anything
            if name in ("__import__", "importlib.import_module") and node.args and str(_constant(node.args[0])).split(".")[0] in PICKLE_MODULES:
                report(node, f"imports {_constant(node.args[0])}")
            elif name.endswith("read_pickle") or name.endswith("to_pickle"):
                report(node, f"{name}(): pickle files")
            elif name in ("torch.load", "torch.serialization.load"):
                if _constant(keywords.get("weights_only")) is not True:
                    report(node, "torch.load() without weights_only=True")
            elif name in ("numpy.load", "numpy.lib.npyio.load"):
                if ("allow_pickle" in keywords and _constant(keywords["allow_pickle"]) is not False) or splat:
                    report(node, "numpy.load() with allow_pickle")
            elif name.endswith("from_pretrained") and "use_safetensors" in keywords and _constant(keywords["use_safetensors"]) is not True:
                report(node, "from_pretrained(use_safetensors=False): .bin weights are pickles")
    return found


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import pickle", "imports pickle"),
        ("import cloudpickle as cp", "imports cloudpickle"),
        ("from joblib import load", "imports from joblib"),
        ("import dill.settings", "imports dill.settings"),
        ("import importlib\nimportlib.import_module('pickle')", "imports pickle"),
        ("import pandas as pd\npd.read_pickle('x.pkl')", "pandas.read_pickle(): pickle files"),
        ("import torch\ntorch.load('x.pt')", "torch.load() without weights_only=True"),
        ("import torch as t\nt.load('x.pt', weights_only=False)", "torch.load() without weights_only=True"),
        ("from torch import load\nload('x.pt', **options)", "torch.load() without weights_only=True"),
        ("import numpy as np\nnp.load('x.npy', allow_pickle=True)", "numpy.load() with allow_pickle"),
        ("from numpy import load as npload\nnpload('x.npy', allow_pickle=flag)", "numpy.load() with allow_pickle"),
        ("M.from_pretrained('dir', use_safetensors=False)", "from_pretrained(use_safetensors=False): .bin weights are pickles"),
    ],
)
def test_the_scan_finds_each_pattern(source, expected):
    assert unsafe_loads(source, "x.py") == [f"x.py:{source.count(chr(10)) + 1}: {expected}"]


def test_the_scan_accepts_safe_loads():
    source = '''
"""Docstrings may say torch.load('x') or import pickle."""
import numpy as np
import torch
torch.load("state.pt", weights_only=True, map_location="cpu")
np.load("rows.npy", allow_pickle=False)
np.load("rows.npy", mmap_mode="r")
Model.from_pretrained("dir", use_safetensors=True)
Model.from_pretrained("dir")
'''
    assert unsafe_loads(source) == []


def test_no_pickle_loading_in_the_code():
    files = sorted(path for directory in SCANNED for path in (REPO / directory).rglob("*.py"))
    assert len(files) > 20  # the scan really sees the code
    found = [hit for path in files for hit in unsafe_loads(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))]
    assert found == [], "unpickling from disk runs arbitrary code:\n" + "\n".join(found)


# --- behaviour: a checkpoint with a pickled object is refused ------------------------------------

EXECUTED: list[str] = []


def _payload() -> str:
    EXECUTED.append("ran")  # what an attacker's pickle would do instead
    return "payload"


class Malicious:
    def __reduce__(self):
        return (_payload, ())


def test_checkpoint_state_with_a_pickled_object_is_refused(tmp_path):
    import hashlib

    net = torch.nn.Linear(2, 2)
    manager = CheckpointManager(tmp_path)
    path = manager.save(1, net, {"step": 1})
    # Replace the state with one holding an arbitrary object, and fix the manifest as an attacker
    # (or a careless tool) would: the checksums pass, so only the loader stands in the way.
    torch.save({"step": 1, "extra": Malicious()}, path / "state.pt")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["state.pt"] = hashlib.sha256((path / "state.pt").read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert manager.latest_valid().path == path

    with pytest.raises(Exception) as err:
        manager.load(path, torch.nn.Linear(2, 2))
    assert EXECUTED == []  # refused before anything ran
    message = str(err.value)
    assert isinstance(err.value, pickle.UnpicklingError) or "state.pt" in message
    assert "_payload" in message or "state.pt" in message  # names the offending global or the file
