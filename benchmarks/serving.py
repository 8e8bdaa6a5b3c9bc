"""Greedy generation speed: `qllm generate` (transformers in-process) against MLflow's model server
with 1 and 4 concurrent clients, and llama.cpp on the export stage's f16 and q8_0 GGUF files, on
the held-out questions.

    python -m benchmarks.serving [--model data/models/dpo] [--questions 32] [--max-tokens 32] [--repeats 3]
    python -m benchmarks.serving --random 30m --max-tokens 32    # a ~30M-parameter model (random weights)

After `make run` (and `make test-gguf`'s install for the llama.cpp arms: llama-cpp-python; without
it they are left out and the output says so). The model directory is logged as `register` logs it
(`register.log_chat_model`: MLflow's chat task) to a temporary MLflow store, and `mlflow models
serve -m runs:/.../model --env-manager local` serves it on 127.0.0.1; the GGUF files are written
as the export stage writes them (`pipelines.core.models.gguf_export.write`) and loaded by
llama-cpp-python (2 threads, the chat template from the file). `--random 30m` builds a Llama of
that size (hidden 512, 8 layers, intermediate 1536, the project's tokenizer) with random weights
instead: the speed of a bigger model, whose answers mean nothing. Each repeat times the same
questions in turn: `flows.generation.generate` one after another, the server's `/invocations`
with one client, then with four clients at once (a thread each), then llama.cpp f16 and q8_0 (one
after another). Tokens are each way's own completion tokens (`qllm generate`'s are the server's:
its answers are the same, which the tests check); requests/s and tokens/s are over the whole batch
of questions. Prints every repeat, the medians and the file sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flows import generation, serve
from flows.local_api import free_port, wait_http
from pipelines import evaluate, register
from pipelines.core.models import gguf_export
from pipelines.core.models.models import stop_token_ids

REPO = Path(__file__).resolve().parents[1]


def _ask(url: str, question: str, max_tokens: int) -> tuple[str, int]:
    import urllib.request

    body = json.dumps({"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        (completion,) = json.loads(response.read())
    return completion["choices"][0]["message"]["content"], completion["usage"]["completion_tokens"]


RANDOM_SIZES = {"30m": {"hidden_size": 512, "intermediate_size": 1536, "num_layers": 8, "num_heads": 8, "num_kv_heads": 8}}


def random_model(size: str, out: Path) -> Path:
    """A random-weight Llama of `size` with the project's tokenizer, saved to `out`."""
    from transformers import AutoTokenizer

    from pipelines.core.config import ModelParams
    from pipelines.core.models.models import build_llama, configure_generation

    tokenizer = AutoTokenizer.from_pretrained(REPO / "data/tokenizer")
    model = build_llama(ModelParams(**RANDOM_SIZES[size]), tokenizer, max_positions=256, seed=0)
    configure_generation(model, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def llama_cpp_arm(path: Path, questions: list[str], max_tokens: int):
    """(answers with their token counts, seconds) of llama-cpp-python's chat completion."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=512, n_threads=2, seed=0, verbose=False)
    ask = lambda q: llm.create_chat_completion([{"role": "user", "content": q}], max_tokens=max_tokens, temperature=0.0)  # noqa: E731
    ask(questions[0])  # warm-up
    started = time.perf_counter()
    out = [ask(q) for q in questions]
    seconds = time.perf_counter() - started
    return [(o["choices"][0]["message"]["content"].strip(), o["usage"]["completion_tokens"]) for o in out], seconds


def decode_transformers(model, tokenizer, prompt: str, tokens: int) -> float:
    """Seconds to decode exactly `tokens` tokens greedily after `prompt` (end of turn suppressed)."""
    import torch

    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    seconds = time.perf_counter() - started
    assert out.shape[1] - ids["input_ids"].shape[1] == tokens
    return seconds


def decode_llama_cpp(path: Path, prompt: str, tokens: int, stop_ids: list[int]) -> float:
    """The same with llama-cpp-python on a GGUF file (the stop tokens' logits biased away)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=512, n_threads=2, seed=0, verbose=False)
    bias = {i: -1e9 for i in stop_ids}
    llm.create_completion(prompt, max_tokens=4, temperature=0.0, logit_bias=bias)  # warm-up
    started = time.perf_counter()
    out = llm.create_completion(prompt, max_tokens=tokens, temperature=0.0, logit_bias=bias)
    seconds = time.perf_counter() - started
    assert out["usage"]["completion_tokens"] == tokens, out["usage"]
    return seconds


def main(argv: list[str] | None = None) -> int:
    import mlflow

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="data/models/dpo", help="a model directory of the project (after `make run`)")
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=128, help="tokens decoded after one prompt for the tokens/s rows")
    parser.add_argument("--random", choices=sorted(RANDOM_SIZES), help="a random-weight model of this size instead of --model")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    questions = [turns[-1]["content"] for turns in evaluate.heldout_questions(REPO / "data/prepared/chat", args.questions)["prompt"]]
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        ggufs = []
        print("llama-cpp-python is not installed (make test-gguf installs it): no llama.cpp arms", flush=True)
    else:
        ggufs = ["f16", "q8_0"]
    with tempfile.TemporaryDirectory(prefix="qllm-serving-bench-") as scratch:
        model_dir = random_model(args.random, Path(scratch) / "model") if args.random else REPO / args.model
        model, tokenizer = generation.load(str(model_dir), REPO)
        print(f"model: {args.random or args.model}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
        sizes = {}
        for kind in ggufs:
            entry = gguf_export.write(model, tokenizer, Path(scratch) / f"model-{kind}.gguf", kind, "qllm")
            sizes[kind] = entry["bytes"]
        full = model_dir / "merged" if (model_dir / "merged").exists() else model_dir  # a LoRA stage's merged model
        sizes["safetensors_fp32"] = sum(p.stat().st_size for p in full.glob("*.safetensors"))
        print("file sizes (bytes):", json.dumps(sizes), flush=True)
        uri = f"sqlite:///{scratch}/mlflow.db"
        mlflow.set_tracking_uri(uri)
        with mlflow.start_run() as run:
            register.log_chat_model(REPO if model_dir.is_relative_to(REPO) else Path(scratch), model_dir)
        port = free_port()
        env = serve.service_env(Path(scratch)) | {"MLFLOW_TRACKING_URI": uri}
        with open(Path(scratch) / "serve.log", "wb") as log:
            server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "models", "serve", "-m", f"runs:/{run.info.run_id}/model",
                                       "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port)], cwd=scratch, env=env,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            wait_http(f"http://127.0.0.1:{port}/ping", server, "mlflow models serve", hint=f"; see {scratch}/serve.log")
            url = f"http://127.0.0.1:{port}/invocations"
            _ask(url, questions[0], args.max_tokens)  # warm-up: the first request loads the pipeline's lazy parts
            generation.generate(model, tokenizer, questions[0], max_new_tokens=args.max_tokens)
            rows = []
            for repeat in range(args.repeats):
                started = time.perf_counter()
                local = [generation.generate(model, tokenizer, q, max_new_tokens=args.max_tokens) for q in questions]
                local_seconds = time.perf_counter() - started
                started = time.perf_counter()
                one = [_ask(url, q, args.max_tokens) for q in questions]
                one_seconds = time.perf_counter() - started
                started = time.perf_counter()
                with ThreadPoolExecutor(4) as pool:
                    four = list(pool.map(lambda q: _ask(url, q, args.max_tokens), questions))
                four_seconds = time.perf_counter() - started
                count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731  answer tokens, every way alike
                tokens = sum(count(a) for a, _ in one)
                same = sum(a == b.strip() for a, (b, _) in zip(local, one, strict=True))
                cpp = {kind: llama_cpp_arm(Path(scratch) / f"model-{kind}.gguf", questions, args.max_tokens) for kind in ggufs}
                row = {"repeat": repeat, "questions": len(questions), "completion_tokens": tokens, "answers_equal": same,
                       "qllm_generate": {"requests_per_s": round(len(questions) / local_seconds, 2), "tokens_per_s": round(tokens / local_seconds, 1)},
                       "server_1_client": {"requests_per_s": round(len(questions) / one_seconds, 2), "tokens_per_s": round(tokens / one_seconds, 1)},
                       "server_4_clients": {"requests_per_s": round(len(questions) / four_seconds, 2),
                                            "tokens_per_s": round(sum(count(a) for a, _ in four) / four_seconds, 1)}}  # fmt: skip
                for kind, (answers, seconds) in cpp.items():
                    row[f"llama_cpp_{kind}"] = {"requests_per_s": round(len(questions) / seconds, 2),
                                                "tokens_per_s": round(sum(count(a) for a, _ in answers) / seconds, 1),
                                                "answers_equal": sum(a == b for (a, _), b in zip(answers, local, strict=True))}  # fmt: skip
                prompt = tokenizer.apply_chat_template([{"role": "user", "content": questions[0]}], tokenize=False, add_generation_prompt=True)
                row["decode_tokens_per_s"] = {"qllm_generate": round(args.decode_tokens / decode_transformers(model, tokenizer, prompt, args.decode_tokens), 1)}
                for kind in ggufs:
                    seconds = decode_llama_cpp(Path(scratch) / f"model-{kind}.gguf", prompt, args.decode_tokens, stop_token_ids(tokenizer))
                    row["decode_tokens_per_s"][f"llama_cpp_{kind}"] = round(args.decode_tokens / seconds, 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            serve.stop_processes({"mlflow models serve": {"pid": server.pid}})
            server.wait()
    for way in ("qllm_generate", "server_1_client", "server_4_clients", *(f"llama_cpp_{kind}" for kind in ggufs)):
        print(f"{way}: median {statistics.median(r[way]['requests_per_s'] for r in rows):.2f} requests/s, "
              f"{statistics.median(r[way]['tokens_per_s'] for r in rows):.1f} answer tokens/s")  # fmt: skip
    for way in rows[0]["decode_tokens_per_s"]:
        print(f"decode {args.decode_tokens} tokens, {way}: median {statistics.median(r['decode_tokens_per_s'][way] for r in rows):.1f} tokens/s "
              f"(min {min(r['decode_tokens_per_s'][way] for r in rows):.1f}, max {max(r['decode_tokens_per_s'][way] for r in rows):.1f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
