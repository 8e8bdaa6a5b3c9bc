"""The runner follows DVC's per-stage protocol, so `qllm run` and `dvc repro` agree."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from pipelines.core import dvc_api, workspace
from pipelines.core.run import repro
from tests.conftest import run


class Toy:
    """Stage bodies for the toy DAG; counts executions so tests can tell ran from cached."""

    def __init__(self):
        self.calls: list[str] = []

    def __call__(self, root: Path, name: str, parent_run_id):
        self.calls.append(name)
        params = yaml.safe_load((root / "params.yaml").read_text())
        if name == "a":
            (root / "data/a").mkdir(parents=True, exist_ok=True)
            (root / "data/a/out.txt").write_text((root / "src/a.txt").read_text() * params["a"]["n"])
        else:
            text = (root / "data/a/out.txt").read_text()
            (root / "data/b.txt").write_text(text.upper() * params["b"]["m"])
            (root / "data/metrics").mkdir(parents=True, exist_ok=True)
            (root / "data/metrics/b.json").write_text(f'{{"len": {len(text)}}}')


def reproduce_all(root: Path, toy: Toy) -> dict[str, tuple[str, str]]:
    return {name: (o.status, o.reason) for name in ("a", "b") for o in [repro.reproduce(root, name, execute=toy)]}


def dvc_status(root: Path) -> str:
    return run([sys.executable, "-m", "dvc", "status"], root).stdout


def test_ran_then_up_to_date_then_run_cache(toy):
    stages = Toy()
    assert reproduce_all(toy, stages) == {"a": ("ran", "executed"), "b": ("ran", "executed")}
    assert (toy / "data/b.txt").read_text() == "XX"
    assert "up to date" in dvc_status(toy)  # DVC agrees with what the runner did

    assert reproduce_all(toy, stages) == {"a": ("cached", "up-to-date"), "b": ("cached", "up-to-date")}
    assert stages.calls == ["a", "b"]

    (toy / "params.yaml").write_text("a:\n  n: 3\nb:\n  m: 1\n")
    assert "changed" in dvc_status(toy)
    assert reproduce_all(toy, stages) == {"a": ("ran", "executed"), "b": ("ran", "executed")}
    assert (toy / "data/b.txt").read_text() == "XXX"

    # Back to the first params: DVC's run-cache restores both stages without running them.
    (toy / "params.yaml").write_text("a:\n  n: 2\nb:\n  m: 1\n")
    assert reproduce_all(toy, stages) == {"a": ("cached", "run-cache"), "b": ("cached", "run-cache")}
    assert (toy / "data/b.txt").read_text() == "XX"
    assert (toy / "data/metrics/b.json").read_text() == '{"len": 2}'  # uncached metrics restored too
    assert stages.calls == ["a", "b", "a", "b"]
    assert "up to date" in dvc_status(toy)


def test_dvc_lock_has_the_bytes_dvc_itself_writes(toy):
    """`dvc_api.dump_lock` reads dvc.lock with the safe parser, not DVC's round-trip one: the file
    it writes is the one DVC's own `stage.dump` writes, from no file, and over a stale entry."""
    from dvc.repo import Repo

    reproduce_all(toy, Toy())
    ours = (toy / "dvc.lock").read_bytes()
    stale = yaml.safe_load(ours)
    stale["stages"]["a"]["outs"][0]["md5"] = "0" * 32 + ".dir"
    with Repo(str(toy)) as repo:
        stages = {stage.name: stage for stage in repo.index.stages}
        (toy / "dvc.lock").unlink()
        for name in ("a", "b"):
            stages[name].dump(update_pipeline=False)  # DVC's own writer
        assert (toy / "dvc.lock").read_bytes() == ours
        for writer in (lambda stage: stage.dump(update_pipeline=False), dvc_api.dump_lock):
            (toy / "dvc.lock").write_text(yaml.safe_dump(stale, sort_keys=False))
            writer(stages["a"])
            assert (toy / "dvc.lock").read_bytes() == ours


