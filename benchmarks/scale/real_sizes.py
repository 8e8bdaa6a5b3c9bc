"""Bases with the exact shapes of real models, built from their configs (no download): the
fine-tuning profile measured at real sizes.

    python -m benchmarks.scale.real_sizes make-base --shape qwen2.5-0.5b --out models/qwen05   # a base directory
    python -m benchmarks.scale.real_sizes stage --project DIR --base models/qwen05 --stage lora [--quantization nf4]
        [--steps 3] [--seq-len 256] [--micro-batch 1] [--eval-batches 0] [--precision auto] [--no-gradient-checkpointing]
        [--loss-chunk 0] [--merge] [--optimizer adamw_bnb_8bit]
    python -m benchmarks.scale.real_sizes qlora-memory --project DIR --base models/qwen05 [--precisions fp32 bf16]
        [--steps 1] [--seq-len 256] [--micro-batch 1] [--eval-batches 1] [--loss-chunk 256]

`make-base` writes a `save_pretrained` directory: a randomly initialised model with the shape of
the named model (hidden size, layers, heads, the full 151,936-row vocabulary of Qwen2.5, tied
embeddings), its weights in bf16 as the hub ships them, a small byte-level BPE tokenizer trained
on the sample texts with the family's special tokens, and the family's real chat template. Its
answers are noise; its memory and time per step are those of the real model.

`stage` runs one stage of the fine-tuning profile (`params/finetune.yaml`) against such a base in
its own process and prints one JSON line: seconds per step, the stage's peak resident memory
(`ru_maxrss` of the process: the stage is all it ran), tokens/s, the dtypes the frozen base is held in.

`qlora-memory` runs the lora stage without and with a 4-bit base (`--quantization`, nf4 by default),
one process each, in each of `--precisions` (bf16 on a CPU without bf16 units is emulated: slower,
the same memory), and prints the CPU, each run and the ratios of their peaks.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

from benchmarks import common

SHAPES = {
    # config.json of each model (hidden, intermediate, layers, heads, kv heads, vocabulary, tied)
    "qwen2.5-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen2.5-1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    # the same family at test size: what the default suite builds
    "qwen2.5-tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 4096, "tie_word_embeddings": True},
}

QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2.5-Instruct's chat template (tokenizer_config.json of Qwen/Qwen2.5-0.5B-Instruct, Apache-2.0),
# tools branch included: ChatML, a newline after the role, a default system prompt.
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)


def sample_texts() -> list[str]:
    """English text to train the BPE on: the Python docs' topics that ship with the standard library."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def tokenizer(texts: list[str], vocab_size: int = 1024):
    """A byte-level BPE with Qwen2.5's special tokens and chat template (eos `<|im_end|>`, pad
    `<|endoftext|>`, as Qwen2.5-Instruct's tokenizer_config sets them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=list(QWEN_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=QWEN25_TEMPLATE)


def make_base(shape: str, out: Path, seed: int = 0, max_positions: int = 32768) -> Path:
    """A randomly initialised model of `shape` (SHAPES) with Qwen2.5's tokenizer layout and
    template, saved in bf16 to `out`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if shape not in SHAPES:
        raise SystemExit(f"--shape: {shape!r} is not one of {', '.join(SHAPES)}")
    tok = tokenizer(sample_texts())
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=max_positions, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                         dtype="bfloat16")  # fmt: skip
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def stage(args: argparse.Namespace) -> dict:
    """One stage of the fine-tuning profile against `args.base`; its numbers."""
    from pipelines import lora, sft
    from pipelines.core.params import files as params_file
    from pipelines.core.run.resources import PeakMemory
    from pipelines.core.training import precision

    root = Path(args.project)
    repo = common.REPO
    params, _ = params_file.load(repo, overlays=[repo / "params" / "finetune.yaml"], overrides=[f"base_model.name={args.base}"])
    section = getattr(params, args.stage)
    train = section.train.model_copy(update={
        "max_steps": args.steps, "micro_batch_size": args.micro_batch, "eval_batches": args.eval_batches, "grad_accum_steps": 1, "warmup_steps": 0, "eval_every": 0,
        "checkpoint_every": 0, "gradient_checkpointing": not args.no_gradient_checkpointing,
        "precision": precision.resolve(args.precision), "loss_chunk_tokens": args.loss_chunk, "optimizer": args.optimizer,
    })
    update = {"base_model": str(Path(args.base).resolve()), "train": train, "max_seq_len": args.seq_len, "packing": True}
    if args.stage == "lora":
        update["allocation"] = "uniform"
        update["adapter"] = section.adapter.model_copy(update={"quantization": args.quantization, "merge": args.merge})
    section = section.model_copy(update=update)
    module = {"lora": lora, "sft": sft}[args.stage]
    start = time.perf_counter()
    with PeakMemory(interval=0.02) as peak:  # anonymous memory too: the checkpoint's mapped pages are file cache
        metrics = module.run(root / "data/prepared/chat", Path(args.work), section)
    steps = max(1, metrics["steps"])
    return {"stage": args.stage, "quantization": args.quantization if args.stage == "lora" else "none",
            "gradient_checkpointing": not args.no_gradient_checkpointing, "loss_chunk_tokens": args.loss_chunk,
            "seq_len": args.seq_len, "merge": args.merge, "optimizer": args.optimizer, "steps": metrics["steps"], "precision": train.precision,
            "seconds_per_step": round(metrics["train_seconds"] / steps, 2), "stage_seconds": round(time.perf_counter() - start, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), "peak_anonymous_mb": round(peak.peak_anonymous / 2**20, 1),
            "total_parameters": metrics["total_parameters"], "trainable_parameters": metrics["trainable_parameters"],
            "base_held_in": _held_in(args, metrics), "tokens_per_second": round(metrics.get("tokens_per_second", 0.0), 1), **_cuda_peak()}


