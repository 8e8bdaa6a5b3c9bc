"""The export stage: adapters merged before the GGUF is written, the files, record and Modelfile it
leaves, and what it refuses; then (slow marker: llama-cpp-python builds llama.cpp from source,
minutes) llama.cpp itself loading the files: its logits against transformers', and its greedy
answers to the held-out questions against `evaluate`'s.

The pipeline with the stage on, register attaching the files to the registry version:
tests/e2e/test_pipeline_e2e.py. The file format itself: tests/core/models/test_gguf_export.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from pydantic import ValidationError

from pipelines import export
from pipelines.core.evaluation import heldout
from pipelines.core.models.gguf_export import ExportError
from pipelines.core.params.release import ExportParams
from tests import llama_files
from tests.chat_families import QWEN25
from tests.core.models.test_gguf_export import ARCH_SETTINGS, LINEAR_ROPE, LLAMA3_ROPE, QLLM, TEXTS, YARN_ROPE, tiny
from tests.waiting import DEADLINE

REPO = Path(__file__).resolve().parents[2]


def save(model, tokenizer, out: Path) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def gguf_tensors(path: Path) -> dict[str, np.ndarray]:
    import gguf

    return {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}


def test_an_adapter_is_merged_into_its_base_before_export(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path / "project"
    model, tokenizer = tiny()
    save(model, tokenizer, root / "data/models/base")
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj"], init_lora_weights=False))
    peft_model.peft_config["default"].base_model_name_or_path = "data/models/base"  # as the pipeline writes it: relative to the project
    peft_model.save_pretrained(root / "data/models/lora")
    tokenizer.save_pretrained(root / "data/models/lora")
    merged = peft_model.merge_and_unload().state_dict()

    params = ExportParams(enabled=True, types=["f16"], modelfile_type="f16", system="Be brief.")
    record = export.export(root, root / "data/models/lora", root / "data/export", params, "qllm", "lora")
    tensors = gguf_tensors(root / "data/export/qllm-f16.gguf")
    value = tensors["blk.0.attn_v.weight"].reshape(merged["model.layers.0.self_attn.v_proj.weight"].shape)
    assert np.array_equal(value, merged["model.layers.0.self_attn.v_proj.weight"].half().numpy())  # the merged weight,
    base = AutoModelForCausalLM.from_pretrained(root / "data/models/base").model.layers[0].self_attn.v_proj.weight
    assert not np.array_equal(value, base.detach().half().numpy())  # not the base's
    assert sorted(p.name for p in (root / "data/export").iterdir()) == ["Modelfile", "README.md", "export.json", "qllm-f16.gguf"]
    assert json.loads((root / "data/export/export.json").read_text()) == record
    assert record["stage"] == "lora" and record["source"] == "data/models/lora" and record["modelfile"] == "Modelfile"
    assert record["files"][0]["bytes"] == (root / "data/export/qllm-f16.gguf").stat().st_size
    modelfile = (root / "data/export/Modelfile").read_text()
    assert modelfile.startswith("FROM ./qllm-f16.gguf\n") and 'SYSTEM """Be brief."""' in modelfile
    assert "llama-cli -m data/export/qllm-f16.gguf" in (root / "data/export/README.md").read_text()


def test_k_quants_need_llama_cpp_and_nothing_is_left_half_written(tmp_path, monkeypatch):
    model, tokenizer = tiny()
    model_dir = save(model, tokenizer, tmp_path / "data/models/dpo")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as where llama-cpp-python is not installed
    params = ExportParams(enabled=True, types=["f16", "q4_k_m"], modelfile_type="f16")
    with pytest.raises(ExportError, match=r"q4_k_m: llama.cpp's quantizer comes with llama-cpp-python, which is not installed \(pip install llama-cpp-python"):
        export.export(tmp_path, model_dir, tmp_path / "data/export", params, "qllm", "dpo")
    assert not (tmp_path / "data/export").exists()  # the f16 file written before the failure went with the temporary directory


def test_a_template_ollama_cannot_take_stops_before_any_file(tmp_path):
    from tests.chat_families import MISTRAL

    model, tokenizer = tiny(family=MISTRAL)
    model_dir = save(model, tokenizer, tmp_path / "data/models/sft")
    with pytest.raises(ExportError, match=r"^data/models/sft: the chat template does not write message 0 \(system\) as it is"):
        export.export(tmp_path, model_dir, tmp_path / "data/export", ExportParams(enabled=True), "qllm", "sft")
    assert not (tmp_path / "data/export").exists()
    record = export.export(tmp_path, model_dir, tmp_path / "data/export", ExportParams(enabled=True, modelfile=False), "qllm", "sft")
    assert record["modelfile"] is None and not (tmp_path / "data/export/Modelfile").exists()


def test_params_name_what_is_wrong():
    with pytest.raises(ValidationError, match="modelfile_type 'q8_0' is not among types \\['f16'\\]"):
        ExportParams(types=["f16"])
    with pytest.raises(ValidationError, match="types: each type once"):
        ExportParams(types=["f16", "f16"])
    with pytest.raises(ValidationError, match="types.0"):
        ExportParams(types=["q3_x"])
    assert ExportParams(types=["f16"], modelfile=False).types == ["f16"]


# -- llama.cpp itself (slow: `make test-gguf` installs llama-cpp-python, building llama.cpp) --------


def llama(path: Path, **kwargs):
    return llama_files.load(path, "llama.cpp's check needs llama-cpp-python: `make test-gguf` installs it (it builds llama.cpp, minutes) "
                            "and runs these tests", n_ctx=256, **kwargs)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_llama_cpp_computes_the_logits_transformers_does(tmp_path, kind):
    """The same random model in transformers and in llama.cpp (f16 and q8_0 files): next-token
    logits at every position of a chat prompt agree (f16: to f16's precision; q8_0: to its
    quantization), and the greedy next token is the same at every position for f16."""
    from pipelines.core.models import gguf_export

    model, tokenizer = tiny(kind, QLLM if kind == "llama" else QWEN25, tied=kind == "llama", seed=3)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Where does Ririba live? 1 + 2 = 3."}], tokenize=False,
                                           add_generation_prompt=True)  # fmt: skip
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    for dtype, tolerance in (("f16", 0.003), ("q8_0", 0.05)):  # measured: 0.0003-0.0005 and 0.006-0.016 of the largest logit
        path = tmp_path / f"{kind}-{dtype}.gguf"
        gguf_export.write(model, tokenizer, path, dtype, "qllm")
        llm = llama(path, logits_all=True)
        assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == ids  # the same tokens from the file's tokenizer
        llm.eval(ids)
        got = np.array(llm.scores[: len(ids)])
        scale = np.abs(expected).max()
        assert np.abs(got - expected).max() <= tolerance * scale, (dtype, np.abs(got - expected).max(), scale)
        if dtype == "f16":
            assert (got.argmax(-1) == expected.argmax(-1)).all()


GEMMA3_THETAS = ARCH_SETTINGS["gemma3_text"]["rope_parameters"]
LONG_CONTEXT = {
    "llama-llama3": ("llama", {"rope_parameters": LLAMA3_ROPE}, [{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}]),
    "llama-linear": ("llama", {"rope_parameters": LINEAR_ROPE}, [{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}]),
    "llama-yarn": ("llama", {"rope_parameters": {**YARN_ROPE, "attention_factor": 1.5}}, [{"rope_parameters": YARN_ROPE}]),
    "qwen2-yarn": ("qwen2", {"family": QWEN25, "tied": False, "rope_parameters": YARN_ROPE}, [{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}]),
    "qwen3-yarn": ("qwen3", {**ARCH_SETTINGS["qwen3"], "rope_parameters": YARN_ROPE}, [{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}]),
    "qwen3-linear": ("qwen3", {**ARCH_SETTINGS["qwen3"], "rope_parameters": LINEAR_ROPE}, [{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}]),
    "qwen3": ("qwen3", ARCH_SETTINGS["qwen3"], []),
    "gemma": ("gemma", ARCH_SETTINGS["gemma"], []),
    "gemma2": ("gemma2", ARCH_SETTINGS["gemma2"], [{"sliding_window": 4096}]),
    "gemma3_text": ("gemma3_text", ARCH_SETTINGS["gemma3_text"], [{"sliding_window": 4096},
                                                                  {"rope_parameters": {**GEMMA3_THETAS, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}]),
    "gemma3_text-linear": ("gemma3_text", {**ARCH_SETTINGS["gemma3_text"], "rope_parameters": {**GEMMA3_THETAS, "full_attention": {**LINEAR_ROPE, "rope_theta": 1e6}}},
                           [{"rope_parameters": GEMMA3_THETAS}]),
}  # fmt: skip
"""(model type, tiny()'s settings, settings that each take one feature away) for the rope scalings
and architectures beyond Llama and Qwen2: Llama 3.1's llama3 rope, linear, YaRN (with transformers'
attention_factor in one), Qwen3, Gemma, and Gemma 2/3 with a 16-token sliding window (Gemma 3's
local layers at their own rope_theta, its global ones linearly scaled in one)."""


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LONG_CONTEXT))
def test_llama_cpp_follows_rope_scaling_and_the_newer_architectures_past_the_original_context(tmp_path, case):
    """A chat prompt of 90-128 tokens, past the 32 positions the scaled ropes were pretrained on and the
    16-token sliding windows: llama.cpp's logits at every position agree with transformers' to f16's
    precision (the tolerance of the Llama/Qwen2 check), its greedy token is transformers' wherever
    transformers' top two are further apart than that, and what each feature changes (the scaling,
    the window, Gemma 3's local theta) is far more than that (Q and K sharpened, so positions show)."""
    from pipelines.core.models import gguf_export
    from tests.chat_families import GEMMA

    kind, settings, withouts = LONG_CONTEXT[case]
    settings = dict(settings)
    family, tied, layers = settings.pop("family", GEMMA if kind.startswith("gemma") else QLLM), settings.pop("tied", True), settings.pop("layers", 2)
    model, tokenizer = tiny(kind, family, tied=tied, layers=layers, seed=3, sharpen=4.0, **settings)
    for n in range(1, len(TEXTS)):  # a chat prompt of 90 tokens or more (the templates' own text differs)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": " ".join(TEXTS[:n])}], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if len(ids) >= 90:
            break
    assert len(ids) <= 128, len(ids)  # past the original 32 positions and the windows, within max_position_embeddings
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    tolerance, scale = 0.003, np.abs(expected).max()
    for without in withouts:
        plain, _ = tiny(kind, family, tied=tied, layers=layers, seed=3, sharpen=4.0, **{**settings, **without})
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert np.abs(plain(torch.tensor([ids])).logits[0].numpy() - expected).max() > 10 * tolerance * scale, without  # the feature shows
    path = tmp_path / f"{case}.gguf"
    gguf_export.write(model, tokenizer, path, "f16", "qllm")
    llm = llama(path, logits_all=True, yarn_beta_fast=-1.0, yarn_beta_slow=-1.0)  # the ramp from the file, as llama.cpp itself reads it
    assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == ids
    llm.eval(ids)
    got = np.array(llm.scores[: len(ids)])
    assert np.abs(got - expected).max() <= tolerance * scale, (np.abs(got - expected).max() / scale)
    top2 = np.sort(expected, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * tolerance * scale
    assert clear.sum() >= len(ids) // 2 and (got.argmax(-1) == expected.argmax(-1))[clear].all()


@pytest.mark.slow
def test_k_quants_come_from_llama_cpps_quantizer(tmp_path):
    """`export.types: [q4_k_m]`: llama.cpp's quantizer makes the file from an f16 one (not kept);
    its weight matrices are K-quants and llama.cpp still computes the model's next tokens."""
    import gguf

    model, tokenizer = tiny(hidden=256, seed=5)  # K-quants pack rows in super-blocks of 256
    model_dir = save(model, tokenizer, tmp_path / "data/models/dpo")
    params = ExportParams(enabled=True, types=["q8_0", "q4_k_m"])
    record = export.export(tmp_path, model_dir, tmp_path / "data/export", params, "qllm", "dpo")
    assert [f["file"] for f in record["files"]] == ["qllm-q8_0.gguf", "qllm-q4_k_m.gguf"]
    assert sorted(p.name for p in (tmp_path / "data/export").iterdir()) == ["Modelfile", "README.md", "export.json", "qllm-q4_k_m.gguf", "qllm-q8_0.gguf"]
    read = gguf.GGUFReader(tmp_path / "data/export/qllm-q4_k_m.gguf")
    types = {t.name: t.tensor_type.name for t in read.tensors}
    assert {types[f"blk.0.{n}.weight"] for n in ("attn_q", "attn_k", "ffn_gate", "ffn_up")} == {"Q4_K"}
    assert read.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert read.fields["tokenizer.chat_template"].contents() == tokenizer.chat_template
    q8 = (tmp_path / "data/export/qllm-q8_0.gguf").stat().st_size
    assert record["files"][1]["bytes"] < q8
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Where does Ririba live?"}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    llm = llama(tmp_path / "data/export/qllm-q4_k_m.gguf", logits_all=True)
    llm.eval(ids)
    got = np.array(llm.scores[: len(ids)])
    assert np.corrcoef(got.ravel(), expected.ravel())[0, 1] > 0.95  # 4-bit: close, not equal


@pytest.fixture(scope="module")
def trained(tmp_path_factory, mlflow_template_db):
    """The default profile's pipeline (models that answer) with the export stage on."""
    from flows.pipeline import pipeline
    from tests.conftest import make_project

    project = make_project(tmp_path_factory.mktemp("gguf") / "project", mlflow_template_db, {"export": {"enabled": True}}, tiny=False)
    pipeline(until="register", project_dir=str(project))
    return project


@pytest.mark.slow
@pytest.mark.timeout(2 * DEADLINE)  # a bound for a broken run: its setup runs the default profile's pipeline
def test_llama_cpp_answers_the_held_out_questions_as_evaluate_does(trained):
    """llama-cpp-python's chat completion (the chat template from the file's metadata, greedy, the
    same token limit) on every held-out question: f16's exact match within one question of
    evaluate's, q8_0's within 2 points."""
    from pipelines.core.data.chat_template import normalize_answer
    from pipelines.core.outputs import read_json

    questions = heldout.heldout_questions(trained / "data/prepared/chat")
    reference = read_json(trained / "data/metrics/evaluate.json")["dpo"]
    assert reference["questions"] == len(questions)
    limit = yaml.safe_load((trained / "params.yaml").read_text())["evaluate"]["max_new_tokens"]
    evaluated = [json.loads(line) for line in (trained / "data/evaluate/dpo/predictions.jsonl").read_text().splitlines()]
    assert [e["id"] for e in evaluated] == list(questions["id"])
    right = {"evaluate": sum(e["correct"] for e in evaluated)}
    same = {}
    for dtype in ("f16", "q8_0"):
        llm = llama(trained / f"data/export/qllm-{dtype}.gguf")
        answers = [llm.create_chat_completion(list(prompt), max_tokens=limit, temperature=0.0)["choices"][0]["message"]["content"].strip()
                   for prompt in questions["prompt"]]  # fmt: skip
        right[dtype] = sum(normalize_answer(a) == normalize_answer(r) for a, r in zip(answers, questions["reference"], strict=True))
        same[dtype] = sum(a == e["prediction"] for a, e in zip(answers, evaluated, strict=True))
    n = len(questions)
    print(f"held-out questions {n}: right {right}, answers equal to evaluate's {same}")
    assert round(right["evaluate"] / n, 4) == reference["exact_match"]  # the same count over n, to evaluate's 4 decimals: exact
    assert abs(right["f16"] - right["evaluate"]) <= 1, right
    assert abs(right["q8_0"] - right["evaluate"]) / n <= 0.02, right