AWKWARD_ENTRY = {"cmd": "python -m pipelines.x --flag 'quoted' \"double\"", "deps": [{"path": "data/a b.txt", "hash": "md5", "md5": "0" * 32, "size": 3}],
                 "params": {"params.yaml": {"x": {"lr": 3e-05, "none": None, "date": "2026-11-28", "on": "on", "yes": True, "big": 10**20,
                                                  "text": "é ü " + "word " * 40, "nested": [[1, 2], {"k": None}], "empty": {}, "colon: key": "a: b",
                                                  "lines": "one\ntwo\n  three", "hash": "x # not a comment"}}},
                 "outs": [{"path": "data/x", "hash": "md5", "md5": "f" * 32 + ".dir", "size": 10, "nfiles": 2}]}  # fmt: skip


def test_dvc_lock_written_stage_by_stage_is_dvcs_whole_dump_on_awkward_values():
    """`dump_lock` renders each stage's block alone and joins them: DVC's dumper, given the whole
    file, writes the same bytes, here on values its YAML writes in odd ways (nulls, floats a YAML
    1.1 reader takes for strings, a date-like string, quotes, unicode, a key that needs quoting, a
    line long enough to fold), in an order that is not sorted."""
    import copy
    import io

    from dvc.utils.serialize._yaml import _dump

    entry = AWKWARD_ENTRY
    data = {"schema": "2.0", "stages": {"zeta": entry, "alpha@1": {**copy.deepcopy(entry), "cmd": "echo 1"}, "mid": {"cmd": "echo", "outs": []}}}
    shared = {"schema": "2.0", "stages": {"zeta": entry, "alpha@1": {**entry, "cmd": "echo 1"}}}  # one deps list twice: an anchor
    odd = {"schema": "2.0", "stages": {"a": entry}, "extra": 1}  # not DVC's layout
    for lock in (data, data, shared, odd):  # data twice: the second time from the kept blocks
        whole = io.StringIO()
        _dump(lock, whole)
        assert dvc_api._lock_text(lock) == whole.getvalue()
    assert "&id001" in dvc_api._lock_text(shared)


