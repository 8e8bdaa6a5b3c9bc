"""Where `make test`'s time goes: the slowest modules and tests of a recorded run, next to the CPU,
and a run against another (before/after) for benchmarks/results/suite.md.

    QLLM_SUITE_TIMES=suite.json make test                          # the suite records its times (tests/conftest.py)
    python -m tools.suite_time suite.json                          # markdown: the run, slowest modules and tests
    python -m tools.suite_time after.json --before before.json     # the same with before, after and after/before

A module's time is its tests' setup, call and teardown summed: under `--dist loadscope` one worker
runs a whole module, so it is that worker's wall time for it. The run's wall time is the session's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KEYS = ("cpu", "wall_seconds", "modules", "tests")


def load(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"suite_time: {path}: not a suite-times file ({exc})") from None
    missing = [key for key in KEYS if key not in record]
    if missing:
        raise SystemExit(f"suite_time: {path}: missing {', '.join(missing)} (written by QLLM_SUITE_TIMES=FILE make test)")
    return record


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:04.1f} s"


def describe(record: dict) -> str:
    cap = ""
    if record.get("isa_cap"):  # `.ci/run` caps every machine; on an AVX2-only CPU that imitates nothing
        own = record["isa_cap"].upper() == "AVX2" and record["cpu"].endswith(", AVX2 only")
        cap = f", capped to {record['isa_cap']} ({'its own kind: the real one, not imitated' if own else 'imitated'})"
    outcomes = ", ".join(f"{n} {kind}" for kind, n in record.get("outcomes", {}).items() if n)
    workers = record.get("workers") or 1
    return f"{_minutes(record['wall_seconds'])} on {record['cpu']}{cap}, {workers} workers; {outcomes}"


def slowest(times: dict[str, float], top: int) -> list[tuple[str, float]]:
    return sorted(times.items(), key=lambda item: (-item[1], item[0]))[:top]


def report(after: dict, before: dict | None = None, top: int = 25) -> str:
    lines = []
    if before is not None:
        lines += [f"- before: {describe(before)}", f"- after: {describe(after)} "
                  f"(**{after['wall_seconds'] / before['wall_seconds']:.2f}x** the wall time)", ""]  # fmt: skip
    else:
        lines += [f"- {describe(after)}", ""]
    for kind in ("modules", "tests"):
        total = sum(after[kind].values())
        lines.append(f"The {top} slowest {kind} ({'summed' if kind == 'modules' else 'setup + call + teardown'}, seconds; all {len(after[kind])} sum to {total:.0f} s):")
        lines.append("")
        if before is None:
            lines += ["| seconds | share | " + kind[:-1] + " |", "|---:|---:|---|"]
            lines += [f"| {s:.1f} | {100 * s / total:.1f}% | `{name}` |" for name, s in slowest(after[kind], top)]
        else:
            names = [name for name, _ in slowest(after[kind], top)]
            names += [name for name, _ in slowest(before[kind], top) if name not in names]
            lines += ["| before | after | after/before | " + kind[:-1] + " |", "|---:|---:|---:|---|"]
            for name in names:
                was, now = before[kind].get(name), after[kind].get(name)
                ratio = f"{now / was:.2f}" if was and now is not None else "-"
                lines.append(f"| {'-' if was is None else f'{was:.1f}'} | {'gone' if now is None else f'{now:.1f}'} | {ratio} | `{name}` |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.suite_time", description=__doc__.split("\n\n")[0])
    parser.add_argument("after", type=Path, help="a run's times (QLLM_SUITE_TIMES=FILE make test)")
    parser.add_argument("--before", type=Path, help="an earlier run's, to compare with")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    print(report(load(args.after), load(args.before) if args.before else None, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
