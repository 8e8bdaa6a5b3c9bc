"""Reading params: `params.yaml` plus overlays (`--params`) and `--set` overrides, merged and
validated into the typed sections of `pipelines.core.params`, with errors that name the file, the
dotted key and, where it can be found, the line::

    params.yaml:57: pretrain.train.lr: Input should be greater than 0 (got -0.001)

A key given twice, bad YAML, an unknown key or a wrong type are `ParamsError`s.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from pipelines.core import dag
from pipelines.core.params.base import INERT_KEY, PARAMS_FILE, ParamsError
from pipelines.core.params.project import Params
from pipelines.core.paths import project_path

log = logging.getLogger("qllm.params")

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


class Layers:
    """Params layers merged in order (`params.yaml`, the `--params` profiles, the `--set`s) and
    validated after each, as `load` reads them. Where a key is refused as inert (`base.INERT_KEY`)
    only because a later layer changed what decides it (a profile's `lora.adapter.r` under
    `--set lora.allocation=quantum_opt`), the key goes back to its default with a warning: the later
    layer's choice stands, as it would have with the key unset. A key given in the same layer as its
    switch, or after it, stays an error: that is a setting that would change nothing."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.sources: list[str] = []
        self._by: dict[tuple[str, ...], int] = {}  # the layer that last set each key path

    def merge(self, source: str, layer: dict[str, Any]) -> Params:
        """Merge a mapping layer (a params file) and validate; raises pydantic's `ValidationError`."""
        self.sources.append(source)
        self._record(layer, ())
        self.data = deep_merge(self.data, layer)
        return self._validate()

    def override(self, overrides: list[str]) -> Params:
        """Apply `--set`s, one layer, and validate; raises pydantic's `ValidationError`."""
        self.sources.append("--set")
        for text in overrides:
            path, value = parse_override(text)
            self._by = {key: by for key, by in self._by.items() if key[: len(path)] != tuple(path)}  # --set replaces what was under it
            self._record(value, tuple(path))
        self.data = apply_overrides(self.data, list(overrides))
        return self._validate()

    def _record(self, value: Any, prefix: tuple[str, ...]) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                self._record(item, (*prefix, str(key)))
        else:
            self._by[prefix] = len(self.sources) - 1

    def _layer_of(self, path: tuple[str, ...]) -> int:
        """The last layer that set `path`, a key above it or one below it; -1 where none did (a default)."""
        n = len(path)
        return max((by for key, by in self._by.items() if key[:n] == path or path[: len(key)] == key), default=-1)

    def _validate(self) -> Params:
        left_at_default: dict[tuple[str, str], list[str]] = {}
        for _ in range(len(self._by) + 1):  # each pass puts at least one key back
            try:
                params = Params.model_validate(self.data)
            except ValidationError as exc:
                if any(not self._put_back(error, left_at_default) for error in exc.errors()):
                    raise
                continue
            for (source, switches), keys in left_at_default.items():
                log.warning("%s: not read with %s, so left at their defaults: %s", source, switches, ", ".join(keys))
            return params
        raise AssertionError("unreachable: each pass puts at least one key back")

    def _put_back(self, error: Any, left_at_default: dict[tuple[str, str], list[str]]) -> bool:
        """Put an inert key that a later layer made inert back at its default; False for any other error."""
        ctx = error.get("ctx") or {}
        if error["type"] != INERT_KEY:
            return False
        section = tuple(str(part) for part in error["loc"])
        key = (*section, *ctx["key"].split("."))
        deciding = [(*section, name) for name in ctx["deciding"]]
        by, switched = self._layer_of(key), max((self._layer_of(d) for d in deciding), default=-1)
        if by >= switched:
            return False
        switches = ", ".join(f"{'.'.join(d)}: {_value(_get(self.data, d))} ({self.sources[self._layer_of(d)]})" for d in deciding if self._layer_of(d) >= 0)
        left_at_default.setdefault((self.sources[by], switches), []).append(f"{'.'.join(key)} ({_value(ctx['default'])})")
        self.data = _put(self.data, key, copy.deepcopy(ctx["default"]))
        self._by[key] = switched
        return True


def _value(value: Any) -> str:
    """A value as params.yaml writes it (`quantum_opt`, `true`, `[2, 4]`)."""
    return value if isinstance(value, str) else json.dumps(value)


def _get(data: dict[str, Any], path: tuple[str, ...]) -> Any:
    for part in path:
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _put(data: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(data)
    node = out
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value
    return out


def load(root: Path | str = ".", overlays: list[Path | str] = (), overrides: list[str] = ()) -> tuple[Params, dict[str, Any]]:
    """Load `<root>/params.yaml`, merge `--params` overlays and `--set` overrides, validate.

    A relative overlay path is relative to `root` (never to the current directory). Each layer is
    validated as it is merged, and errors name the layer, key and line; a key that an earlier layer
    set and a later one made inert goes back to its default with a warning (`Layers`).
    Returns the typed params and the plain merged mapping (what a run workspace writes out).
    """
    layers = Layers()
    for path in [Path(root) / PARAMS_FILE, *(project_path(overlay, root) for overlay in overlays)]:
        try:
            params = layers.merge(_shown(path), read_yaml(path))
        except ValidationError as exc:
            raise ParamsError(_format_errors(exc, _shown(path), _key_lines(path.read_text(encoding="utf-8")))) from None
    if overrides:
        try:
            params = layers.override(list(overrides))
        except ValidationError as exc:
            raise ParamsError(_format_errors(exc, "--set", {})) from None
    return params, layers.data
