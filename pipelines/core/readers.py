"""Read one data source (a `SourceParams` entry of `ingest.sources`) into records of one kind.

    from pipelines.core.config import SourceParams
    from pipelines.core.readers import read_source
    frame = read_source(SourceParams(path="data/sources/chats.jsonl", kind="chat"), root=Path("."))

Every record kind is a DataFrame of `str` columns (`COLUMNS`): `id, source, split` plus
`text` (text), `messages` (chat: a JSON list of {role, content}) or `prompt` (a JSON message list
ending with a user turn), `chosen`, `rejected` (preference). The layouts people have are
recognised from their keys (`LAYOUTS`), no `columns` map needed: chats as OpenAI `messages` (with
per-message `name` and `weight`: 0 marks an assistant turn that is context, not a target),
ShareGPT `conversations` (`from`/`value`, `human`/`gpt`/`system`), `prompt`/`completion`, Alpaca
`instruction`/`input`/`output` and Dolly `instruction`/`context`/`response`; preferences with a
`prompt`, or without one (TRL's implicit prompt: `chosen`/`rejected` conversations; Anthropic
HH-RLHF: `\n\nHuman:`/`\n\nAssistant:` transcripts), whose shared turns become the prompt. A chat needs an assistant turn; a
held-out chat (`split: test`) must end with one, the reference answer `evaluate` scores. Anything
wrong with the input is a `ReaderError` naming the file, the 1-based line (JSONL, text, CSV) or
the 0-based record index (JSON, Parquet, hf), and what was expected.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.core.config import SourceParams
from pipelines.core.errors import QllmError


class ReaderError(QllmError, ValueError):
    """A source cannot be read as its kind; the message names the file, line or record, and why."""


COLUMNS: dict[str, tuple[str, ...]] = {
    "text": ("id", "source", "split", "text"),
    "chat": ("id", "source", "split", "messages"),
    "preference": ("id", "source", "split", "prompt", "chosen", "rejected"),
}
ROLES = ("system", "user", "assistant")

EXTENSIONS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".tsv": "csv",
    ".txt": "text",
    ".md": "text",
}
# Files `Dataset.save_to_disk` / `DatasetDict.save_to_disk` write at the top of their directory.
HF_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")
TEXT_SUFFIXES = (".txt", ".md")
_FORMATS_HELP = "jsonl (.jsonl, .ndjson), json, parquet, csv (.csv, .tsv), text (.txt, .md or a directory of them), hf"


def empty_frame(kind: str) -> pd.DataFrame:
    """A zero-row frame with the columns (all `str`) of one record kind."""
    return pd.DataFrame({name: pd.Series([], dtype="str") for name in COLUMNS[kind]})


# ------------------------------------------------------------------------------------- formats


class Table(NamedTuple):
    """What a format reader yields: the column names when the format has a schema (else None) and
    `(where, record)` pairs, `where` being the location used in error messages."""

    shown: str
    columns: list[str] | None
    rows: Iterable[tuple[str, dict[str, Any]]]


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _decode(path: Path, shown: str) -> str:
    """The file's text, with a 1-based line and in-line byte position for invalid UTF-8."""
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise ReaderError(f"{shown}: expected a file, got a directory") from None
    except OSError as exc:
        raise ReaderError(f"{shown}: cannot read ({exc.strerror})") from None
    data = data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark is valid, just redundant
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1)
        raise ReaderError(
            f"{shown}:{line}: not valid UTF-8 (byte 0x{data[exc.start]:02x} at position {column}); "
            "re-encode the file as UTF-8"
        ) from None


def _json_error(exc: json.JSONDecodeError) -> str:
    return f"invalid JSON ({exc.msg} at column {exc.colno})"


def _jsonl_rows(text: str, shown: str) -> Iterator[tuple[str, dict[str, Any]]]:
    # split("\n") rather than splitlines(): JSON strings may hold U+2028, which is no line break here.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ReaderError(f"{shown}:{number}: {_json_error(exc)}") from None
        if not isinstance(record, dict):
            raise ReaderError(f"{shown}:{number}: expected a JSON object, got {_type_name(record)}")
        yield f"{shown}:{number}", record


