"""The device check: the CUDA paths run and measured on one GPU, in two commands that fit a bare,
offline GPU machine (docs/development.md, "The device check").

    python -m tools.gpu_check core       # the training code alone: needs pydantic and bitsandbytes, never DVC, Prefect or MLflow
    python -m tools.gpu_check pipeline   # `qllm run` of the tiny profile: the orchestration wheels carried
    python -m tools.gpu_check            # both in one process (`make gpu-check`, a machine that has everything)
    python -m tools.gpu_check core --device cpu --tiny   # the same code at tiny sizes on the CPU (the suite, the rehearsal)

On the lent machine, `tools/device_run.sh core|pipeline` installs the part's wheels (`make
device-wheels` puts them in .device/) and runs it. Sections, each timed and each allowed to fail on
its own (its row then says why, the others go on):

core (`refuse_orchestration`: DVC, Prefect and MLflow are absent from the process, as there):
- `pretrain`: bf16 training tokens/s of the shared loop and of HF `Trainer` on random tokens, at
  about 125M and 1B parameters (Llama shapes), and the shared loop's model-FLOPs utilisation
  against the device's bf16 dense peak (H100/H200 SXM: 989 TFLOP/s; else the measured peak of a
  large bf16 matrix product);
- `lora`: LoRA against QLoRA nf4 at the shapes of Qwen2.5-0.5B and -1.5B (`benchmarks.scale.real_sizes`,
  each run its own process): tokens/s and peak `torch.cuda.max_memory_allocated`;
- `fp8`: the 0.5B shape with `quantization: fp8` (compute capability 8.9+);
- `compile`: the shared loop at 125M with `train.compile` off and on: tokens/s and the warm-up;
- `ddp`: one rank through NCCL (`torchrun --nproc_per_node 1`): a process group, DDP around the
  model, the project's loss, five steps (the pipeline's own DDP path starts at 2 ranks: one GPU
  can only prove that NCCL and DDP work);
- `real`: the real-model profile (params/smollm2.yaml, its settings as written) through
  continued pretraining, SFT, DPO and GRPO, each stage's body run untracked
  (`stage.execute_untracked`): seconds per step, on SmolLM2-135M-Instruct's shape and tokenizer
  with random weights (`SMOLLM2_SHAPE`).

pipeline:
- `pipeline`: the tiny pipeline end to end (`qllm run --params params/tiny.yaml`) in a copy of this
  project, on the device (`probe_device` must say so).

Writes `<out>/<part>.json` (every row) and `<out>/<part>.md` (the table) after each section
(`gpu_check.*` for both), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT_FILES = ["pipelines", "flows", "qllm", "params", "dvc.yaml", "params.yaml", ".dvcignore", ".gitignore", "data/sources"]
BF16_PEAK = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}
"""Dense bf16 peak FLOP/s by device name (vendor data sheets, SXM parts)."""
PRETRAIN_SIZES = {  # Llama shapes: ~125M (GPT-2 small's width) and ~1.2B (Llama-3.2-1B's)
    "125m": {"hidden_size": 768, "intermediate_size": 2048, "num_layers": 12, "num_heads": 12, "num_kv_heads": 12, "vocab": 32000, "seq": 1024, "batch": 8},
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8, "vocab": 32000, "seq": 1024, "batch": 4},
    "tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2, "vocab": 256, "seq": 32, "batch": 2},
}
WARMUP, TIMED = 3, 10


def row(section: str, what: str, value=None, unit: str = "", note: str = "") -> dict:
    return {"section": section, "what": what, "value": value, "unit": unit, "note": note}


def _env(home: Path) -> dict[str, str]:
    env = dict(
        os.environ,
        DVC_NO_ANALYTICS="1",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PREFECT_HOME=str(home / "prefect"),
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    )  # fmt: skip (the carried wheels' folder too, on the device)
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("PREFECT_API_URL", None)
    return env


def _copy_project(project: Path, skip: tuple[str, ...] = ()) -> None:
    """This project's code, dvc.yaml, params and sources into `project`."""
    project.mkdir(parents=True, exist_ok=True)
    for name in PROJECT_FILES:
        source = REPO / name
        if name in skip:
            continue
        if source.is_dir():
            shutil.copytree(source, project / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.exists():
            (project / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, project / name)


def make_project(where: Path) -> Path:
    """A copy of this project's code and params in its own git and DVC repository."""
    project = where / "project"
    _copy_project(project)
    env = _env(where)
    if shutil.which("git") is None:  # DVC without git (`dvc init --no-scm`): the device image may have no git
        commands = [[sys.executable, "-m", "dvc", "init", "-q", "--no-scm"]]
    else:
        commands = [["git", "init", "-q"], ["git", "config", "user.email", "check@qllm"], ["git", "config", "user.name", "check"],
                    [sys.executable, "-m", "dvc", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "check"]]  # fmt: skip
    for command in commands:
        subprocess.run(command, cwd=project, env=env, check=True, capture_output=True)
    return project


# ---------------------------------------------------------------------------------------- the core, without orchestration

ORCHESTRATION = ("dvc", "dvc_data", "dvc_objects", "dvc_task", "scmrepo", "prefect", "mlflow")
"""What the core never imports: the device machine does not have them (DVC, Prefect, MLflow)."""
REAL_STAGES = ("sft", "dpo", "grpo")
"""The training stages of the real-model profile the core times (and everything they need first)."""


def refuse_orchestration() -> None:
    """Make the orchestration packages absent from this process, as they are on the device machine:
    `None` in `sys.modules` halts `import mlflow` (ModuleNotFoundError) and makes
    `importlib.util.find_spec` answer None, the way libraries probe for optional packages. The core
    proves by running that its path needs none of them."""
    loaded = [name for name in ORCHESTRATION if sys.modules.get(name) is not None]
    if loaded:
        raise RuntimeError(f"already imported before the core started: {', '.join(loaded)}")
    for name in ORCHESTRATION:
        sys.modules[name] = None


def _guarded(module: str, *args: str) -> list[str]:
    """A command running `python -m <module> <args>` with the orchestration packages refused."""
    return [sys.executable, "-m", "tools.gpu_check", "guarded", module, *args]


def bare_project(where: Path, overlays: list[str], overrides: list[str] = ()) -> Path:
    """The layout a stage reads (code, dvc.yaml, data/sources) and the effective params.yaml of
    `overlays` and `overrides`, with no git and no DVC: the core runs stages in it untracked."""
    import yaml

    from pipelines.core.params import files as params_file

    project = where
    _copy_project(project, skip=("params.yaml",))
    _, data = params_file.load(REPO, overlays=[REPO / o for o in overlays], overrides=list(overrides))
    (project / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return project


def run_stages(root: Path, until: tuple[str, ...]) -> dict[str, dict]:
    """Every stage `until` needs, then those, in the DAG's order, each in this process through
    `stage.execute_untracked` (or the world-reading stages' own `world.execute`): {stage: metrics}."""
    import importlib

    from pipelines.core import dag
    from pipelines.core.data import world
    from pipelines.core.run import stage

    wanted: list[str] = []
    for name in until:
        wanted += [n for n in dag.order(root, until=name) if n not in wanted]
    graph, done = dag.stages(root), {}
    for name in [n for n in dag.order(root) if n in wanted]:
        spec = graph[name]
        module = importlib.import_module(spec.module)
        run = world.execute if spec.always_changed else stage.execute_untracked
        done[name] = run(name, module.body, root)
    return done


# ---------------------------------------------------------------------------------------- sections


def pipeline(args, work: Path) -> list[dict]:
    project = make_project(work)
    start = time.perf_counter()
    summary = work / "pipeline-summary.json"
    done = subprocess.run([sys.executable, "-m", "qllm.cli", "run", "--params", "params/tiny.yaml", "--summary-json", str(summary)], cwd=project,
                          env=_env(work), capture_output=True, text=True, timeout=args.section_timeout)  # fmt: skip
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        return [row("pipeline", "tiny pipeline end to end", "failed", note=(done.stdout + done.stderr)[-600:])]
    args.project = Path(json.loads(summary.read_text())["workspace"])  # a run with --params has its own workspace
    device = json.loads((args.project / "data/metrics/probe_device.json").read_text())
    return [row("pipeline", "tiny pipeline end to end", round(seconds, 1), "s", f"probe_device: {device.get('device')}, precision auto = {device.get('auto')}")]


def _peak(device) -> tuple[float, str]:
    import torch

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in BF16_PEAK.items():
            if key in name:
                return peak, f"{name}, data-sheet bf16 dense peak"
    from benchmarks.peers.peer_training import matmul_peak

    return matmul_peak("bf16" if device.type == "cuda" else "fp32"), "measured matrix-product peak"


def _llama(size: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden_size"], intermediate_size=size["intermediate_size"],
                         num_hidden_layers=size["num_layers"], num_attention_heads=size["num_heads"], num_key_value_heads=size["num_kv_heads"],
                         max_position_embeddings=size["seq"])  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _shared_tokens_per_second(model, size: dict, precision: str, device, compile: bool = False) -> tuple[float, float]:
    """(tokens/s after warm-up, seconds of the warm-up steps) of `loop.train` on random tokens."""
    import numpy as np
    import torch

    from pipelines.core.extensions import Hook
    from pipelines.core.params.training import TrainParams
    from pipelines.core.training import loop

    rows = np.random.default_rng(0).integers(0, size["vocab"], (64, size["seq"]))
    cfg = TrainParams(max_steps=WARMUP + TIMED, micro_batch_size=size["batch"], warmup_steps=1, eval_every=0, checkpoint_every=0, log_every=100,
                      precision=precision, compile=compile)  # fmt: skip
    marks: list[float] = []
    started = time.perf_counter()

    def sync(state, metrics):
        if device.type == "cuda":
            torch.cuda.synchronize()
        marks.append(time.perf_counter())

    model.to(device)
    loop.train(model, loop.causal_lm_loss, loop.Batches(len(rows), cfg.micro_batch_size, 0,
                   lambda idx: {"input_ids": torch.from_numpy(rows[np.sort(idx)].astype(np.int64))}), cfg,
                   extensions=[Hook("on_step_end", sync)])  # fmt: skip
    return TIMED * size["batch"] * size["seq"] / (marks[-1] - marks[WARMUP - 1]), marks[WARMUP - 1] - started


def _trainer_tokens_per_second(model, size: dict, precision: str, device) -> float:
    import numpy as np
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    rows = np.random.default_rng(0).integers(0, size["vocab"], (64, size["seq"]))
    marks: list[float] = []

    class Mark(TrainerCallback):
        def on_step_end(self, a, state, control, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize()
            marks.append(time.perf_counter())

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            x = torch.from_numpy(rows[i].astype(np.int64))
            return {"input_ids": x, "labels": x}

    with tempfile.TemporaryDirectory() as out:
        arguments = TrainingArguments(output_dir=out, max_steps=WARMUP + TIMED, per_device_train_batch_size=size["batch"], bf16=precision == "bf16",
                                      use_cpu=device.type == "cpu", save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0)  # fmt: skip
        Trainer(model=model.to(device), args=arguments, train_dataset=Rows(), callbacks=[Mark()]).train()
    return TIMED * size["batch"] * size["seq"] / (marks[-1] - marks[WARMUP - 1])


def pretrain(args, work: Path) -> list[dict]:
    import torch

    device = torch.device(args.device)
    precision = "bf16" if device.type == "cuda" else "fp32"
    peak, source = _peak(device)
    rows = []
    for name in ("tiny",) if args.tiny else ("125m", "1b"):
        size = PRETRAIN_SIZES[name]
        model = _llama(size)
        n = sum(p.numel() for p in model.parameters())
        ours, _ = _shared_tokens_per_second(model, size, precision, device)
        del model
        theirs = _trainer_tokens_per_second(_llama(size), size, precision, device)
        mfu = 6 * n * ours / peak
        rows.append(row("pretrain", f"{name} ({n / 1e6:.0f}M), {precision}, shared loop", round(ours), "tokens/s", f"MFU {100 * mfu:.1f}% of {peak / 1e12:.3g} TFLOP/s ({source})"))
        rows.append(row("pretrain", f"{name}, HF Trainer", round(theirs), "tokens/s", f"shared loop / Trainer = {ours / theirs:.2f}"))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _real_size_stage(args, work: Path, shape: str, quantization: str) -> dict:
    base = work / f"base-{shape}"
    if not base.exists():
        subprocess.run(_guarded("benchmarks.scale.real_sizes", "make-base", "--shape", shape, "--out", str(base)), cwd=REPO,
                       check=True, capture_output=True, timeout=args.section_timeout)  # fmt: skip
    command = _guarded("benchmarks.scale.real_sizes", "stage", "--project", str(args.project), "--base", str(base), "--stage", "lora",
                       "--quantization", quantization, "--steps", "3" if args.tiny else "10", "--seq-len", "64" if args.tiny else "1024", "--loss-chunk", "1024")  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=args.section_timeout, env=_env(work))
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError((done.stdout + done.stderr)[-600:])
    return json.loads(lines[-1])


def lora(args, work: Path) -> list[dict]:
    rows = []
    for shape in ("qwen2.5-tiny",) if args.tiny else ("qwen2.5-0.5b", "qwen2.5-1.5b"):
        measured = {}
        for quantization in ("none", "nf4"):
            result = _real_size_stage(args, work, shape, quantization)
            memory = result.get("peak_cuda_allocated_mb") or result["peak_rss_mb"]
            measured[quantization] = memory
            what = "LoRA" if quantization == "none" else "QLoRA nf4"
            unit = "MB (CUDA max allocated)" if result.get("peak_cuda_allocated_mb") else "MB (peak resident)"
            rows.append(row("lora", f"{shape}, {what}", memory, unit, f"{result['tokens_per_second']:.0f} tokens/s, {result['seconds_per_step']} s/step"))
        rows.append(row("lora", f"{shape}, QLoRA / LoRA memory", round(measured["nf4"] / measured["none"], 3)))
    return rows


def fp8(args, work: Path) -> list[dict]:
    import torch

    if args.device != "cuda" or torch.cuda.get_device_capability() < (8, 9):
        return [row("fp8", "0.5B shape, quantization fp8", "skipped", note="needs a CUDA device of compute capability 8.9+")]
    result = _real_size_stage(args, work, "qwen2.5-0.5b", "fp8")
    return [row("fp8", "qwen2.5-0.5b, fp8", result.get("peak_cuda_allocated_mb"), "MB (CUDA max allocated)", f"{result['tokens_per_second']:.0f} tokens/s")]


def compile_(args, work: Path) -> list[dict]:
    import torch

    device = torch.device(args.device)
    precision = "bf16" if device.type == "cuda" else "fp32"
    size = PRETRAIN_SIZES["tiny" if args.tiny else "125m"]
    eager, eager_warmup = _shared_tokens_per_second(_llama(size), size, precision, device)
    compiled, compiled_warmup = _shared_tokens_per_second(_llama(size), size, precision, device, compile=True)
    return [row("compile", "train.compile false", round(eager), "tokens/s", f"warm-up {eager_warmup:.1f} s"),
            row("compile", "train.compile true", round(compiled), "tokens/s", f"warm-up {compiled_warmup:.1f} s (compilation); {compiled / eager:.2f}x eager")]  # fmt: skip


def ddp(args, work: Path) -> list[dict]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        "-m",
        "tools.gpu_check",
        "ddp-worker",
        "--device",
        args.device,
    ]  # fmt: skip (the worker refuses the orchestration packages itself)
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=args.section_timeout, env=_env(work))
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError((done.stdout + done.stderr)[-600:])
    result = json.loads(lines[-1])
    return [row("ddp", f"torchrun, 1 rank, {result['backend']}", result["loss_last"], "loss", f"first {result['loss_first']:.3f}, {result['steps']} steps in DDP")]


