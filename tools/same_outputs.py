"""The md5 of every stage output of the tiny profile at a commit: proof that a refactor changed no output.

    python -m tools.same_outputs [--commit REV] [--save FILE] [--against FILE]

Clones the repository at `REV` (default HEAD) into a temporary directory, runs
`qllm run --params params/tiny.yaml` there with this interpreter, and prints `path md5` for every
output in the run workspace's `dvc.lock`: models, tokenizer, tokenized data, reference log-probs,
evaluation and so on (DVC's md5s, `<md5>.dir` for directories). Metrics files hold timings and
`data/device.json` the machine, so both are left out. `--save` writes the listing; `--against` compares
with a saved one and exits 1 on any difference. Training is deterministic on one machine: compare
listings taken on the same machine (and the same `precision: auto`).

Example (issue 16, no behaviour change): before the restructure
`python -m tools.same_outputs --commit 4b3789b --save before.txt`, after it
`python -m tools.same_outputs --against before.txt`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
LEFT_OUT = ("data/metrics/", "data/device.json")


def listing(commit: str) -> dict[str, str]:
    with tempfile.TemporaryDirectory(prefix="qllm-same-outputs-") as tmp:
        clone = Path(tmp) / "repo"
        subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
        subprocess.run(["git", "checkout", "--quiet", commit], cwd=clone, check=True)
        env = {**os.environ, "PYTHONPATH": str(clone), "DVC_NO_ANALYTICS": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        qllm = [sys.executable, "-c", "import sys; from qllm.cli import main; sys.exit(main())"]
        subprocess.run([*qllm, "run", "--params", "params/tiny.yaml"], cwd=clone, env=env, check=True, stdout=subprocess.DEVNULL)
        (workspace,) = (clone / ".qllm" / "runs").iterdir()
        lock = yaml.safe_load((workspace / "dvc.lock").read_text())["stages"]
    return {
        out["path"]: out["md5"]
        for entry in lock.values()
        for out in entry.get("outs", ())
        if not out["path"].startswith(LEFT_OUT)
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commit", default="HEAD", help="revision to clone and run (default HEAD; commit your change first)")
    parser.add_argument("--save", type=Path, help="write the listing here")
    parser.add_argument("--against", type=Path, help="compare with a saved listing; exit 1 on a difference")
    args = parser.parse_args(argv)
    outputs = listing(args.commit)
    text = "".join(f"{path} {md5}\n" for path, md5 in sorted(outputs.items()))
    print(text, end="")
    if args.save:
        args.save.write_text(text)
    if args.against:
        before = dict(line.split() for line in args.against.read_text().splitlines() if line.strip())
        changed = sorted(p for p in before.keys() | outputs.keys() if before.get(p) != outputs.get(p))
        for path in changed:
            print(f"CHANGED {path}: {before.get(path)} -> {outputs.get(path)}", file=sys.stderr)
        print(f"{len(outputs) - len(changed)} of {len(before.keys() | outputs.keys())} outputs have the same md5", file=sys.stderr)
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