def _read_jsonl(path: Path, shown: str, source: SourceParams) -> Table:
    return Table(shown, None, _jsonl_rows(_decode(path, shown), shown))


def _read_json(path: Path, shown: str, source: SourceParams) -> Table:
    text = _decode(path, shown)
    if not text.strip():
        return Table(shown, None, [])
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReaderError(f"{shown}:{exc.lineno}: {_json_error(exc)}") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise ReaderError(f'{shown}: expected an array of objects or {{"data": [...]}}, got {_type_name(data)}')

    def rows() -> Iterator[tuple[str, dict[str, Any]]]:
        for index, record in enumerate(data):
            if not isinstance(record, dict):
                raise ReaderError(f"{shown}: record {index}: expected a JSON object, got {_type_name(record)}")
            yield f"{shown}: record {index}", record

    return Table(shown, None, rows())


def _read_parquet(path: Path, shown: str, source: SourceParams) -> Table:
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise ReaderError(f"{shown}: not a readable Parquet file ({exc})") from None
    records = table.to_pylist()  # plain lists and dicts, no numpy arrays
    return Table(shown, table.column_names, ((f"{shown}: record {i}", r) for i, r in enumerate(records)))


def _csv_problem(exc: csv.Error) -> str:
    """What a (strict) `csv.Error` means, in the user's terms."""
    message = str(exc).replace("\t", "\\t")
    if message == "unexpected end of data":
        return "unterminated quote: a quote opened in this row is never closed"
    if message.endswith("expected after '\"'"):
        return f'{message}: a quote inside a quoted field must be doubled ("")'
    return message


def _read_csv(path: Path, shown: str, source: SourceParams) -> Table:
    text = _decode(path, shown)
    if not text.strip():
        return Table(shown, None, [])
    csv.field_size_limit(2**31 - 1)  # documents longer than the 128 KiB default are fine
    # strict: a quote that is never closed is an error, not the rest of the file read as one field.
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
    try:
        header = next(reader)
    except csv.Error as exc:
        raise ReaderError(f"{shown}:1: invalid CSV header ({_csv_problem(exc)})") from None
    duplicated = sorted({name for name in header if header.count(name) > 1})
    if duplicated:
        raise ReaderError(f"{shown}:1: duplicate column {duplicated[0]!r} in the header")

    def rows() -> Iterator[tuple[str, dict[str, Any]]]:
        # A quoted field may span lines, so a row starts on the line after the previous row ended.
        start = reader.line_num + 1
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                raise ReaderError(f"{shown}:{start}: invalid CSV ({_csv_problem(exc)})") from None
            where, start = f"{shown}:{start}", reader.line_num + 1
            if not row:
                continue
            if len(row) != len(header):
                raise ReaderError(f"{where}: expected {len(header)} fields like the header, got {len(row)}")
            yield where, dict(zip(header, row, strict=True))

    return Table(shown, header, rows())


def _text_files(path: Path) -> list[Path]:
    """Every .txt/.md file under `path` in sorted relative-path order, skipping hidden ones."""
    found = [
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix.lower() in TEXT_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    ]
    return sorted(found, key=lambda p: p.relative_to(path).as_posix())


