"""`qllm serve-openai` (qllm/serving/openai_api.py) through the official `openai` client: the answers are
`qllm generate`'s, streamed or not, and every expected value here is computed by the test itself
(transformers' `model.generate`, the tokenizer, `qllm.serving.generation`), never by the server's code.

The server runs as the command runs (`python -m qllm.cli serve-openai`, a subprocess on a free
port of 127.0.0.1, with an API key) on a tiny random Llama whose weights are redrawn larger, so that
each prompt gets a different answer of its own length: some end at the end-of-turn token, some run
to the token limit (the stop tokens' embeddings are scaled up so that both happen).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipelines.core.data.chat_template import render_prompt
from pipelines.core.errors import QllmError
from pipelines.core.models.models import stop_token_ids
from qllm.cli import build_parser, main
from qllm.services.local_api import free_port, wait_http
from qllm.serving import chat_request, generation, openai_api

openai = pytest.importorskip("openai")  # the `test` extra

REPO = Path(__file__).resolve().parents[2]
KEY = "qllm-test-key-0123456789abcdef"
KEY_ENV = "QLLM_TEST_OPENAI_KEY"
NAME = "tiny"
MAX_TOKENS = 24
NAMES = ["Tovik", "Marela", "Sanit", "Orvin", "Lumi", "Pera"]
PROMPTS = [f"Where does {n} live?" for n in NAMES] + [f"What is {a} plus {b}?" for a, b in [(1, 2), (3, 4), (2, 5), (6, 1), (4, 4), (5, 3)]]


@dataclass
class Served:
    url: str
    log: Path


@pytest.fixture(scope="module")
def model_dir(tiny_base, tmp_path_factory) -> Path:
    """tiny_base's random Llama, weights redrawn with std 0.3 (chaotic: every prompt its own answer)
    and the stop tokens' (tied) embeddings scaled by 2.5 (so answers end at various lengths)."""
    import torch

    model, tokenizer = generation.load(str(tiny_base / "model"))
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.3)
        embeddings = model.get_input_embeddings().weight
        for token in stop_token_ids(tokenizer):
            embeddings[token] *= 2.5
    out = tmp_path_factory.mktemp("openai_api") / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def reference(model_dir):
    """(model, tokenizer) loaded here, as `qllm generate` loads them."""
    return generation.load(str(model_dir))


def expected(reference, messages: list[dict], max_tokens: int = MAX_TOKENS) -> tuple[str, str, int, int, list[int]]:
    """(answer, finish reason, prompt tokens, completion tokens, generated ids): greedy
    `model.generate` on the chat template's prompt, computed here."""
    import torch

    model, tokenizer = reference
    prompt = tokenizer(render_prompt(tokenizer, messages), return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=max_tokens, do_sample=False, eos_token_id=stop_token_ids(tokenizer),
                                pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    new = output[0, prompt["input_ids"].shape[1] :].tolist()
    finish = "stop" if new[-1] in stop_token_ids(tokenizer) else "length"
    return tokenizer.decode(new, skip_special_tokens=True).strip(), finish, prompt["input_ids"].shape[1], len(new), new


@pytest.fixture(scope="module")
def answers(reference) -> dict[str, tuple]:
    """Every prompt's expected greedy answer (MAX_TOKENS), as `expected` gives it."""
    return {prompt: expected(reference, [{"role": "user", "content": prompt}]) for prompt in PROMPTS}


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    """`qllm serve-openai --model DIR --api-key-env VAR` on 127.0.0.1 (a free port), stopped after."""
    port = free_port()
    log = tmp_path_factory.mktemp("openai_api_log") / "server.log"
    env = os.environ | {KEY_ENV: KEY}
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "qllm.cli", "serve-openai", "--model", str(model_dir), "--port", str(port),
                                   "--api-key-env", KEY_ENV, "--model-name", NAME], cwd=REPO, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/health", server, "qllm serve-openai", hint=f"; see {log}")
        yield Served(f"http://127.0.0.1:{port}", log)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def ask(client, messages: list[dict], **options) -> tuple[str, str, object]:
    """(content, finish reason, usage) of a non-streamed completion."""
    done = client.chat.completions.create(model=NAME, messages=messages, **options)
    assert done.object == "chat.completion" and done.model == NAME and done.id.startswith("chatcmpl-") and len(done.choices) == 1
    assert done.choices[0].message.role == "assistant"
    return done.choices[0].message.content, done.choices[0].finish_reason, done.usage


def ask_streamed(client, messages: list[dict], **options) -> tuple[str, str, object, list]:
    """(the concatenated content, finish reason, usage or None, the chunks) of a streamed completion."""
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, stream=True, **options))
    choices = [c for c in chunks if c.choices]
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert choices[0].choices[0].delta.role == "assistant" and not choices[0].choices[0].delta.content
    assert all(c.choices[0].finish_reason is None for c in choices[:-1]) and choices[-1].choices[0].delta.content is None
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) <= 1 and (not usage or not chunks[-1].choices)  # the usage chunk, when asked for, comes last
    content = "".join(c.choices[0].delta.content or "" for c in choices)
    return content, choices[-1].choices[0].finish_reason, usage[0] if usage else None, chunks


