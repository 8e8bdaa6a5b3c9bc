"""QLoRA: a 4-/8-bit frozen base under full-precision adapters (bitsandbytes, here on the CPU)."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoConfig

from pipelines import lora
from pipelines.core.errors import QllmError
from pipelines.core.models import quantize
from pipelines.core.params import files as params_file
from pipelines.core.params.finetuning import LoraAdapterParams, LoraParams
from pipelines.core.params.training import TrainParams
from tests import numerics
from tests.conftest import REPO, record_dpo_losses
from tests.stages.test_dpo import FORMULA, cached_magnitude, logp_tolerance

bnb = pytest.importorskip("bitsandbytes")  # a declared dependency; skipped only in a bare checkout

TRAIN = TrainParams(max_steps=4, micro_batch_size=4, warmup_steps=1, lr=0.01, eval_every=2, eval_batches=1, checkpoint_every=2,
                    keep_checkpoints=3, precision="fp32")


@pytest.fixture(scope="module")
def qbase(tiny_base, tmp_path_factory):
    """tiny_base's chats and tokenizer with a model of 64-wide layers: one 4-bit block per row, so
    the backbone-bytes figures mean something."""
    from pipelines.core.models.models import build_llama, load_tokenizer, save_pretrained
    from pipelines.core.params.pretraining import ModelParams

    root = tmp_path_factory.mktemp("qbase")
    tokenizer = load_tokenizer(tiny_base / "model")
    model = build_llama(ModelParams(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=2), tokenizer, max_positions=128, seed=0)
    save_pretrained(model, tokenizer, root / "model", max_length=128)
    (root / "chat").symlink_to(tiny_base / "chat")
    (root / "preference").symlink_to(tiny_base / "preference")
    return root


def params(base, quantization="nf4", **kw) -> LoraParams:
    adapter = {"quantization": quantization, "r": 4, "lora_alpha": 8, "lora_dropout": 0.0} | {k: kw.pop(k) for k in list(kw) if k in LoraAdapterParams.model_fields}
    return LoraParams(base_model=str(base / "model"), allocation="uniform", adapter=adapter, train=kw.pop("train", TRAIN), **kw)


# ------------------------------------------------------------------------ capability and config


def test_fp8_needs_a_recent_cuda_device(monkeypatch):
    with pytest.raises(QllmError, match=r"lora.adapter.quantization: fp8 needs a CUDA device of compute capability 8.9 or newer .* trains on cpu; use nf4 or int8"):
        quantize.check("fp8", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(QllmError, match=r"fp8 needs compute capability 8.9 or newer; NVIDIA A100 has 8.0"):
        quantize.check("fp8", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    quantize.check("fp8", torch.device("cuda"))  # H100: fine


def test_missing_or_old_bitsandbytes_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(QllmError, match=r"dpo.adapter.quantization: nf4 needs bitsandbytes \(pip install 'bitsandbytes>=0.48'\)"):
        quantize.check("nf4", torch.device("cpu"), "dpo.adapter")
    monkeypatch.setitem(sys.modules, "bitsandbytes", bnb)
    monkeypatch.setattr(bnb, "__version__", "0.45.5")
    with pytest.raises(QllmError, match=r"bitsandbytes 0.45.5 has no CPU backend for int8 .*>= 0.48"):
        quantize.check("int8", torch.device("cpu"))
    quantize.check("int8", torch.device("cuda"))  # the CUDA backend has been there all along


def test_4bit_trains_and_validates_a_model_with_32_wide_layers(tiny_base, tmp_path):
    """bitsandbytes' repacked CPU inference layout fails on layers narrower than 64 inputs; kept
    in the standard layout, the tiny test model trains and validates in 4 bits too."""
    metrics = lora.run(tiny_base / "chat", tmp_path / "out", params(tiny_base, "nf4"))
    assert metrics["steps"] == 4 and np.isfinite(metrics["val/loss"]) and (tmp_path / "out/merged/config.json").exists()


def test_quantization_configs(monkeypatch):
    nf4 = quantize.config("nf4", True, torch.bfloat16)
    assert nf4.load_in_4bit and nf4.bnb_4bit_quant_type == "nf4" and nf4.bnb_4bit_use_double_quant and nf4.bnb_4bit_compute_dtype == torch.bfloat16
    assert quantize.config("fp4", False, torch.float32).bnb_4bit_quant_type == "fp4"
    assert quantize.config("int8", True, torch.float32).load_in_8bit
    assert type(quantize.config("fp8", True, torch.bfloat16)).__name__ == "FineGrainedFP8Config"
    assert quantize.config("none", True, torch.float32) is None
    assert quantize.compute_dtype("auto", "bf16") == torch.bfloat16 and quantize.compute_dtype("auto", "fp32") == torch.float32
    assert quantize.compute_dtype("fp16", "fp32") == torch.float16


# ----------------------------------------------------------------------- training on the CPU


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_qlora_trains_adapters_on_a_quantized_frozen_base(qbase, tmp_path, quantization):
    metrics = lora.run(qbase / "chat", tmp_path / "out", params(qbase, quantization), checkpoint_dir=tmp_path / "ckpt", base_for_users="data/models/pretrain")
    assert metrics["steps"] == 4 and np.isfinite(metrics["val/loss"])
    # the backbone's linear weights: 4 bits (plus block scales) or 8 bits against 16 in bf16
    ceiling = {"nf4": 0.36, "int8": 0.6}[quantization]  # nf4: 0.25 + block scales, which 64x64 matrices make heavy (0.27 at real sizes)
    bf16_bytes = 2 * sum(m.weight.numel() for n, m in _full_linears(qbase))
    assert metrics["linear_weight_bytes"] <= ceiling * bf16_bytes
    adapter = load_file(str(tmp_path / "out/adapter_model.safetensors"))
    assert adapter and all("lora_" in k or "trainable_tokens_delta" in k for k in adapter)  # adapters and the chat-marker rows only
    config = json.loads((tmp_path / "out/adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "data/models/pretrain"
    # the adapter and the stage's metrics say what base it was trained against
    assert metrics["quantization"] == quantization
    recorded = json.loads((tmp_path / "out/qllm_quantization.json").read_text())
    assert recorded == ({"quantization": "nf4", "double_quant": True, "compute_dtype": "fp32"} if quantization == "nf4" else {"quantization": "int8"})
    assert f"quantization: {quantization}" in (tmp_path / "out/README.md").read_text()


def _full_linears(qbase):
    from pipelines.core.models.models import load_causal_lm

    model = load_causal_lm(qbase / "model")
    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")]


def test_merged_qlora_is_a_normal_model_equal_to_the_trained_one(qbase, tmp_path):
    """merge: the adapter goes into the dequantized base, the weights it was trained against."""
    from peft import PeftModel

    from pipelines.core.models.models import load_causal_lm, load_model_and_tokenizer

    lora.run(qbase / "chat", tmp_path / "out", params(qbase, "nf4", compute_dtype="fp32"))
    merged, _ = load_model_and_tokenizer(tmp_path / "out/merged")
    assert all(type(m) is not bnb.nn.Linear4bit for m in merged.modules())  # a plain model
    assert not hasattr(merged.config, "quantization_config")
    qconfig = quantize.config("nf4", True, torch.float32)
    trained = PeftModel.from_pretrained(load_causal_lm(qbase / "model", quantization=qconfig), str(tmp_path / "out")).eval()
    naive = PeftModel.from_pretrained(load_causal_lm(qbase / "model"), str(tmp_path / "out")).merge_and_unload()  # into the fp32 base
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        expected, got, other = trained(ids).logits, merged(ids).logits, naive(ids).logits
    # bitsandbytes' CPU inference kernel computes in bf16 (hence not 1e-6); merging into the
    # full-precision base instead misses by the quantization error, an order of magnitude more
    gap, naive_gap = float((got - expected).abs().max()), float((other - expected).abs().max())
    assert gap < 0.01 and gap < naive_gap / 10, (gap, naive_gap)


def test_qlora_resumes_exactly_from_its_adapter_checkpoint(qbase, tmp_path, caplog):
    straight = lora.run(qbase / "chat", tmp_path / "a", params(qbase, "nf4", merge=False), checkpoint_dir=tmp_path / "ca")
    lora.run(qbase / "chat", tmp_path / "b", params(qbase, "nf4", merge=False), checkpoint_dir=tmp_path / "cb")
    shutil.rmtree(tmp_path / "b")
    shutil.rmtree(tmp_path / "cb/step-00000004")  # as if killed after the step-2 checkpoint
    with caplog.at_level("INFO", logger="qllm.training"):
        resumed = lora.run(qbase / "chat", tmp_path / "b", params(qbase, "nf4", merge=False), checkpoint_dir=tmp_path / "cb")
    assert "lora: resumed from step 2" in caplog.text and straight["steps"] == resumed["steps"] == 4
    a = load_file(str(tmp_path / "a/adapter_model.safetensors"))
    b = load_file(str(tmp_path / "b/adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)  # the base re-quantized to the same bits


def test_qlora_in_fine_tuning_mode_loads_the_pointed_base_straight_into_4_bits(qbase, tmp_path):
    """`base_model.name` set: lora's base is the pointer `pretrain` writes; it is followed and the
    model it names is quantized as it loads."""
    from pipelines.core import dag
    from pipelines.core.models import model_source

    pointer = tmp_path / "project/data/models/pretrain"
    pointer.mkdir(parents=True)
    record = {"name": str(qbase / "model"), "kind": "local", "md5": dag.dvc_md5(qbase / "model")}
    (pointer / model_source.POINTER).write_text(json.dumps(record))
    two = TRAIN.model_copy(update={"max_steps": 2, "eval_every": 0, "checkpoint_every": 0})
    metrics = lora.run(qbase / "chat", tmp_path / "out", LoraParams(base_model=str(pointer), allocation="uniform", adapter={"quantization": "nf4", "r": 4}, train=two))
    assert metrics["steps"] == 2 and metrics["linear_weight_bytes"] < metrics["other_parameter_bytes"]
    assert (tmp_path / "out/merged/model.safetensors").exists()


def test_qlora_dpo_starts_from_the_reference_it_was_scored_against(qbase, tmp_path, monkeypatch):
    """ref_logprobs and dpo.lora both quantize the SFT model (to nf4): at step 1 the policy is the
    reference, so the loss is log 2; the merged model is a plain one."""
    import math

    from pipelines import dpo, ref_logprobs
    from pipelines.core.params.preference import DpoParams, RefLogprobsParams

    shutil.copytree(qbase / "model", tmp_path / "data/models/sft")
    ref = ref_logprobs.run(tmp_path, tmp_path / "data/models/sft", qbase / "preference", tmp_path / "data/ref_logprobs",
                           RefLogprobsParams(quantization="nf4", compute_dtype="fp32"))
    assert ref["train"]["pairs"] == 6
    first = record_dpo_losses(monkeypatch)
    train = TRAIN.model_copy(update={"micro_batch_size": 2, "eval_every": 0, "checkpoint_every": 0, "weight_decay": 0.0})
    params = DpoParams(beta=0.1, loss_type="sigmoid", train=train,
                       adapter={"enabled": True, "r": 2, "trainable_tokens": [], "quantization": "nf4", "compute_dtype": "fp32"})
    metrics = dpo.run(tmp_path, tmp_path / "data/ref_logprobs", tmp_path / "data/models/dpo", params)
    # step 1: log 2 up to two forward passes' rounding of each log-ratio (as tests/stages/test_dpo.py)
    tol = logp_tolerance(tmp_path, cached_magnitude(tmp_path))
    assert first[0][0] == pytest.approx(math.log(2), abs=0.5 * 0.1 * 2 * tol + numerics.tolerance(FORMULA, magnitude=math.log(2))) and metrics["steps"] == 4
    assert metrics["linear_weight_bytes"] > 0
    merged = json.loads((tmp_path / "data/models/dpo/merged/config.json").read_text())
    assert "quantization_config" not in merged


def test_qlora_grpo_takes_its_reference_from_the_quantized_base_under_the_adapter(qbase, tmp_path, monkeypatch):
    """GRPO with a LoRA adapter on the 4-bit SFT model and beta > 0: the reference is the same
    quantized model with its adapter switched off (no second copy), so the KL starts at 0."""
    from pipelines import grpo
    from pipelines.core.params.rl import GrpoParams

    shutil.copytree(qbase / "model", tmp_path / "data/models/sft")
    train = TRAIN.model_copy(update={"micro_batch_size": 8, "eval_every": 0, "checkpoint_every": 0, "log_every": 1, "extensions": []})
    params = GrpoParams(rewards=[{"function": "format"}], group_size=4, max_completion_length=6, beta=0.1, train=train,
                        adapter={"enabled": True, "r": 2, "trainable_tokens": [], "quantization": "nf4", "compute_dtype": "fp32"})  # fmt: skip
    kl, sizes = [], []
    real = grpo.grpo_loss

    def recording(p):
        fn = real(p)

        def loss_fn(model, batch):
            loss, metrics = fn(model, batch)
            kl.append(metrics["kl"])
            sizes.append(float(batch["ref_logps"].abs().max()))
            return loss, metrics

        return loss_fn

    monkeypatch.setattr(grpo, "grpo_loss", recording)
    metrics = grpo.run(tmp_path, tmp_path / "data/models/sft", qbase / "chat", tmp_path / "data/models/grpo", params)
    assert metrics["steps"] == 4 and metrics["linear_weight_bytes"] > 0 and len(kl) == 4
    # each log-ratio d within two forward passes' rounding `tol` of 0; e^d - d - 1 <= d^2 there, and
    # the formula's own rounding on its terms' size (e^d, |d| and 1: 3) (tests/numerics.py)
    tol = numerics.tolerance(numerics.model_roundings(AutoConfig.from_pretrained(tmp_path / "data/models/sft"), 128), magnitude=sizes[0])
    assert kl[0] == pytest.approx(0.0, abs=tol**2 + numerics.tolerance(numerics.FUNCTION + 2, magnitude=3.0))
    merged = json.loads((tmp_path / "data/models/grpo/merged/config.json").read_text())
    assert "quantization_config" not in merged


def test_reference_and_policy_must_be_quantized_alike(tmp_path):
    from pipelines.core.params.base import ParamsError

    (tmp_path / "params.yaml").write_text("ingest:\n  sources:\n    - {path: a.txt, kind: text}\ndpo:\n  adapter:\n    enabled: true\n    quantization: nf4\n")
    with pytest.raises(ParamsError, match=r"ref_logprobs.quantization is 'none' but DPO starts from the SFT model quantized as 'nf4'"):
        params_file.load(tmp_path)


def test_probe_lora_on_a_quantized_base_records_gradients_without_updating_it(qbase, tmp_path):
    """The probe's gradients of a frozen 4-bit base come from activations and output gradients;
    they match what autograd gives the same model with its weights dequantized to full precision."""
    from pipelines import probe_lora
    from pipelines.core.models.models import load_causal_lm
    from pipelines.core.params.finetuning import ProbeLoraParams

    train = TRAIN.model_copy(update={"max_steps": 2, "eval_every": 0, "checkpoint_every": 0, "micro_batch_size": 4})
    params = ProbeLoraParams(base_model=str(qbase / "model"), ranks=[1, 2], target_modules=["q_proj", "down_proj"], train=train,
                             quantization="nf4", compute_dtype="fp32")
    metrics = probe_lora.run(qbase / "chat", tmp_path / "probe", params)
    table = json.loads((tmp_path / "probe/scores.json").read_text())
    assert metrics["steps"] == 2 and table["steps"] == 2 and len(table["values"]) == 4  # 2 layers x 2 modules
    assert sum(m["energy_share"] for m in table["modules"].values()) == numerics.approx(1.0, n=numerics.svd_roundings(128, 64) + 2 * 128 * 64)
    # the same steps on the dequantized model with real weight gradients give the same shares
    qconfig = quantize.config("nf4", True, torch.float32)
    reference = load_causal_lm(qbase / "model", quantization=qconfig).dequantize().float()
    modules = probe_lora.candidate_modules(reference, params.target_modules)
    recorder = probe_lora.GradientRecorder(modules)
    from pipelines.core.data import chat_examples
    from pipelines.core.models.models import load_tokenizer
    from pipelines.core.training import finetune, loop

    tokenizer = load_tokenizer(qbase / "model")
    rows, _, _ = finetune.build_rows(tokenizer, qbase / "chat", params, 128)
    batches = iter(loop.Batches(len(rows), 4, train.seed, chat_examples.collate(rows, tokenizer.pad_token_id, True)))
    for _ in range(2):
        reference.zero_grad()
        loss, _ = chat_examples.chat_loss(reference, next(batches))
        loss.backward()
        recorder.on_gradients(None)
    expected = probe_lora.scores(recorder, [1, 2])
    # the activations' weight gradients against autograd's on the same (dequantized) weights: two orders
    # of one backward pass, squared, through an SVD (as tests/stages/test_probe_lora.py)
    n = 2 * numerics.model_roundings(reference.config, 128, tokens=4 * 128, backward=True) + numerics.svd_roundings(128, 64) + 2 * 128 * 64
    for name, shape in table["modules"].items():
        assert shape["energy_share"] == numerics.approx(expected["modules"][name]["energy_share"], n=n), name


def test_an_unmerged_qlora_adapter_is_merged_into_the_dequantized_base_when_loaded(qbase, tmp_path):
    """Without `merged/`, `load_for_inference` (evaluate, qllm generate) reads the recorded
    quantization and merges into that base dequantized, as `merge: true` would have: the same
    weights, not the full-precision base's."""
    from pipelines.core.models.models import load_causal_lm, load_for_inference

    lora.run(qbase / "chat", tmp_path / "merged", params(qbase, "nf4", compute_dtype="fp32"))
    lora.run(qbase / "chat", tmp_path / "adapter", params(qbase, "nf4", compute_dtype="fp32", merge=False))
    assert not (tmp_path / "adapter/merged").exists()
    loaded, _ = load_for_inference(tmp_path / "adapter")
    written = load_causal_lm(tmp_path / "merged/merged")
    for (name, got), (_, want) in zip(loaded.state_dict().items(), written.state_dict().items(), strict=True):
        assert torch.equal(got, want), name  # the same dequantization and merge of the same weights
    (tmp_path / "adapter/qllm_quantization.json").unlink()  # an adapter of a full-precision base: merged into that base
    naive, _ = load_for_inference(tmp_path / "adapter")
    assert any(not torch.equal(a, b) for a, b in zip(naive.state_dict().values(), written.state_dict().values(), strict=True))


