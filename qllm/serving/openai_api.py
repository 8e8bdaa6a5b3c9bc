"""OpenAI's chat completions API for a trained model: `qllm serve-openai`.

    qllm serve-openai --model models:/qllm@champion               # http://127.0.0.1:8000/v1
    qllm serve-openai --model data/models/dpo --port 8001 --api-key-file ~/.qllm-key

`POST /v1/chat/completions` (streamed as server-sent events with `"stream": true`) and
`GET /v1/models`, as OpenAI's clients call them (`openai.OpenAI(base_url="http://127.0.0.1:8000/v1",
api_key=...)`). The model is loaded as `qllm generate` loads it (`generation.load`: a registered
version `models:/NAME@ALIAS` or `models:/NAME/VERSION`, or a model directory), the messages are
rendered with its chat template as `generate` and `evaluate` render them
(`chat_template.render_prompt`), and decoding is `generation.decode`'s `model.generate` call (the
same stop tokens, pad token, seeding and generation config): greedy answers are `qllm generate`'s,
streamed or not (tests/qllm/test_openai_api.py checks it with the official `openai` client).

Why this and not another server: MLflow's `/invocations` takes the chat format but is not OpenAI's
API (no `/v1` routes, no streaming, no models list), and llama.cpp's server needs a GGUF export and
a from-source llama-cpp-python; this is a thin Starlette app (already installed with MLflow and
Prefect) under uvicorn around the pipeline's own loading and decoding code, with no new
dependency and nothing to convert.

Decoding, per request:
- `temperature`: 0 is greedy. When the request leaves it out, the model's generation config decides
  (`gguf_export.generation_temperature`): greedy for the pipeline's models, as `qllm generate`,
  `evaluate` and the exported Modelfile; OpenAI's own default is 1, so pass it to sample.
- `top_p` (sampling only) and `seed`; without a seed a sampled answer takes a random one. The
  model's generation config supplies the rest (e.g. `top_k`), as for `qllm generate`: a request with
  temperature T and seed S answers what `qllm generate --temperature T --seed S` prints.
- `max_tokens` (or `max_completion_tokens`): default, `--default-max-tokens` (512) or the room left
  in the model's context, the smaller.
- `stop`: a string or up to 4; the answer ends before the first one (`finish_reason` "stop").
- Answers stop at the end of the assistant turn (`models.stop_token_ids`), special tokens removed and
  surrounding whitespace stripped as `qllm generate` does; `usage` counts the prompt's tokens and
  the generated ones (the end-of-turn token included).
- `n` other than 1, tools, `response_format`, `logprobs`, `logit_bias`, penalties and any field
  OpenAI does not define are refused with a 400 naming the field, never silently ignored
  (`chat_request.parse_request`: what a request may say, checked before anything runs).

One model is in memory and one generation runs at a time (one worker thread, first come first
served), so concurrent clients wait in line: at most `--max-waiting` (16) behind the one being
answered, one more gets a 429 with `Retry-After`. A client that disconnects, streamed or not, ends
its generation at the next token (or leaves the line); a generation still running after
`--time-limit` seconds (300) ends there with `finish_reason` "length". A stream decodes a few tokens
per token (`AnswerText`), not the whole answer again. Errors have OpenAI's shape, `{"error":
{"message", "type", "param", "code"}}`; a 500 says only that the server failed (the log has the
exception's type and frames, not its message). The log has one line per request (method, path,
status, token counts, why it ended early, seconds): never prompts, answers or keys.

It binds 127.0.0.1 unless told otherwise. With an API key (`--api-key-env VAR`, or `--api-key-file
FILE` readable by its owner only; never a command-line value, which `ps` shows) every route but
`/health` needs `Authorization: Bearer KEY`. A host beyond this machine is refused without a key,
and with one over plain HTTP unless `--insecure`: `--tls-cert/--tls-key` has uvicorn speak TLS
itself (`serve.check_tls`, the team servers' rule).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import math
import os
import secrets
import stat
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.core.errors import QllmError
from qllm.serving.chat_request import (
    MAX_BODY,
    MIN_KEY_LENGTH,
    ApiError,
    ChatRequest,
    bad_request,
    error_body,
    parse_request,
)

log = logging.getLogger("qllm.openai_api")

@dataclass
class Prepared:
    encoded: Any
    prompt_tokens: int
    max_tokens: int


@dataclass
class Completion:
    content: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ended: str | None = None  # "time limit" or "client left" when generation stopped for that


class ClientLeft(Exception):
    """The client went away before its request's turn came."""


