"""Tools and environments for agentic GRPO (issue 55): what a model may call inside a rollout.

    calculator = load("calculator")                       # built in
    lookup = load("lookup", table={"Tovik": "Pelora"})    # built in, over a table the data gives
    mine = load("mypkg.tools:weather")                    # a user's, `package.module:function`
    env = ToolEnvironment([calculator, mine], timeout=5.0)
    env.reset(record)
    observation = env.step(ToolCall("calculator", {"expression": "123 * 457"}))  # Observation("56211")

A **tool** is a Python function with type hints and a Google-style docstring, as TRL's
`GRPOTrainer(tools=[...])` and transformers' `apply_chat_template(tools=[...])` take one: its JSON
schema (`Tool.schema`, the `{"type": "function", "function": {...}}` that chat templates render)
is made from them by `transformers.utils.get_json_schema`, and a function it cannot describe is
refused when it loads, naming the function.

An **environment** holds one episode's state (OpenEnv's and TRL's `environment_factory` shape):
`ToolEnvironment` is the stateless one over the `functions`; `UserEnvironment` wraps a user's class
(`tools.environment`), whose public methods are tools and whose `reward()` the `environment` reward
reads (`environments` gives a stage both):

    class Environment(Protocol):
        tools: list[Tool]                           # what the model is told it may call
        def reset(self, record: dict) -> str | None # a new episode on a data record; optional text for the first turn
        def step(self, call: ToolCall) -> Observation
        def reward(self) -> float | None            # the episode's own reward (None: none), for the `environment` reward

`ToolEnvironment` is the stateless one: each step runs the named tool. A call never stops a run:
an unknown tool, arguments that do not fit the schema, a tool that raises, one that runs past
`timeout` seconds and one that returns something that is neither text nor JSON each come back as
an `Observation` with `error` set (the model reads the message; the rollout logs the kind). A
call past its time is abandoned, not killed: Python cannot stop a thread, so a tool that may hang
for good should bound itself (a socket timeout, a subprocess).

**Tool calls in text** (`parse_tool_calls`) follow the chat template's own format:

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call
  (Qwen2.5, Hermes 2/3);
- `llama3`: the message is one JSON object `{"name": ..., "parameters": {...}}` (Llama 3.1-3.3's
  JSON tool calling), optionally after `<|python_tag|>`.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipelines.core import extensions
from pipelines.core.data import layouts
from pipelines.core.errors import QllmError
from pipelines.core.extensions import user_tool
from pipelines.core.params.rl import ToolsParams

log = logging.getLogger("qllm.tools")


class ToolError(QllmError, ValueError):
    """A tool that cannot be loaded or described (raised when params load, before any training)."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Observation:
    """What a call gives back to the model (`content`, rendered as a `tool` message), and `error`:
    None, or the kind of failure (`ERRORS`) for the rollout's counts."""

    content: str
    error: str | None = None


ERRORS = ("unknown_tool", "bad_arguments", "raised", "timeout", "bad_result")
"""The kinds of a failed call, as `Observation.error` names them."""

MAX_RESULT_CHARS = 2000
"""A tool's answer is cut to this many characters, the cut said at its end (`truncated`), and the
call marked `bad_result`: one call must not fill memory. An episode then bounds what a turn's
answers take in tokens (`episodes.fit_answers`)."""


def truncated(shown: str, kept: int, total: int, unit: str) -> str:
    """`shown`, the first `kept` of an answer's `total` `unit`s, with the cut said at its end, so the
    model reads that the answer goes on."""
    return f"{shown} [truncated: {kept} of {total} {unit}]"


@dataclass(frozen=True)
class Tool:
    """A function the model may call, with the JSON schema chat templates render."""

    name: str
    schema: dict[str, Any]
    fn: Callable[..., Any]

    @classmethod
    def from_function(cls, fn: Callable[..., Any], where: str) -> Tool:
        """The schema from `fn`'s type hints and Google-style docstring (`extensions.describe`:
        transformers' `get_json_schema`, what `apply_chat_template(tools=[fn])` uses); a
        `ToolError` naming `where` if it cannot be made."""
        try:
            schema = extensions.describe(fn, where)
        except QllmError as exc:
            raise ToolError(str(exc)) from None
        return cls(schema["function"]["name"], schema, fn)

    @property
    def parameters(self) -> dict[str, Any]:
        return self.schema["function"].get("parameters", {})