def test_the_checkpoint_pages_loading_read_are_given_back_and_the_weights_still_read(tmp_path):
    """safetensors are memory-mapped (privately, as transformers maps them): after a quantized
    load the file's pages are released (madvise PAGEOUT), and a tensor that is still a view into
    the file reads the same after."""
    import mmap
    import sys

    values = torch.arange(1 << 20, dtype=torch.float32)
    path = tmp_path / "model.safetensors"
    path.write_bytes(values.numpy().tobytes())
    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    view = torch.frombuffer(mapping, dtype=torch.float32)
    assert float(view.sum()) == float(values.sum())  # every page read: resident
    advised = quantize.release_checkpoint_pages()
    assert advised >= path.stat().st_size if sys.platform.startswith("linux") else advised == 0  # madvise is Linux's
    assert torch.equal(view, values)  # read back from the file where it was dropped
    del view
    (tmp_path / "maps").write_text("7f00-7f10 r--p 00000000 00:00 1 /nowhere/lib.so\n")
    assert quantize.release_checkpoint_pages(tmp_path / "maps") == 0  # no checkpoint mapped: nothing advised


FREED_WEIGHT = """
import sys, torch
from pipelines.core.models import quantize
if sys.argv[1] != "-":
    quantize.load(sys.argv[1], quantize.config("nf4", True, torch.float32), "lora.adapter")
def anon():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("RssAnon"))
first = torch.ones(4864 * 896)  # Qwen2.5-0.5B's MLP weight dequantized to fp32 (17 MB), used, freed
del first
weight = torch.ones(4864 * 896 // 2)  # the next one (8.7 MB, in bf16)
kept = torch.ones(256 * 896)  # the activation the layer keeps, allocated after it
before = anon()
del weight
print(before - anon())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and /proc/self/status: Linux")
def test_after_a_4_bit_load_a_dequantized_weight_freed_is_given_back(qbase):
    """Issue 78, point 11: a 4-bit base dequantizes each weight at every forward and backward and
    frees it. glibc raises its mmap threshold to the largest block freed, so after the first every
    dequantized weight came from the heap and, with activations kept above it, stayed resident when
    freed: 46 MB a layer of a 0.5B model's fp32 forward. After `quantize.load`
    (`return_freed_weights`) a freed weight goes back to the system at once."""
    import subprocess

    def given_back(base: str) -> int:
        done = subprocess.run([sys.executable, "-c", FREED_WEIGHT, base], capture_output=True, text=True, cwd=REPO, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return int(done.stdout.split()[-1])

    weight = 4864 * 896 // 2 * 4
    assert given_back("-") < weight // 2  # the cause, on this C library: the freed copy stays
    assert given_back(str(qbase / "model")) >= weight  # every page of it returned


# ------------------------------------------------- what a quantized base holds (issue 78, point 11)


@pytest.fixture(scope="module")
def qbase_bf16(qbase, tmp_path_factory):
    """qbase's model saved in bf16, as the hub ships models, with a vocabulary wide enough that the
    embedding (tied to the output head) is the largest matrix, as in Qwen2.5 and SmolLM2."""
    from pipelines.core.models.models import build_llama, load_tokenizer, save_pretrained
    from pipelines.core.params.pretraining import ModelParams

    root = tmp_path_factory.mktemp("qbase_bf16")
    tokenizer = load_tokenizer(qbase / "model")
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(2048 - len(tokenizer))])  # 2,048 rows x 64: 2x an MLP matrix
    model = build_llama(ModelParams(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=2), tokenizer, max_positions=128, seed=0)
    save_pretrained(model.to(torch.bfloat16), tokenizer, root / "model", max_length=128)
    (root / "chat").symlink_to(qbase / "chat")
    return root


def _prepared(base, quantization="nf4", trainable_tokens=(), precision="fp32"):
    from pipelines.core.models import adapters

    adapter = LoraAdapterParams(enabled=True, quantization=quantization, r=4, lora_alpha=8, lora_dropout=0.0, trainable_tokens=list(trainable_tokens))
    qconfig = quantize.from_params(adapter, precision, "lora.adapter")
    model, tokenizer = quantize.load(base / "model", qconfig, "lora")
    return model, tokenizer, lambda m: adapters.wrap(adapter)(quantize.for_adapters(m, qconfig, True), tokenizer)


def _batch(tokenizer, rows=2, length=24):
    ids = torch.arange(rows * length).reshape(rows, length) % (len(tokenizer) - 1) + 1
    return {"input_ids": ids, "labels": ids.clone()}


def _copies_of(weight_shape, run) -> list[str]:
    """The ops that produce a new tensor of `weight_shape` while `run()` runs: a copy of that
    matrix (a cast, a clone), whatever the dtype."""
    from torch.utils._python_dispatch import TorchDispatchMode

    made = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == tuple(weight_shape) and tensor.untyped_storage().data_ptr() not in inputs:
                    made.append(f"{func} -> {tensor.dtype}")  # new memory, not a view (detach, t, slices)
            return out

    with Record():
        run()
    return made


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_4_bit_base_holds_its_16_bit_embedding_as_loaded_and_never_copies_it_whole(qbase_bf16, precision, monkeypatch):
    """The frozen, unquantized embedding (tied to the output head) of a bf16 checkpoint stays in
    bf16: preparing the base for adapters, a training step (forward, chunked loss, backward) and
    validation make no full-size copy of it, neither the fp32 cast PEFT's
    `prepare_model_for_kbit_training` made (0.55 GB at Qwen2.5-0.5B's shape, 0.93 GB at 1.5B) nor
    autocast's bf16 cast of an fp32 head at every use."""
    from pipelines.core.training import chunked_loss, loop

    monkeypatch.setattr(quantize, "HEAD_BLOCK_BYTES", 256 * 64 * 4)  # 256 of the 2,048 rows a block, as 32 MB are of a real vocabulary's
    model, tokenizer, prepare = _prepared(qbase_bf16, precision=precision)
    weight = model.get_input_embeddings().weight
    assert weight.dtype == torch.bfloat16 and model.get_output_embeddings().weight is weight  # as loaded: the checkpoint's dtype, tied
    batch = _batch(tokenizer)

    def prepare_and_step():
        peft_model = prepare(model)
        peft_model.train()
        with loop.autocast(torch.device("cpu"), precision):
            loss, _ = chunked_loss.causal(16)(peft_model, batch)
        loss.backward()
        with torch.no_grad(), loop.autocast(torch.device("cpu"), precision):
            peft_model(input_ids=batch["input_ids"])

    assert _copies_of(weight.shape, prepare_and_step) == []
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16


def test_the_16_bit_embedding_gives_the_loss_and_gradients_of_the_fp32_one(qbase_bf16):
    """Held in bf16 (its checkpoint's values) instead of cast to fp32, the embedding and head give
    the same loss and adapter gradients up to fp32 rounding: the values are the same numbers, only
    the head's product runs a block of rows at a time."""
    from peft import prepare_model_for_kbit_training

    from pipelines.core.models import adapters
    from pipelines.core.training import chunked_loss
    from tests import numerics

    model, tokenizer, prepare = _prepared(qbase_bf16)
    reference, _, _ = _prepared(qbase_bf16)
    adapter = LoraAdapterParams(enabled=True, quantization="nf4", r=4, lora_alpha=8, lora_dropout=0.0, trainable_tokens=[], init_lora_weights="gaussian")
    results = []
    for built in (prepare_model_for_kbit_training(reference, use_gradient_checkpointing=False), quantize.for_adapters(model, quantize.from_params(adapter, "fp32", "x"), False)):
        torch.manual_seed(0)
        peft_model = adapters.wrap(adapter)(built, tokenizer)
        loss, _ = chunked_loss.causal(16)(peft_model, _batch(tokenizer))
        loss.backward()
        grads = torch.cat([p.grad.flatten() for n, p in sorted(peft_model.named_parameters()) if p.requires_grad])
        results.append((loss.detach(), grads))
    assert reference.get_input_embeddings().weight.dtype == torch.float32  # PEFT's way: the reference is the fp32 embedding
    (loss_fp32, grads_fp32), (loss_held, grads_held) = results
    n = numerics.model_roundings(model.config, 24, backward=True)
    numerics.assert_close_as(loss_held, loss_fp32, n=n, what="loss")
    numerics.assert_close_as(grads_held, grads_fp32, n=n, what="adapter gradients")


def test_trainable_tokens_on_a_4_bit_base_train_the_embedding_in_fp32(qbase_bf16):
    """PEFT's trainable tokens write fp32 rows into the embedding: a base whose embedding was held
    in bf16 gets it back in fp32 for them, and trains."""
    from pipelines.core.training import chunked_loss

    model, tokenizer, prepare = _prepared(qbase_bf16, trainable_tokens=["<|im_start|>"])
    peft_model = prepare(model)
    loss, _ = chunked_loss.causal(16)(peft_model, _batch(tokenizer))
    loss.backward()
    delta = [p for n, p in peft_model.named_parameters() if "trainable_tokens_delta" in n]
    assert delta and delta[0].grad is not None and bool(torch.isfinite(loss))


def test_a_4_bit_layer_under_bf16_autocast_returns_bf16_as_torch_linear_does(qbase_bf16):
    """Under autocast torch's Linear returns the autocast dtype; bitsandbytes' 4-bit layer cast its
    output back to its input's fp32, so every activation after it (attention, the MLP's products)
    was held in fp32 where LoRA's are bf16."""
    model, _, prepare = _prepared(qbase_bf16, precision="bf16")
    four_bit = next(m for m in prepare(model).modules() if isinstance(m, bnb.nn.Linear4bit))
    plain = torch.nn.Linear(four_bit.in_features, four_bit.out_features)
    x = torch.randn(3, four_bit.in_features)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert four_bit(x).dtype == plain(x).dtype == torch.bfloat16
    assert four_bit(x).dtype == torch.float32  # without autocast: as before
