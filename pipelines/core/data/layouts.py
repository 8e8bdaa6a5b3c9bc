"""Record layouts: how a record of each kind may look (OpenAI, ShareGPT, TRL, LLaMA-Factory, Alpaca,
Dolly, HH-RLHF; content parts, tool calls, loss weights, images) and how it becomes the kind's
fields, with a clear `Bad`/`Missing` naming what is wrong (`readers` adds the file and line)."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from pipelines.core.data.formats import ReaderError, type_name
from pipelines.core.data.images import IMAGE_TOKEN, ImageError, check_image, count_placeholders
from pipelines.core.params.data import SourceParams

ROLES = ("system", "user", "assistant", "tool")


class Bad(ValueError):
    """A record does not fit its kind; the reader prefixes the location."""


class Missing(KeyError):
    """A record lacks a required field (args[0] is its expected name)."""


def plain(value: Any) -> Any:
    """Numpy arrays/scalars and tuples (from Parquet or `datasets`) as plain lists and scalars."""
    if isinstance(value, str):
        return value
    if isinstance(value, (np.ndarray, list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def _string(record: dict[str, Any], field: str) -> str:
    value = record[field]
    if not isinstance(value, str):
        raise Bad(f"{field!r} must be a string, got {type_name(value)}")
    return value


def _weight(message: dict[str, Any], role: str, at: str) -> int | None:
    """OpenAI's `weight` (assistant messages only) or LLaMA-Factory's `loss_weight` (0 on any
    message, 1 on an assistant's): the same meaning, 0 is context, not trained, 1 trained; None
    when not given."""
    if message.get("weight") is not None:
        weight = plain(message["weight"])
        if role != "assistant" or weight not in (0, 1) or isinstance(weight, bool):
            raise Bad(f"'weight' must be 0 or 1 on an assistant message, got {weight!r} on a {role} message {at}")
        return int(weight)
    if message.get("loss_weight") is None:
        return None
    weight = plain(message["loss_weight"])
    if isinstance(weight, bool) or weight not in (0, 1):
        raise Bad(f"'loss_weight' must be 0 or 1 (LLaMA-Factory's per-message switch), got {weight!r} {at}")
    if weight == 1 and role != "assistant":
        raise Bad(f"'loss_weight' 1 on a {role} message {at}: only assistant turns are trained (0 or none there)")
    return int(weight)


def _part_image(part: dict[str, Any], at: str) -> Any:
    """What an image part names: a path, bytes (a data: URL decoded), or None (TRL's bare
    `{"type": "image"}`: the image is in the record's `images` column)."""
    value = part.get("image", part.get("value", part.get("path", part.get("image_url"))))
    if isinstance(value, dict):  # OpenAI: {"type": "image_url", "image_url": {"url": ...}}
        value = value.get("url", value.get("path"))
    if isinstance(value, str) and value.startswith("data:"):
        header, _, data = value.partition(",")
        if ";base64" not in header:
            raise Bad(f"a data: URL image must be base64-encoded {at}")
        try:
            return base64.b64decode(data, validate=True)
        except ValueError:
            raise Bad(f"a data: URL image is not valid base64 {at}") from None
    if isinstance(value, str) and value.split("://", 1)[0] in ("http", "https"):
        raise Bad(f"the image {value!r} {at} is a web address: images are not downloaded; save it and give its path")
    return value


TEXT_PART_KEYS = ("text", "value")
"""Where a text part holds its text: OpenAI and TRL `{"type": "text", "text"}`, LLaMA-Factory `"value"`."""
IMAGE_PART_TYPES = ("image", "image_url")


def _content(value: Any, at: str, images: list | None) -> str:
    """A message's content: a string, or a list of content parts (OpenAI, TRL, LLaMA-Factory),
    whose text parts are joined and whose image parts become `<image>` (their images appended to
    `images`; a text chat, `images` None, refuses them)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (np.ndarray, tuple)):
        value = list(value)
    if not isinstance(value, list):
        raise Bad(f"'content' must be a string or a list of content parts, got {type_name(value)} {at}")
    pieces = []
    for index, part in enumerate(value):
        where = f"{at}, content part {index}"
        if not isinstance(part, dict) or "type" not in part:
            raise Bad(f"expected a content part {{type, ...}}, got {type_name(part)} {where}")
        kind = part["type"]
        if kind == "text":
            text = next((part[k] for k in TEXT_PART_KEYS if part.get(k) is not None), None)
            if not isinstance(text, str):
                raise Bad(f"a text part needs its text as a string under 'text' (or 'value'), got {type_name(text)} {where}")
            pieces.append(text)
        elif kind in IMAGE_PART_TYPES:
            if images is None:
                raise Bad(f"an {kind!r} part {where}: a chat source holds text; a source of chats with images is `kind: image_chat`")
            images.append(_part_image(part, where))
            pieces.append(IMAGE_TOKEN)
        else:
            allowed = "text, image or image_url" if images is not None else "text"
            raise Bad(f"unsupported content part type {kind!r} {where} (expected {allowed})")
    return "".join(pieces)


def _arguments(value: Any, at: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise Bad(f"a tool call's arguments are not valid JSON ({exc.msg}) {at}") from None
    if not isinstance(value, dict):
        raise Bad(f"a tool call's arguments must be a JSON object, got {type_name(value)} {at}")
    return value


def tool_calls(value: Any, at: str) -> list[dict[str, Any]]:
    """Tool calls in the form Hugging Face chat templates render: `{"type": "function",
    "function": {"name", "arguments": {...}}}` (and the call's `id` where given). Read from
    OpenAI's `tool_calls` (arguments as JSON text) or a bare `{name, arguments}` (ShareGPT's
    `function_call` turn; Llama's `parameters` too), one or a list."""
    value = plain(value)
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise Bad(f"'tool_calls' is an empty list {at}")
    out = []
    for index, call in enumerate(calls):
        where = f"{at}, tool call {index}"
        if not isinstance(call, dict):
            raise Bad(f"expected a tool call object {{name, arguments}}, got {type_name(call)} {where}")
        function = call.get("function", call)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise Bad(f"a tool call needs the function's 'name' {where}")
        arguments = function.get("arguments", function.get("parameters", {}))
        kept: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": _arguments(arguments, where)}}
        if isinstance(call.get("id"), str):
            kept["id"] = call["id"]
        out.append(kept)
    return out


def _tools(value: Any) -> list[dict[str, Any]]:
    """A record's `tools`: JSON schemas of the functions the chat may call, as a list or its JSON
    text (LLaMA-Factory), each `{"type": "function", "function": {name, description, parameters}}`
    (OpenAI, Hugging Face) or the bare function (LLaMA-Factory, Glaive), kept in the first form."""
    value = plain(value)
    if value is None or value == "":
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise Bad(f"'tools' is not valid JSON ({exc.msg})") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise Bad(f"'tools' must be a list of function schemas (or its JSON text), got {type_name(value)}")
    out = []
    for index, tool in enumerate(value):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise Bad(f"'tools'[{index}] must be a function schema with a 'name' (and 'description', 'parameters')")
        out.append({"type": "function", "function": function})
    return out


def _message_list(value: Any, label: str, images: list | None = None) -> list[dict[str, Any]]:
    """Validate a list of {role, content} messages; returns copies with role and content (a string:
    content parts joined, see `_content`), OpenAI's `name`, `weight: 0` (or LLaMA-Factory's
    `loss_weight: 0`) where given, an assistant's `tool_calls` and a tool result's `tool_call_id`;
    other keys left out."""
    if isinstance(value, (np.ndarray, tuple)):
        value = list(value)
    if not isinstance(value, list):
        raise Bad(f"{label!r} must be a string or a list of {{role, content}} messages, got {type_name(value)}")
    messages: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []  # the last assistant's tool calls not answered yet
    for index, message in enumerate(value):
        at = f"in {label}[{index}]"
        if not isinstance(message, dict):
            raise Bad(f"expected a {{role, content}} object, got {type_name(message)} {at}")
        role = plain(message.get("role"))
        calls = plain(message.get("tool_calls")) if role == "assistant" else None
        calls = calls or None  # OpenAI writes `tool_calls: null` (or []) on plain answers
        if "role" not in message or ("content" not in message and calls is None):
            missing = "role" if "role" not in message else "content"
            raise Bad(f"missing {missing!r} {at}")
        if role not in ROLES:
            raise Bad(f"unknown role {role!r} (expected system, user, assistant or tool) {at}")
        content = message.get("content")
        content = "" if content is None and calls is not None else _content(plain(content), at, images)
        if role == "system" and index > 0:
            raise Bad(f"a system message may only come first {at}")
        if role == "tool" and not (messages and (messages[-1]["role"] == "tool" or "tool_calls" in messages[-1])):
            raise Bad(f"a tool result must follow an assistant message with tool calls (or another tool result) {at}")
        kept: dict[str, Any] = {"role": role, "content": content}
        if calls is not None:
            kept["tool_calls"] = tool_calls(calls, at)
        for key in ("name", "tool_call_id"):  # OpenAI: a participant's name; the call a tool result answers
            if message.get(key) is not None:
                named = plain(message[key])
                if not isinstance(named, str):
                    raise Bad(f"{key!r} must be a string, got {type_name(named)} {at}")
                kept[key] = named
        if _weight(message, role, at) == 0 and role == "assistant":
            kept["weight"] = 0
        if "tool_calls" in kept:
            pending = list(kept["tool_calls"])
        elif role == "tool" and pending:  # results answer the calls in order, or by the call's id where given
            call = next((c for c in pending if kept.get("tool_call_id") is not None and c.get("id") == kept["tool_call_id"]), pending[0])
            pending.remove(call)
            kept.setdefault("name", call["function"]["name"])  # the function a result comes from (Hermes-style templates print it)
        messages.append(kept)
    return messages


def _turns(value: Any, label: str, role: str) -> list[dict[str, str]]:
    """A plain string as one `role` message, or a message list (TRL conversational format)."""
    return [{"role": role, "content": value}] if isinstance(value, str) else _message_list(value, label)


_dump = json.JSONEncoder(ensure_ascii=False).encode  # one encoder: json.dumps builds one per call


def _chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> tuple[str]:
    """The chat as stored: its messages' JSON, the tool schemas (if any) on the first message as
    `tools` (`chat_template.tools_of` takes them off again to render), so a chat stays one value
    and chats without tools keep the bytes they always had."""
    roles = [m["role"] for m in messages]
    if "system" in roles[1:]:
        # Only reachable when prompt and completion lists are joined: each list was checked alone.
        raise Bad(f"a system message may only come first (found at position {roles.index('system', 1)} of the chat)")
    if "assistant" not in roles:
        raise Bad("no assistant message (a chat needs at least one assistant turn)")
    if all(m.get("weight", 1) == 0 for m in messages if m["role"] == "assistant"):
        raise Bad("every assistant message has weight 0 (nothing to train on)")
    if tools:
        messages = [{**messages[0], "tools": tools}, *messages[1:]]
    return (_dump(messages),)


KTO_HELP = ("unpaired feedback (a completion labelled desirable or not) is KTO's layout: give the source `kind: feedback` "
            "and train with `dpo.method: kto` (docs/data.md), or leave the label out to train on the chats with sft")  # fmt: skip


def _refuse_unpaired(record: dict[str, Any]) -> None:
    """TRL's `{prompt, completion, label}` and LLaMA-Factory's `kto_tag`: KTO data, not chats."""
    if "kto_tag" in record or isinstance(plain(record.get("label")), bool):
        field = "kto_tag" if "kto_tag" in record else "label"
        raise Bad(f"{field!r}: {KTO_HELP}")


def _text_record(record: dict[str, Any]) -> tuple[str]:
    return (_string(record, "text"),)


def _messages_value(record: dict[str, Any], field: str = "messages") -> Any:
    value = record[field]
    if isinstance(value, str):
        # CSV cells (and re-read ingested data) hold the list as JSON text.
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise Bad(f"{field!r} must be a list of {{role, content}} messages (or its JSON text), got str") from None
    return value


def _chat_messages(record: dict[str, Any]) -> tuple[str]:
    _refuse_unpaired(record)
    return _chat(_message_list(_messages_value(record), "messages"), _tools(record.get("tools")))


def _chat_prompt_completion(record: dict[str, Any]) -> tuple[str]:
    _refuse_unpaired(record)
    prompt = _turns(record["prompt"], "prompt", "user")
    completion = _turns(record["completion"], "completion", "assistant")
    return _chat(prompt + completion, _tools(record.get("tools")))


def _chat_alpaca(record: dict[str, Any]) -> tuple[str]:
    instruction, output = _string(record, "instruction"), _string(record, "output")
    extra = record.get("input")
    if extra is not None and not isinstance(extra, str):
        raise Bad(f"'input' must be a string, got {type_name(extra)}")
    user = instruction + ("\n\n" + extra if extra else "")
    return _chat([{"role": "user", "content": user}, {"role": "assistant", "content": output}])


SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
                  "function_call": "assistant", "observation": "tool", "tool": "tool"}  # fmt: skip


def _sharegpt_turns(value: Any, label: str = "conversations", images: list | None = None) -> list[dict[str, Any]]:
    """ShareGPT/Vicuna turns `{from, value}` (`human`/`gpt`/`system`, and LLaMA-Factory's tool
    turns: `function_call`, the assistant's call as `{name, arguments}` JSON, and `observation`,
    the tool's result) as checked messages; some exports use `{role, content}` there, which is
    read as messages."""
    value = plain(value)
    if not isinstance(value, list):
        raise Bad(f"{label!r} must be a list of {{from, value}} turns, got {type_name(value)}")
    turns = []
    for index, turn in enumerate(value):
        at = f"in {label}[{index}]"
        if not isinstance(turn, dict):
            raise Bad(f"expected a {{from, value}} object, got {type_name(turn)} {at}")
        if "from" not in turn and "role" in turn:
            turns.append(turn)
            continue
        if "from" not in turn or "value" not in turn:
            raise Bad(f"missing {'from' if 'from' not in turn else 'value'!r} {at}")
        speaker = str(turn["from"]).lower()
        role = SHAREGPT_ROLES.get(speaker)
        if role is None:
            raise Bad(f"unknown speaker 'from': {turn['from']!r} (expected human, gpt, system, function_call or observation) {at}")
        weights = {k: turn[k] for k in ("weight", "loss_weight") if k in turn}
        if speaker == "function_call":
            call = turn["value"]
            if isinstance(call, str):
                try:
                    call = json.loads(call)
                except json.JSONDecodeError as exc:
                    raise Bad(f"a function_call turn's value must be the call as JSON {{name, arguments}} ({exc.msg}) {at}") from None
            turns.append({"role": "assistant", "content": "", "tool_calls": call, **weights})
        else:
            turns.append({"role": role, "content": turn["value"], **weights})
    return _message_list(turns, label, images)


def _chat_sharegpt(record: dict[str, Any]) -> tuple[str]:
    _refuse_unpaired(record)
    return _chat(_sharegpt_turns(record["conversations"]), _tools(record.get("tools")))


def _chat_dolly(record: dict[str, Any]) -> tuple[str]:
    """databricks-dolly: `instruction`, optional `context` (joined after a blank line), `response`."""
    instruction, response = _string(record, "instruction"), _string(record, "response")
    context = record.get("context")
    if context is not None and not isinstance(context, str):
        raise Bad(f"'context' must be a string, got {type_name(context)}")
    user = instruction + ("\n\n" + context if context and context.strip() else "")
    return _chat([{"role": "user", "content": user}, {"role": "assistant", "content": response}])


def _prompt(value: Any) -> list[dict[str, str]]:
    messages = _turns(value, "prompt", "user")
    if not messages:
        raise Bad("'prompt' is an empty message list")
    if messages[-1]["role"] != "user":
        raise Bad(f"'prompt' must end with a user message, got {messages[-1]['role']}")
    return messages


def _response(value: Any, label: str, prompt: list[dict[str, str]]) -> str:
    """`chosen`/`rejected`: a string, or a message list holding one assistant message."""
    if isinstance(value, str):
        return value
    messages = _message_list(value, label)
    # Some data sets (e.g. UltraFeedback binarized) repeat the prompt before the answer.
    if len(messages) > len(prompt) and messages[: len(prompt)] == prompt:
        messages = messages[len(prompt) :]
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        roles = ", ".join(m["role"] for m in messages) or "none"
        raise Bad(f"{label!r} as a list must be a single assistant message, got {len(messages)} ({roles})")
    return _answer(messages[0], label)


def _answer(message: dict[str, Any], label: str) -> str:
    if "tool_calls" in message:
        raise Bad(f"{label!r} is a tool call: a preference pair's answers are text")
    return message["content"]


def _preference(record: dict[str, Any]) -> tuple[str, str, str]:
    prompt = _prompt(record["prompt"])
    return (
        _dump(prompt),
        _response(record["chosen"], "chosen", prompt),
        _response(record["rejected"], "rejected", prompt),
    )


HH_TURN = re.compile(r"(?:^|\n\n)(Human|Assistant): ?")


def _hh_transcript(text: str, label: str) -> list[dict[str, str]]:
    """Anthropic HH-RLHF: `\n\nHuman: …\n\nAssistant: …` as messages."""
    parts = HH_TURN.split(text)
    if len(parts) < 3:
        raise Bad(f"{label!r} is not a transcript of '\\n\\nHuman:' / '\\n\\nAssistant:' turns (HH-RLHF layout)")
    if parts[0].strip():
        raise Bad(f"{label!r} has text before its first 'Human:' turn")
    return [{"role": "user" if who == "Human" else "assistant", "content": said.strip()} for who, said in zip(parts[1::2], parts[2::2], strict=True)]


def _conversation(value: Any, label: str) -> list[dict[str, str]]:
    messages = _hh_transcript(value, label) if isinstance(value, str) else _message_list(value, label)
    if not messages or messages[-1]["role"] != "assistant":
        last = messages[-1]["role"] if messages else "nothing"
        raise Bad(f"{label!r} must end with an assistant turn, the answer (it ends with {last})")
    return messages


def _preference_implicit(record: dict[str, Any]) -> tuple[str, str, str]:
    """No `prompt`: `chosen` and `rejected` are whole conversations (TRL's implicit prompt, as
    message lists) or transcripts (HH-RLHF); what they share before the last turn is the prompt."""
    chosen, rejected = _conversation(record["chosen"], "chosen"), _conversation(record["rejected"], "rejected")
    prompt, other = chosen[:-1], rejected[:-1]
    if prompt != other:
        turn = next((i for i, (a, b) in enumerate(zip(prompt, other, strict=False)) if a != b), min(len(prompt), len(other)))
        raise Bad(
            f"'chosen' and 'rejected' have different prompts: they differ at turn {turn + 1} "
            f"(an implicit-prompt pair shares every turn but the final answer)"
        )
    return (_dump(_prompt(prompt)), _answer(chosen[-1], "chosen"), _answer(rejected[-1], "rejected"))


def _preference_messages(record: dict[str, Any]) -> tuple[str, str, str]:
    """LLaMA-Factory's v1 layout: `chosen_messages`/`rejected_messages`, whole conversations
    that share their prompt (as TRL's implicit prompt)."""
    return _preference_implicit({"chosen": plain(record["chosen_messages"]), "rejected": plain(record["rejected_messages"])})


def _sharegpt_answer(value: Any, label: str) -> str:
    """LLaMA-Factory's ranking layout: `chosen`/`rejected` as one `{from: gpt, value}` turn (or a
    string, or a list of turns holding one answer)."""
    value = plain(value)
    if isinstance(value, str):
        return value
    turns = _sharegpt_turns(value if isinstance(value, list) else [value], label)
    if len(turns) != 1 or turns[0]["role"] != "assistant":
        raise Bad(f"{label!r} must be the answer, one {{from: gpt, value}} turn, got {', '.join(t['role'] for t in turns) or 'none'}")
    return _answer(turns[0], label)


def _preference_sharegpt(record: dict[str, Any]) -> tuple[str, str, str]:
    """LLaMA-Factory's DPO layout (`dpo_en_demo.json`): ShareGPT `conversations` up to the last
    user turn, and `chosen`/`rejected` as `{from: gpt, value}` turns."""
    prompt = _sharegpt_turns(record["conversations"])
    if not prompt or prompt[-1]["role"] != "user":
        raise Bad(f"'conversations' must end with a human turn, the prompt (it ends with {prompt[-1]['role'] if prompt else 'nothing'})")
    return (_dump(prompt), _sharegpt_answer(record["chosen"], "chosen"), _sharegpt_answer(record["rejected"], "rejected"))


def _preference_unpaired(record: dict[str, Any]) -> tuple[str, str, str]:
    raise Bad(f"'label': {KTO_HELP}")


def _label(record: dict[str, Any], field: str) -> str:
    """KTO's label as the stored string: "true" (desirable) or "false". CSV cells may spell it."""
    value = plain(record[field])
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        value = value.strip().lower() == "true"
    if not isinstance(value, bool):
        raise Bad(f"{field!r} must be a boolean (true: the completion is desirable, false: undesirable), got {type_name(value)}")
    return "true" if value else "false"


def _feedback(record: dict[str, Any]) -> tuple[str, str, str]:
    """TRL's unpaired preference layout: `prompt`, `completion` (strings or messages), `label`."""
    prompt = _prompt(record["prompt"])
    return (_dump(prompt), _response(record["completion"], "completion", prompt), _label(record, "label"))


def _feedback_conversation(messages: list[dict[str, Any]], record: dict[str, Any], field: str, label: str) -> tuple[str, str, str]:
    """A whole conversation judged by its final assistant turn (LLaMA-Factory's `kto_en_demo.json`)."""
    if not messages or messages[-1]["role"] != "assistant":
        raise Bad(f"{label!r} must end with an assistant turn, the completion judged (it ends with {messages[-1]['role'] if messages else 'nothing'})")
    return (_dump(_prompt(messages[:-1])), _answer(messages[-1], "completion"), _label(record, field))


def _feedback_messages(field: str) -> Callable[[dict[str, Any]], tuple[str, str, str]]:
    def convert(record: dict[str, Any]) -> tuple[str, str, str]:
        return _feedback_conversation(_message_list(_messages_value(record), "messages"), record, field, "messages")

    return convert


def _feedback_sharegpt(record: dict[str, Any]) -> tuple[str, str, str]:
    return _feedback_conversation(_sharegpt_turns(record["conversations"]), record, "kto_tag", "conversations")


def _image_chat(messages: list[dict[str, Any]], found: list, record: dict[str, Any], tools: Any) -> tuple[str]:
    """An image chat whose image parts (`found`: each part's image, None where it names none)
    go with the record's `images` column (TRL: bare `{"type": "image"}` parts) or carry the
    images themselves (LLaMA-Factory v1, OpenAI: a path or a data: URL in the part), which then
    become the record's `images`."""
    named = [item for item in found if item is not None]
    if named:
        if len(named) != len(found):
            raise Bad("some image parts name their image and some do not: give every image in its part, or all in 'images'")
        if record.get("images") is not None and len(plain(record["images"])):
            raise Bad("the image parts name their images and the record has 'images' too: give each image once")
        record["images"] = named
    return _chat(messages, _tools(tools))


def _image_chat_messages(record: dict[str, Any]) -> tuple[str]:
    found: list = []
    return _image_chat(_message_list(_messages_value(record), "messages", found), found, record, record.get("tools"))


def _image_chat_sharegpt(record: dict[str, Any]) -> tuple[str]:
    found: list = []
    return _image_chat(_sharegpt_turns(record["conversations"], images=found), found, record, record.get("tools"))


# Per kind, the accepted layouts in priority order: (fields it needs, how it becomes the kind's fields).
LAYOUTS: dict[str, tuple[tuple[tuple[str, ...], Callable[[dict[str, Any]], tuple[str, ...]]], ...]] = {
    "text": ((("text",), _text_record),),
    "chat": (
        (("messages",), _chat_messages),
        (("conversations",), _chat_sharegpt),
        (("prompt", "completion"), _chat_prompt_completion),
        (("instruction", "output"), _chat_alpaca),
        (("instruction", "response"), _chat_dolly),
    ),
    "preference": (
        (("prompt", "chosen", "rejected"), _preference),
        (("conversations", "chosen", "rejected"), _preference_sharegpt),
        (("chosen", "rejected"), _preference_implicit),
        (("chosen_messages", "rejected_messages"), _preference_messages),
        (("prompt", "completion", "label"), _preference_unpaired),
    ),
    # KTO's unpaired feedback: TRL's layout, LLaMA-Factory's (`messages` + `kto_tag`, which its
    # dataset_info maps to the file's `label`) and ShareGPT turns + `kto_tag`.
    "feedback": (
        (("prompt", "completion", "label"), _feedback),
        (("messages", "kto_tag"), _feedback_messages("kto_tag")),
        (("messages", "label"), _feedback_messages("label")),
        (("conversations", "kto_tag"), _feedback_sharegpt),
    ),
    # The chat layouts that carry messages; `_batches` reads the `images` beside them (or the
    # converter puts there the images the content parts carry).
    "image_chat": (
        (("messages", "images"), _image_chat_messages),
        (("conversations", "images"), _image_chat_sharegpt),
        (("messages",), _image_chat_messages),
    ),
}


REFUSED = (_preference_unpaired,)
"""Layouts recognised only to say what they are (KTO's unpaired feedback): never suggested."""


def layout(kind: str, keys: Iterable[str]) -> Callable[[dict[str, Any]], tuple[str, ...]]:
    """The first layout whose fields are all present, else `Missing` naming the closest one's gap."""
    keys = set(keys)
    best: tuple[str, ...] | None = None
    for fields, convert in LAYOUTS[kind]:
        if keys.issuperset(fields):
            return convert
        if best is None or sum(f in keys for f in fields) > sum(f in keys for f in best):
            best = fields
    raise Missing(next(f for f in best if f not in keys))


def missing_message(where: str, name: str, source: SourceParams, found: Iterable[str], noun: str) -> str:
    listed = ", ".join(found) or "nothing"
    if name in source.columns:
        return (
            f"{where}: missing {noun} {source.columns[name]!r} (mapped to {name!r} by columns) "
            f"required for kind {source.kind!r} (found: {listed})"
        )
    others = [" + ".join(fields) for fields, convert in LAYOUTS[source.kind] if name not in fields and convert not in REFUSED]
    also = f"; kind {source.kind!r} also accepts {' or '.join(others)}" if others else ""
    return (
        f"{where}: missing {noun} {name!r} required for kind {source.kind!r} "
        f"(found: {listed}; map yours with columns: {{{name}: <name>}}{also})"
    )


def rename(record: dict[str, Any], columns: dict[str, str]) -> dict[str, Any]:
    record = dict(record)
    for expected, column in columns.items():
        if column in record:
            record[expected] = record.pop(column)
    return record


def check_heldout_chat(messages: str, where: str) -> None:
    """A held-out chat (`split: test`) is scored against its last turn: it must be the assistant's
    text answer."""
    final = json.loads(messages)[-1]
    last = final["role"]
    if "tool_calls" in final:
        raise ReaderError(f"{where}: a held-out chat (split: test) must end with the assistant's text answer, which evaluate scores "
                          "(this one ends with a tool call)")  # fmt: skip
    if last != "assistant":
        raise ReaderError(
            f"{where}: a held-out chat (split: test) must end with an assistant turn, the reference answer "
            f"that evaluate scores (this one ends with a {last} turn)"
        )


def _counted(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _image(item: Any, at: str, folder: Path, shown: str) -> bytes:
    """One entry of `images` as its file's bytes, unchanged, after checking that Pillow decodes
    them: a path (relative to `folder`, the source's folder, which errors call `shown`), bytes,
    or a `{bytes, path}` object (`datasets` Image features), whose bytes win when there are any."""
    if isinstance(item, dict):
        if item.get("bytes") is None and item.get("path") is None:
            raise Bad(f"{at} is a {{bytes, path}} object with neither (expected the image's bytes or its path)")
        item = item["bytes"] if item.get("bytes") is not None else item["path"]
    if isinstance(item, (bytes, bytearray, memoryview)):
        data = bytes(item)
        named = f"{at} ({_counted(len(data), 'byte')} given in the record)"
    elif isinstance(item, str):
        if not item:
            raise Bad(f"{at} is an empty path (expected an image file's path)")
        path = Path(item)
        named = f"{at} {item!r}"
        try:
            data = (path if path.is_absolute() else folder / path).read_bytes()
        except FileNotFoundError:
            looked = item if path.is_absolute() else (Path(shown) / path).as_posix()
            raise Bad(f"{named}: image file not found (looked for {looked}; a relative path is relative to the source's folder)") from None
        except IsADirectoryError:
            raise Bad(f"{named}: expected an image file, got a directory") from None
        except OSError as exc:
            raise Bad(f"{named}: cannot read ({exc.strerror})") from None
    else:
        raise Bad(f"{at} must be an image path, bytes or a {{bytes, path}} object, got {type_name(item)}")
    try:
        check_image(data)
    except ImageError as exc:
        raise Bad(f"{named}: {exc}") from None
    return data


def record_images(record: dict[str, Any], messages: str, folder: Path, shown: str) -> list[bytes]:
    """The `images` of an image chat whose checked `messages` (JSON) are given: each image's bytes,
    in order. Its `<image>` tags must all be in user turns, one per image (a chat without images
    has none; a null or missing `images` is none)."""
    value = record.get("images")
    if value is None:
        value = []
    if isinstance(value, (np.ndarray, tuple)):
        value = list(value)
    if not isinstance(value, list):
        raise Bad(f"'images' must be a list of image paths, bytes or {{bytes, path}} objects, got {type_name(value)}")
    turns = json.loads(messages)
    label = "messages" if "messages" in record else "conversations"  # (the layout's priority)
    for index, message in enumerate(turns):
        if message["role"] != "user" and IMAGE_TOKEN in message["content"]:
            raise Bad(f"{IMAGE_TOKEN} in {label}[{index}], whose role is {message['role']}: images go in user turns only")
    tags = count_placeholders(turns)
    if tags != len(value):
        raise Bad(
            f"{_counted(tags, IMAGE_TOKEN + ' placeholder')} in the user turns but {_counted(len(value), 'image')} "
            f"in 'images' (each image needs one {IMAGE_TOKEN} where it goes, in order)"
        )
    return [_image(item, f"images[{index}]", folder, shown) for index, item in enumerate(value)]


