"""tools.gpu_check: the device check's code paths at tiny sizes on the CPU (the CUDA run itself
needs a GPU: docs/development.md), its core without DVC, Prefect and MLflow, its refusal without
CUDA, and its table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tools import gpu_check


def test_without_cuda_it_says_what_to_run_instead(tmp_path):
    hidden = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device visible, as on a CPU machine, whatever this one has
    done = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, env=hidden)
    assert done.returncode == 2
    assert "no CUDA device here" in done.stderr and "--device cpu --tiny" in done.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def test_unknown_sections_and_sections_of_the_other_part_are_named(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "tools.gpu_check", *args, "--device", "cpu", "--out", str(tmp_path)], cwd=REPO,
                              capture_output=True, text=True)  # fmt: skip

    done = run("--sections", "pretrain,warp")
    assert done.returncode == 2 and "--sections: warp not in check" in done.stderr
    done = run("pipeline", "--sections", "pretrain")
    assert done.returncode == 2 and "--sections: pretrain not in pipeline (its sections: pipeline)" in done.stderr
    # refused before torch is imported (a second or more on a CPU): with torch unimportable, the same refusal
    blocked = tmp_path / "no_torch"
    blocked.mkdir()
    (blocked / "torch.py").write_text("raise ImportError('torch imported before the sections were checked')\n")
    done = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--sections", "warp", "--device", "cpu", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(blocked)})  # fmt: skip
    assert done.returncode == 2 and "--sections: warp not in check" in done.stderr, done.stderr[-2000:]


def check(tmp_path, sections: str, part: str = "core") -> dict:
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "tools.gpu_check", part, "--device", "cpu", "--tiny", "--sections", sections, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((out / f"{part}.json").read_text())
    assert report["device"] == "cpu" and report["part"] == part and not [r for r in report["rows"] if r["what"] == "failed"]
    assert (out / f"{part}.md").read_text().startswith(f"Device: cpu, torch {report['torch']}, part {part}")
    return {(r["section"], r["what"]): r for r in report["rows"]}


@pytest.mark.slow
def test_the_lora_section_runs_the_real_size_stages_at_a_tiny_shape(tmp_path):
    rows = check(tmp_path, "lora")  # the data stages untracked, then LoRA and QLoRA in their own (guarded) processes
    assert rows[("lora", "qwen2.5-tiny, QLoRA / LoRA memory")]["value"] > 0


def test_the_core_runs_its_sections_with_dvc_prefect_and_mlflow_absent(tmp_path):
    """The core's process refuses the orchestration packages (as the device machine lacks them), so
    any import of them on its path fails a row and this test."""
    rows = check(tmp_path, "pretrain,fp8,ddp,real")
    ours = next(r for (s, w), r in rows.items() if s == "pretrain" and "shared loop" in w)
    assert ours["value"] > 0 and "MFU" in ours["note"]
    assert rows[("fp8", "0.5B shape, quantization fp8")]["value"] == "skipped"
    ddp = next(r for (s, w), r in rows.items() if s == "ddp")
    assert "gloo" in ddp["what"] and ddp["value"] < ddp_first(ddp)  # five steps lowered the loss through DDP
    for stage in ("pretrain", "sft", "dpo", "grpo"):  # the real-model profile's stages, two steps each at --tiny
        real = rows[("real", f"smollm2 profile, {stage}")]
        assert real["unit"] == "s/step" and real["value"] > 0 and real["note"].startswith("2 steps, "), real


def test_refused_orchestration_is_absent_to_probes_and_fails_imports():
    code = (
        "import importlib.util, sys\n"
        "from tools import gpu_check\n"
        "gpu_check.refuse_orchestration()\n"
        "assert all(importlib.util.find_spec(n) is None for n in gpu_check.ORCHESTRATION)\n"  # how accelerate and transformers probe
        "from pipelines.core.run import stage\n"
        "try:\n"
        "    stage.execute('prepare_data', lambda ctx: {}, '.')\n"  # the tracked path opens an MLflow run
        "except ModuleNotFoundError as exc:\n"
        "    print('refused:', exc.name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "refused: mlflow"


def test_stages_run_untracked_in_a_bare_project(tmp_path):
    """No git, no DVC, no MLflow store: the data stages' outputs and metrics files, mlflow_run_id null."""
    project = gpu_check.bare_project(tmp_path / "p", ["params/tiny.yaml"], ["prepare_data.validation_fraction=0.25"])
    done = gpu_check.run_stages(project, ("prepare_data",))
    assert list(done) == ["sample_data", "ingest", "prepare_data"]
    metrics = json.loads((project / "data/metrics/prepare_data.json").read_text())
    assert metrics["mlflow_run_id"] is None and metrics["seconds"] > 0
    assert (
        (project / "data/prepared/chat").is_dir()
        and not (project / "mlflow.db").exists()
        and not (project / ".dvc").exists()
    )
    import pyarrow.parquet as pq

    rows = {
        split: pq.read_metadata(project / f"data/prepared/chat/{split}.parquet").num_rows
        for split in ("train", "validation")
    }
    assert (
        rows["validation"] / (rows["train"] + rows["validation"]) > 0.1
    )  # the override reached the stage (by default 3 of 84: 0.05 asked)


def ddp_first(row: dict) -> float:
    return float(row["note"].split("first ")[1].split(",")[0])


def test_the_table_keeps_one_line_per_row():
    text = gpu_check.table([gpu_check.row("lora", "a | b", 1, "MB", "line\nbreak")])
    assert text.splitlines()[2] == "| lora | a | b | 1 | MB | line break |"
