"""`precision: auto`: the choice per device with the hardware mocked, the warning for emulated bf16,
and how stages and the loop use the resolved value."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from pipelines.core.params.training import TrainParams
from pipelines.core.training import precision


@pytest.fixture(autouse=True)
def fresh_capability():
    precision.capability.cache_clear()
    precision.cpu_bf16_slowdown.cache_clear()
    precision._warned.clear()
    yield
    precision.capability.cache_clear()
    precision.cpu_bf16_slowdown.cache_clear()
    precision._warned.clear()


def _cpu(monkeypatch, *, amx=False, avx512_bf16=False, onednn_bf16=True, slowdown=0.2):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "_device_type", lambda: "cpu")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn_bf16)
    monkeypatch.setattr(precision, "cpu_bf16_slowdown", lambda: slowdown)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"amx": True}, "bf16"),  # Sapphire Rapids and newer
        ({"avx512_bf16": True}, "bf16"),  # Cooper Lake, Zen 4
        ({}, "fp32"),  # AVX2-only (most laptops, EPYC before Zen 4), AVX-512 without BF16
        ({"amx": True, "onednn_bf16": False}, "fp32"),  # ONEDNN_MAX_CPU_ISA capped below bf16
    ],
)
def test_auto_on_cpu(monkeypatch, flags, expected):
    _cpu(monkeypatch, **flags)
    assert precision.resolve("auto") == expected
    assert precision.capability().auto == expected
    assert precision.capability().bf16_native is (expected == "bf16")


@pytest.mark.parametrize(("native", "expected"), [(True, "bf16"), (False, "fp16")])
def test_auto_on_cuda(monkeypatch, native, expected):
    monkeypatch.setattr(precision, "_device_type", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native)
    assert precision.resolve("auto") == expected


def test_auto_on_mps_is_fp32(monkeypatch):
    monkeypatch.setattr(precision, "_device_type", lambda: "mps")
    assert precision.resolve("auto") == "fp32"


def test_explicit_precisions_are_kept(monkeypatch):
    _cpu(monkeypatch, amx=True)
    assert [precision.resolve(p) for p in ("bf16", "fp16", "fp32")] == ["bf16", "fp16", "fp32"]
    with pytest.raises(ValueError, match="precision must be one of auto, bf16, fp16, fp32, not 'fp8'"):
        precision.resolve("fp8")


def test_explicit_bf16_on_emulating_cpu_warns_once_with_the_slowdown(monkeypatch, caplog):
    _cpu(monkeypatch, slowdown=78.0)
    with caplog.at_level(logging.WARNING, logger="qllm.precision"):
        assert precision.resolve("bf16", "sft") == "bf16"
        assert precision.resolve("bf16", "lora") == "bf16"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "sft: precision bf16 on a CPU without bf16 matrix units" in warnings[0]
    assert "took 78x as long as fp32 here; precision auto would choose fp32" in warnings[0]


def test_no_warning_where_bf16_is_native(monkeypatch, caplog):
    _cpu(monkeypatch, avx512_bf16=True)
    with caplog.at_level(logging.WARNING, logger="qllm.precision"):
        precision.resolve("bf16")
    assert not caplog.records


def test_measured_probe_is_a_positive_ratio():
    """The real probe (used only in the warning): a finite, positive ratio on this machine."""
    assert 0 < precision.cpu_bf16_slowdown() < 10_000


def test_auto_is_resolved_once_where_a_stage_starts_and_the_loop_refuses_it(monkeypatch):
    """The stage runner resolves `auto` (`run.stage`); the loop and autocast take what it chose
    and refuse `auto` itself, so no second place can choose differently."""
    from pipelines.core.params.training import TrainParams
    from pipelines.core.training import loop

    _cpu(monkeypatch)  # no bf16 units: auto is fp32, autocast a no-op
    with loop.autocast(torch.device("cpu"), precision.resolve("auto")):
        assert not torch.is_autocast_enabled("cpu")
    precision.capability.cache_clear()
    _cpu(monkeypatch, amx=True)
    with loop.autocast(torch.device("cpu"), precision.resolve("auto")):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    with pytest.raises(ValueError, match=r"precision is 'auto': resolve it first"):
        loop.autocast(torch.device("cpu"), "auto")
    with pytest.raises(ValueError, match=r"pretrain.train.precision is 'auto': resolve it first"):
        loop.train(torch.nn.Linear(2, 2), loop.causal_lm_loss, loop.Batches(4, 2, 0, lambda i: {}), TrainParams(), desc="pretrain")


def test_default_is_auto_and_params_yaml_uses_it():
    import yaml

    from tests.conftest import REPO

    assert TrainParams().precision == "auto"
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    assert {name: section["train"]["precision"] for name, section in data.items() if isinstance(section, dict) and "train" in section} == {
        name: "auto" for name in ("pretrain", "sft", "probe_lora", "lora", "dpo", "grpo", "multimodal")
    }


def test_stage_resolves_and_records_precision(monkeypatch):
    from pipelines.core.params.finetuning import FinetuneParams
    from pipelines.core.run import stage

    _cpu(monkeypatch)
    params = FinetuneParams()
    resolved = stage.resolve_precision("sft", params)
    assert params.train.precision == "auto"
    assert resolved.train.precision == "fp32"
    assert resolved.model_copy(update={"train": params.train}) == params  # only the precision changed


# --- probe_device remembers the answer per machine (no torch import on a no-change run) -------------


def test_probe_device_remembers_the_answer_until_the_machine_changes(monkeypatch, tmp_path):
    from pipelines import probe_device

    for name in probe_device.ENVIRONMENT:  # the machine as it is (CI caps it to AVX2; the test sets the cap itself below)
        monkeypatch.delenv(name, raising=False)
    _cpu(monkeypatch, amx=True)
    asked = []
    real = precision.capability
    monkeypatch.setattr(precision, "capability", lambda: asked.append(1) or real())
    cache = tmp_path / ".qllm/device-probe.json"
    out = tmp_path / "device.json"
    assert probe_device.run(out, cache) == ({"device": "cpu", "bf16_native": True, "auto": "bf16"}, False)
    assert probe_device.run(out, cache) == ({"device": "cpu", "bf16_native": True, "auto": "bf16"}, True)
    assert len(asked) == 1  # the second answer came from the cache
    assert json.loads(out.read_text()) == json.loads(cache.read_text())["capability"] == {"device": "cpu", "bf16_native": True, "auto": "bf16"}
    # A cap on the CPU's instruction sets changes what torch finds: asked again, and told fp32 now.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    _cpu(monkeypatch, amx=True, onednn_bf16=False)
    real.cache_clear()
    assert probe_device.run(out, cache) == ({"device": "cpu", "bf16_native": False, "auto": "fp32"}, False)
    assert len(asked) == 2
    cache.write_text("{not json")  # a damaged cache is asked anew and rewritten
    assert probe_device.run(out, cache)[1] is False and probe_device.run(out, cache)[1] is True


def test_probe_device_without_readable_cpu_flags_asks_torch_every_time(tmp_path):
    from pipelines import probe_device

    assert probe_device.environment_key(tmp_path / "no-cpuinfo") is None
    assert probe_device.environment_key() is not None  # Linux: /proc/cpuinfo


def test_a_known_machine_is_probed_without_importing_torch(tmp_path):
    import subprocess
    import sys

    script = ("import sys; from pathlib import Path; from pipelines import probe_device; "
              f"cap, cached = probe_device.run(Path({str(tmp_path / 'd.json')!r}), Path({str(tmp_path / 'c.json')!r})); "
              "print(cached, 'torch' in sys.modules)")  # fmt: skip
    outputs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split() for _ in range(2)]
    assert outputs == [["False", "True"], ["True", "False"]]
