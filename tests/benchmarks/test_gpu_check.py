"""benchmarks.gpu_check: the device check's code paths at tiny sizes on the CPU (the CUDA run itself
needs a GPU: `make gpu-check`), its refusal without CUDA, and its table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import gpu_check
from tests.conftest import REPO


def test_without_cuda_it_says_what_to_run_instead(tmp_path):
    hidden = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device visible, as on a CPU machine, whatever this one has
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, env=hidden)
    assert done.returncode == 2
    assert "no CUDA device here" in done.stderr and "--device cpu --tiny" in done.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def test_unknown_sections_are_named(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--sections", "pretrain,warp", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and "--sections: unknown warp" in done.stderr


def check(tmp_path, sections: str) -> dict:
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--tiny", "--sections", sections, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["device"] == "cpu" and not [r for r in report["rows"] if r["what"] == "failed"]
    assert (out / "gpu_check.md").read_text().startswith("Device: cpu")
    return {(r["section"], r["what"]): r for r in report["rows"]}


@pytest.mark.slow
def test_the_lora_section_runs_the_real_size_stages_at_a_tiny_shape(tmp_path):
    rows = check(tmp_path, "lora")  # a tiny project through prepare_data, then LoRA and QLoRA in their own processes
    assert rows[("lora", "qwen2.5-tiny, QLoRA / LoRA memory")]["value"] > 0


def test_the_sections_run_at_tiny_sizes_and_write_the_json_and_the_table(tmp_path):
    rows = check(tmp_path, "pretrain,fp8,ddp")
    ours = next(r for (s, w), r in rows.items() if s == "pretrain" and "shared loop" in w)
    assert ours["value"] > 0 and "MFU" in ours["note"]
    assert rows[("fp8", "0.5B shape, quantization fp8")]["value"] == "skipped"
    ddp = next(r for (s, w), r in rows.items() if s == "ddp")
    assert "gloo" in ddp["what"] and ddp["value"] < ddp_first(ddp)  # five steps lowered the loss through DDP


def ddp_first(row: dict) -> float:
    return float(row["note"].split("first ")[1].split(",")[0])


def test_the_table_keeps_one_line_per_row():
    text = gpu_check.table([gpu_check.row("lora", "a | b", 1, "MB", "line\nbreak")])
    assert text.splitlines()[2] == "| lora | a | b | 1 | MB | line break |"
