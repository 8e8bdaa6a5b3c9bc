"""What a chat completions request may say (`qllm serve-openai`): the body checked field by field
against OpenAI's API and what this server does (`parse_request`), and the error bodies OpenAI's
clients read (`ApiError`, `error_body`). Nothing here loads a model."""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant")
MAX_STOP = 4  # as OpenAI
MAX_BODY = 8 << 20  # bytes of a request body
MIN_KEY_LENGTH = 16
KNOWN = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed", "n", "stream",
         "stream_options", "user", "logprobs", "presence_penalty", "frequency_penalty"}  # fmt: skip
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format", "logit_bias",
               "top_logprobs", "audio", "modalities", "prediction", "reasoning_effort", "service_tier", "store", "metadata",
               "web_search_options", "verbosity", "prompt_cache_key", "safety_identifier", "suffix", "best_of", "echo")  # fmt: skip


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ----------------------------------------------------------------------------- the request


@dataclass
class ChatRequest:
    messages: list[dict]
    max_tokens: int | None
    temperature: float
    top_p: float | None
    stop: list[str]
    seed: int
    stream: bool
    include_usage: bool


def bad_request(param: str, message: str, code: str | None = None) -> ApiError:
    """A 400 naming the request field `param`."""
    return ApiError(400, message, param=param, code=code)


def _number(body: dict, key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(key, f"'{key}' must be a number (got {json.dumps(value)})")
    if not low <= value <= high:
        raise bad_request(key, f"'{key}' must be between {low:g} and {high:g} (got {value})", "invalid_value")
    return float(value)


def _integer(body: dict, key: str, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(key, f"'{key}' must be an integer (got {json.dumps(value)})")
    if value < low or (high is not None and value > high):
        bound = f"at least {low}" if high is None else f"between {low} and {high}"
        raise bad_request(key, f"'{key}' must be {bound} (got {value})", "invalid_value")
    return value


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"messages.[{i}].content.[{j}]", f"only text content parts are supported (got {json.dumps(kind)})")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"messages.[{i}].content", f"messages[{i}].content must be a string or a list of text parts (got {json.dumps(content)})")


def _messages(value: Any) -> list[dict]:
    if value is None:
        raise bad_request("messages", "Missing required parameter: 'messages'.", "missing_required_parameter")
    if not isinstance(value, list) or not value:
        raise bad_request("messages", "'messages' must be a non-empty list of messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad_request(f"messages.[{i}]", f"messages[{i}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(f"messages.[{i}].role", f"messages[{i}].role must be one of {', '.join(map(repr, ROLES))} (got {json.dumps(role)})",
                       "invalid_value")  # fmt: skip
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise bad_request(f"messages.[{i}].{extra[0]}", f"messages[{i}].{extra[0]} is not supported by this server (a message has 'role' and 'content')")
        messages.append({"role": role, "content": _content(message, i)})
    return messages


def parse_request(body: Any, served: str, default_temperature: float) -> ChatRequest:
    """The chat completion request `body` (decoded JSON) checked as OpenAI checks it; ApiError(400)
    naming the parameter for anything wrong, unsupported or unknown."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    for key in body:
        if key in UNSUPPORTED:
            raise bad_request(key, f"'{key}' is not supported by this server (qllm serve-openai: text chat completions only)", "unsupported_parameter")
        if key not in KNOWN:
            raise bad_request(key, f"Unrecognized request argument supplied: {key}", "unknown_parameter")
    model = body.get("model")
    if model is not None and model != served:
        raise ApiError(404, f"The model '{model}' does not exist (this server serves '{served}').", "model", "model_not_found")
    messages = _messages(body.get("messages"))
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise bad_request("max_completion_tokens", "give 'max_tokens' or 'max_completion_tokens', not both")
    max_tokens = _integer(body, "max_tokens", 1) or _integer(body, "max_completion_tokens", 1)
    temperature = _number(body, "temperature", 0, 2)
    top_p = _number(body, "top_p", 0, 1)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise bad_request("stop", f"'stop' must be a non-empty string or a list of at most {MAX_STOP} (got {json.dumps(body.get('stop'))})")
    seed = _integer(body, "seed", -(2**63), 2**64 - 1)  # torch.manual_seed's range
    if _integer(body, "n", 1) not in (None, 1):
        raise bad_request("n", "this server answers one choice per request: 'n' must be 1", "unsupported_value")
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(body, key, -2, 2) not in (None, 0.0):
            raise bad_request(key, f"'{key}' is not supported by this server (only 0)", "unsupported_value")
    if body.get("logprobs") not in (None, False):
        raise bad_request("logprobs", "'logprobs' is not supported by this server", "unsupported_value")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad_request("user", "'user' must be a string")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("stream", f"'stream' must be true or false (got {json.dumps(stream)})")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("stream_options", "The 'stream_options' parameter is only allowed when 'stream' is enabled.")
        if not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
            raise bad_request("stream_options", "'stream_options' takes only {\"include_usage\": true|false}")
        include_usage = options.get("include_usage", False)
    temperature = default_temperature if temperature is None else temperature
    if seed is None:
        seed = secrets.randbits(63)  # OpenAI's behaviour without a seed: a different sample each time
    return ChatRequest(messages, max_tokens, temperature, top_p, stop, seed, bool(stream), include_usage)


# ----------------------------------------------------------------------------- generation