def test_dvc_lock_is_parsed_block_by_block_as_dvc_parses_it_whole():
    """`dvc_api.parse_dvc_file` gives DVC's parse of the whole file, in its order, on awkward values;
    anything but DVC's layout is parsed whole (the same values, or DVC's error with the file's lines)."""
    import copy
    import json

    from dvc.utils.serialize._yaml import YAMLFileCorruptedError, parse_yaml

    def same(text: str, path: str = "p/dvc.lock") -> None:
        ours, dvcs = dvc_api.parse_dvc_file(text, path), parse_yaml(text, path)
        assert json.dumps(ours) == json.dumps(dvcs)  # values, types as JSON has them, and every mapping's order
        assert ours == dvcs

    plain = {k: v for k, v in AWKWARD_ENTRY.items() if k != "params"} | {"params": {"params.yaml": {"lr": 0.1, "name": "x"}}}
    data = {"schema": "2.0", "stages": {"zeta": copy.deepcopy(AWKWARD_ENTRY), "alpha@1": {**copy.deepcopy(plain), "cmd": "echo 1"}, "mid": {"cmd": "echo", "outs": []}}}
    text = dvc_api._lock_text(data)
    assert "&" not in text and "*" not in text and "\n  #" not in text  # DVC's layout: parsed block by block
    same(text)
    body = text.removeprefix("schema: '2.0'\nstages:\n")
    blocks = [body[: body.index("  alpha@1:")], body[body.index("  alpha@1:") : body.index("  mid:")], body[body.index("  mid:") :]]
    assert "".join(blocks) == body and all(block in dvc_api._PARSED_LOCK_BLOCKS._items for block in blocks)
    starred = copy.deepcopy(data)
    starred["stages"]["mid"]["cmd"] = "echo a*b & c"
    same(dvc_api._lock_text(starred))  # an anchor or alias could tie blocks together: parsed whole
    calm_text = dvc_api._lock_text({"schema": "2.0", "stages": {"zeta": plain, "alpha@1": {**copy.deepcopy(plain), "cmd": "echo 1"}, "mid": {"cmd": "echo", "outs": []}}})
    for odd in (
        calm_text.replace("  mid:\n", "  # a comment\n  mid:\n"),  # a comment line
        calm_text + "extra: 1\n",  # a line outside the blocks
        calm_text.replace("schema: '2.0'\n", "schema: '3.0'\n"),  # not the header DVC writes
        dvc_api._lock_text({"schema": "2.0", "stages": {"a": plain, "b": {**plain, "deps": plain["deps"]}}}),  # an anchor ties blocks
    ):
        same(odd)
    same(calm_text, "p/dvc.yaml")  # not a dvc.lock
    twice = calm_text + "  mid:\n    cmd: again\n"  # a stage named twice: DVC's parse says what it makes of it
    with pytest.raises(YAMLFileCorruptedError):
        parse_yaml(twice, "p/dvc.lock")
    with pytest.raises(YAMLFileCorruptedError):
        dvc_api.parse_dvc_file(twice, "p/dvc.lock")
    broken = calm_text.replace("    cmd: echo\n", "    cmd: [echo\n")  # the last block is not YAML
    with pytest.raises(YAMLFileCorruptedError) as ours:
        dvc_api.parse_dvc_file(broken, "p/dvc.lock")
    with pytest.raises(YAMLFileCorruptedError) as dvcs:
        parse_yaml(broken, "p/dvc.lock")
    assert str(ours.value.__cause__) == str(dvcs.value.__cause__)  # the file's line numbers, not a block's


def test_after_a_commit_the_next_collection_parses_only_the_changed_stages_block(toy, monkeypatch):
    from ruamel.yaml import YAML

    stages = Toy()
    reproduce_all(toy, stages)
    (toy / "params.yaml").write_text("a:\n  n: 2\nb:\n  m: 3\n")
    assert repro.reproduce(toy, "b", execute=stages).status == "ran"  # dvc.lock rewritten, b's block changed
    text = (toy / "dvc.lock").read_text()
    parsed, load = [], YAML.load

    def recording(self, stream):  # every parse DVC's YAML readers make
        parsed.append(stream)
        return load(self, stream)

    monkeypatch.setattr(YAML, "load", recording)
    assert repro.reproduce(toy, "b", execute=stages).status == "cached"  # collects b from the new dvc.lock
    lock_parses = [t for t in parsed if "cmd: python -m toy" in t]
    assert lock_parses == ["stages:\n" + text[text.index("  b:\n") :]], lock_parses  # b's block alone, a's kept
    assert repro.reproduce(toy, "a", execute=stages).status == "cached" and [t for t in parsed if "cmd: python -m toy" in t] == lock_parses


def test_a_new_stage_is_appended_to_dvc_lock_as_dvc_appends_it(toy):
    """Over a dvc.lock that holds only `b`, `a`'s entry goes after it (DVC updates the mapping),
    byte for byte what DVC's `stage.dump` writes; and no temporary file is left beside it."""
    from dvc.repo import Repo

    reproduce_all(toy, Toy())
    written = {}
    for writer in (lambda stage: stage.dump(update_pipeline=False), dvc_api.dump_lock):
        with Repo(str(toy)) as repo:
            stages = {stage.name: stage for stage in repo.index.stages}
            (toy / "dvc.lock").unlink()
            with repo.lock:
                writer(stages["b"])
                writer(stages["a"])
        written[writer] = (toy / "dvc.lock").read_bytes()
    assert len(set(written.values())) == 1 and list(yaml.safe_load(next(iter(written.values())))["stages"]) == ["b", "a"]
    assert sorted(p.name for p in toy.iterdir() if p.name.startswith("dvc.lock")) == ["dvc.lock"]