def _documents(text: str, shown: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Documents of one text file: runs of lines separated by one or more blank lines."""
    lines: list[str] = []
    first = 0
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if line.strip():
            if not lines:
                first = number
            lines.append(line)
        elif lines:
            yield f"{shown}:{first}", {"text": "\n".join(lines)}
            lines = []
    if lines:
        yield f"{shown}:{first}", {"text": "\n".join(lines)}


def _read_text(path: Path, shown: str, source: SourceParams) -> Table:
    if not path.is_dir():
        return Table(shown, None, _documents(_decode(path, shown), shown))
    files = [(file, f"{shown.rstrip('/')}/{file.relative_to(path).as_posix()}") for file in _text_files(path)]
    return Table(shown, None, (row for file, name in files for row in _documents(_decode(file, name), name)))


def _read_hf(path: Path, shown: str, source: SourceParams) -> Table:
    import datasets  # imported here: it takes a second or two and only hf sources need it

    if path.is_dir() and any((path / marker).exists() for marker in HF_MARKERS):
        try:
            data = datasets.load_from_disk(str(path))
        except Exception as exc:  # datasets raises many types; all mean "cannot load this directory"
            raise ReaderError(f"{shown}: not a readable saved dataset ({type(exc).__name__}: {exc})") from None
        if isinstance(data, datasets.DatasetDict):
            if source.hf_split not in data:
                found = ", ".join(data) or "none"
                raise ReaderError(f"{shown}: no split {source.hf_split!r} (found: {found}; set hf_split)")
            data = data[source.hf_split]
    else:
        # A local directory or file that is not a saved dataset, or a hub name (no local path).
        target = str(path) if path.exists() else source.path
        try:
            data = datasets.load_dataset(target, split=source.hf_split)
        except Exception as exc:  # as above: missing data set, no network, bad split, bad files
            where = "" if path.exists() else " (not found locally)"
            raise ReaderError(f"{shown}{where}: datasets.load_dataset failed ({type(exc).__name__}: {exc})") from None
    records = data.to_list()
    return Table(shown, list(data.column_names), ((f"{shown}: record {i}", r) for i, r in enumerate(records)))


READERS: dict[str, Callable[[Path, str, SourceParams], Table]] = {
    "jsonl": _read_jsonl,
    "json": _read_json,
    "parquet": _read_parquet,
    "csv": _read_csv,
    "text": _read_text,
    "hf": _read_hf,
}


def infer_format(path: Path, shown: str | None = None) -> str:
    """The format of a source from its extension or, for a directory, its contents.

    Args:
        path: the file or directory (must exist).
        shown: how to name it in errors (default: `path`).

    Returns:
        One of jsonl, json, parquet, csv, text, hf.
    """
    path = Path(path)
    shown = shown or str(path)
    if not path.exists():
        raise ReaderError(f"{shown}: not found")
    if path.is_dir():
        if any((path / marker).exists() for marker in HF_MARKERS):
            return "hf"
        if _text_files(path):
            return "text"
        raise ReaderError(
            f"{shown}: cannot infer the format of this directory: it is neither a saved `datasets` "
            f"directory nor holds .txt/.md files; set format: to one of {_FORMATS_HELP}"
        )
    fmt = EXTENSIONS.get(path.suffix.lower())
    if fmt is None:
        raise ReaderError(
            f"{shown}: cannot infer the format from the extension {path.suffix!r}; set format: to one of {_FORMATS_HELP}"
        )
    return fmt


# ------------------------------------------------------------------------------- record kinds


class _Bad(ValueError):
    """A record does not fit its kind; the reader prefixes the location."""


class _Missing(KeyError):
    """A record lacks a required field (args[0] is its expected name)."""


def _plain(value: Any) -> Any:
    """Numpy arrays/scalars and tuples (from Parquet or `datasets`) as plain lists and scalars."""
    if isinstance(value, str):
        return value
    if isinstance(value, (np.ndarray, list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def _string(record: dict[str, Any], field: str) -> str:
    value = record[field]
    if not isinstance(value, str):
        raise _Bad(f"{field!r} must be a string, got {_type_name(value)}")
    return value


def _message_list(value: Any, label: str) -> list[dict[str, str]]:
    """Validate a list of {role, content} messages; returns copies with role and content (and
    OpenAI's `name` and `weight: 0` where given), other keys left out."""
    if isinstance(value, (np.ndarray, tuple)):
        value = list(value)
    if not isinstance(value, list):
        raise _Bad(f"{label!r} must be a string or a list of {{role, content}} messages, got {_type_name(value)}")
    messages = []
    for index, message in enumerate(value):
        at = f"in {label}[{index}]"
        if not isinstance(message, dict):
            raise _Bad(f"expected a {{role, content}} object, got {_type_name(message)} {at}")
        if "role" not in message or "content" not in message:
            missing = "role" if "role" not in message else "content"
            raise _Bad(f"missing {missing!r} {at}")
        role, content = _plain(message["role"]), _plain(message["content"])
        if role not in ROLES:
            raise _Bad(f"unknown role {role!r} (expected system, user or assistant) {at}")
        if not isinstance(content, str):
            raise _Bad(f"'content' must be a string, got {_type_name(content)} {at}")
        if role == "system" and index > 0:
            raise _Bad(f"a system message may only come first {at}")
        kept = {"role": role, "content": content}
        if "name" in message and message["name"] is not None:  # OpenAI: a participant's name (templates may use it)
            name = _plain(message["name"])
            if not isinstance(name, str):
                raise _Bad(f"'name' must be a string, got {_type_name(name)} {at}")
            kept["name"] = name
        if "weight" in message and message["weight"] is not None:  # OpenAI: 0 = context, not trained
            weight = _plain(message["weight"])
            if role != "assistant" or weight not in (0, 1) or isinstance(weight, bool):
                raise _Bad(f"'weight' must be 0 or 1 on an assistant message, got {weight!r} on a {role} message {at}")
            if weight == 0:
                kept["weight"] = 0
        messages.append(kept)
    return messages


def _turns(value: Any, label: str, role: str) -> list[dict[str, str]]:
    """A plain string as one `role` message, or a message list (TRL conversational format)."""
    return [{"role": role, "content": value}] if isinstance(value, str) else _message_list(value, label)


_dump = json.JSONEncoder(ensure_ascii=False).encode  # one encoder: json.dumps builds one per call


def _chat(messages: list[dict[str, str]]) -> tuple[str]:
    roles = [m["role"] for m in messages]
    if "system" in roles[1:]:
        # Only reachable when prompt and completion lists are joined: each list was checked alone.
        raise _Bad(f"a system message may only come first (found at position {roles.index('system', 1)} of the chat)")
    if "assistant" not in roles:
        raise _Bad("no assistant message (a chat needs at least one assistant turn)")
    if all(m.get("weight", 1) == 0 for m in messages if m["role"] == "assistant"):
        raise _Bad("every assistant message has weight 0 (nothing to train on)")
    return (_dump(messages),)


def _text_record(record: dict[str, Any]) -> tuple[str]:
    return (_string(record, "text"),)


def _chat_messages(record: dict[str, Any]) -> tuple[str]:
    value = record["messages"]
    if isinstance(value, str):
        # CSV cells (and re-read ingested data) hold the list as JSON text.
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise _Bad("'messages' must be a list of {role, content} messages (or its JSON text), got str") from None
    return _chat(_message_list(value, "messages"))


def _chat_prompt_completion(record: dict[str, Any]) -> tuple[str]:
    prompt = _turns(record["prompt"], "prompt", "user")
    completion = _turns(record["completion"], "completion", "assistant")
    return _chat(prompt + completion)


def _chat_alpaca(record: dict[str, Any]) -> tuple[str]:
    instruction, output = _string(record, "instruction"), _string(record, "output")
    extra = record.get("input")
    if extra is not None and not isinstance(extra, str):
        raise _Bad(f"'input' must be a string, got {_type_name(extra)}")
    user = instruction + ("\n\n" + extra if extra else "")
    return _chat([{"role": "user", "content": user}, {"role": "assistant", "content": output}])


SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant"}


def _chat_sharegpt(record: dict[str, Any]) -> tuple[str]:
    """ShareGPT/Vicuna: `conversations` of `{from, value}` turns (`human`/`gpt`/`system`; some
    exports use `{role, content}` there, which is read as messages)."""
    value = _plain(record["conversations"])
    if not isinstance(value, list):
        raise _Bad(f"'conversations' must be a list of {{from, value}} turns, got {_type_name(value)}")
    turns = []
    for index, turn in enumerate(value):
        at = f"in conversations[{index}]"
        if not isinstance(turn, dict):
            raise _Bad(f"expected a {{from, value}} object, got {_type_name(turn)} {at}")
        if "from" not in turn and "role" in turn:
            turns.append(turn)
            continue
        if "from" not in turn or "value" not in turn:
            raise _Bad(f"missing {'from' if 'from' not in turn else 'value'!r} {at}")
        role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
        if role is None:
            raise _Bad(f"unknown speaker 'from': {turn['from']!r} (expected human, gpt or system) {at}")
        turns.append({"role": role, "content": turn["value"], **({"weight": turn["weight"]} if "weight" in turn else {})})
    return _chat(_message_list(turns, "conversations"))


def _chat_dolly(record: dict[str, Any]) -> tuple[str]:
    """databricks-dolly: `instruction`, optional `context` (joined after a blank line), `response`."""
    instruction, response = _string(record, "instruction"), _string(record, "response")
    context = record.get("context")
    if context is not None and not isinstance(context, str):
        raise _Bad(f"'context' must be a string, got {_type_name(context)}")
    user = instruction + ("\n\n" + context if context and context.strip() else "")
    return _chat([{"role": "user", "content": user}, {"role": "assistant", "content": response}])


def _prompt(value: Any) -> list[dict[str, str]]:
    messages = _turns(value, "prompt", "user")
    if not messages:
        raise _Bad("'prompt' is an empty message list")
    if messages[-1]["role"] != "user":
        raise _Bad(f"'prompt' must end with a user message, got {messages[-1]['role']}")
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
        raise _Bad(f"{label!r} as a list must be a single assistant message, got {len(messages)} ({roles})")
    return messages[0]["content"]


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
        raise _Bad(f"{label!r} is not a transcript of '\\n\\nHuman:' / '\\n\\nAssistant:' turns (HH-RLHF layout)")
    if parts[0].strip():
        raise _Bad(f"{label!r} has text before its first 'Human:' turn")
    return [{"role": "user" if who == "Human" else "assistant", "content": said.strip()} for who, said in zip(parts[1::2], parts[2::2], strict=True)]


def _conversation(value: Any, label: str) -> list[dict[str, str]]:
    messages = _hh_transcript(value, label) if isinstance(value, str) else _message_list(value, label)
    if not messages or messages[-1]["role"] != "assistant":
        last = messages[-1]["role"] if messages else "nothing"
        raise _Bad(f"{label!r} must end with an assistant turn, the answer (it ends with {last})")
    return messages


def _preference_implicit(record: dict[str, Any]) -> tuple[str, str, str]:
    """No `prompt`: `chosen` and `rejected` are whole conversations (TRL's implicit prompt, as
    message lists) or transcripts (HH-RLHF); what they share before the last turn is the prompt."""
    chosen, rejected = _conversation(record["chosen"], "chosen"), _conversation(record["rejected"], "rejected")
    prompt, other = chosen[:-1], rejected[:-1]
    if prompt != other:
        turn = next((i for i, (a, b) in enumerate(zip(prompt, other, strict=False)) if a != b), min(len(prompt), len(other)))
        raise _Bad(
            f"'chosen' and 'rejected' have different prompts: they differ at turn {turn + 1} "
            f"(an implicit-prompt pair shares every turn but the final answer)"
        )
    return (_dump(_prompt(prompt)), chosen[-1]["content"], rejected[-1]["content"])


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
        (("chosen", "rejected"), _preference_implicit),
    ),
}


