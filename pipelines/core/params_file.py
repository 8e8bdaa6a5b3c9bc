"""Reading params: `params.yaml` plus overlays (`--params`) and `--set` overrides, merged and
validated into the typed sections of `pipelines.core.config`, with errors that name the file, the
dotted key and, where it can be found, the line::

    params.yaml:57: pretrain.train.lr: Input should be greater than 0 (got -0.001)

A key given twice, bad YAML, an unknown key or a wrong type are `ParamsError`s.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from pipelines.core import dag
from pipelines.core.config import PARAMS_FILE, Params, ParamsError
from pipelines.core.paths import project_path

FAST_LOADER = dag.FAST_YAML
"""PyYAML's safe loader on libyaml where it is built in (8x faster on params.yaml: every stage
process and every `qllm run` reads it), else the pure-Python one; the same nodes, marks and values."""


def _reject_duplicate_keys(node: yaml.Node, prefix: tuple[str, ...], path: Path, seen: set[int] | None = None) -> None:
    """A key given twice in one mapping is an error (PyYAML would keep the last one silently)."""
    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias of a node already checked (or of one that holds itself)
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key, line = (key_node.tag, key_node.value), key_node.start_mark.line + 1
                if key in first:
                    dotted = ".".join((*prefix, str(key_node.value)))
                    raise ParamsError(f"{path}:{line}: {dotted}: duplicate key (first given on line {first[key]})")
                first[key] = line
            _reject_duplicate_keys(value_node, (*prefix, str(key_node.value)), path, seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _reject_duplicate_keys(item, (*prefix, str(index)), path, seen)


def _load(text: str, path: Path, loader_class: type) -> Any:
    loader = loader_class(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _reject_duplicate_keys(node, (), path)
        return loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping, with errors that name the file and line (a duplicate key is one)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ParamsError(f"{path}: file not found") from None
    except UnicodeDecodeError as exc:
        raise ParamsError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        data = _load(text, path, FAST_LOADER)
    except yaml.YAMLError:  # libyaml's messages are terser ("did not find expected ','"): the pure-Python one's, with the same line
        try:
            data = _load(text, path, yaml.SafeLoader)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f":{mark.line + 1}" if mark is not None else ""
            raise ParamsError(f"{path}{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}")
    return data


def deep_merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """Return `base` with `overlay` merged in: mappings merge key by key, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse one `--set section.key=value` (the value is YAML: `0.2`, `true`, `[4, 8]`)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ParamsError(f"--set {text!r}: expected KEY=VALUE with a dotted key, e.g. dpo.beta=0.2")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `--set` overrides; each key must already exist (a typo is an error, not a new key)."""
    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for depth, part in enumerate(path[:-1]):
            nxt = node.get(part) if isinstance(node, dict) else None
            if nxt is None:
                nxt = node[part] = {} if isinstance(node, dict) else None
            if not isinstance(nxt, dict):
                raise ParamsError(f"--set {text!r}: {'.'.join(path[: depth + 1])} is not a section")
            node = nxt
        node[path[-1]] = value
    return out


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Map dotted key paths of a YAML document to their 1-based line numbers."""
    lines: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, prefix: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                path = (*prefix, str(key_node.value))
                lines[path] = key_node.start_mark.line + 1
                walk(value_node, path)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                path = (*prefix, str(index))
                lines[path] = item.start_mark.line + 1
                walk(item, path)

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return lines
    if root is not None:
        walk(root, ())
    return lines


def _model_at(loc: tuple[str, ...]) -> type[BaseModel] | None:
    """The params model class found at a validation-error location (list indices skipped)."""
    model: type[BaseModel] | None = Params
    for part in loc:
        if model is None or part.isdigit():
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        candidates = [field.annotation, *getattr(field.annotation, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return model


def _named_key(loc: tuple[str, ...], msg: str) -> str | None:
    """The dotted key a section's own check names at the start of its message (`lora.r: ...`), when
    its first part is a key of the section at `loc`; else None."""
    head, sep, _ = msg.partition(": ")
    model = _model_at(loc)
    if not sep or model is None or not all(part.isidentifier() for part in head.split(".")):
        return None
    return head if head.split(".")[0] in model.model_fields else None


def _format_errors(exc: ValidationError, source: str, lines: dict[tuple[str, ...], int]) -> str:
    messages = []
    for error in exc.errors():
        loc = tuple(str(part) for part in error["loc"])
        msg = error["msg"].removeprefix("Value error, ")
        named = _named_key(loc, msg)
        if named:  # a section's check that names its own key ("discopop_tau: ..."): the key's full path and its line
            loc, msg = loc + tuple(named.split(".")), msg.removeprefix(f"{named}: ")
        key = ".".join(loc) or "<top level>"
        line = next((lines[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in lines), None)
        where = f"{source}:{line}" if line else source
        if error["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            hint = f" (expected one of: {', '.join(sorted(parent.model_fields))})" if parent else ""
            messages.append(f"{where}: {key}: unknown key{hint}")
        elif error["type"] == "missing":
            messages.append(f"{where}: {key}: required key is missing")
        else:
            got = error.get("input")
            shown = "" if isinstance(got, dict) or named else f" (got {got!r})"
            messages.append(f"{where}: {key}: {msg}{shown}")
    return "\n".join(messages)


def validate(data: dict[str, Any], source: str = PARAMS_FILE, text: str | None = None) -> Params:
    """Validate a params mapping, raising `ParamsError` that names every bad key."""
    try:
        return Params.model_validate(data)
    except ValidationError as exc:
        lines = _key_lines(text) if text else {}
        raise ParamsError(_format_errors(exc, source, lines)) from None


def _shown(path: Path) -> str:
    """A path as the user would type it: relative to the current directory when inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def load(root: Path | str = ".", overlays: list[Path | str] = (), overrides: list[str] = ()) -> tuple[Params, dict[str, Any]]:
    """Load `<root>/params.yaml`, merge `--params` overlays and `--set` overrides, validate.

    A relative overlay path is relative to `root` (never to the current directory).
    Returns the typed params and the plain merged mapping (what a run workspace writes out).
    """
    base_path = Path(root) / PARAMS_FILE
    data = read_yaml(base_path)
    validate(data, _shown(base_path), base_path.read_text(encoding="utf-8"))
    for overlay in overlays:
        overlay_path = project_path(overlay, root)
        layer = read_yaml(overlay_path)
        data = deep_merge(data, layer)
        validate(data, _shown(overlay_path), overlay_path.read_text(encoding="utf-8"))
    if overrides:
        data = apply_overrides(data, list(overrides))
        try:
            return Params.model_validate(data), data
        except ValidationError as exc:
            raise ParamsError(_format_errors(exc, "--set", {})) from None
    return validate(data), data