@dataclass(frozen=True)
class Limits:
    """What one request may take of the server (`qllm serve-openai` options of the same names)."""

    time_limit: float = 300.0
    """Seconds a request's generation may run (`--time-limit`), counted from when its turn comes:
    then it ends with the answer so far and `finish_reason` "length"."""
    max_waiting: int = 16
    """Requests that may wait for the model behind the one it is answering (`--max-waiting`); one
    more is answered 429 with `Retry-After`."""
    default_max_tokens: int = 512
    """A request without `max_tokens` gets at most this many tokens, or the room left in the
    model's context when that is less (`--default-max-tokens`)."""

    def check(self) -> Limits:
        if not (math.isfinite(self.time_limit) and self.time_limit > 0):
            raise QllmError(f"serve-openai: --time-limit must be a positive number of seconds (got {self.time_limit:g})")
        if self.max_waiting < 0:
            raise QllmError(f"serve-openai: --max-waiting must be 0 or more (got {self.max_waiting})")
        if self.default_max_tokens < 1:
            raise QllmError(f"serve-openai: --default-max-tokens must be at least 1 (got {self.default_max_tokens})")
        return self


def _settled_end(raw: str, stops: list[str], cleanup: bool) -> int:
    """Where `settled`'s part of `raw` ends: found from the end, in the time the held-back tail takes."""
    end = len(raw)
    while end and raw[end - 1] == "\ufffd":
        end -= 1
    end -= max((k for s in stops for k in range(min(len(s) - 1, end), 0, -1) if raw.startswith(s[:k], end - k)), default=0)
    while end and raw[end - 1].isspace():
        end -= 1
    if cleanup:  # the last word and the spaces before it
        while end and not raw[end - 1].isspace():
            end -= 1
        while end and raw[end - 1].isspace():
            end -= 1
    return end


def settled(raw: str, stops: list[str], cleanup: bool) -> str:
    """The part of `raw` (the answer decoded so far) that no later token or stop string can change:
    what a stream may send. Held back: leading and trailing whitespace (the answer is stripped),
    an unfinished UTF-8 character (U+FFFD at the end), an end that may be the start of a stop
    string, and with a tokenizer that rewrites decoded text (` .` to `.`) the last word."""
    return raw[: _settled_end(raw, stops, cleanup)].lstrip()


ROUND_TRIP = "Tovik . lives , in ! Pelora ? do n't it 's we 've they 're I 'm"
"""Text whose decoded tokens `rewrites_text` compares with it: the patterns a tokenizer's clean-up
of spaces rewrites (transformers' `clean_up_tokenization`, WordPiece's decoder)."""


def rewrites_text(tokenizer: Any) -> bool:
    """Whether decoding does more than join the tokens' text: True when `ROUND_TRIP`, encoded and
    decoded, does not come back as it was (a clean-up of spaces, lower-casing, unknown tokens).
    Such a tokenizer may change text it decoded before (` n` then `'t` gives `n't`), so an answer
    is decoded whole at every token and a stream holds back its last word."""
    ids = tokenizer(ROUND_TRIP, add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids, skip_special_tokens=True) != ROUND_TRIP


UNFINISHED_TOKENS = 4
"""A window ending in U+FFFD waits for the tokens that may finish its character while fewer than
this many came since the text last grew: a character has at most 4 bytes in UTF-8, so its
unfinished start is at most 3 tokens. After that the U+FFFD are invalid bytes, and the window's
text is taken as it is (were a character finished after all, the next window would not begin with
it, and the answer is decoded whole, once)."""