def _layout(kind: str, keys: Iterable[str]) -> Callable[[dict[str, Any]], tuple[str, ...]]:
    """The first layout whose fields are all present, else `_Missing` naming the closest one's gap."""
    keys = set(keys)
    best: tuple[str, ...] | None = None
    for fields, convert in LAYOUTS[kind]:
        if keys.issuperset(fields):
            return convert
        if best is None or sum(f in keys for f in fields) > sum(f in keys for f in best):
            best = fields
    raise _Missing(next(f for f in best if f not in keys))


def _missing_message(where: str, name: str, source: SourceParams, found: Iterable[str], noun: str) -> str:
    listed = ", ".join(found) or "nothing"
    if name in source.columns:
        return (
            f"{where}: missing {noun} {source.columns[name]!r} (mapped to {name!r} by columns) "
            f"required for kind {source.kind!r} (found: {listed})"
        )
    others = [" + ".join(fields) for fields, _ in LAYOUTS[source.kind] if name not in fields]
    also = f"; kind {source.kind!r} also accepts {' or '.join(others)}" if others else ""
    return (
        f"{where}: missing {noun} {name!r} required for kind {source.kind!r} "
        f"(found: {listed}; map yours with columns: {{{name}: <name>}}{also})"
    )


def _rename(record: dict[str, Any], columns: dict[str, str]) -> dict[str, Any]:
    record = dict(record)
    for expected, column in columns.items():
        if column in record:
            record[expected] = record.pop(column)
    return record


