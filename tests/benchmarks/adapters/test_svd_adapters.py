"""The adapter-layer benchmark (SVD form and plain LoRA): one row per shape, the size it prints, and
the form the rule picks."""

from __future__ import annotations

import re

from benchmarks.adapters import svd_adapters


def _rows(capsys, *args):
    assert svd_adapters.main(["--hidden", "16", "--trials", "1", "--tokens", "64", "--repeats", "2", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if re.match(r"\| \d+ x \d+ \|", line)]


def test_the_benchmark_times_each_shape_of_a_block_and_names_the_form_the_rule_picks(capsys):
    rows = _rows(capsys)
    assert [row[0] for row in rows] == ["16 x 16", "16 x 64", "64 x 16"]
    assert [row[1] for row in rows] == ["8.0", "12.8", "12.8"]  # 16*16 / 32, 16*64 / 80
    for row in rows:
        peft, factored, merged = (float(cell) for cell in row[2:5])
        assert min(peft, factored, merged) > 0
        low, high = (factored - 0.005) / (peft + 0.005), (factored + 0.005) / (peft - 0.005)  # the ms are printed to 0.01
        assert low - 0.005 <= float(row[5]) <= high + 0.005
    assert {row[8] for row in rows} == {"merged"}  # fp32 and small weights


def test_under_bf16_autocast_the_rule_never_merges(capsys):
    assert {row[8] for row in _rows(capsys, "--precision", "bf16")} == {"factored"}


def test_plain_lora_layers_are_timed_and_the_rule_picks_by_size_alone(capsys):
    rows = _rows(capsys, "--kind", "lora", "--rank", "4", "--hidden", "160", "162", "--tokens", "648")
    assert [row[0] for row in rows] == ["160 x 160", "160 x 640", "640 x 160", "162 x 162", "162 x 648", "648 x 162"]
    assert [row[1] for row in rows] == ["80.0", "128.0", "128.0", "81.0", "129.6", "129.6"]
    assert all(float(cell) > 0 for row in rows for cell in row[2:5])
    assert [row[8] for row in rows] == ["merged"] * 4 + ["factored"] * 2  # 128 the largest merged (648 tokens: at least d_in)