def ddp_worker(device_name: str) -> dict:
    import torch
    import torch.distributed as dist

    from pipelines.core.training import loop

    backend = "nccl" if device_name == "cuda" else "gloo"
    dist.init_process_group(backend=backend)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if device_name == "cuda" else torch.device("cpu")
    size = PRETRAIN_SIZES["tiny"]
    model = _llama(size).to(device)
    net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    x = torch.randint(0, size["vocab"], (4, size["seq"]), generator=torch.Generator().manual_seed(0)).to(device)
    losses = []
    for _ in range(5):
        loss, _ = loop.causal_lm_loss(net, {"input_ids": x})
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(float(value))
    dist.destroy_process_group()
    return {"backend": backend, "steps": len(losses), "loss_first": losses[0], "loss_last": round(losses[-1], 4)}


SMOLLM2_SHAPE = Path(".device/smollm2")
"""config.json and tokenizer of SmolLM2-135M-Instruct without its weights (`smollm2-shape`, made
by `make device-wheels`): the weights (a 98 MB GGUF file) do not fit the 64 MiB a device command
carries, so the core builds the real profile's base at the real shape with random weights. Step
times depend on the shapes and token counts, not on the weights' values; GRPO's random model
always samples the full `max_completion_length` (the trained one may stop sooner)."""
TINY_REAL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
"""--tiny: SmolLM2's configuration at test width and depth (the suite's rehearsal on a CPU)."""


