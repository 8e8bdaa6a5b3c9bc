"""Greedy generation speed: `qllm generate` (transformers in-process) against MLflow's model server
with 1 and 4 concurrent clients, on the held-out questions.

    python -m benchmarks.serving [--model data/models/dpo] [--questions 32] [--max-tokens 32] [--repeats 3]

After `make run`. The model directory is logged as `register` logs it (`register.log_chat_model`:
MLflow's chat task) to a temporary MLflow store, and `mlflow models serve -m runs:/.../model
--env-manager local` serves it on 127.0.0.1. Each repeat times the same questions three ways,
in turn: `flows.generation.generate` one after another, then the server's `/invocations` with one
client, then with four clients at once (a thread each). Tokens are the server's
`usage.completion_tokens` (its answers equal `qllm generate`'s, which the tests check); requests/s
and tokens/s are over the whole batch of questions. Prints every repeat and the medians.
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

REPO = Path(__file__).resolve().parents[1]


def _ask(url: str, question: str, max_tokens: int) -> tuple[str, int]:
    import urllib.request

    body = json.dumps({"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        (completion,) = json.loads(response.read())
    return completion["choices"][0]["message"]["content"], completion["usage"]["completion_tokens"]


def main(argv: list[str] | None = None) -> int:
    import mlflow

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="data/models/dpo", help="a model directory of the project (after `make run`)")
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    questions = [turns[-1]["content"] for turns in evaluate.heldout_questions(REPO / "data/prepared/chat", args.questions)["prompt"]]
    model, tokenizer = generation.load(args.model, REPO)
    with tempfile.TemporaryDirectory(prefix="qllm-serving-bench-") as scratch:
        uri = f"sqlite:///{scratch}/mlflow.db"
        mlflow.set_tracking_uri(uri)
        with mlflow.start_run() as run:
            register.log_chat_model(REPO, REPO / args.model)
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
                tokens = sum(n for _, n in one)
                same = sum(a == b.strip() for a, (b, _) in zip(local, one, strict=True))
                row = {"repeat": repeat, "questions": len(questions), "completion_tokens": tokens, "answers_equal": same,
                       "qllm_generate": {"requests_per_s": round(len(questions) / local_seconds, 2), "tokens_per_s": round(tokens / local_seconds, 1)},
                       "server_1_client": {"requests_per_s": round(len(questions) / one_seconds, 2), "tokens_per_s": round(tokens / one_seconds, 1)},
                       "server_4_clients": {"requests_per_s": round(len(questions) / four_seconds, 2),
                                            "tokens_per_s": round(sum(n for _, n in four) / four_seconds, 1)}}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            serve.stop_processes({"mlflow models serve": {"pid": server.pid}})
            server.wait()
    for way in ("qllm_generate", "server_1_client", "server_4_clients"):
        print(f"{way}: median {statistics.median(r[way]['requests_per_s'] for r in rows):.2f} requests/s, "
              f"{statistics.median(r[way]['tokens_per_s'] for r in rows):.1f} tokens/s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