# ---------------------------------------------------------------------------------------------
# Built-in tools

CALCULATOR_LIMITS = {"chars": 256, "nodes": 64, "bits": 4096, "exponent": 64}
"""The calculator's bounds: the expression's length, its syntax-tree nodes, an integer's size in
bits (inputs and every partial result: about 1,233 decimal digits) and the largest exponent."""

_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b, ast.Pow: lambda a, b: a**b,
}  # fmt: skip


def _bounded(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > CALCULATOR_LIMITS["bits"]:
        raise ValueError(f"a number past {CALCULATOR_LIMITS['bits']} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    return value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _evaluate(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            if right != int(right) or abs(right) > CALCULATOR_LIMITS["exponent"]:
                raise ValueError(f"an exponent must be a whole number from -{CALCULATOR_LIMITS['exponent']} to {CALCULATOR_LIMITS['exponent']}")
            if isinstance(left, int) and left.bit_length() * abs(int(right)) > CALCULATOR_LIMITS["bits"]:
                raise ValueError(f"a number past {CALCULATOR_LIMITS['bits']} bits")
            right = int(right)
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ValueError("division by zero")
        try:
            return _bounded(_OPERATORS[type(node.op)](left, right))
        except OverflowError:
            raise ValueError("the result is too large") from None
    what = type(node).__name__ if not isinstance(node, ast.Constant) else f"the constant {node.value!r}"
    raise ValueError(f"{what} is not arithmetic (numbers, + - * / // % ** and parentheses only)")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses.

    Args:
        expression: The expression, for example "123 * 457 + 89".
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be text, got {type(expression).__name__}")
    if len(expression) > CALCULATOR_LIMITS["chars"]:
        raise ValueError(f"the expression has {len(expression)} characters; at most {CALCULATOR_LIMITS['chars']}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > CALCULATOR_LIMITS["nodes"]:
        raise ValueError(f"the expression is too long (more than {CALCULATOR_LIMITS['nodes']} parts)")
    value = _evaluate(tree.body)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.12g}"
    return str(value)


def lookup_tool(table: Mapping[str, str], name: str = "lookup") -> Tool:
    """A tool that answers a key with its value in `table` (one the data provides), case- and
    space-insensitively; an unknown key is an error the model reads."""
    keys = {" ".join(str(k).split()).casefold(): str(v) for k, v in table.items()}

    def lookup(key: str) -> str:
        """Look a key up in the table.

        Args:
            key: The key to look up.
        """
        found = keys.get(" ".join(str(key).split()).casefold())
        if found is None:
            raise KeyError(f"no entry for {key!r}")
        return found

    lookup.__name__ = name
    return Tool.from_function(lookup, name)


BUILT_IN = ("calculator", "lookup")
"""The built-in tools (`BUILT_IN_TOOLS`: the names params accept without importing anything)."""


def load(spec: str, where: str = "tools", table: Mapping[str, str] | None = None) -> Tool:
    """A built-in tool by name (`lookup` with the data's `table`), or a user's `package.module:function`
    (`user_tool`: what params accept)."""
    if spec == "lookup" and table is not None:
        return lookup_tool(table)
    try:
        fn = user_tool(spec, where)
    except QllmError as exc:
        raise ToolError(str(exc)) from None
    return Tool.from_function(calculator if fn is None else fn, where)


# ---------------------------------------------------------------------------------------------
# Calling a tool

_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
                                            "array": (list,), "object": (dict,)}  # fmt: skip


def argument_problem(tool: Tool, arguments: Any) -> str | None:
    """Why `arguments` do not fit `tool`'s schema (required names, no unknown ones, JSON types), or None."""
    if not isinstance(arguments, dict):
        return f"arguments must be an object, got {type(arguments).__name__}"
    properties = tool.parameters.get("properties", {})
    missing = [name for name in tool.parameters.get("required", []) if name not in arguments]
    if missing:
        return f"missing {', '.join(missing)}"
    unknown = [name for name in arguments if name not in properties]
    if unknown:
        return f"unknown argument {', '.join(unknown)} (it takes {', '.join(properties) or 'none'})"
    for name, value in arguments.items():
        kind = properties[name].get("type")
        kinds = kind if isinstance(kind, list) else [kind]
        allowed = tuple(t for k in kinds if k in _JSON_TYPES for t in _JSON_TYPES[k])
        if allowed and (not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)):
            return f"{name} must be {' or '.join(str(k) for k in kinds)}, got {type(value).__name__}"
    return None


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def call(tools: Mapping[str, Tool], tool_call: ToolCall, timeout: float) -> Observation:
    """Run `tool_call` with a time limit; every failure is an `Observation` with `error` set."""
    tool = tools.get(tool_call.name)
    if tool is None:
        return Observation(f"error: no tool named {tool_call.name!r} (there are: {', '.join(sorted(tools)) or 'none'})", "unknown_tool")
    problem = argument_problem(tool, tool_call.arguments)
    if problem:
        return Observation(f"error: {tool.name}: {problem}", "bad_arguments")
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = tool.fn(**tool_call.arguments)
        except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's observation, never the run's end
            outcome["error"] = exc

    worker = threading.Thread(target=run, name=f"qllm-tool-{tool.name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return Observation(f"error: {tool.name} did not answer within {timeout:g} s", "timeout")
    if "error" in outcome:
        exc = outcome["error"]
        return Observation(f"error: {tool.name}: {str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else exc}", "raised")
    try:
        text = _as_text(outcome["value"])
    except (TypeError, ValueError):
        return Observation(f"error: {tool.name} returned a {type(outcome['value']).__name__}, which is neither text nor JSON", "bad_result")
    if len(text) > MAX_RESULT_CHARS:
        room = MAX_RESULT_CHARS - len(truncated("", MAX_RESULT_CHARS, len(text), "characters"))
        return Observation(truncated(text[:room], room, len(text), "characters"), "bad_result")
    return Observation(text)


class Environment(Protocol):
    """One episode's world: the tools it offers, a reset per data record, a step per tool call."""

    tools: list[Tool]

    def reset(self, record: dict[str, Any]) -> str | None: ...

    def step(self, call: ToolCall) -> Observation: ...

    def reward(self) -> float | None: ...


class ToolEnvironment:
    """The stateless environment: each step runs the named tool (`call`), none gives a reward."""

    def __init__(self, tools: Sequence[Tool], timeout: float = 5.0) -> None:
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ToolError(f"tools: two tools share a name ({', '.join(sorted({n for n in names if names.count(n) > 1}))})")
        self.tools = list(tools)
        self.timeout = timeout
        self._by_name = {t.name: t for t in tools}

    def reset(self, record: dict[str, Any]) -> str | None:
        return None

    def step(self, call_: ToolCall) -> Observation:
        return call(self._by_name, call_, self.timeout)

    def reward(self) -> float | None:
        return None


class UserEnvironment(ToolEnvironment):
    """A user's environment class (`tools.environment`) around one new instance: its public methods
    (other than `reset` and `reward`) are tools beside `functions`, called as any tool (`call`: a time
    limit, every failure an observation); `reset(record)` and `reward()` are the instance's own, if
    it has them. A `reward()` that raises or returns no number is logged and gives None (not scored),
    as a tool's failure never stops the run. A call past its time is abandoned while it may still
    change the instance: a method that can hang should bound itself."""

    def __init__(self, instance: Any, functions: Sequence[Tool], timeout: float, where: str = "tools.environment",
                 described: Sequence[Tool] | None = None) -> None:  # fmt: skip
        """`described`: the tools of an earlier instance of the same class (`environments`), whose
        schemas are reused with this instance's methods: described once, not once per episode."""
        if described is None:
            methods = [Tool.from_function(getattr(instance, name), f"{where} ({type(instance).__name__}.{name})") for name in extensions.public_methods(instance)]
        else:
            methods = [Tool(t.name, t.schema, getattr(instance, t.name)) for t in described[len(functions) :]]
        super().__init__([*functions, *methods], timeout)
        self.instance, self.where = instance, where

    def reset(self, record: dict[str, Any]) -> str | None:
        """The instance's `reset(record)`, if it has one. One that raises stops the run with the
        record named: it is the episode's set-up, not a call the model made."""
        hook = getattr(self.instance, "reset", None)
        if hook is None:
            return None
        try:
            return hook(record)
        except Exception as exc:
            raise QllmError(f"{self.where}: {type(self.instance).__name__}.reset() failed on record {record.get('id')!r} "
                            f"({type(exc).__name__}: {exc})") from exc  # fmt: skip

    def reward(self) -> float | None:
        hook = getattr(self.instance, "reward", None)
        if hook is None:
            return None
        try:
            value = hook()
            return None if value is None else float(value)
        except Exception as exc:  # noqa: BLE001 - the user's code: logged, not scored, the run goes on
            log.warning("%s: %s.reward() failed (%s: %s); the episode is not scored by it", self.where, type(self.instance).__name__, type(exc).__name__, exc)
            return None


def environments(params: ToolsParams, section: str) -> tuple[Callable[[], ToolEnvironment], list[Tool]]:
    """(a new episode's environment, the tools it offers) for `params` at `section` (`grpo.tools`,
    `evaluate.tools`): a `ToolEnvironment` over `functions`, or with `environment` a `UserEnvironment`
    around a new instance of the user's class. Errors name the key."""
    offered = [load(name, f"{section}.functions[{i}]") for i, name in enumerate(params.functions)]
    if params.environment is None:
        return (lambda: ToolEnvironment(offered, params.timeout_seconds)), offered
    where = f"{section}.environment"
    try:  # described when the params loaded (`extensions.environment_tools`): here the class, and one instance for its tools
        cls = extensions.import_callable(params.environment, where, what="environment class")
    except QllmError as exc:
        raise ToolError(str(exc)) from None

    first = UserEnvironment(cls(), offered, params.timeout_seconds, where)

    def make() -> ToolEnvironment:
        return UserEnvironment(cls(), offered, params.timeout_seconds, where, described=first.tools)

    return make, first.tools


# ---------------------------------------------------------------------------------------------
# Tool calls in the model's text

STYLES = ("hermes", "llama3")


@dataclass(frozen=True)
class Parsed:
    """A turn read for tool calls: the calls, the text outside them, and `failure` (why a call
    that was begun could not be read; None when every call parsed or there was none)."""

    calls: list[ToolCall]
    text: str
    failure: str | None = None


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _calls_from(text: str) -> list[ToolCall]:
    """The calls in one JSON value of a turn, read as ingest reads a record's tool calls
    (`layouts.tool_calls`: `{name, arguments}` or Llama's `parameters`, arguments as an object or
    its JSON text; one call or a list); a `ValueError` saying what is wrong."""
    return [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in layouts.tool_calls(json.loads(text), "in the model's turn")]


def parse_tool_calls(text: str, style: str) -> Parsed:
    """The tool calls in one generated turn, in the chat template's format (`STYLES`)."""
    if style == "hermes":
        calls, failure = [], None
        for body in _HERMES.findall(text):
            try:
                calls.extend(_calls_from(body))
            except ValueError as exc:
                failure = failure or f"<tool_call> block not read: {exc}"
        rest = _HERMES.sub("", text)
        if "<tool_call>" in rest:
            failure = failure or "<tool_call> without </tool_call>"
            rest = rest.split("<tool_call>", 1)[0]
        return Parsed(calls, rest.strip(), failure)
    if style == "llama3":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return Parsed([], text.strip())
        try:
            return Parsed(_calls_from(body), "")
        except ValueError as exc:
            return Parsed([], "", f"JSON tool call not read: {exc}")
    raise ToolError(f"tool-call style {style!r}: expected one of {', '.join(STYLES)}")
