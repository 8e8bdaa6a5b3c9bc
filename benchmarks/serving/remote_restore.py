"""A second machine against the first: `qllm run` restoring every stage from a DVC remote, against
training from scratch, and the bytes the remote holds.

    python -m benchmarks.serving.remote_restore --remote ssh://USER@HOST:PORT/PATH [--keyfile KEY] [--remote-dir PATH] [--params params/tiny.yaml]

Two fresh clones of this repository under a temporary directory, each with its own HOME (the
caller's `~/.ssh/known_hosts` copied in), DVC cache, MLflow store and no `dvc.lock`, sharing only
the remote: the first runs `qllm run` (training everything, pushing each stage as it finishes),
the second runs `qllm run` (restoring). Each is a `qllm run` process, timed whole. `--remote-dir`,
where the remote is a directory on this machine (an SSH server on 127.0.0.1), sums the bytes it
holds; the second clone's DVC cache afterwards is what it downloaded. `--baseline` also times a
third clone's `qllm run` without a remote (what pushing costs the first). Prints the wall times,
their ratio and the stages each ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO


def sh(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, check=True, capture_output=True, text=True)


def clone(dest: Path, remote: str | None, keyfile: str | None) -> tuple[Path, dict]:
    sh(["git", "clone", "-q", str(REPO), str(dest)], REPO)
    home = dest.parent / f"{dest.name}-home"
    (home / ".ssh").mkdir(parents=True)
    known = Path.home() / ".ssh/known_hosts"
    if known.exists():
        shutil.copy(known, home / ".ssh/known_hosts")
    if remote:
        sh([sys.executable, "-m", "dvc", "remote", "add", "-f", "-d", "--local", "team", remote], dest)
    if remote and keyfile:
        sh([sys.executable, "-m", "dvc", "remote", "modify", "--local", "team", "keyfile", keyfile], dest)
    return dest, os.environ | {"HOME": str(home), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def qllm_run(root: Path, env: dict, params: list[str]) -> tuple[float, dict]:
    started = time.perf_counter()
    args = [sys.executable, "-m", "qllm.cli", "run", "--summary-json", "summary.json"] + [a for p in params for a in ("--params", p)]
    done = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"qllm run failed in {root}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    summary = json.loads((root / "summary.json").read_text())
    return seconds, {s["name"]: s["status"] for s in summary["stages"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--remote", required=True, help="the DVC remote URL both clones share")
    parser.add_argument("--keyfile", help="an SSH key for the remote")
    parser.add_argument("--remote-dir", type=Path, help="the remote's directory, where it is on this machine: its size is reported")
    parser.add_argument("--params", action="append", default=[], help="params files for both runs (e.g. params/tiny.yaml)")
    parser.add_argument("--baseline", action="store_true", help="also time a clone without a remote")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            alone, alone_env = clone(Path(tmp) / "alone", None, None)
            baseline, _ = qllm_run(alone, alone_env, args.params)
            print(f"a clone without a remote: {baseline:.1f} s", flush=True)
        first, first_env = clone(Path(tmp) / "first", args.remote, args.keyfile)
        trained, first_stages = qllm_run(first, first_env, args.params)
        print(f"first clone (trains, pushes): {trained:.1f} s, ran {sorted(n for n, s in first_stages.items() if s == 'ran')}", flush=True)
        second, second_env = clone(Path(tmp) / "second", args.remote, args.keyfile)
        restored, second_stages = qllm_run(second, second_env, args.params)
        downloaded = sum(f.stat().st_size for f in (second / ".dvc/cache").rglob("*") if f.is_file())
    held = sum(f.stat().st_size for f in args.remote_dir.rglob("*") if f.is_file()) if args.remote_dir else None
    print(f"second clone (restores): {restored:.1f} s, ran {sorted(n for n, s in second_stages.items() if s == 'ran')}; "
          f"its DVC cache afterwards {downloaded / 1e6:.2f} MB")
    print(f"restore / train: {restored / trained:.3f}" + (f"; the remote holds {held / 1e6:.2f} MB" if held is not None else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
