"""Atomic outputs: complete or absent, never half-written."""

from __future__ import annotations

import os

import pytest

from pipelines.core.outputs import atomic_dir, atomic_file, read_json, write_json


def test_atomic_dir_replaces_only_on_success(tmp_path):
    out = tmp_path / "out"
    with atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("1")
    assert (out / "a.txt").read_text() == "1"
    with pytest.raises(RuntimeError), atomic_dir(out) as tmp:
        (tmp / "b.txt").write_text("partial")
        raise RuntimeError("crash mid-write")
    assert sorted(p.name for p in out.iterdir()) == ["a.txt"]  # the old complete output survives
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary left behind


def test_stale_temporaries_of_a_killed_run_are_cleaned(tmp_path):
    (tmp_path / ".tmp-out-abc").mkdir()  # an older run's (no process id)
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "x").write_text("")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_live_writers_temporary_is_not_stale(tmp_path):
    """Two runs writing one shared file at once: neither removes the other's work in progress."""
    import os
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    dead = tmp_path / f".tmp-m.json-{gone.stdout.strip()}-dead1"
    live = tmp_path / f".tmp-m.json-{os.getppid()}-live1"  # a live process (our parent), writing right now
    longer = tmp_path / ".tmp-m.json-x-abc"  # not ours: a temporary of "m.json-x"
    for path in (dead, live, longer):
        path.write_text("")
    write_json(tmp_path / "m.json", {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m.json", live.name, longer.name])
    with atomic_file(tmp_path / "n.json") as tmp:
        assert tmp.name.startswith(f".tmp-n.json-{os.getpid()}-")


def test_atomic_file_and_json(tmp_path):
    write_json(tmp_path / "m.json", {"b": 1, "a": 2})
    assert (tmp_path / "m.json").read_text() == '{\n  "a": 2,\n  "b": 1\n}\n'
    assert read_json(tmp_path / "m.json") == {"a": 2, "b": 1}
    with pytest.raises(ValueError), atomic_file(tmp_path / "m.json") as tmp:
        tmp.write_text("garbage")
        raise ValueError
    assert read_json(tmp_path / "m.json") == {"a": 2, "b": 1}


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_finished_outputs_have_the_permissions_of_a_plain_write(tmp_path, umask):
    """Not the owner-only ones of Python's temporaries: on a shared checkout the team reads them."""
    import stat

    old = os.umask(umask)
    try:
        with atomic_dir(tmp_path / "out") as tmp:
            (tmp / "model.txt").write_text("weights")
        write_json(tmp_path / "out.json", {"a": 1})
        (tmp_path / "plain").mkdir()
        (tmp_path / "plain.json").write_text("{}")
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(tmp_path / "out") == mode(tmp_path / "plain") == 0o777 & ~umask
    assert mode(tmp_path / "out.json") == mode(tmp_path / "plain.json") == mode(tmp_path / "out/model.txt") == 0o666 & ~umask


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_a_secret_file_is_owner_only_from_its_first_byte(tmp_path, umask, monkeypatch):
    """`write_private` (the team profile's passwords, a workspace's remote credentials): the new
    text lands in a file created 0600 and renamed over the old one, so an existing file readable
    by others never holds it, not even while it is written (the old way opened it with O_TRUNC and
    chmodded after)."""
    import stat

    from pipelines.core.outputs import write_private

    path = tmp_path / "secrets.json"
    path.write_text("old")
    os.chmod(path, 0o644)
    seen = []
    real_write = os.fdopen

    def spying_fdopen(fd, *args, **kwargs):  # the mode of the file the secret is written into, while it is written
        seen.append(stat.S_IMODE(os.fstat(fd).st_mode))
        return real_write(fd, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", spying_fdopen)
    old = os.umask(umask)
    try:
        write_private(path, '{"password": "s3cret"}')
    finally:
        os.umask(old)
    assert seen == [0o600] and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == '{"password": "s3cret"}' and sorted(p.name for p in tmp_path.iterdir()) == ["secrets.json"]