def test_dvc_yaml_and_dvc_lock_are_parsed_once_per_text_and_each_caller_gets_its_own_copy(toy):
    from dvc.dvcfile import Lockfile, ProjectFile
    from dvc.repo import Repo
    from dvc.utils import strictyaml

    reproduce_all(toy, Toy())  # opens the project's Repo: the reader is in place from then on
    assert getattr(strictyaml.load, "qllm_once_per_content", False)
    with Repo(str(toy)) as repo:
        lock = str(toy / "dvc.lock")
        first, text = strictyaml.load(lock, Lockfile.SCHEMA, repo.fs)
        assert text == (toy / "dvc.lock").read_text() and text in dvc_api._PARSED_DVC_FILES._items and (text, id(Lockfile.SCHEMA)) in dvc_api._VALID_DVC_FILES._items  # kept by its text
        first["stages"]["a"]["cmd"] = "changed"  # a caller's change stays its own
        assert strictyaml.load(lock, Lockfile.SCHEMA, repo.fs)[0] == yaml.safe_load(text)
        stages, _ = strictyaml.load(str(toy / "dvc.yaml"), ProjectFile.SCHEMA, repo.fs)
        assert list(stages["stages"]) == ["a", "b"]
        (toy / "dvc.lock").write_text(text.replace("schema: '2.0'", "schema: '2.0'\nunknown: 1"))  # fails DVC's lock schema
        with pytest.raises(strictyaml.YAMLValidationError, match="dvc.lock"):
            strictyaml.load(lock, Lockfile.SCHEMA, repo.fs)
        (toy / "dvc.lock").write_text("stages: [1\n")  # not YAML
        with pytest.raises(strictyaml.YAMLSyntaxError, match="dvc.lock"):
            strictyaml.load(lock, Lockfile.SCHEMA, repo.fs)


def test_a_params_file_is_parsed_once_per_text_and_each_caller_gets_its_own_copy(toy):
    from dvc.dependency import param
    from dvc.repo import Repo

    reproduce_all(toy, Toy())  # opens the project's Repo: the reader is in place from then on
    assert getattr(param.load_path, "qllm_once_per_content", False)
    with Repo(str(toy)) as repo:
        path = str(toy / "params.yaml")
        first = param.load_path(path, repo.fs)
        first["a"]["n"] = 99  # a caller's change stays its own
        assert param.load_path(path, repo.fs) == {"a": {"n": 2}, "b": {"m": 1}}
        (toy / "params.yaml").write_text("a:\n  n: 5\nb:\n  m: 1\n")  # new text, same size and perhaps the same mtime
        assert param.load_path(path, repo.fs) == {"a": {"n": 5}, "b": {"m": 1}}
        (toy / "params.yaml").write_text("a:\n  n: [1\n")
        with pytest.raises(Exception, match="params.yaml"):  # a parse error names the file, as DVC's reader does
            param.load_path(path, repo.fs)


def test_the_params_in_dvc_yamls_interpolation_context_are_parsed_once_per_text_too(toy):
    """DVC loads params.yaml into the context dvc.yaml's `${...}` reads (`Context.load_from`, through
    `dvc.utils.serialize.load_path`, imported at each call) for every collection of a stage."""
    from dvc.parsing.context import Context
    from dvc.repo import Repo
    from dvc.utils import serialize

    reproduce_all(toy, Toy())
    assert getattr(serialize.load_path, "qllm_once_per_content", False)
    with Repo(str(toy)) as repo:
        (toy / "params.yaml").write_text("a:\n  n: 7\nb:\n  m: 1\n")
        text = (toy / "params.yaml").read_text()
        assert text not in dvc_api._PARSED_PARAMS._items
        context = Context.load_from(repo.fs, str(toy / "params.yaml"))
        assert context.select("a.n").value == 7 and text in dvc_api._PARSED_PARAMS._items  # parsed once, kept by its text
        dvc_api._PARSED_PARAMS._items[text]["a"]["n"] = 8  # what a second load gets is the kept parse (copied)
        assert Context.load_from(repo.fs, str(toy / "params.yaml")).select("a.n").value == 8
        dvc_api._PARSED_PARAMS._items.pop(text)