def user(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def post(served: Served, path: str, body: bytes | dict, key: str | None = KEY) -> tuple[int, dict]:
    """(status, JSON answer) of a raw POST; errors returned, not raised."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(served.url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def assert_error_shape(body: dict, param: str | None = None) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"] and isinstance(body["error"]["type"], str)
    assert body["error"]["param"] == param, body
    return body["error"]


# ----------------------------------------------------------------------------- the model here


def test_the_test_model_answers_each_prompt_its_own_way(reference, answers):
    """What the tests below rely on: distinct answers, some ended by the end-of-turn token and some
    by the limit; `expected` is `qllm generate`'s decoding."""
    model, tokenizer = reference
    assert len({a[0] for a in answers.values()}) == len(PROMPTS)
    assert {a[1] for a in answers.values()} == {"stop", "length"}
    for prompt in PROMPTS[:3]:
        assert generation.generate(model, tokenizer, prompt, max_new_tokens=MAX_TOKENS) == answers[prompt][0]


# ----------------------------------------------------------------------------- answers


def test_greedy_answers_equal_qllm_generates_streamed_or_not(client, reference, answers, capsys, model_dir):
    model, tokenizer = reference
    for prompt in PROMPTS[:6]:
        answer, finish, prompt_tokens, completion_tokens, _ = answers[prompt]
        assert generation.generate(model, tokenizer, prompt, max_new_tokens=MAX_TOKENS) == answer
        content, reason, usage = ask(client, user(prompt), max_tokens=MAX_TOKENS, temperature=0)
        assert (content, reason) == (answer, finish), prompt
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)
        streamed, reason, usage, chunks = ask_streamed(client, user(prompt), max_tokens=MAX_TOKENS, temperature=0)
        assert (streamed, reason, usage) == (answer, finish, None), prompt
    # a long answer arrives in pieces, not at the end
    longest = max(PROMPTS, key=lambda p: len(answers[p][0]))
    _, _, _, chunks = ask_streamed(client, user(longest), max_tokens=MAX_TOKENS, temperature=0)
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) > 3
    # the command itself prints the same answer
    capsys.readouterr()
    assert main(["generate", "--model", str(model_dir), "--prompt", PROMPTS[0], "--max-new-tokens", str(MAX_TOKENS)]) == 0
    assert capsys.readouterr().out.strip() == answers[PROMPTS[0]][0]


def test_conversations_use_the_chat_template_and_usage_counts_the_tokens(client, reference):
    """System, user and assistant turns go through the model's chat template; `usage` counts the
    rendered prompt's tokens and the generated ones (end of turn included); the usage chunk of a
    stream (`stream_options.include_usage`) has the same counts."""
    model, tokenizer = reference
    conversation = [{"role": "system", "content": "Answer with one word."}, {"role": "user", "content": "Where does Tovik live?"},
                    {"role": "assistant", "content": "Pelora"}, {"role": "user", "content": "And Marela?"}]  # fmt: skip
    prompt_tokens = len(tokenizer(render_prompt(tokenizer, conversation), add_special_tokens=False)["input_ids"])
    answer, finish, counted, completion_tokens, _ = expected(reference, conversation)
    assert counted == prompt_tokens
    content, reason, usage = ask(client, conversation, max_tokens=MAX_TOKENS, temperature=0)
    assert (content, reason) == (answer, finish)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)
    streamed, reason, usage, _ = ask_streamed(client, conversation, max_tokens=MAX_TOKENS, temperature=0, stream_options={"include_usage": True})
    assert (streamed, reason) == (answer, finish)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)
    # a system message, as `qllm generate --system`
    system = "Answer with one word."
    assert ask(client, [{"role": "system", "content": system}, *user("Where does Lumi live?")], max_tokens=MAX_TOKENS, temperature=0)[0] == \
        generation.generate(model, tokenizer, "Where does Lumi live?", max_new_tokens=MAX_TOKENS, system=system)  # fmt: skip
    # text content parts are the text
    parts = [{"role": "user", "content": [{"type": "text", "text": "Where does Orvin live?"}]}]
    assert ask(client, parts, max_tokens=MAX_TOKENS, temperature=0)[0] == expected(reference, user("Where does Orvin live?"))[0]


def test_max_tokens_ends_with_length_after_exactly_that_many_tokens(client, reference, answers):
    long = [p for p in PROMPTS if answers[p][3] > 5]
    assert long
    for prompt in long[:3]:
        answer, finish, _, completion_tokens, _ = expected(reference, user(prompt), max_tokens=5)
        assert (finish, completion_tokens) == ("length", 5)
        for option in ("max_tokens", "max_completion_tokens"):
            content, reason, usage = ask(client, user(prompt), temperature=0, **{option: 5})
            assert (content, reason, usage.completion_tokens) == (answer, "length", 5), (prompt, option)
        streamed, reason, usage, _ = ask_streamed(client, user(prompt), max_tokens=5, temperature=0, stream_options={"include_usage": True})
        assert (streamed, reason, usage.completion_tokens) == (answer, "length", 5)
    # without max_tokens: up to the end of the context, so an answer that ends by itself is the whole answer
    ended = next(p for p in PROMPTS if answers[p][1] == "stop")
    assert ask(client, user(ended), temperature=0)[:2] == answers[ended][:2]


def test_stop_strings_end_the_answer_before_them(client, reference, answers):
    _, tokenizer = reference
    checked = 0
    for prompt in PROMPTS:
        answer, _, _, _, ids = answers[prompt]
        # a stop string from inside the answer: two characters, no replacement character, not at its start
        at = next((i for i in range(2, len(answer) - 2) if not any(c == "\ufffd" or c.isspace() for c in answer[i : i + 2])), None)
        if at is None:
            continue
        stop = answer[at : at + 2]
        cut = answer[: answer.index(stop)].strip()
        # the tokens generated until the stop string showed up (what usage counts)
        tokens = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k], skip_special_tokens=True))
        for stops in (stop, ["never-in-an-answer", stop]):
            content, reason, usage = ask(client, user(prompt), max_tokens=MAX_TOKENS, temperature=0, stop=stops)
            assert (content, reason, usage.completion_tokens) == (cut, "stop", tokens), (prompt, stops)
            streamed, reason, _, chunks = ask_streamed(client, user(prompt), max_tokens=MAX_TOKENS, temperature=0, stop=stops)
            assert (streamed, reason) == (cut, "stop"), (prompt, stops)
            assert not any(stop in (c.choices[0].delta.content or "") for c in chunks if c.choices)
        checked += 1
    assert checked >= 3
    # a stop string that never shows up changes nothing
    prompt = PROMPTS[0]
    assert ask(client, user(prompt), max_tokens=MAX_TOKENS, temperature=0, stop="never-in-an-answer")[:2] == answers[prompt][:2]


