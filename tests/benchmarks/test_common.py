"""benchmarks.common: the machine line, the per-seed loop and the mean ± sd summary the benchmarks share."""

from __future__ import annotations

import json

from benchmarks import common


def test_mean_sd_is_the_sample_spread_formatted_as_the_benchmarks_printed_it():
    assert common.sd([1.0, 2.0, 3.0]) == 1.0 and common.sd([5.0]) == 0.0
    assert common.mean_sd([0.25, 0.5, 0.75]) == "0.5000 +- 0.2500"
    assert common.mean_sd([0.812, 0.834], ".1f", scale=100, with_range=True) == "82.3 +- 1.6 [81.2, 83.4]"
    assert common.mean_sd([1.5, 1.7], ".4g", ".2g", with_range=True) == "1.6 +- 0.14 [1.5, 1.7]"
    assert common.mean_sd(iter([3.0])) == "3.0000 +- 0.0000"  # one seed: no spread


def test_per_seed_runs_each_seed_in_its_own_scratch_and_records_every_row(tmp_path, capsys):
    jsonl, seen = tmp_path / "runs.jsonl", []

    def run(seed, scratch):
        assert scratch.is_dir() and not any(scratch.iterdir())
        (scratch / "out").write_text("x")
        seen.append(scratch)
        return {"seed": seed, "value": seed / 2}

    rows = common.per_seed([0, 1, 2], run, jsonl=jsonl, extra={"label": "a"})
    assert rows == [{"seed": s, "value": s / 2, "label": "a"} for s in (0, 1, 2)]
    assert len(set(seen)) == 3 and not any(p.exists() for p in seen)  # a fresh directory each, removed after
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == rows and [json.loads(line) for line in jsonl.read_text().splitlines()] == rows
    common.record({"seed": 3}, jsonl)
    assert json.loads(jsonl.read_text().splitlines()[-1]) == {"seed": 3}


def test_the_machine_line_names_the_cpu_and_its_kind():
    assert common.cpu_kind({"amx_bf16", "avx512_bf16", "avx2"}) == "AMX"
    assert common.cpu_kind({"avx512_bf16", "avx2"}) == "AVX512-BF16"
    assert common.cpu_kind({"avx2"}) == "AVX2 only" and common.cpu_kind(set()) == "no AVX2"
    name = common.cpu_name()
    assert name and common.cpu() == f"{name}, {common.cpu_kind()}"  # tools.suite_time reads the kind off its end
    assert common.machine_line().startswith(f"{name}, torch ") and common.machine_line().endswith(" threads")
    assert (common.REPO / "benchmarks" / "common.py").exists()
