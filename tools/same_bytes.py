"""The same outputs before and after a change that should change nothing (a move of code, a
rename): the whole pipeline run at two commits, each in a clone of its own, and every stage
output compared byte for byte (the suite's same-bytes test, across commits).

    python -m tools.same_bytes --before HEAD~3 --after HEAD [--params params/tiny.yaml] [--work /tmp/same]

Each clone runs `python -m qllm.cli run` with its own code (`--params` as given; none: the
default profile) under its own MLflow database. Prints one JSON line per output that differs, then
a summary; exits 1 where any does. What is compared is every stage output in the run's
`dvc.lock` (content hashes, as DVC computes them) except the metrics files, which hold timings.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from pipelines.core.workspace import RUNS_DIR

REPO = Path(__file__).resolve().parents[1]


def run_at(ref: str, dest: Path, params: list[str]) -> Path:
    """Clone this repository at `ref` into `dest`, run the pipeline there; the directory that holds
    the run's dvc.lock (the project, or its run workspace under .qllm/runs/)."""
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(dest)], check=True)
    subprocess.run(["git", "checkout", "--quiet", ref], cwd=dest, check=True)
    env = {**os.environ, "PYTHONPATH": str(dest), "DVC_NO_ANALYTICS": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    cli = "qllm.cli" if (dest / "qllm/cli.py").exists() else "flows.cli"  # the CLI moved in 0.2 (issue 79)
    command = [sys.executable, "-m", cli, "run", *[arg for path in params for arg in ("--params", path)]]
    done = subprocess.run(command, cwd=dest, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{ref}: {' '.join(command)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    locks = sorted(dest.glob(f"{RUNS_DIR}/*/dvc.lock")) or [dest / "dvc.lock"]
    return locks[0].parent


def outputs(root: Path) -> dict[str, str]:
    """`{output path: md5}` of every stage output in `root`'s dvc.lock, metrics files left out."""
    stages = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    spec = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    metrics = {next(iter(m)) if isinstance(m, dict) else m for body in spec.values() for m in body.get("metrics", [])}
    return {out["path"]: out["md5"] for body in stages.values() for out in body["outs"] if out["path"] not in metrics}


def differing(a: Path, b: Path) -> list[str]:
    """Files under output `a` whose bytes differ from (or are missing in) the same output `b`."""
    if a.is_file() or b.is_file():
        return [] if a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes() else [a.name]
    names = {p.relative_to(a) for p in a.rglob("*") if p.is_file()} | {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    return sorted(str(n) for n in names if not ((a / n).is_file() and (b / n).is_file() and (a / n).read_bytes() == (b / n).read_bytes()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.same_bytes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="a commit, branch or tag")
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--params", action="append", default=[], help="a profile each run merges (repeatable); none: the default profile")
    parser.add_argument("--work", default=None, help="where the two clones go (default: a temporary directory, removed after)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="same-bytes-") as scratch:
        work = Path(args.work or scratch)
        before, after = run_at(args.before, work / "before", args.params), run_at(args.after, work / "after", args.params)
        ours, theirs = outputs(before), outputs(after)
        changed = {path: differing(before / path, after / path) for path in sorted(set(ours) | set(theirs)) if ours.get(path) != theirs.get(path)}
        for path, files in changed.items():
            print(json.dumps({"output": path, "files": files[:20], "before": ours.get(path), "after": theirs.get(path)}))
        print(json.dumps({"before": args.before, "after": args.after, "params": args.params, "outputs": len(ours), "differing": len(changed)}))
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