def test_a_params_dependencys_values_are_read_once_per_text_and_keys(toy):
    """A stage's params (`ParamsDependency.read_params`, at each status, hash and save of it) are the
    file's values at its keys, which DVC picks out with dpath over the whole file every time: kept
    by (file, text, keys), as DVC computes them, each caller getting its own copy."""
    from dvc.dependency import param
    from dvc.repo import Repo

    reproduce_all(toy, Toy())
    read = param.read_param_file
    assert getattr(read, "qllm_once_per_content", False)
    with Repo(str(toy)) as repo:
        path = str(toy / "params.yaml")
        (toy / "params.yaml").write_text("a:\n  n: 4\n  k: {x: [1, 2]}\nb:\n  m: 1\n")
        assert read(repo.fs, path, ["a.k", "b"], flatten=True) == {"a.k": {"x": [1, 2]}, "b": {"m": 1}}
        assert read(repo.fs, path, ["a.n"]) == {"a": {"n": 4}}  # DVC's nested form without flatten
        assert read(repo.fs, path) == {"a": {"n": 4, "k": {"x": [1, 2]}}, "b": {"m": 1}}
        assert read(repo.fs, path, ["a.missing"], flatten=True) == {}
        text = (toy / "params.yaml").read_text()
        assert (path, text, ("a.k", "b"), True) in dvc_api._PARAM_VALUES._items  # kept by file, text and keys
        read(repo.fs, path, ["a.k", "b"], flatten=True)["a.k"]["x"].append(3)  # a caller's change stays its own
        assert read(repo.fs, path, ["a.k", "b"], flatten=True) == {"a.k": {"x": [1, 2]}, "b": {"m": 1}}
        (toy / "params.yaml").write_text("a:\n  n: 5\n  k: {x: [1, 2]}\nb:\n  m: 1\n")  # new text, same size
        assert read(repo.fs, path, ["a.n"], flatten=True) == {"a.n": 5}
        (toy / "params.yaml").unlink()
        with pytest.raises(FileNotFoundError):  # as DVC's reader fails
            read(repo.fs, path, ["a.n"], flatten=True)


def test_a_run_cache_restore_hashes_each_dependency_once_before_and_once_after(toy, monkeypatch):
    """DVC hashes a stage's dependencies at every look (status, the run-cache's `_can_hash` and key,
    `save_deps`, `save`): eight times for `src/a.txt` in a restore of stage a. Held per step of the
    bookkeeping (`dvc_api.dependencies_hashed_once`), it is once before the stage would run and once
    after, and the outcome is DVC's."""
    import collections

    import dvc.output

    stages = Toy()
    reproduce_all(toy, stages)
    (toy / "params.yaml").write_text("a:\n  n: 3\nb:\n  m: 1\n")
    reproduce_all(toy, stages)
    builds, build = collections.Counter(), dvc.output.build

    def counting(odb, path, fs, name, **kwargs):
        builds[Path(path).relative_to(toy).as_posix()] += 1
        return build(odb, path, fs, name, **kwargs)

    monkeypatch.setattr(dvc.output, "build", counting)
    (toy / "params.yaml").write_text("a:\n  n: 2\nb:\n  m: 1\n")
    assert reproduce_all(toy, stages) == {"a": ("cached", "run-cache"), "b": ("cached", "run-cache")}
    assert builds["src/a.txt"] == 2, builds  # a's dependency
    assert builds["data/a"] == 4, builds  # a's output (save, commit: never held) and b's dependency
    assert (toy / "data/b.txt").read_text() == "XX" and "up to date" in dvc_status(toy)