def _check_heldout_chat(messages: str, where: str) -> None:
    """A held-out chat (`split: test`) is scored against its last turn: it must be the assistant's."""
    last = json.loads(messages)[-1]["role"]
    if last != "assistant":
        raise ReaderError(
            f"{where}: a held-out chat (split: test) must end with an assistant turn, the reference answer "
            f"that evaluate scores (this one ends with a {last} turn)"
        )


def _frame(table: Table, source: SourceParams, name: str) -> pd.DataFrame:
    """Convert a table's records into the kind's DataFrame, checking fields and ids."""
    if table.columns is not None:
        try:
            _layout(source.kind, _rename(dict.fromkeys(table.columns), source.columns))
        except _Missing as missing:
            raise ReaderError(_missing_message(table.shown, missing.args[0], source, table.columns, "column")) from None
    rows = []
    first_seen: dict[str, str] = {}
    for index, (where, raw) in enumerate(table.rows):
        record = _rename(raw, source.columns) if source.columns else raw
        try:
            fields = _layout(source.kind, record)(record)
        except _Missing as missing:
            raise ReaderError(_missing_message(where, missing.args[0], source, raw, "field")) from None
        except _Bad as bad:
            raise ReaderError(f"{where}: {bad}") from None
        if source.kind == "chat" and source.split == "test":
            _check_heldout_chat(fields[0], where)
        given = _plain(record.get("id"))
        record_id = f"{name}-{index}" if given is None or given == "" else str(given)
        if record_id in first_seen:
            raise ReaderError(f"{where}: duplicate id {record_id!r} (first at {first_seen[record_id]})")
        first_seen[record_id] = where
        rows.append((record_id, name, source.split, *fields))
    if not rows:
        raise ReaderError(f"{table.shown}: no records (empty source)")
    return pd.DataFrame(rows, columns=list(COLUMNS[source.kind])).astype("str")


def source_name(source: SourceParams) -> str:
    """The name a source goes by in records and metrics: `name`, else its file name."""
    return source.name or Path(source.path).name


def read_source(source: SourceParams, root: Path) -> pd.DataFrame:
    """Read one source into records of its kind.

    Args:
        source: the `ingest.sources` entry (path, kind, format, split, name, columns, hf_split).
        root: directory against which a relative `source.path` is resolved (the project root).

    Returns:
        A DataFrame with the kind's `COLUMNS`, every value a `str`, in source order.

    Raises:
        ReaderError: the source is missing, unreadable, empty or does not fit its kind.
    """
    path = Path(source.path)
    resolved = path if path.is_absolute() else Path(root) / path
    shown = source.path
    fmt = source.format
    if fmt is None:
        fmt = infer_format(resolved, shown)
    elif fmt != "hf" and not resolved.exists():
        # (An hf path that does not exist locally may be a hub name.)
        raise ReaderError(f"{shown}: not found")
    if fmt == "text" and source.kind != "text":
        raise ReaderError(
            f"{shown}: format 'text' holds plain documents, so it needs kind 'text' (got {source.kind!r})"
        )
    return _frame(READERS[fmt](resolved, shown, source), source, source_name(source))