class AnswerText:
    """The text of an answer as it grows, `tokenizer.decode(ids, skip_special_tokens=True)`,
    kept up to date a token at a time by decoding a few of the last tokens (the method of vLLM's
    detokenizer and of `tokenizers.decoders.DecodeStream`): the window from `prefix` decodes to
    the text already had for ids[prefix:read], then what the new tokens add. A window that ends in
    an unfinished UTF-8 character (U+FFFD) waits for the tokens that finish it (`UNFINISHED_TOKENS`); one whose text does
    not begin with what it had (the tokenizer changed earlier text) has the answer decoded whole,
    that once. A tokenizer that `rewrites_text` has the answer decoded whole at every token.

    `text` is the answer up to `read`, `pending` the window's text after it while a character is
    unfinished (ending in U+FFFD: `text + pending` is the whole decode); `kept` how much of `text`
    the last `extend` left as it was."""

    def __init__(self, tokenizer: Any, whole: bool) -> None:
        self.tokenizer, self.whole = tokenizer, whole
        self.ids: list[int] = []
        self.text = self.pending = ""
        self.kept = 0
        self.prefix = self.read = 0
        self.prefix_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def extend(self, ids: list[int]) -> None:
        self.kept = len(self.text)
        for token in ids:
            self.ids.append(token)
            if self.whole:
                continue
            window = self._decode(self.ids[self.prefix :])
            if window == self.prefix_text:
                continue  # no text from the new tokens (special ones)
            if window.endswith("\ufffd") and len(self.ids) - self.read < UNFINISHED_TOKENS:  # an unfinished character
                self.pending = window[len(self.prefix_text) :] if window.startswith(self.prefix_text) else ""
                continue
            self.pending = ""
            if window.startswith(self.prefix_text):
                self.text += window[len(self.prefix_text) :]
            else:
                self._whole()
            self.prefix, self.read = self.read, len(self.ids)
            self.prefix_text = self._decode(self.ids[self.prefix : self.read])
        if self.whole and ids:
            self._whole()

    def _whole(self) -> None:
        old, self.text = self.text, self._decode(self.ids)
        self.kept = min(self.kept, len(os.path.commonprefix([old, self.text])))


