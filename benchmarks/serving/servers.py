"""Greedy generation speed: `qllm generate` (transformers in-process) against MLflow's model server
with 1, 4 and 8 concurrent clients, `qllm serve-openai` (OpenAI's chat completions API, streamed)
with 1 and 8, and llama.cpp on the export stage's f16 and q8_0 GGUF files, on the held-out questions.

    python -m benchmarks.serving.servers [--model data/models/dpo] [--questions 32] [--max-tokens 32] [--repeats 3]
    python -m benchmarks.serving.servers --random 30m --max-tokens 32    # a ~30M-parameter model (random weights)
    python -m benchmarks.serving.servers --project-dir ../other-checkout   # its model and held-out questions

After `make run` (and `make test-gguf`'s install for the llama.cpp arms: llama-cpp-python; without
it they are left out and the output says so). The model directory is logged as `register` logs it
(`register.log_chat_model`: MLflow's chat task) to a temporary MLflow store, and `mlflow models
serve -m runs:/.../model --env-manager local` serves it on 127.0.0.1; the GGUF files are written
as the export stage writes them (`pipelines.core.models.gguf_export.write`) and loaded by
llama-cpp-python (2 threads, the chat template from the file). `--random 30m` builds a Llama of
that size (hidden 512, 8 layers, intermediate 1536, the project's tokenizer) with random weights
instead: the speed of a bigger model, whose answers mean nothing. Each repeat times the same
questions in turn: `qllm.serving.generation.generate` one after another, the server's `/invocations`
with one client, then with four and with eight clients at once (a thread each), then `qllm
serve-openai` (started as the command starts it, on 127.0.0.1) with one client and with eight, each
request streamed (`"stream": true`), then llama.cpp f16 and q8_0 (one after another). Tokens are
each way's own completion tokens (`qllm generate`'s are the server's: its answers are the same,
which the tests check); requests/s and tokens/s are over the whole batch of questions. Time to
first token: from sending a streamed request to its first piece of answer (median over the
questions), against `qllm generate`'s in-process time for a one-token answer (the prompt's forward
pass and one token: the least any server adds to). MLflow's server does not stream: its answers
come whole. Prints every repeat, the medians with the ratios to the in-process baseline, and the
file sizes.
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

from benchmarks.common import REPO
from pipelines import register
from pipelines.core.evaluation import heldout
from pipelines.core.models import gguf_export
from pipelines.core.models.models import stop_token_ids
from qllm.services import serve
from qllm.services.local_api import free_port, wait_http
from qllm.serving import generation

ROOT = REPO  # the project whose model, held-out questions and tokenizer are used (--project-dir)


def _ask(url: str, question: str, max_tokens: int) -> tuple[str, int]:
    import urllib.request

    body = json.dumps({"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        (completion,) = json.loads(response.read())
    return completion["choices"][0]["message"]["content"], completion["usage"]["completion_tokens"]


def _timed_clients(ask, questions: list, clients: int) -> tuple[list, float]:
    """Every question through `ask` by `clients` clients at once (1: one after another); the
    answers in question order and the wall seconds."""
    started = time.perf_counter()
    if clients == 1:
        answers = [ask(q) for q in questions]
    else:
        with ThreadPoolExecutor(clients) as pool:
            answers = list(pool.map(ask, questions))
    return answers, time.perf_counter() - started


def _ask_openai(base: str, question: str, max_tokens: int) -> tuple[str, int, float]:
    """(answer, completion tokens, seconds to the answer's first piece) of a streamed chat completion."""
    import urllib.request

    body = json.dumps({"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()  # fmt: skip
    request = urllib.request.Request(f"{base}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    pieces, tokens, first = [], 0, None
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:  # server-sent events, read as they come
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[len(b"data: ") :])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    first = time.perf_counter() - started if first is None else first
                    pieces.append(choice["delta"]["content"])
    return "".join(pieces), tokens, time.perf_counter() - started if first is None else first


RANDOM_SIZES = {"30m": {"hidden_size": 512, "intermediate_size": 1536, "num_layers": 8, "num_heads": 8, "num_kv_heads": 8}}


def random_model(size: str, out: Path) -> Path:
    """A random-weight Llama of `size` with the project's tokenizer, saved to `out`."""
    from transformers import AutoTokenizer

    from pipelines.core.models.models import build_llama, configure_generation
    from pipelines.core.params.pretraining import ModelParams

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "data/tokenizer")
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
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave out the llama.cpp arms (even when llama-cpp-python is installed)")
    parser.add_argument("--project-dir", type=Path, default=REPO, help="the project with the model, data/prepared/chat and data/tokenizer (default: this checkout)")
    args = parser.parse_args(argv)
    global ROOT
    ROOT = args.project_dir.resolve()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    questions = [turns[-1]["content"] for turns in heldout.heldout_questions(ROOT / "data/prepared/chat", args.questions)["prompt"]]
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        ggufs = []
        print("llama-cpp-python is not installed (make test-gguf installs it): no llama.cpp arms", flush=True)
    else:
        ggufs = [] if args.no_llama_cpp else ["f16", "q8_0"]
    with tempfile.TemporaryDirectory(prefix="qllm-serving-bench-") as scratch:
        model_dir = random_model(args.random, Path(scratch) / "model") if args.random else ROOT / args.model
        model, tokenizer = generation.load(str(model_dir), ROOT)
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
            register.log_chat_model(ROOT if model_dir.is_relative_to(ROOT) else Path(scratch), model_dir)
        port = free_port()
        env = serve.service_env(Path(scratch)) | {"MLFLOW_TRACKING_URI": uri}
        with open(Path(scratch) / "serve.log", "wb") as log:
            server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "models", "serve", "-m", f"runs:/{run.info.run_id}/model",
                                       "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port)], cwd=scratch, env=env,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        openai_port = free_port()
        with open(Path(scratch) / "serve-openai.log", "wb") as log:  # as `qllm serve-openai` starts (this checkout's code), no API key
            openai_server = subprocess.Popen([sys.executable, "-m", "qllm.cli", "serve-openai", "--model", str(model_dir), "--port",
                                              str(openai_port), "--project-dir", str(ROOT)], cwd=REPO, env=env, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            wait_http(f"http://127.0.0.1:{port}/ping", server, "mlflow models serve", hint=f"; see {scratch}/serve.log")
            wait_http(f"http://127.0.0.1:{openai_port}/health", openai_server, "qllm serve-openai", hint=f"; see {scratch}/serve-openai.log")
            url = f"http://127.0.0.1:{port}/invocations"
            base = f"http://127.0.0.1:{openai_port}"
            _ask(url, questions[0], args.max_tokens)  # warm-up: the first request loads the pipeline's lazy parts
            _ask_openai(base, questions[0], args.max_tokens)
            generation.generate(model, tokenizer, questions[0], max_new_tokens=args.max_tokens)
            rows = []
            for repeat in range(args.repeats):
                started = time.perf_counter()
                local = [generation.generate(model, tokenizer, q, max_new_tokens=args.max_tokens) for q in questions]
                local_seconds = time.perf_counter() - started
                one, one_seconds = _timed_clients(lambda q: _ask(url, q, args.max_tokens), questions, 1)
                four, four_seconds = _timed_clients(lambda q: _ask(url, q, args.max_tokens), questions, 4)
                eight, eight_seconds = _timed_clients(lambda q: _ask(url, q, args.max_tokens), questions, 8)
                first_token = []  # in-process: the prompt's forward pass and one token
                for q in questions:
                    started = time.perf_counter()
                    generation.generate(model, tokenizer, q, max_new_tokens=1)
                    first_token.append(time.perf_counter() - started)
                openai_one, openai_one_seconds = _timed_clients(lambda q: _ask_openai(base, q, args.max_tokens), questions, 1)
                openai_eight, openai_eight_seconds = _timed_clients(lambda q: _ask_openai(base, q, args.max_tokens), questions, 8)
                count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731  answer tokens, every way alike
                tokens = sum(count(a) for a, _ in one)
                same = sum(a == b.strip() for a, (b, _) in zip(local, one, strict=True))
                cpp = {kind: llama_cpp_arm(Path(scratch) / f"model-{kind}.gguf", questions, args.max_tokens) for kind in ggufs}
                row = {"repeat": repeat, "questions": len(questions), "completion_tokens": tokens, "answers_equal": same,
                       "qllm_generate": {"requests_per_s": round(len(questions) / local_seconds, 2), "tokens_per_s": round(tokens / local_seconds, 1)},
                       "server_1_client": {"requests_per_s": round(len(questions) / one_seconds, 2), "tokens_per_s": round(tokens / one_seconds, 1)},
                       "server_4_clients": {"requests_per_s": round(len(questions) / four_seconds, 2),
                                            "tokens_per_s": round(sum(count(a) for a, _ in four) / four_seconds, 1)},
                       "server_8_clients": {"requests_per_s": round(len(questions) / eight_seconds, 2),
                                            "tokens_per_s": round(sum(count(a) for a, _ in eight) / eight_seconds, 1)},
                       "first_token_in_process_s": round(statistics.median(first_token), 4)}  # fmt: skip
                for way, answers, seconds in (("openai_1_client", openai_one, openai_one_seconds), ("openai_8_clients", openai_eight, openai_eight_seconds)):
                    row[way] = {"requests_per_s": round(len(questions) / seconds, 2), "tokens_per_s": round(sum(count(a) for a, _, _ in answers) / seconds, 1),
                                "first_token_s": round(statistics.median(t for _, _, t in answers), 4),
                                "answers_equal": sum(a == b for (a, _, _), b in zip(answers, local, strict=True))}  # fmt: skip
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
            serve.stop_processes({"mlflow models serve": {"pid": server.pid}, "qllm serve-openai": {"pid": openai_server.pid}})
            server.wait()
            openai_server.wait()
    baseline = statistics.median(r["qllm_generate"]["requests_per_s"] for r in rows)
    first_token = statistics.median(r["first_token_in_process_s"] for r in rows)
    for way in ("qllm_generate", "server_1_client", "server_4_clients", "server_8_clients", "openai_1_client", "openai_8_clients",
                *(f"llama_cpp_{kind}" for kind in ggufs)):  # fmt: skip
        rate = statistics.median(r[way]["requests_per_s"] for r in rows)
        ttft = f", time to first token {statistics.median(r[way]['first_token_s'] for r in rows) * 1000:.1f} ms " \
               f"({statistics.median(r[way]['first_token_s'] for r in rows) / first_token:.2f}x in-process)" if way.startswith("openai") else ""  # fmt: skip
        print(f"{way}: median {rate:.2f} requests/s ({rate / baseline:.2f}x qllm_generate), "
              f"{statistics.median(r[way]['tokens_per_s'] for r in rows):.1f} answer tokens/s{ttft}")  # fmt: skip
    print(f"in-process one-token answer (time-to-first-token baseline): median {first_token * 1000:.1f} ms")
    for way in rows[0]["decode_tokens_per_s"]:
        print(f"decode {args.decode_tokens} tokens, {way}: median {statistics.median(r['decode_tokens_per_s'][way] for r in rows):.1f} tokens/s "
              f"(min {min(r['decode_tokens_per_s'][way] for r in rows):.1f}, max {max(r['decode_tokens_per_s'][way] for r in rows):.1f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