def test_seeded_sampling_is_reproducible_and_is_qllm_generates(client, reference, answers):
    model, tokenizer = reference
    prompt = PROMPTS[4]
    sampled = {seed: ask(client, user(prompt), max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)[0] for seed in (1, 2, 3)}
    assert ask(client, user(prompt), max_tokens=MAX_TOKENS, temperature=1.0, seed=1)[0] == sampled[1]
    assert ask_streamed(client, user(prompt), max_tokens=MAX_TOKENS, temperature=1.0, seed=1)[0] == sampled[1]
    assert len(set(sampled.values())) > 1
    for seed in (1, 2):  # `qllm generate --temperature 1 --seed S`
        assert sampled[seed] == generation.generate(model, tokenizer, prompt, max_new_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
    # top_p 0 keeps only the likeliest token: sampling it is greedy decoding
    for seed in (1, 2):
        assert ask(client, user(prompt), max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.0, seed=seed)[0] == answers[prompt][0]


def test_eight_concurrent_clients_each_get_their_own_answer(served, reference):
    """8 clients at once (a thread each, half of them streaming, each its own prompt and token limit,
    twice over): every answer is its own prompt's, with its own usage, nothing lost or mixed up."""
    jobs = [(PROMPTS[i], 8 + 2 * i, i % 2 == 1) for i in range(8)]
    wanted = {i: expected(reference, user(prompt), max_tokens=limit)[:4] for i, (prompt, limit, _) in enumerate(jobs)}
    assert len({answer for answer, *_ in wanted.values()}) == len(jobs)  # eight different answers: a mix-up would show
    start = threading.Barrier(len(jobs))
    results: dict[int, list] = {i: [] for i in range(len(jobs))}

    def one(i: int) -> None:
        prompt, limit, stream = jobs[i]
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=300)
        start.wait()
        for _ in range(2):
            if stream:
                content, finish, usage, _ = ask_streamed(client, user(prompt), max_tokens=limit, temperature=0, stream_options={"include_usage": True})
            else:
                content, finish, usage = ask(client, user(prompt), max_tokens=limit, temperature=0)
            results[i].append((content, finish, usage.prompt_tokens, usage.completion_tokens))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert results == {i: [wanted[i], wanted[i]] for i in range(len(jobs))}


# ----------------------------------------------------------------------------- the API around the answers


def test_models_lists_the_served_model(client, served):
    listed = client.models.list()
    assert [m.id for m in listed.data] == [NAME] and listed.data[0].object == "model"
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("other")
    assert (info.value.code, info.value.param) == ("model_not_found", "model")
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="other", messages=user("hi"))
    assert (info.value.code, info.value.param) == ("model_not_found", "model")