class Engine:
    """One model and its tokenizer, generating one answer at a time on its own worker thread (every
    use of the tokenizer too: a fast tokenizer is not to be shared across threads), with a line of
    at most `limits.max_waiting` requests behind it (`admit`)."""

    def __init__(self, model: Any, tokenizer: Any, name: str, limits: Limits = Limits()) -> None:
        from pipelines.core.models.gguf_export import generation_temperature
        from pipelines.core.models.models import stop_token_ids

        if not getattr(tokenizer, "chat_template", None):
            raise QllmError("the model's tokenizer has no chat template (train it with the pipeline's train_tokenizer stage)")
        self.model, self.tokenizer, self.name, self.limits = model, tokenizer, name, limits.check()
        self.stop_ids = stop_token_ids(tokenizer)
        self.default_temperature = generation_temperature(model)
        self.context = self._context_length()
        self.cleanup = rewrites_text(tokenizer)
        self.created = int(time.time())
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="qllm-generate")
        self.cancels: set[threading.Event] = set()  # one per request in line: set when its client leaves
        self.last_seconds = 1.0  # how long the last generation took: the 429's Retry-After

    def _context_length(self) -> int | None:
        length = getattr(self.model.config, "max_position_embeddings", None)
        if not length:
            length = getattr(self.tokenizer, "model_max_length", None)
        return int(length) if length and length < 10**8 else None

    @property
    def in_line(self) -> int:
        """Requests admitted and not done: the one generating and those waiting."""
        return len(self.cancels)

    def admit(self) -> threading.Event:
        """A place in line for a request (on the event loop's thread): the event its client's
        leaving sets; a 429 with `Retry-After` when `limits.max_waiting` requests wait already.
        Give it back with `leave`."""
        if self.in_line > self.limits.max_waiting:
            retry = max(1, math.ceil(min(self.last_seconds, self.limits.time_limit)))
            raise ApiError(429, f"The server is busy: {self.limits.max_waiting} request{'s' * (self.limits.max_waiting != 1)} "
                                f"already wait for the model. Retry after {retry} s.", code="rate_limit_exceeded", kind="requests",
                           headers={"Retry-After": str(retry)})  # fmt: skip
        cancelled = threading.Event()
        self.cancels.add(cancelled)
        return cancelled

    def leave(self, cancelled: threading.Event) -> None:
        self.cancels.discard(cancelled)

    def submit(self, fn, *args, cancelled: threading.Event | None = None) -> asyncio.Future:
        """`fn(*args)` on the worker thread, in turn; ClientLeft instead when `cancelled` is set by then."""

        def job():
            if cancelled is not None and cancelled.is_set():
                raise ClientLeft
            return fn(*args)

        return asyncio.wrap_future(self._worker.submit(job))

    def close(self) -> None:
        for event in list(self.cancels):
            event.set()
        self._worker.shutdown(wait=True, cancel_futures=True)

    def prepare(self, request: ChatRequest) -> Prepared:
        """The prompt as the model sees it (the chat template), its token count and the answer's
        token budget (`max_tokens`, else `limits.default_max_tokens` or the room left in the
        context, the smaller); a 400 when it does not fit in the model's context."""
        from jinja2 import TemplateError

        from pipelines.core.data.chat_template import render_prompt

        try:
            text = render_prompt(self.tokenizer, request.messages)  # as generation.generate and evaluate render prompts
        except TemplateError as exc:
            raise bad_request("messages", f"the model's chat template refused the messages: {exc}") from None
        encoded = self.tokenizer(text, return_tensors="pt", add_special_tokens=False).to(self.model.device)
        prompt_tokens = int(encoded["input_ids"].shape[1])
        default = self.limits.default_max_tokens
        if self.context is None:
            return Prepared(encoded, prompt_tokens, request.max_tokens or default)
        room = self.context - prompt_tokens
        wanted = request.max_tokens or min(default, room)
        if room < 1 or wanted > room:
            raise ApiError(400, f"This model's maximum context length is {self.context} tokens. However, you requested "
                                f"{prompt_tokens + wanted} tokens ({prompt_tokens} in the messages, {wanted} in the completion). "
                                "Please reduce the length of the messages or completion.", "messages", "context_length_exceeded")  # fmt: skip
        return Prepared(encoded, prompt_tokens, wanted)

    def generate(self, request: ChatRequest, prepared: Prepared, on_text=None, cancelled: threading.Event | None = None) -> Completion:
        """The answer: `generation.decode`'s `model.generate` call, plus stop strings, `top_p` and,
        for a stream, `on_text(piece)` with each settled piece (their concatenation is the answer).
        It ends at the next token once `cancelled` is set or `limits.time_limit` has passed."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        tokenizer, prompt_length, stops, cleanup = self.tokenizer, prepared.prompt_tokens, request.stop, self.cleanup
        answer = AnswerText(tokenizer, whole=cleanup)
        longest = max(map(len, stops), default=1)
        started = time.monotonic()
        deadline = started + self.limits.time_limit
        ended: list[str | None] = [None]
        sent = [0, ""]  # where the answer starts in the text (after its leading whitespace), and what was sent

        def send(text: str, kept: int) -> None:
            """Send what the text settles beyond what was sent (nothing if the text changed behind it)."""
            lead, emitted = sent
            if not emitted or kept < lead + len(emitted):  # the first text, or one that changed where it was sent
                lead = len(text) - len(text.lstrip())
                if not text.startswith(emitted, lead):
                    return  # not seen with the tokenizers here: the final check below says so
            end = _settled_end(text, stops, cleanup)
            if end > lead + len(emitted):
                piece = text[lead + len(emitted) : end]
                sent[:] = [lead, emitted + piece]
                on_text(piece)

        class Watch(StoppingCriteria):
            """After each new token: a client gone or the time limit passed ends generation, as does
            a stop string; a stream gets the settled text."""

            def __call__(self, input_ids, scores, **kwargs):
                if cancelled is not None and cancelled.is_set():
                    ended[0] = "client left"
                elif time.monotonic() >= deadline:
                    ended[0] = "time limit"
                done = ended[0] is not None
                if not done and (stops or on_text is not None):
                    answer.extend(input_ids[0, prompt_length + len(answer.ids) :].tolist())
                    text = answer.text
                    tail = text[max(0, answer.kept - longest + 1) :] + answer.pending  # where a new stop string can be
                    done = any(s in tail for s in stops)
                    if not done and on_text is not None:
                        send(text, answer.kept)
                return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

        sampling = {"do_sample": True, "temperature": request.temperature} if request.temperature > 0 else {"do_sample": False}
        if request.temperature > 0 and request.top_p is not None:
            sampling["top_p"] = request.top_p
        self.model.eval()
        with torch.no_grad():
            if request.temperature > 0:
                torch.manual_seed(request.seed)
            output = self.model.generate(**prepared.encoded, max_new_tokens=prepared.max_tokens, eos_token_id=self.stop_ids,
                                         pad_token_id=tokenizer.pad_token_id, stopping_criteria=StoppingCriteriaList([Watch()]),
                                         **sampling)  # fmt: skip
        new = output[0, prompt_length:].tolist()
        raw = tokenizer.decode(new, skip_special_tokens=True)  # the whole answer, once: what it is, streamed or not
        cut = min((raw.find(s) for s in stops if s in raw), default=-1)
        content = (raw[:cut] if cut >= 0 else raw).strip()
        finish = "stop" if cut >= 0 or (new and new[-1] in self.stop_ids) else "length"
        if on_text is not None:
            emitted = sent[1]
            if content.startswith(emitted):
                if len(content) > len(emitted):
                    on_text(content[len(emitted) :])
            else:  # not seen with the tokenizers here (SentencePiece's byte fallback could: a character from byte tokens, sent,
                # then a bad byte after it, which makes the whole decode replace both): the text changed behind what was sent
                log.warning("a streamed answer's text changed after it was sent; the stream differs from the answer")
        self.last_seconds = time.monotonic() - started
        return Completion(content, finish, prompt_length, len(new), ended[0])


# ----------------------------------------------------------------------------- the app


def _json(status: int, body: dict):
    from starlette.responses import JSONResponse

    return JSONResponse(body, status_code=status)


def _sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


async def _read_json(request) -> Any:
    size = 0
    chunks = []
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise ApiError(413, f"The request body is larger than {MAX_BODY >> 20} MiB.")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except ValueError:
        raise ApiError(400, "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your HTTP "
                            "library correctly. The OpenAI API expects a JSON payload.)") from None  # fmt: skip


def create_app(engine: Engine, api_key: str | None = None):
    """The Starlette app: `/v1/chat/completions`, `/v1/models`, `/v1/models/{id}` and `/health`
    (unauthenticated, says only "ok"), behind the bearer key when one is given."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    def model_card() -> dict:
        return {"id": engine.name, "object": "model", "created": engine.created, "owned_by": "qllm"}

    async def health(request):
        return _json(200, {"status": "ok"})

    async def models(request):
        return _json(200, {"object": "list", "data": [model_card()]})

    async def one_model(request):
        if request.path_params["model"] != engine.name:
            raise ApiError(404, f"The model '{request.path_params['model']}' does not exist", "model", "model_not_found")
        return _json(200, model_card())

    async def chat(request):
        body = await _read_json(request)
        chat_request = parse_request(body, engine.name, engine.default_temperature)
        cancelled = engine.admit()  # a 429 when the line is full
        watcher = asyncio.create_task(_until_disconnect(request.receive, cancelled))
        pieces: asyncio.Queue = asyncio.Queue()
        try:
            prepared = await engine.submit(engine.prepare, chat_request, cancelled=cancelled)
            request.state.tokens = (prepared.prompt_tokens, None)
            loop = asyncio.get_running_loop()
            on_text = (lambda piece: loop.call_soon_threadsafe(pieces.put_nowait, piece)) if chat_request.stream else None
            job = engine.submit(engine.generate, chat_request, prepared, on_text, cancelled, cancelled=cancelled)
        except BaseException:
            watcher.cancel()
            engine.leave(cancelled)
            raise

        def finished(_) -> None:  # the request's place in line is free once its generation has ended
            watcher.cancel()
            engine.leave(cancelled)
            pieces.put_nowait(None)

        job.add_done_callback(finished)
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if not chat_request.stream:
            done = await job
            request.state.tokens, request.state.ended = (done.prompt_tokens, done.completion_tokens), done.ended
            return _json(200, {"id": ident, "object": "chat.completion", "created": created, "model": engine.name,
                               "choices": [{"index": 0, "message": {"role": "assistant", "content": done.content, "refusal": None},
                                            "logprobs": None, "finish_reason": done.finish_reason}],
                               "usage": _usage(done), "system_fingerprint": None})  # fmt: skip
        return StreamingResponse(_stream(engine, request, chat_request, job, pieces, cancelled, ident, created), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip

    async def client_left(request, exc: ClientLeft):
        request.state.ended = "client left"
        return _json(499, error_body("The client closed the request before its turn.", code="client_closed_request"))

    async def http_error(request, exc: HTTPException):
        codes = {404: "Not found: no such route (this server has /v1/chat/completions and /v1/models).", 405: "Method not allowed."}
        return _json(exc.status_code, error_body(codes.get(exc.status_code, str(exc.detail))))

    async def api_error(request, exc: ApiError):
        response = _json(exc.status, exc.body())
        response.headers.update(exc.headers)
        return response

    async def server_error(request, exc: Exception):
        _log_failure(exc)
        return _json(500, error_body("The server had an error while processing your request.", "server_error"))

    routes = [Route("/health", health), Route("/v1/models", models), Route("/v1/models/{model:path}", one_model),
              Route("/v1/chat/completions", chat, methods=["POST"])]  # fmt: skip
    handlers = {HTTPException: http_error, ApiError: api_error, ClientLeft: client_left, Exception: server_error}
    app = Starlette(routes=routes, exception_handlers=handlers)
    return _Guard(app, api_key)


def _usage(done: Completion) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}  # fmt: skip


