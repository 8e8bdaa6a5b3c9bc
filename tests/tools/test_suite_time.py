"""tools.suite_time and the times tests/conftest.py records (QLLM_SUITE_TIMES)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests import numerics
from tests.conftest import REPO
from tools import suite_time


def test_a_session_records_its_modules_tests_wall_time_and_cpu(tmp_path):
    times = tmp_path / "times.json"
    module = "tests/core/test_outputs.py"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module], cwd=REPO, capture_output=True, text=True,
                          env=outside_xdist() | {"QLLM_SUITE_TIMES": str(times)})  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:]
    record = json.loads(times.read_text())
    passed = int(done.stdout.strip().splitlines()[-1].split(" passed")[0].split()[-1])
    assert record["outcomes"]["passed"] == passed and record["outcomes"]["failed"] == 0
    assert set(record["modules"]) == {module} and len(record["tests"]) == passed
    # the same reports' seconds summed per module and per test then over tests: float64 in another order, 3 reports a test
    assert record["modules"][module] == numerics.approx(sum(record["tests"].values()), n=3 * len(record["tests"]), dtype=torch.float64)
    assert 0 < record["modules"][module] <= record["wall_seconds"]
    assert record["cpu"] and record["workers"] == 0  # no xdist here


def outside_xdist() -> dict[str, str]:
    """This environment without the xdist worker's variables: a session started from a worker's
    test is a session of its own, not a worker of ours."""
    return {key: value for key, value in os.environ.items() if not key.startswith(("PYTEST_XDIST_", "PYTEST_CURRENT_TEST"))}


def _record(wall: float, modules: dict, tests: dict, cap=None, cpu="AMD EPYC, AVX512-BF16") -> dict:
    return {"cpu": cpu, "isa_cap": cap, "workers": 2, "wall_seconds": wall, "outcomes": {"passed": 3, "failed": 0},
            "modules": modules, "tests": tests}  # fmt: skip


def test_the_report_ranks_shares_and_compares():
    before = _record(1800.0, {"a.py": 900.0, "b.py": 100.0}, {"a.py::t": 900.0, "b.py::u": 100.0})
    after = _record(900.0, {"a.py": 300.0, "c.py": 100.0}, {"a.py::t": 300.0, "c.py::v": 100.0}, cap="AVX2")
    alone = suite_time.report(after, top=1)
    assert "- 15 min 00.0 s on AMD EPYC, AVX512-BF16, capped to AVX2 (imitated), 2 workers; 3 passed" in alone
    assert "| 300.0 | 75.0% | `a.py` |" in alone and "c.py`" not in alone  # top 1 of 2; 300 of 400 s
    both = suite_time.report(after, before, top=2)
    assert "(**0.50x** the wall time)" in both
    assert "| 900.0 | 300.0 | 0.33 | `a.py` |" in both
    assert "| - | 100.0 | - | `c.py` |" in both and "| 100.0 | gone | - | `b.py` |" in both


def test_the_cap_on_an_avx2_only_cpu_is_not_called_an_imitation():
    """`.ci/run` caps every machine to AVX2; on a CPU with nothing beyond AVX2 the figure is the real
    slow kind's, and a report that called it imitated would invite the 2.2x factor a second time."""
    real = suite_time.describe(_record(852.1, {}, {}, cap="AVX2", cpu="AMD EPYC, AVX2 only"))
    assert real == "14 min 12.1 s on AMD EPYC, AVX2 only, capped to AVX2 (its own kind: the real one, not imitated), 2 workers; 3 passed"
    uncapped = suite_time.describe(_record(600.0, {}, {}, cpu="AMD EPYC, AVX2 only"))
    assert uncapped == "10 min 00.0 s on AMD EPYC, AVX2 only, 2 workers; 3 passed"
    native = suite_time.describe(_record(600.0, {}, {}, cap="AVX2", cpu="Intel Xeon, AMX"))
    assert native.endswith("capped to AVX2 (imitated), 2 workers; 3 passed")


def test_a_file_that_is_not_a_record_is_named(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"modules": {}}))
    with pytest.raises(SystemExit, match=r"x.json: missing cpu, wall_seconds, tests \(written by QLLM_SUITE_TIMES=FILE make test\)"):
        suite_time.load(bad)
    bad.write_text("{")
    with pytest.raises(SystemExit, match="x.json: not a suite-times file"):
        suite_time.load(bad)


def test_make_test_hands_out_the_longest_modules_first():
    """`tests/conftest.py` collects `LONGEST_FIRST` first, longest first, and `make test` keeps that
    order: pytest-xdist's default `--loadscope-reorder` sorts modules by their number of tests,
    which put these (a few long tests each) last, one of them running alone at the end."""
    from tests.conftest import LONGEST_FIRST

    assert all((REPO / path).is_file() for path in LONGEST_FIRST)  # a renamed module would be silently unordered
    dry = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    command = next(line for line in dry.splitlines() if " -m pytest" in line)
    assert "--dist loadscope --no-loadscope-reorder" in command, command
    modules = ["tests/core/test_outputs.py", LONGEST_FIRST[3], LONGEST_FIRST[2]]  # [0] and [1] are the slow set's: deselected here
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *modules], cwd=REPO, capture_output=True,
                          text=True, env=outside_xdist())  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:]
    order = list(dict.fromkeys(line.split("::")[0] for line in done.stdout.splitlines() if "::" in line))
    assert order == [LONGEST_FIRST[2], LONGEST_FIRST[3], "tests/core/test_outputs.py"]