def test_a_key_is_required_when_set(served):
    wrong = openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong-key-0123456789abcdef", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.chat.completions.create(model=NAME, messages=user("hi"), max_tokens=2)
    assert (info.value.status_code, info.value.code) == (401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    for key, message in ((None, "You didn't provide an API key"), ("wrong-key-0123456789abcdef", "Incorrect API key provided")):
        status, body = post(served, "/v1/chat/completions", {"messages": user("hi"), "max_tokens": 2}, key=key)
        assert status == 401 and assert_error_shape(body)["code"] == "invalid_api_key" and body["error"]["message"].startswith(message)
    request = urllib.request.Request(f"{served.url}/v1/models", headers={"Authorization": f"Basic {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == 401 and info.value.headers["WWW-Authenticate"] == "Bearer"
    with urllib.request.urlopen(f"{served.url}/health", timeout=60) as response:  # for readiness checks: says nothing else
        assert json.loads(response.read()) == {"status": "ok"}
    status, _ = post(served, "/v1/chat/completions", {"messages": user("hi"), "max_tokens": 2})
    assert status == 200


M = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"max_tokens": 2}, "messages", "missing_required_parameter"),
        ({"messages": []}, "messages", None),
        ({"messages": "hi"}, "messages", None),
        ({"messages": ["hi"]}, "messages.[0]", None),
        ({"messages": [{"role": "bot", "content": "hi"}]}, "messages.[0].role", "invalid_value"),
        ({"messages": [{"role": "tool", "content": "hi"}]}, "messages.[0].role", "invalid_value"),
        ({"messages": [{"role": "user"}]}, "messages.[0].content", None),
        ({"messages": [{"role": "user", "content": "hi", "name": "x"}]}, "messages.[0].name", None),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.[0].content.[0]", None),
        ({**M, "max_tokens": -1}, "max_tokens", "invalid_value"),
        ({**M, "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({**M, "max_tokens": 2.5}, "max_tokens", None),
        ({**M, "max_tokens": True}, "max_tokens", None),
        ({**M, "max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
        ({**M, "max_tokens": 2, "max_completion_tokens": 2}, "max_completion_tokens", None),
        ({**M, "temperature": 2.5}, "temperature", "invalid_value"),
        ({**M, "temperature": -0.1}, "temperature", "invalid_value"),
        ({**M, "temperature": "hot"}, "temperature", None),
        ({**M, "top_p": 1.5}, "top_p", "invalid_value"),
        ({**M, "stop": ["a", "b", "c", "d", "e"]}, "stop", None),
        ({**M, "stop": [""]}, "stop", None),
        ({**M, "stop": 3}, "stop", None),
        ({**M, "seed": "x"}, "seed", None),
        ({**M, "n": 2}, "n", "unsupported_value"),
        ({**M, "stream": "yes"}, "stream", None),
        ({**M, "stream_options": {"include_usage": True}}, "stream_options", None),
        ({**M, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options", None),
        ({**M, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "unsupported_parameter"),
        ({**M, "tool_choice": "auto"}, "tool_choice", "unsupported_parameter"),
        ({**M, "response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
        ({**M, "logprobs": True}, "logprobs", "unsupported_value"),
        ({**M, "top_logprobs": 2}, "top_logprobs", "unsupported_parameter"),
        ({**M, "logit_bias": {"1": 5}}, "logit_bias", "unsupported_parameter"),
        ({**M, "frequency_penalty": 0.5}, "frequency_penalty", "unsupported_value"),
        ({**M, "presence_penalty": 1}, "presence_penalty", "unsupported_value"),
        ({**M, "fancy": 1}, "fancy", "unknown_parameter"),
        ({**M, "max_tokens": 1000}, "messages", "context_length_exceeded"),  # beyond the model's 128 positions
    ],
)
def test_bad_requests_are_400s_naming_the_parameter(served, body, param, code):
    status, answer = post(served, "/v1/chat/completions", body)
    assert status == 400, answer
    error = assert_error_shape(answer, param)
    assert (error["type"], error["code"]) == ("invalid_request_error", code), error


def test_bad_requests_through_the_client_and_what_is_not_a_request(client, served):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=user("hi"), n=2)
    assert info.value.status_code == 400 and info.value.param == "n"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=user("hi"), tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert info.value.param == "tools"
    status, body = post(served, "/v1/chat/completions", b"{not json")
    assert status == 400 and "could not parse the JSON body" in assert_error_shape(body)["message"]
    status, body = post(served, "/v1/chat/completions", b"[1, 2]")
    assert status == 400 and assert_error_shape(body)
    status, body = post(served, "/v1/completions", {"prompt": "hi"})
    assert status == 404 and assert_error_shape(body)
    # `model` may be left out (this server has one)
    assert post(served, "/v1/chat/completions", {"messages": user(PROMPTS[0]), "max_tokens": 3, "temperature": 0})[0] == 200


# ----------------------------------------------------------------------------- in-process: failures, the command's checks


@pytest.fixture
def app_client(reference):
    from starlette.testclient import TestClient

    model, tokenizer = reference
    engine = openai_api.Engine(model, tokenizer, NAME)
    with TestClient(openai_api.create_app(engine, None)) as test_client:
        yield engine, test_client
    engine.close()


def test_a_failure_is_a_500_without_its_message_or_traceback(app_client, monkeypatch, caplog):
    secret = "the prompt said: hunter2"
    engine, test_client = app_client

    def failing(*args, **kwargs):
        raise RuntimeError(secret)

    monkeypatch.setattr(engine, "generate", failing)
    with caplog.at_level("INFO", logger="qllm.openai_api"):
        answer = test_client.post("/v1/chat/completions", json={"messages": user("hunter2"), "max_tokens": 2})
        assert answer.status_code == 500
        assert answer.json() == {"error": {"message": "The server had an error while processing your request.", "type": "server_error",
                                           "param": None, "code": None}}  # fmt: skip
        streamed = test_client.post("/v1/chat/completions", json={"messages": user("hunter2"), "max_tokens": 2, "stream": True})
    assert streamed.status_code == 200  # the status was sent before the failure: the error is the stream's last event
    events = [json.loads(line.removeprefix("data: ")) for line in streamed.text.split("\n\n") if line.startswith("data: {")]
    assert events[-1] == answer.json()
    for text in (answer.text, streamed.text, caplog.text):
        assert "hunter2" not in text and "Traceback" not in text
    assert "RuntimeError" in caplog.text and "openai_api.py" in caplog.text  # where it happened, for whoever runs the server
    assert "POST /v1/chat/completions 500" in caplog.text


def test_no_key_no_authorization_needed_and_the_default_temperature_is_the_models(app_client, reference):
    """Without a key no header is needed. A request without `temperature` decodes as the model's
    generation config says: greedy for the pipeline's models (`do_sample` false), as `qllm generate`."""
    _, test_client = app_client
    assert test_client.get("/v1/models").json()["data"][0]["id"] == NAME
    assert reference[0].generation_config.do_sample is False
    for seed in (1, 2):
        answer = test_client.post("/v1/chat/completions", json={"messages": user(PROMPTS[4]), "max_tokens": 8, "seed": seed})
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == expected(reference, user(PROMPTS[4]), 8)[0]


def test_a_cancelled_generation_stops_at_the_next_token(reference, answers):
    """What a streaming client's disconnect does (the stream sets the event): generation ends at
    the next token instead of running on to its limit."""
    model, tokenizer = reference
    prompt = next(p for p in PROMPTS if answers[p][1] == "length")
    engine = openai_api.Engine(model, tokenizer, NAME)
    try:
        request = chat_request.parse_request({"messages": user(prompt), "max_tokens": 60, "temperature": 0}, NAME, 0.0)
        prepared = engine.prepare(request)
        whole = engine.generate(request, prepared)
        assert whole.completion_tokens >= MAX_TOKENS and whole.content.startswith(answers[prompt][0])
        cancelled, seen = threading.Event(), []

        def first_piece(piece: str) -> None:
            seen.append(piece)
            cancelled.set()

        stopped = engine.generate(request, prepared, first_piece, cancelled)
        assert len(seen) >= 1 and stopped.content.startswith(seen[0]) and stopped.completion_tokens < whole.completion_tokens
        assert whole.content.startswith(stopped.content)
        assert engine.generate(request, prepared, None, cancelled).completion_tokens == 1  # cancelled before it started: one token
    finally:
        engine.close()


def test_serving_beyond_this_host_needs_a_key_and_tls(tmp_path, monkeypatch, capsys):
    """Refused before the model loads (here: a model that does not exist), exit code 2: beyond this
    host without a key; with a key but over plain HTTP unless --insecure (the team servers' rule,
    the same words); options that would do nothing or are half given."""
    from tests.certificates import self_signed

    def qllm(*argv: str) -> tuple[int, str]:
        capsys.readouterr()
        code = main(["serve-openai", "--model", "data/models/none", "--project-dir", str(tmp_path), *argv])
        return code, capsys.readouterr().err

    self_signed(tmp_path / "tls")
    tls = ("--tls-cert", "tls/cert.pem", "--tls-key", "tls/key.pem")  # relative to the project
    loads = "data/models/none: no such model directory"  # what an accepted command says next
    for host in ("0.0.0.0", "::", "10.1.2.3"):
        code, err = qllm("--host", host)
        assert code == 2 and f"--host {host!r} without an API key would let anyone who reaches the port use the model" in err
        code, err = qllm("--host", host, *tls)
        assert code == 2 and "without an API key" in err
    monkeypatch.setenv(KEY_ENV, KEY)
    code, err = qllm("--host", "0.0.0.0", "--api-key-env", KEY_ENV)
    assert code == 2 and "--host '0.0.0.0' without TLS would send the API key, the prompts and the answers over the network in clear" in err
    assert "give --tls-cert CERT.pem --tls-key KEY.pem (docs/deployments.md), or --insecure on a network you trust" in err
    code, err = qllm("--host", "0.0.0.0", "--api-key-env", KEY_ENV, *tls)  # allowed: it goes on to load the model
    assert code == 2 and loads in err
    code, err = qllm("--host", "0.0.0.0", "--api-key-env", KEY_ENV, "--insecure")
    assert code == 2 and loads in err and "warning: serve-openai serves 0.0.0.0 without TLS (--insecure)" in err
    code, err = qllm(*tls)  # TLS on this host: allowed, with or without a key
    assert code == 2 and loads in err
    for argv, refusal in ((("--insecure",), "--insecure is for a --host beyond this machine; with '127.0.0.1' it would do nothing"),
                          (("--host", "0.0.0.0", "--api-key-env", KEY_ENV, "--insecure", *tls), "with --tls-cert it would do nothing"),
                          (tls[:2], "--tls-cert and --tls-key go together"),
                          (("--tls-cert", "tls/key.pem", "--tls-key", "tls/key.pem"), "not a certificate and its key"),
                          (("--time-limit", "0"), "--time-limit must be a positive number of seconds (got 0)"),
                          (("--time-limit", "nan"), "--time-limit must be a positive number of seconds (got nan)"),
                          (("--max-waiting", "-1"), "--max-waiting must be 0 or more (got -1)"),
                          (("--default-max-tokens", "0"), "--default-max-tokens must be at least 1 (got 0)")):  # fmt: skip
        code, err = qllm(*argv)
        assert code == 2 and refusal in err, (argv, err)
    monkeypatch.setenv(KEY_ENV, "short")
    code, err = qllm("--api-key-env", KEY_ENV)
    assert code == 2 and "must be at least 16 characters" in err
    monkeypatch.delenv(KEY_ENV)
    code, err = qllm("--api-key-env", KEY_ENV)
    assert code == 2 and f"--api-key-env {KEY_ENV}: the environment variable is not set or empty" in err
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o644)
    code, err = qllm("--api-key-file", "key")
    assert code == 2 and "must be yours and readable by you only (mode 0644; chmod 600 key)" in err
    key_file.chmod(0o600)
    assert openai_api.read_key(None, "key", tmp_path) == KEY
    code, err = qllm("--host", "0.0.0.0", "--api-key-file", "key", *tls)
    assert code == 2 and loads in err
    with pytest.raises(SystemExit):  # one or the other
        main(["serve-openai", "--model", "x", "--api-key-env", KEY_ENV, "--api-key-file", "key"])
    with pytest.raises(SystemExit):  # no --api-key option takes the key itself
        main(["serve-openai", "--model", "x", "--api-key", KEY])
    openai_api.check_host("127.0.0.1", None)
    openai_api.check_host("localhost", None)
    openai_api.check_host("0.0.0.0", KEY, (str(tmp_path / "tls/cert.pem"), str(tmp_path / "tls/key.pem")))
    # the command's defaults are the library's
    defaults = build_parser().parse_args(["serve-openai", "--model", "x"])
    assert openai_api.Limits(defaults.time_limit, defaults.max_waiting, defaults.default_max_tokens) == openai_api.Limits()


def test_the_command_serves_a_registered_version_as_generate_loads_it(reference, monkeypatch, tmp_path, capsys):
    """`--model models:/NAME@ALIAS` goes to `generation.load` with the project directory, the id
    is NAME@ALIAS, the host and port are uvicorn's; nothing of the key is printed."""
    import uvicorn
    from starlette.testclient import TestClient

    seen = {}
    monkeypatch.setattr(generation, "is_image_model", lambda model, root: False)
    monkeypatch.setattr(generation, "load", lambda model, root: seen.setdefault("load", (model, root)) and reference)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: seen.setdefault("config", self.config))
    monkeypatch.setenv(KEY_ENV, KEY)
    capsys.readouterr()
    assert main(["serve-openai", "--model", "models:/qllm@champion", "--port", "8123", "--api-key-env", KEY_ENV, "--project-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert seen["load"] == ("models:/qllm@champion", tmp_path.resolve())
    assert (seen["config"].host, seen["config"].port) == ("127.0.0.1", 8123)
    assert "serving 'qllm@champion' on http://127.0.0.1:8123/v1" in out and KEY not in out + err
    with TestClient(seen["config"].app) as test_client:
        assert test_client.get("/v1/models").status_code == 401
        assert test_client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"] == "qllm@champion"
    assert openai_api.default_name("models:/qllm/3") == "qllm/3" and openai_api.default_name("data/models/dpo/") == "dpo"
    # TLS and the limits reach uvicorn and the engine
    from tests.certificates import self_signed

    self_signed(tmp_path / "tls")

    def run(server) -> None:  # while the command serves
        seen["config"] = server.config
        with TestClient(server.config.app) as test_client:
            seen["answer"] = test_client.post("/v1/chat/completions", json={"messages": user(PROMPTS[0]), "temperature": 0},
                                              headers={"Authorization": f"Bearer {KEY}"}).json()  # fmt: skip

    monkeypatch.setattr(uvicorn.Server, "run", run)
    assert main(["serve-openai", "--model", "models:/qllm@champion", "--host", "0.0.0.0", "--api-key-env", KEY_ENV, "--tls-cert", "tls/cert.pem",
                 "--tls-key", "tls/key.pem", "--default-max-tokens", "3", "--max-waiting", "0", "--project-dir", str(tmp_path)]) == 0  # fmt: skip
    assert seen["config"].is_ssl and "serving 'qllm@champion' on https://0.0.0.0:8000/v1" in capsys.readouterr().out
    assert seen["answer"]["usage"]["completion_tokens"] == expected(reference, user(PROMPTS[0]), 3)[3]


def test_settled_text_holds_back_what_may_still_change():
    settled = openai_api.settled
    assert settled("  Pelora is", [], False) == "Pelora is"
    assert settled("Pelora \ufffd", [], False) == "Pelora"  # an unfinished character
    assert settled("Pelora\ufffdx", [], False) == "Pelora\ufffdx"  # a bad byte inside stays
    assert settled("Pelora. Ne", ["Next"], False) == "Pelora."  # may become the stop string
    assert settled("Pelora. Na", ["Next"], False) == "Pelora. Na"
    assert settled("Pelora is nice", [], True) == "Pelora is"  # ` .` may yet become `.`
    assert settled("Pelora", [], True) == ""


# ----------------------------------------------------------------------------- streaming decodes a window per token


class CountingTokenizer:
    """A tokenizer that records how many ids each `decode` call is given (everything else passes through)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer, self.decoded = tokenizer, []

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def decode(self, ids, *args, **kwargs):
        self.decoded.append(len(ids))
        return self._tokenizer.decode(ids, *args, **kwargs)


LONG_TOKENS = 100  # a long answer: the tiny model's context is 128 positions


def long_answers(model_dir: Path) -> tuple:
    """The test model (a copy of its own) answering LONG_TOKENS tokens to every prompt: its generation
    config's `min_new_tokens` holds the end-of-turn tokens back until then (as `model.generate`
    reads it, in the server and in `expected` alike)."""
    model, tokenizer = generation.load(str(model_dir))
    model.generation_config.min_new_tokens = LONG_TOKENS
    return model, tokenizer


@pytest.fixture(scope="module")
def long_model(model_dir):
    return long_answers(model_dir)


def test_a_stream_decodes_a_few_tokens_per_token_and_joins_to_the_answer(long_model):
    """Streamed, an answer of n tokens is decoded a short window at a time: no decode call but the
    final one (the whole answer, once) sees more than 8 tokens, and all of them together see at
    most 6n (decoding the answer so far at every token: n(n+1)/2). The pieces still join to
    exactly the answer, here with a stop string that never shows up as well. The answers (of the
    chaotic test model) hold runs of bytes that are no UTF-8 character."""
    model, tokenizer = long_model
    for prompt, stop in [(prompt, []) for prompt in PROMPTS[:4]] + [(PROMPTS[0], ["never-in-an-answer"])]:
        answer, _, _, tokens, _ = expected(long_model, user(prompt), LONG_TOKENS)
        assert tokens == LONG_TOKENS
        counting = CountingTokenizer(tokenizer)
        engine = openai_api.Engine(model, counting, NAME)
        try:
            request = chat_request.parse_request({"messages": user(prompt), "max_tokens": LONG_TOKENS, "temperature": 0, "stop": stop or None},
                                               NAME, 0.0)  # fmt: skip
            prepared = engine.prepare(request)
            counting.decoded.clear()
            pieces: list[str] = []
            done = engine.generate(request, prepared, pieces.append)
        finally:
            engine.close()
        n = done.completion_tokens
        assert ("".join(pieces), done.content, n) == (answer, answer, tokens) and len(pieces) > 10
        *window, whole = counting.decoded
        assert whole == n and max(window) <= 8 and sum(window) <= 6 * n, (prompt, counting.decoded)


def _sentencepiece_like(texts: list[str]):
    """A Llama-2-style tokenizer (SentencePiece's BPE: `▁` for spaces, the leading one dropped when
    decoding, bytes as `<0xNN>` tokens), trained here with `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    saved = json.loads(backend.to_str())  # the byte tokens join the vocabulary as ordinary tokens, as in Llama 2's
    vocab = saved["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(saved)), unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _wordpiece(texts: list[str]):
    """A BERT-style tokenizer: lower-cased, `##` pieces joined, spaces cleaned up when decoding."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", sep_token="[SEP]", clean_up_tokenization_spaces=True)


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece", "wordpiece"])
def test_the_answer_text_is_the_tokenizers_decode_at_every_token(reference, kind):
    """`AnswerText` against the tokenizer's own `decode`, token by token, on seeded random sequences
    (bytes that split characters or are none, special tokens, `'t` after ` n` included): its text is
    the whole decode whenever that ends in a finished character, and with what is pending always
    (with SentencePiece's byte fallback, a byte token's character that a following bad byte turns
    into U+FFFD in the whole decode may show until the text grows again); what `kept` says is
    unchanged. Byte-level BPE (the
    pipeline's, Qwen's, Llama 3's) and SentencePiece's decode a window per token; a tokenizer that
    rewrites decoded text (WordPiece's clean-up, lower-casing) decodes the whole answer each time."""
    import random

    texts = ["Tovik lives in Pelora. Don't they? It's 5, isn't it! caf\u00e9 na\u00efve \u65e5\u672c \U0001f600"] * 50
    tokenizer = {"byte-level": lambda: reference[1], "sentencepiece": lambda: _sentencepiece_like(texts), "wordpiece": lambda: _wordpiece(texts)}[kind]()
    assert openai_api.rewrites_text(tokenizer) == (kind == "wordpiece")
    rng = random.Random(0)
    pieces = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in (texts[0], " n't", " 's", " .", "\u00e9", "\U0001f600")]
    for _ in range(100):
        ids = [token for _ in range(rng.randint(5, 30)) for token in rng.choice([*pieces, [rng.randrange(len(tokenizer))]])]
        text = openai_api.AnswerText(tokenizer, whole=openai_api.rewrites_text(tokenizer))
        for k in range(1, len(ids) + 1):
            before = text.text
            text.extend(ids[k - 1 : k])
            whole = tokenizer.decode(ids[:k], skip_special_tokens=True)
            assert text.text + text.pending == whole or (kind == "sentencepiece" and whole.endswith("\ufffd")), (kind, ids[:k])
            assert text.text == whole or whole.endswith("\ufffd"), (kind, ids[:k])
            assert text.text[: text.kept] == before[: text.kept]


# ----------------------------------------------------------------------------- abandoned requests, the queue, the time limit


STEP = 0.05  # seconds the slowed model sleeps before each forward pass (one a token)


@pytest.fixture(scope="module")
def slow(model_dir):
    """The long-answering test model (`long_answers`, a copy of its own) sleeping STEP before each
    forward pass, so an answer takes seconds; `calls` has the time of each pass."""
    model, tokenizer = long_answers(model_dir)
    calls: list[float] = []

    def pause(module, args) -> None:
        calls.append(time.monotonic())
        time.sleep(STEP)

    model.register_forward_pre_hook(pause)
    return model, tokenizer, calls


DEADLINE = 120.0  # seconds any wait below may take on a busy machine; each ends as soon as what it waits for happens


def until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {DEADLINE:g} s"
        time.sleep(0.01)


@contextlib.contextmanager
def serving(engine, config=None):
    """`engine`'s app under uvicorn on a free port of 127.0.0.1, in a thread of this process (a
    real socket: a client's disconnect is the server's to see); its URL."""
    import uvicorn

    port = free_port()
    config = config or uvicorn.Config(openai_api.create_app(engine, None), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        until(lambda: server.started or not thread.is_alive(), "the server started")
        assert server.started
        yield f"{'https' if config.is_ssl else 'http'}://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=DEADLINE)
        engine.close()


def open_request(url: str, body: dict) -> socket.socket:
    """A chat completion request sent on a raw socket (the test decides when the client leaves)."""
    data = json.dumps(body).encode()
    connection = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=DEADLINE)
    connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(data), data))  # fmt: skip
    return connection


def queued(engine) -> int:
    """Jobs waiting for the engine's worker thread."""
    return engine._worker._work_queue.qsize()


@pytest.mark.filterwarnings("ignore:Unfeasible length constraints")  # the long-answering model asked for fewer tokens
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_client_that_leaves_frees_the_server_within_a_second(slow, stream, caplog):
    """A client leaves in the middle of a long answer (LONG_TOKENS at STEP a token: seconds more to
    go); the client waiting behind it gets its own answer (one token) within a second of the
    disconnect, streamed or not: the abandoned generation ended at its next token."""
    model, tokenizer, calls = slow
    caplog.set_level("INFO", logger="qllm.openai_api")
    engine = openai_api.Engine(model, tokenizer, NAME)
    with serving(engine) as url:
        started = len(calls)
        leaving = open_request(url, {"messages": user(PROMPTS[1]), "max_tokens": LONG_TOKENS, "temperature": 0, "stream": stream})
        if stream:  # the first piece of the answer has arrived
            seen = b""
            while b'"content": "' not in seen.split(b'"role": "assistant"', 1)[-1]:
                seen += leaving.recv(4096)
        until(lambda: len(calls) >= started + 3, "the long answer is being generated")
        answered: list[float] = []

        def next_client() -> None:
            status, body = post(Served(url, Path()), "/v1/chat/completions", {"messages": user(PROMPTS[0]), "max_tokens": 1, "temperature": 0}, key=None)
            assert status == 200 and body["usage"]["completion_tokens"] == 1
            answered.append(time.monotonic())

        waiting = threading.Thread(target=next_client)
        waiting.start()
        until(lambda: queued(engine) >= 1, "the next client waits for the model")
        left = time.monotonic()
        leaving.close()
        waiting.join(timeout=DEADLINE)
        assert answered, "the next client got no answer"
        assert answered[0] - left < 1.0, f"the next client waited {answered[0] - left:.2f} s after the first one left"
        assert len(calls) - started < LONG_TOKENS // 2  # the abandoned answer did not run on to its limit
        until(lambda: "POST /v1/chat/completions 200 prompt_tokens=" in caplog.text and "ended: client left" in caplog.text, "the log says why it ended")


@pytest.mark.filterwarnings("ignore:Unfeasible length constraints")  # the long-answering model asked for fewer tokens
def test_a_full_queue_answers_429_with_retry_after(slow):
    """With `max_waiting` 1, one request generating and one waiting, the next is answered 429 in
    OpenAI's shape with a `Retry-After` (seconds) that OpenAI's clients wait before retrying;
    once those two leave, requests are served again."""
    model, tokenizer, calls = slow
    engine = openai_api.Engine(model, tokenizer, NAME, limits=openai_api.Limits(max_waiting=1))
    with serving(engine) as url:
        started = len(calls)
        running = open_request(url, {"messages": user(PROMPTS[1]), "max_tokens": LONG_TOKENS, "temperature": 0})
        until(lambda: len(calls) >= started + 2, "the first answer is being generated")
        waiting = open_request(url, {"messages": user(PROMPTS[2]), "max_tokens": LONG_TOKENS, "temperature": 0, "stream": True})
        until(lambda: queued(engine) >= 1, "the second request waits")
        request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps({"messages": user("hi"), "max_tokens": 1}).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=DEADLINE)
        assert info.value.code == 429 and int(info.value.headers["Retry-After"]) >= 1
        error = assert_error_shape(json.loads(info.value.read()))
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded") and "1 request" in error["message"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=DEADLINE)
        with pytest.raises(openai.RateLimitError) as raised:
            client.chat.completions.create(model=NAME, messages=user("hi"), max_tokens=1)
        assert raised.value.response.headers["retry-after"] == info.value.headers["Retry-After"]
        running.close(), waiting.close()
        until(lambda: not engine.in_line, "the two that left gave their places back")
        done = client.chat.completions.create(model=NAME, messages=user(PROMPTS[0]), max_tokens=2, temperature=0)
        assert done.usage.completion_tokens == 2


@pytest.mark.filterwarnings("ignore:Unfeasible length constraints")  # the long-answering model asked for fewer tokens
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_the_time_limit_ends_an_answer_with_finish_reason_length(slow, long_model, stream, caplog):
    """A generation still running at the time limit ends there: the answer so far with
    `finish_reason` "length" (what OpenAI's clients read as an answer cut short), the tokens
    counted; it is the greedy answer's start, streamed or not."""
    model, tokenizer, _ = slow
    caplog.set_level("INFO", logger="qllm.openai_api")
    limit = 0.5
    engine = openai_api.Engine(model, tokenizer, NAME, limits=openai_api.Limits(time_limit=limit))
    with serving(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=DEADLINE)
        if stream:
            content, finish, usage, _ = ask_streamed(client, user(PROMPTS[3]), max_tokens=LONG_TOKENS, temperature=0,
                                                     stream_options={"include_usage": True})  # fmt: skip
        else:
            content, finish, usage = ask(client, user(PROMPTS[3]), max_tokens=LONG_TOKENS, temperature=0)
    assert finish == "length" and 1 <= usage.completion_tokens <= int(limit / STEP) + 2, usage  # each token takes STEP at least
    assert content == expected(long_model, user(PROMPTS[3]), usage.completion_tokens)[0]
    assert f"completion_tokens={usage.completion_tokens} ended: time limit" in caplog.text


def test_max_tokens_defaults_to_the_smaller_of_the_default_and_the_context_left(reference):
    """Without `max_tokens` an answer may take `default_max_tokens` tokens, or the room left in the
    context when that is less (here 128 positions, so the default 512 is the room)."""
    from starlette.testclient import TestClient

    model, tokenizer = reference
    prompt = next(p for p in PROMPTS if expected(reference, user(p), 10)[3] == 10)
    for limits, tokens in ((openai_api.Limits(default_max_tokens=3), 3), (openai_api.Limits(), None)):
        engine = openai_api.Engine(model, tokenizer, NAME, limits=limits)
        request = chat_request.parse_request({"messages": user(prompt)}, NAME, 0.0)
        try:
            prepared = engine.prepare(request)
            assert prepared.max_tokens == (tokens or 128 - prepared.prompt_tokens)
            with TestClient(openai_api.create_app(engine, None)) as test_client:
                answer = test_client.post("/v1/chat/completions", json={"messages": user(prompt), "temperature": 0}).json()
        finally:
            engine.close()
        if tokens:
            assert (answer["choices"][0]["finish_reason"], answer["usage"]["completion_tokens"]) == ("length", tokens)
            assert answer["choices"][0]["message"]["content"] == expected(reference, user(prompt), tokens)[0]
    with pytest.raises(QllmError, match="--default-max-tokens must be at least 1"):
        openai_api.Limits(default_max_tokens=0).check()


def test_the_server_speaks_tls_itself(reference, tmp_path):
    """With `--tls-cert/--tls-key` uvicorn terminates TLS (1.2 or newer): a client that trusts the
    certificate gets the answer; plain HTTP to the port gets none; an older TLS is refused."""
    import ssl

    import httpx

    from tests.certificates import self_signed

    cert, key = self_signed(tmp_path / "tls")
    model, tokenizer = reference
    engine = openai_api.Engine(model, tokenizer, NAME)
    port = free_port()
    config = openai_api.server_config(engine, KEY, "127.0.0.1", port, (str(cert), str(key)))
    trust = ssl.create_default_context(cafile=str(cert))
    with serving(engine, config) as url:
        assert url == f"https://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=DEADLINE, http_client=httpx.Client(verify=trust))
        assert ask(client, user(PROMPTS[0]), max_tokens=MAX_TOKENS, temperature=0)[0] == expected(reference, user(PROMPTS[0]))[0]
        with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as plain:
            plain.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert b"200" not in plain.recv(4096)
        old = ssl.create_default_context(cafile=str(cert))
        old.minimum_version = old.maximum_version = ssl.TLSVersion.TLSv1_1
        with pytest.raises((ssl.SSLError, OSError)), socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as raw:
            old.wrap_socket(raw, server_hostname="127.0.0.1")


def test_the_log_has_no_prompts_answers_or_key(served, answers):
    """Last in this module: every request above was logged, as one line without contents."""
    text = served.log.read_text(encoding="utf-8", errors="replace")
    assert "POST /v1/chat/completions 200 prompt_tokens=" in text and "POST /v1/chat/completions 400" in text
    assert "GET /v1/models 401" in text
    assert KEY not in text
    for prompt in PROMPTS:
        assert prompt not in text
    assert not any(len(a[0]) > 6 and a[0] in text for a in answers.values())