def _log_failure(exc: BaseException) -> None:
    """The exception's type and where it happened, not its message (it may quote a prompt)."""
    frames = "".join(traceback.format_list(traceback.extract_tb(exc.__traceback__)))
    log.error("request failed: %s\n%s", type(exc).__name__, frames.rstrip())


async def _until_disconnect(receive, cancelled: threading.Event) -> None:
    """Set `cancelled` when the client goes away (ASGI's `http.disconnect`; the request's body was read)."""
    message = await receive()
    while message["type"] != "http.disconnect":  # anything else the client sends is read and dropped
        message = await receive()
    cancelled.set()


async def _stream(engine: Engine, request, chat: ChatRequest, job: asyncio.Future, pieces: asyncio.Queue, cancelled: threading.Event,
                  ident: str, created: int):  # fmt: skip
    """Server-sent events in OpenAI's chunk format: the role, the answer's pieces (from `pieces`, until
    None), the finish reason, the usage when asked (`stream_options.include_usage`), then `[DONE]`."""
    usage_field = {"usage": None} if chat.include_usage else {}

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": engine.name, "system_fingerprint": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **usage_field}  # fmt: skip

    request.state.ended = "client left"  # until the stream's end is sent
    try:
        yield _sse(chunk({"role": "assistant", "content": "", "refusal": None}))
        while (piece := await pieces.get()) is not None:
            yield _sse(chunk({"content": piece}))
        try:
            done = job.result()
        except ClientLeft:
            return
        except Exception as exc:  # the status line is sent: the error goes in the stream, as OpenAI's do
            _log_failure(exc)
            request.state.ended = None
            yield _sse(error_body("The server had an error while processing your request.", "server_error"))
            return
        while not pieces.empty():  # pieces queued after the end marker (none expected: the job ends after its last piece)
            if (piece := pieces.get_nowait()) is not None:
                yield _sse(chunk({"content": piece}))
        request.state.tokens = (done.prompt_tokens, done.completion_tokens)
        yield _sse(chunk({}, done.finish_reason))
        if chat.include_usage:
            yield _sse({"id": ident, "object": "chat.completion.chunk", "created": created, "model": engine.name,
                        "system_fingerprint": None, "choices": [], "usage": _usage(done)})  # fmt: skip
        yield _sse("[DONE]")
        request.state.ended = done.ended
    finally:
        cancelled.set()  # a client that left ends its generation at the next token (a finished one: no effect)


