"""How lossy is merging a QLoRA adapter: into the dequantized base (what lora.adapter.merge writes) vs into the original
full-precision base. Usage: python -m benchmarks.adapters.qlora_merge PROJECT BASE_DIR (PROJECT: after `qllm run --until tokenize`)."""
import json
import sys
import tempfile
from pathlib import Path

import torch
from peft import PeftModel

from pipelines import lora
from pipelines.core.evaluation.heldout import heldout_questions
from pipelines.core.evaluation.report import evaluate_model
from pipelines.core.models import quantize
from pipelines.core.models.models import load_causal_lm, load_tokenizer, save_pretrained
from pipelines.core.params import files as params_file
from pipelines.core.params.finetuning import LoraParams
from pipelines.core.params.training import TrainParams

root, base = Path(sys.argv[1]), sys.argv[2]
params, _ = params_file.load(root)
questions = heldout_questions(root / "data/prepared/chat", params.evaluate.max_questions)
with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    train = TrainParams(seed=0, max_steps=150, micro_batch_size=16, warmup_steps=10, lr=0.003, eval_every=0, checkpoint_every=0, precision="bf16")
    p = LoraParams(base_model=base, allocation="uniform", adapter={"r": 8, "lora_alpha": 16, "quantization": "nf4"}, train=train)
    lora.run(root / "data/prepared/chat", tmp / "q", p)
    qconfig = quantize.config("nf4", True, torch.bfloat16)
    trained = quantize.keep_standard_layout(PeftModel.from_pretrained(load_causal_lm(base, quantization=qconfig), str(tmp / "q")).eval())
    naive = PeftModel.from_pretrained(load_causal_lm(base), str(tmp / "q")).merge_and_unload()
    save_pretrained(naive, load_tokenizer(tmp / "q"), tmp / "naive")
    merged = load_causal_lm(tmp / "q/merged")
    ids = torch.tensor([load_tokenizer(tmp / "q")("Where does Tovik live? He lives in Pelora with a cat.")["input_ids"]])
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            t = trained(ids).logits.float()
        m, n = merged(ids).logits, naive(ids).logits
    scale = float(t.abs().mean())
    out = {"mean_abs_logit": round(scale, 4),
           "dequantized_merge_max_abs_diff": round(float((m - t).abs().max()), 4), "dequantized_merge_mean_abs_diff": round(float((m - t).abs().mean()), 5),
           "fp_base_merge_max_abs_diff": round(float((n - t).abs().max()), 4), "fp_base_merge_mean_abs_diff": round(float((n - t).abs().mean()), 5)}
    for name, d in (("dequantized_merge", tmp / "q"), ("fp_base_merge", tmp / "naive")):
        r = evaluate_model(d, root, root / "data/tokenized", questions, tmp / f"e-{name}", params.evaluate)
        out[f"{name}_exact_match"] = r["exact_match"]
    print(json.dumps(out))