def test_a_held_dependency_hash_is_computed_once_and_only_while_held(toy, monkeypatch):
    from dvc.repo import Repo

    reproduce_all(toy, Toy())
    monkeypatch.chdir(toy)
    with Repo(str(toy)) as repo:
        (stage,) = repo.stage.collect("dvc.yaml:a")
        (dep,) = [d for d in stage.deps if d.def_path == "src/a.txt"]
        (out,) = stage.outs
        before = dep.get_hash()
        with dvc_api.dependencies_hashed_once():
            (toy / "src/a.txt").write_text("y")
            changed = dep.get_hash()
            assert changed != before
            (toy / "src/a.txt").write_text("z")  # what a hold must never span: a dependency written
            assert dep.get_hash() == changed  # held
            with dvc_api.dependencies_hashed_once():  # nested: the outer block's hashes
                assert dep.get_hash() == changed
            dep.save()
            assert dep.hash_info == changed
            old_out = out.get_hash()
            (toy / "data/a/out.txt").write_text("other")
            assert out.get_hash() != old_out  # an output is never held: a restore writes it
        assert dep.get_hash() not in (before, changed)  # outside, hashed anew: "z"
        with dvc_api.dependencies_hashed_once():
            assert dep.get_hash() not in (before, changed)


def test_failed_stage_leaves_no_lock_entry_and_no_output(toy):
    def broken(root, name, parent_run_id):
        (root / "data/a").mkdir(parents=True, exist_ok=True)
        raise RuntimeError("killed mid-stage")

    with pytest.raises(RuntimeError):
        repro.reproduce(toy, "a", execute=broken)
    assert not (toy / "dvc.lock").exists()
    stages = Toy()
    assert repro.reproduce(toy, "a", execute=stages).status == "ran"


def test_override_workspace_shares_the_cache_and_leaves_params_yaml(toy):
    stages = Toy()
    reproduce_all(toy, stages)
    before = (toy / "params.yaml").read_bytes()
    ws = workspace.prepare(toy, {"a": {"n": 2}, "b": {"m": 3}})
    assert ws.parent == toy / ".qllm" / "runs"
    try:
        outcomes = reproduce_all(ws, stages)
    finally:
        repro.close(ws)
    # `a` has the same inputs as in the project: restored from the shared run-cache, not rerun.
    assert outcomes == {"a": ("cached", "run-cache"), "b": ("ran", "executed")}
    assert (ws / "data/b.txt").read_text() == "XXXXXX"
    assert (toy / "params.yaml").read_bytes() == before and (toy / "data/b.txt").read_text() == "XX"
    assert workspace.project_root(ws) == toy.resolve()
    assert workspace.prepare(toy, yaml.safe_load(before)) == toy.resolve()  # no overrides: the project itself


THREADS_IMPORTING = """
import threading
from pipelines.core.run import repro

barrier, errors = threading.Barrier(4), []

def stage(i):  # what run_in_process does first, then what the stage modules import
    barrier.wait()
    try:
        repro.warm_imports()
        if i % 2:
            from transformers import AutoModelForCausalLM
        else:
            from peft import get_peft_model
            from transformers import AutoTokenizer
    except Exception as exc:
        errors.append(repr(exc))

threads = [threading.Thread(target=stage, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("errors:", errors)
"""


def test_stages_starting_together_in_threads_import_transformers_safely():
    """transformers 5 resolves its names lazily and not thread-safely: without `warm_imports`
    this script failed 5 of 5 times here ("cannot import name 'AutoModel' from 'transformers'"),
    which is how `dpo` once died starting beside `lora` in `qllm run`. A fresh interpreter each
    time, since the race is only on first import."""
    import subprocess

    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", THREADS_IMPORTING], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[3], timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().endswith("errors: []"), done.stdout[-2000:]
