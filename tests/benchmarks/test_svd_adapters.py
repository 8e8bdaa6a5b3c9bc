"""The SVD-adapter benchmark: one row per shape, the ratio it prints, and the form the rule picks."""

from __future__ import annotations

from benchmarks import svd_adapters


def _rows(capsys, *args):
    assert svd_adapters.main(["--hidden", "16", "--trials", "1", "--tokens", "64", "--repeats", "2", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if line.startswith("| 16") or line.startswith("| 64")]


def test_the_benchmark_times_each_shape_of_a_block_and_names_the_form_the_rule_picks(capsys):
    rows = _rows(capsys)
    assert [row[0] for row in rows] == ["16 x 16", "16 x 64", "64 x 16"]
    assert [row[1] for row in rows] == ["0.7", "1.1", "1.1"]  # 16*16 / (12 * 32), 16*64 / (12 * 80)
    for row in rows:
        peft, factored, merged = (float(cell) for cell in row[2:5])
        assert min(peft, factored, merged) > 0
        low, high = (factored - 0.005) / (peft + 0.005), (factored + 0.005) / (peft - 0.005)  # the ms are printed to 0.01
        assert low - 0.005 <= float(row[5]) <= high + 0.005
    assert {row[8] for row in rows} == {"merged"}  # fp32 and small against rank 12


def test_under_bf16_autocast_the_rule_never_merges(capsys):
    assert {row[8] for row in _rows(capsys, "--precision", "bf16")} == {"factored"}