def smollm2_shape(out: Path) -> Path:
    """Write `out`: SmolLM2-135M-Instruct's config.json and tokenizer (chat template included),
    read from the GGUF file `make install-smollm2` installs (`params/smollm2.yaml`'s base)."""
    import yaml
    from transformers import AutoConfig

    from pipelines.core.models import gguf_import

    name = yaml.safe_load((REPO / "params/smollm2.yaml").read_text())["base_model"]["name"]
    path = gguf_import.locate(name, REPO)
    AutoConfig.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    gguf_import.load_tokenizer(path).save_pretrained(out)
    return out


def _real_base(args, work: Path) -> tuple[Path, str]:
    """A base with SmolLM2-135M's configuration and tokenizer and random weights (at test size
    with --tiny); without SMOLLM2_SHAPE (--tiny only), a small BPE tokenizer with ChatML's markers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    shape = REPO / SMOLLM2_SHAPE
    if shape.is_dir():
        config, tokenizer, what = (
            AutoConfig.from_pretrained(shape),
            AutoTokenizer.from_pretrained(shape),
            "SmolLM2-135M-Instruct's config and tokenizer",
        )
    elif args.tiny:
        from benchmarks.scale.real_sizes import sample_texts
        from benchmarks.scale.real_sizes import tokenizer as bpe

        tokenizer, what = bpe(sample_texts(), vocab_size=512), "a small BPE tokenizer (no SmolLM2 shape here)"
        config = LlamaConfig(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                             max_position_embeddings=2048, tie_word_embeddings=True)  # fmt: skip
    else:
        raise FileNotFoundError(
            f"{SMOLLM2_SHAPE}: no SmolLM2 shape to build the real profile's base from (make device-wheels writes it)"
        )
    if args.tiny:
        config.update(TINY_REAL)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    base = work / "smollm2-base"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    n = sum(p.numel() for p in model.parameters())
    return base, f"{what}, random weights, {n / 1e6:.1f}M parameters"


def real(args, work: Path) -> list[dict]:
    """The real-model profile's training stages (params/smollm2.yaml, settings as written) on the
    base `_real_base` builds, each stage untracked, after the data stages it needs."""
    base, what = _real_base(args, work)
    overrides = [f"base_model.name={base}"]
    if args.tiny:  # two steps of each: the code paths, not the times
        overrides += [f"{stage}.train.{key}" for stage in ("pretrain", *REAL_STAGES) for key in ("max_steps=2", "warmup_steps=1")]
        overrides += ["base_answers.max_new_tokens=4"]  # the replay's reference answers: what the stages read, not their length
    project = bare_project(work / "real", ["params/smollm2.yaml"], overrides)
    metrics = run_stages(project, REAL_STAGES)
    rows = []
    for name in ("pretrain", *REAL_STAGES):
        m = metrics[name]
        steps = max(1, m.get("steps", 0))
        per_step = m.get("train_seconds", m["seconds"]) / steps
        rows.append(row("real", f"smollm2 profile, {name}", round(per_step, 3), "s/step",
                        f"{m.get('steps')} steps, stage {m['seconds']:.1f} s, {m.get('tokens_per_second', '-')} tokens/s, precision {m.get('precision')}; {what}"))  # fmt: skip
    return rows


SECTIONS: dict[str, Callable[[argparse.Namespace, Path], list[dict]]] = {
    "pipeline": pipeline, "pretrain": pretrain, "lora": lora, "fp8": fp8, "compile": compile_, "ddp": ddp, "real": real,
}
PARTS = {"core": ("pretrain", "lora", "fp8", "compile", "ddp", "real"), "pipeline": ("pipeline",)}
"""`core`: the project's training code on the device with only pydantic and bitsandbytes added (no
DVC, Prefect or MLflow import, refused by `refuse_orchestration`); `pipeline`: `qllm run` of the tiny
pipeline, with the orchestration packages carried. `check` runs both in one process (a machine
that has everything: `make gpu-check`)."""


def table(rows: list[dict]) -> str:
    lines = ["| section | what | value | unit | note |", "|---|---|---|---|---|"]
    lines += [f"| {r['section']} | {r['what']} | {r['value']} | {r['unit']} | {str(r['note']).replace('|', '/').replace(chr(10), ' ')} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["guarded"]:  # guarded MODULE ARGS...: a module run with the orchestration packages refused
        import runpy

        refuse_orchestration()
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", default="check", choices=["check", *PARTS, "smollm2-shape", "ddp-worker"],
                        help="core | pipeline: the two parts the device machine runs (docs/development.md); check: both; "
                             "smollm2-shape: write SmolLM2's config and tokenizer to --out (make device-wheels)")  # fmt: skip
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (the suite's run of these code paths on a CPU)")
    parser.add_argument(
        "--sections",
        default=None,
        help=f"comma-separated, of: {', '.join(SECTIONS)} (default: the command's part, or all)",
    )
    parser.add_argument("--out", default="gpu_check")
    parser.add_argument("--section-timeout", type=int, default=300)
    args = parser.parse_args(argv)
    if args.command == "smollm2-shape":
        print(smollm2_shape(Path(args.out)))
        return 0
    if args.command in ("core", "ddp-worker"):
        refuse_orchestration()
    if args.command == "ddp-worker":
        print(json.dumps(ddp_worker(args.device)), flush=True)
        return 0
    allowed = PARTS.get(args.command, tuple(SECTIONS))
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()] if args.sections else list(allowed)
    unknown = sorted(set(wanted) - set(allowed))
    if unknown:  # before importing torch: a mistyped section is refused at once
        parser.error(f"--sections: {', '.join(unknown)} not in {args.command} (its sections: {', '.join(allowed)})")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); on a CPU run --device cpu --tiny", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out, name = Path(args.out), args.command if args.command in PARTS else "gpu_check"
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def write() -> None:  # after every section: a command stopped at its time limit keeps what it measured
        (out / f"{name}.json").write_text(json.dumps({"device": device, "torch": torch.__version__, "part": args.command, "rows": rows}, indent=2) + "\n")
        (out / f"{name}.md").write_text(f"Device: {device}, torch {torch.__version__}, part {args.command}\n\n" + table(rows))

    with tempfile.TemporaryDirectory(prefix="qllm-gpu-check-") as tmp:
        work = Path(tmp)
        args.project = None
        if {"lora", "fp8"} & set(wanted):  # they train on prepared chats: the data stages, untracked
            args.project = bare_project(work / "chats", ["params/tiny.yaml"])
            run_stages(args.project, ("prepare_data",))
        for section in wanted:
            start = time.perf_counter()
            try:
                got = SECTIONS[section](args, work)
            except Exception as exc:  # one section's failure is a row, the check goes on
                got = [row(section, "failed", type(exc).__name__, note=f"{exc}"[-600:] or traceback.format_exc()[-600:])]
            for r in got:
                r["section_seconds"] = round(time.perf_counter() - start, 1)
            rows.extend(got)
            write()
            print(table(got), end="", flush=True)
    print(f"\n{out / f'{name}.md'}")
    return 1 if any(r["what"] == "failed" or r["value"] == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