class _Guard:
    """ASGI middleware: the bearer key (every route but /health) and one log line per request,
    without its body or headers."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app, self.key = app, api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), [0]
        scope.setdefault("state", {})

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is None:
                with contextlib.suppress(Exception):  # Starlette re-raises what its 500 handler answered (and logged): no traceback for uvicorn to log
                    await self.app(scope, receive, sending)
            else:
                response = _json(401, error_body(refusal, code="invalid_api_key"))
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, sending)
        finally:
            tokens, ended = scope["state"].get("tokens"), scope["state"].get("ended")
            counted = "" if tokens is None else f" prompt_tokens={tokens[0]} completion_tokens={'-' if tokens[1] is None else tokens[1]}"
            counted += f" ended: {ended}" if ended else ""
            log.info("%s %s %s%s %.3fs", scope["method"], scope["path"], status[0] or "-", counted, time.perf_counter() - started)

    def _refusal(self, scope) -> str | None:
        if self.key is None or scope["path"] == "/health":
            return None
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, given = header.partition(b" ")
        if scheme.lower() != b"bearer" or not given.strip():
            return "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
        if not secrets.compare_digest(given.strip(), self.key):
            return "Incorrect API key provided."
        return None


# ----------------------------------------------------------------------------- the command


def read_key(env: str | None, file: str | None, root: Path) -> str | None:
    """The API key from the environment variable `env` or the owner-only file `file` (relative to
    `root`); None when neither is given. Never from the command line, where `ps` shows it."""
    from pipelines.core.paths import project_path

    if env is not None:
        key = os.environ.get(env, "")
        where = f"${env}"
        if not key.strip():
            raise QllmError(f"serve-openai: --api-key-env {env}: the environment variable is not set or empty")
    elif file is not None:
        path = project_path(file, root)
        where = str(file)
        try:
            info = path.stat()
        except OSError:
            raise QllmError(f"serve-openai: --api-key-file {file}: no such file") from None
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
            raise QllmError(f"serve-openai: --api-key-file {file}: must be yours and readable by you only "
                            f"(mode {stat.S_IMODE(info.st_mode):04o}; chmod 600 {file})")  # fmt: skip
        key = path.read_text(encoding="utf-8")
    else:
        return None
    key = key.strip()
    if len(key) < MIN_KEY_LENGTH or any(c.isspace() for c in key):
        raise QllmError(f"serve-openai: the API key in {where} must be at least {MIN_KEY_LENGTH} characters without spaces "
                        "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")  # fmt: skip
    return key


def check_host(host: str, api_key: str | None, tls: tuple[str, str] | None = None, insecure: bool = False) -> None:
    """Refuse to serve beyond this machine without an API key (anyone who reaches the port would
    use the model), or with one but without TLS unless `insecure` (the key, prompts and answers
    would cross the network in clear: the rule of the team's servers, `serve.check_tls`)."""
    from qllm.services.serve import check_tls, is_loopback

    if api_key is None and not is_loopback(host):
        raise QllmError(f"serve-openai: --host {host!r} without an API key would let anyone who reaches the port use the model: give "
                        "--api-key-env VAR or --api-key-file FILE (clients send it as Authorization: Bearer KEY) with "
                        "--tls-cert/--tls-key, or serve 127.0.0.1")  # fmt: skip
    check_tls("serve-openai", host, tls, insecure, "the API key, the prompts and the answers")


def default_name(model: str) -> str:
    """`qllm@champion` for models:/qllm@champion, `qllm/3` for models:/qllm/3, a directory's name."""
    return model.removeprefix("models:/") if model.startswith("models:/") else Path(model.rstrip("/")).name


def server_config(engine: Engine, api_key: str | None, host: str, port: int, tls: tuple[str, str] | None = None):
    """uvicorn's configuration for `engine`'s app; with `tls` (cert, key) uvicorn terminates TLS
    with the context the team's fronts use (`tls_front.server_context`: TLS 1.2 or newer)."""
    import uvicorn

    from qllm.services.tls_front import server_context

    factory = (lambda config, default: server_context(*tls)) if tls else None
    return uvicorn.Config(create_app(engine, api_key), host=host, port=port, access_log=False, log_level="info",
                          timeout_graceful_shutdown=10, lifespan="off", ssl_context_factory=factory)  # fmt: skip


def serve(model: str, root: Path, host: str, port: int, api_key: str | None, name: str | None = None, tls: tuple[str, str] | None = None,
          insecure: bool = False, limits: Limits = Limits()) -> int:  # fmt: skip
    """Load `model` as `qllm generate` does and serve it with uvicorn until stopped (Ctrl-C, SIGTERM)."""
    import uvicorn

    from qllm.serving import generation

    check_host(host, api_key, tls, insecure)
    limits.check()
    if generation.is_image_model(model, root):
        raise QllmError(f"{model}: serve-openai serves text models; ask the multimodal model with qllm generate --image")
    loaded, tokenizer = generation.load(model, root)
    engine = Engine(loaded, tokenizer, name or default_name(model), limits)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    config = server_config(engine, api_key, host, port, tls)
    shown = f"[{host}]" if ":" in host else host
    print(f"serving {engine.name!r} on {'https' if tls else 'http'}://{shown}:{port}/v1 (POST /v1/chat/completions, GET /v1/models); "
          f"{'a bearer API key is required' if api_key else 'no API key (this host only)'}; at most {limits.max_waiting} requests wait, "
          f"each answer at most {limits.time_limit:g} s; Ctrl-C stops it", flush=True)  # fmt: skip
    try:
        uvicorn.Server(config).run()
    finally:
        with contextlib.suppress(Exception):
            engine.close()
    return 0