def _held_in(args: argparse.Namespace, metrics: dict) -> str:
    """The dtypes of the frozen base: a full-precision base loads in fp32 whatever the stage's
    precision (bf16 autocasts it); a quantized one keeps its linear layers in their bits, the
    embedding (and tied head) as `embedding_dtype` says, the norms in fp32."""
    if args.stage != "lora" or args.quantization == "none":
        return "fp32 (every weight)"
    return f"{args.quantization} linear layers, {metrics['embedding_dtype']} embedding and head, fp32 norms"


def bf16_units() -> str:
    """The machine line with the bf16 units that decide `precision: auto`: the CPU's model name,
    its cores, its units (Linux /proc/cpuinfo) and whether torch has native bf16 here."""
    from pipelines.core.training import precision

    lines = common.cpuinfo()
    if not lines:
        return "unknown CPU"
    flags = common.cpu_flags()
    units = [flag for flag in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if flag in flags]
    cores = sum(1 for line in lines if line.startswith("processor"))
    return f"{common.cpu_name()}, {cores} cores, {'/'.join(units) or 'no AVX2'}, bf16 native: {'yes' if precision.capability().bf16_native else 'no'}"


def qlora_memory(args: argparse.Namespace) -> int:
    """The lora stage with and without a 4-bit base, each in its own process, one after another,
    in each precision asked; prints each run and the ratio of the peaks (QLoRA over LoRA)."""
    import subprocess

    print(json.dumps({"cpu": bf16_units()}), flush=True)
    for name in args.precisions:
        rows = {}
        for quantization in ("none", args.quantization):
            command = [sys.executable, "-m", "benchmarks.scale.real_sizes", "stage", "--project", args.project, "--base", args.base, "--stage", "lora",
                       "--quantization", quantization, "--precision", name, "--steps", str(args.steps), "--seq-len", str(args.seq_len),
                       "--micro-batch", str(args.micro_batch), "--eval-batches", str(args.eval_batches), "--loss-chunk", str(args.loss_chunk)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode or not lines:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            rows[quantization] = json.loads(lines[-1])
            print(lines[-1], flush=True)
        quantized, full = rows[args.quantization], rows["none"]
        print(json.dumps({"precision": name, "base": Path(args.base).name, f"{args.quantization}/none peak_rss": round(quantized["peak_rss_mb"] / full["peak_rss_mb"], 3),
                          f"{args.quantization}/none peak_anonymous": round(quantized["peak_anonymous_mb"] / full["peak_anonymous_mb"], 3),
                          "none": full["base_held_in"], args.quantization: quantized["base_held_in"]}), flush=True)  # fmt: skip
    return 0


def _cuda_peak() -> dict[str, float]:
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"peak_cuda_allocated_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale.real_sizes", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-base")
    make.add_argument("--shape", required=True, choices=sorted(SHAPES))
    make.add_argument("--out", required=True)
    run = sub.add_parser("stage")
    run.add_argument("--project", required=True, help="a project after `qllm run --until prepare_data` (its data/prepared/chat)")
    run.add_argument("--base", required=True)
    run.add_argument("--stage", choices=("sft", "lora"), default="lora")
    run.add_argument("--quantization", default="none")
    run.add_argument("--steps", type=int, default=3)
    run.add_argument("--seq-len", type=int, default=256)
    run.add_argument("--no-gradient-checkpointing", action="store_true")
    run.add_argument("--loss-chunk", type=int, default=0)
    run.add_argument("--merge", action="store_true", help="lora: write merged/ too (the full model)")
    run.add_argument("--optimizer", default="adamw_fused", help="train.optimizer (adamw_bnb_8bit: 8-bit AdamW)")
    run.add_argument("--micro-batch", type=int, default=1, help="rows of --seq-len tokens a step")
    run.add_argument("--eval-batches", type=int, default=0, help="validation batches at the end (0: the whole validation set)")
    run.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"),
                     help="train.precision (auto: bf16 where the CPU has bf16 matrix units, else fp32)")
    run.add_argument("--work", default=None)
    memory = sub.add_parser("qlora-memory", help="the lora stage with and without a 4-bit base, in each precision: peaks and their ratio")
    memory.add_argument("--project", required=True)
    memory.add_argument("--base", required=True)
    memory.add_argument("--quantization", default="nf4")
    memory.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=("fp32", "bf16"))
    memory.add_argument("--steps", type=int, default=1)
    memory.add_argument("--seq-len", type=int, default=256)
    memory.add_argument("--micro-batch", type=int, default=1)
    memory.add_argument("--eval-batches", type=int, default=1)
    memory.add_argument("--loss-chunk", type=int, default=256)
    args = parser.parse_args(argv)
    if args.command == "make-base":
        print(make_base(args.shape, Path(args.out)))
        return 0
    if args.command == "qlora-memory":
        return qlora_memory(args)
    import tempfile

    with tempfile.TemporaryDirectory() as work:
        args.work = args.work or work
        print(json.dumps(stage(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
