"""Extensions: code that joins the training loop at fixed points without editing it.

An extension is an object with no-op methods for the points it cares about (the design notes'
ExtensionManager and hooks; Lightning's and the HF Trainer's callbacks play the same part):

    class GradientNorms(Extension):
        name = "gradient_norms"

        def __init__(self):
            self.norms = []

        def on_gradients(self, state):               # after backward, before clipping
            self.norms.append(...)

        def state_dict(self):                         # saved in every checkpoint ...
            return {"norms": self.norms}

        def load_state_dict(self, state):             # ... and given back on resume
            self.norms = list(state["norms"])

    loop.train(model, loss_fn, batches, cfg, extensions=[GradientNorms()])

The points, in the order they come in a run:

- `on_train_begin(state)`: after a resumed run restored its state (`state.step` is where it goes on)
- `on_gradients(state)`: after backward (and unscaling), before clipping and the optimizer: the
  raw gradients of the step are in `.grad`; never for a batch skipped as non-finite
- `on_optimizer_step(state)`: right after the optimizer and schedule step, before the gradients
  are cleared (`state.step` is still the step's 0-based index): where AdaLoRA-style rank
  allocation reads the step's gradients and masks what the step updated
- `on_step_end(state, metrics)`: after the optimizer step; `metrics` holds the last logged values
- `on_log(state, metrics, step)`: the loop reports metrics at `step`: the training metrics every
  `train.log_every` steps, validation metrics after each evaluation, `train/skipped_nonfinite` when
  a batch is skipped (the metric loggers, `pipelines.core.training.loggers`, implement only this)
- `on_evaluate(state, metrics)`: after validation, with its metrics (`val/loss`, ...)
- `on_save(state, best)`: just before a checkpoint is written (rank 0)
- `on_train_end(state, summary)`: after the last step (and the best weights are back), with the
  summary `train` returns

`close()` is no hook point: it runs once when the loop ends, whether it finished, stopped or failed
(stop threads, close files).

Extensions run in the order given. `state` is the loop's `TrainState`; setting `state.stop = True`
ends training after the current step (early stopping is an extension). `state_dict` and
`load_state_dict` make an extension resume exactly: its state is saved in each checkpoint under its
`name` (unique within a run) and must be what `torch.load(weights_only=True)` reads back (tensors,
numbers, strings, lists, dicts). An exception in an extension stops training with an
`ExtensionError` naming the extension and the point (a stop signal arriving meanwhile stays a
stop signal).

In params, `train.extensions` names the extensions of a training stage, with their settings
(`build`): the built-in ones below by name, others as `package.module:Class`, built with
`Class(context, **settings)` (`ExtensionContext`: the stage, its MLflow tracker, the project root).
A user's plain function named in params the same way (GRPO's reward functions) is imported and
checked against how it will be called by `user_function`, when the params load.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.core.errors import QllmError, StopRequested

HOOKS = ("on_train_begin", "on_gradients", "on_optimizer_step", "on_step_end", "on_log", "on_evaluate", "on_save", "on_train_end")

BUILTIN = {
    "mlflow_metrics": "pipelines.core.training.loggers:MlflowMetrics",
    "tensorboard": "pipelines.core.training.loggers:TensorBoard",
    "system_metrics": "pipelines.core.training.loggers:SystemMetrics",
}
"""The extensions `train.extensions` knows by name (imported only when a run uses them)."""

log = logging.getLogger("qllm.extensions")


class ExtensionError(QllmError, RuntimeError):
    """An extension raised: training stopped (the last checkpoint stays)."""


class Extension:
    """Base class: every hook does nothing; override the ones you need."""

    name: str = "extension"

    def on_train_begin(self, state) -> None:
        """After a resumed run restored its state; `state.step` is where training goes on."""

    def on_gradients(self, state) -> None:
        """After backward, before clipping and the optimizer: `.grad` holds the step's raw gradients."""

    def on_optimizer_step(self, state) -> None:
        """After the optimizer and schedule step, before `zero_grad`: `.grad` still holds the step's
        (clipped) gradients; `state.step` is the 0-based index of this step."""

    def on_step_end(self, state, metrics: dict[str, float]) -> None:
        """After the optimizer step; `metrics`: the last logged values."""

    def on_log(self, state, metrics: dict[str, float], step: int) -> None:
        """The loop reports `metrics` at `step` (training, validation, a skipped batch)."""

    def on_evaluate(self, state, metrics: dict[str, float]) -> None:
        """After validation, with its metrics (`val/loss`, ...)."""

    def on_save(self, state, best: bool) -> None:
        """Just before a checkpoint is written (rank 0); `best`: at a new best validation loss."""

    def on_train_end(self, state, summary: dict[str, Any]) -> None:
        """After the last step (best weights restored), with the summary `train` returns."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what `state_dict` returned (a resumed run)."""

    def close(self) -> None:
        """Release what the extension holds (threads, files); called once however the loop ends."""


class Hook(Extension):
    """One function at one point, for timing and tests: `Hook("on_step_end", lambda state, metrics: ...)`."""

    def __init__(self, point: str, function, name: str | None = None) -> None:
        if point not in HOOKS:
            raise ValueError(f"unknown extension point {point!r} (expected one of: {', '.join(HOOKS)})")
        self.name = name or f"hook:{point}"
        setattr(self, point, function)


class Extensions:
    """The extensions of one run, called in order at each point."""

    def __init__(self, extensions: Sequence[Extension], desc: str = "train") -> None:
        self.items = list(extensions)
        self.desc = desc
        names = [extension.name for extension in self.items]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ExtensionError(f"{desc}: extension names must be unique within a run (their state is saved by name): {', '.join(repeated)}")
        # only the hooks some extension overrides are called: a run without extensions pays nothing per step
        self.active = {hook: [e for e in self.items if hook in vars(e) or getattr(type(e), hook) is not getattr(Extension, hook)] for hook in HOOKS}

    def __bool__(self) -> bool:
        return bool(self.items)

    def call(self, hook: str, *args: Any) -> None:
        for extension in self.active[hook]:
            try:
                getattr(extension, hook)(*args)
            except StopRequested:  # a stop signal that arrived while the extension ran: the loop's business
                raise
            except Exception as exc:
                raise ExtensionError(f"{self.desc}: extension {extension.name!r} failed in {hook}: {type(exc).__name__}: {exc}") from exc

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {extension.name: extension.state_dict() for extension in self.items}

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        for extension in self.items:
            if extension.name in state:
                extension.load_state_dict(state[extension.name])

    def close(self) -> None:
        """Close every extension, each even if another fails (the loop may be unwinding an error)."""
        for extension in self.items:
            try:
                extension.close()
            except Exception:
                log.warning("%s: closing extension %r failed", self.desc, extension.name, exc_info=True)


@dataclass(frozen=True)
class ExtensionContext:
    """What an extension named in params is built with."""

    stage: str
    """The stage (or `desc` of a direct `train` call)."""
    tracker: Any = None
    """The stage's MLflow tracker on rank 0 (`pipelines.core.run.tracking.Tracker`), None elsewhere."""
    root: Path | None = None
    """The project root (shared by its run workspaces), None for a direct `train` call."""


def parse(entry: Any, where: str) -> tuple[str, dict[str, Any]]:
    """One `train.extensions` entry, a name or `{name: ..., <settings>}`, as (name, settings)."""
    if isinstance(entry, str):
        name, settings = entry, {}
    elif isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
        name, settings = entry["name"], {k: v for k, v in entry.items() if k != "name"}
    else:
        raise QllmError(f"{where}: expected an extension name or a mapping with 'name' and its settings, got {entry!r}")
    if name not in BUILTIN and ":" not in name:
        raise QllmError(f"{where}: unknown extension {name!r}; built in: {', '.join(BUILTIN)}; others as 'package.module:Class'")
    return name, settings


def resolve(name: str, where: str) -> type:
    """The class behind an extension name (a built-in one or `package.module:Class`)."""
    module_name, _, attribute = BUILTIN.get(name, name).partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise QllmError(f"{where}: cannot import extension {name!r} ({type(exc).__name__}: {exc})") from exc
    if not (isinstance(cls, type) and issubclass(cls, Extension)):
        raise QllmError(f"{where}: {name!r} is not a subclass of pipelines.core.extensions.Extension")
    return cls


def check_settings(cls: type, settings: Mapping[str, Any], where: str) -> None:
    """Settings must be keyword parameters of the class's `__init__` (after the context)."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, context
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return
    accepted = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(settings) - set(accepted))
    if unknown:
        raise QllmError(f"{where}: unknown setting(s) {', '.join(unknown)}; accepted: {', '.join(accepted) or 'none'}")


def build(entries: Sequence[Any], context: ExtensionContext, where: str = "train.extensions") -> list[Extension]:
    """The extensions `train.extensions` names, built in the listed order."""
    built = []
    for index, entry in enumerate(entries):
        at = f"{where}[{index}]"
        name, settings = parse(entry, at)
        cls = resolve(name, at)
        check_settings(cls, settings, f"{at} ({name})")
        try:
            built.append(cls(context, **settings))
        except (TypeError, ValueError) as exc:
            raise QllmError(f"{at} ({name}): {exc}") from exc
    return built


def import_callable(name: str, where: str, what: str = "function") -> Callable[..., Any]:
    """`package.module:function` imported and callable; each failure a `QllmError` naming `where`."""
    module_name, sep, attribute = name.partition(":")
    if not sep or not module_name or not attribute:
        raise QllmError(f"{where}: {name!r} is not `package.module:function`")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise QllmError(f"{where}: cannot import module {module_name!r} ({exc}); is it on PYTHONPATH or installed?") from None
    fn = getattr(module, attribute, None)
    if fn is None:
        raise QllmError(f"{where}: module {module_name!r} has no {attribute!r}")
    if not callable(fn):
        raise QllmError(f"{where}: {name!r} is a {type(fn).__name__}, not a {what}")
    return fn


def describe(fn: Callable[..., Any], where: str) -> dict[str, Any]:
    """`fn` as a tool's JSON schema, made from its type hints and Google-style docstring by
    transformers' `get_json_schema` (what `apply_chat_template(tools=[fn])` and TRL's tools use);
    a `QllmError` naming `where` if it cannot be made."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:  # noqa: BLE001 - transformers raises several kinds: each is the same user error
        raise QllmError(f"{where}: {getattr(fn, '__name__', fn)!r} cannot be described to the model ({exc}); a tool needs type hints on "
                        "every argument and a Google-style docstring with a line per argument (`Args:`)") from None  # fmt: skip


ENVIRONMENT_HOOKS = ("reset", "reward")
"""An environment class's methods that are not tools: `reset(record)` and `reward()`."""


def environment_tools(name: str, where: str) -> tuple[Callable[[], Any], list[dict[str, Any]]]:
    """A user's environment class `package.module:Class` (`tools.environment`): (the class, the
    JSON schemas of its tools, one per public method other than `ENVIRONMENT_HOOKS`, described from
    a new instance's bound methods). Each failure a `QllmError` naming `where`."""
    cls = import_callable(name, where, what="environment class")
    try:
        instance = cls()
    except Exception as exc:  # noqa: BLE001 - any failure to construct is the same user error
        raise QllmError(f"{where}: {name} could not be constructed with no arguments ({type(exc).__name__}: {exc})") from None
    names = public_methods(instance)
    if not names:
        raise QllmError(f"{where}: {name} has no public method to offer as a tool (its methods other than {', '.join(ENVIRONMENT_HOOKS)})")
    return cls, [describe(getattr(instance, method), f"{where} ({name}.{method})") for method in names]


def public_methods(instance: Any) -> list[str]:
    """The tools of an environment instance: its public methods other than `ENVIRONMENT_HOOKS`, sorted."""
    return sorted(n for n in dir(type(instance)) if not n.startswith("_") and n not in ENVIRONMENT_HOOKS and callable(getattr(instance, n)))


def user_function(name: str, where: str, required: Sequence[str], given: Sequence[str], what: str = "function") -> Callable[..., Any]:
    """`package.module:function` imported, callable, taking every name of `required` and
    `**kwargs` (it is called with keywords), and requiring nothing outside `given`; each failure a
    `QllmError` naming `where` and what was expected."""
    fn = import_callable(name, where, what)
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn  # a builtin or C function: nothing to inspect
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    missing = [n for n in required if n not in parameters and not takes_any]
    if missing:
        raise QllmError(f"{where}: {name!r} must take ({', '.join(required)}, **kwargs); it lacks {', '.join(missing)}")
    if not takes_any:
        raise QllmError(f"{where}: {name!r} must accept **kwargs: it is called with keywords ({', '.join(given)}, ...)")
    unknown = [n for n, p in parameters.items() if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in given]
    if unknown:
        raise QllmError(f"{where}: {name!r} requires {', '.join(unknown)}, which it would not be given (it gets {', '.join(given)})")
    return fn


# ---------------------------------------------------- the plug-ins params name: rewards and tools


BUILT_IN_REWARDS = ("exact_match", "strict_match", "format", "environment")
"""The reward functions `pipelines.core.rl.rewards` has built in."""


REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "answer", "id", "source", "split",
                    "candidates", "environments")
"""What a reward function is called with: TRL's arguments and the records' columns (the prepared
chat records' `id`, `source`, `split`, and `answer`, the reference), `candidates` (the answers of
the question's group), and in episodes with `grpo.tools.environment`, `environments` (each
completion's environment instance, as TRL's)."""


def user_reward(name: str, where: str):
    """None for a built-in reward's name; else the user's `package.module:function`, imported and
    checked against how it will be called (`REWARD_ARGUMENTS`); a `QllmError` naming `where` if it
    is neither. Used when params load and by `pipelines.core.rl.rewards.load`."""
    if name in BUILT_IN_REWARDS:
        return None
    if name == "flexible_match":
        raise QllmError(f"{where}: flexible_match is evaluate's lenient score: as a reward, an answer naming every candidate (\"Pelora, Dunmar or "
                        "Kestwick\") scores 1 and the policy learns to list them; use strict_match, the same score that gives 0 when another "
                        "candidate answer of the question's group is named")  # fmt: skip
    if ":" not in name:
        if Path(name).is_dir() or name.count("/") == 1:
            raise QllmError(f"{where}: {name!r} looks like a reward model (a directory or hub id): grpo takes reward functions only, not TRL's "
                            "reward models; load the model in a `package.module:function` of your own and return its scores")  # fmt: skip
        raise QllmError(f"{where}: {name!r} is neither a built-in reward ({', '.join(BUILT_IN_REWARDS)}) nor `package.module:function`")
    fn = user_function(name, where, required=("prompts", "completions"), given=REWARD_ARGUMENTS, what="reward function")
    if any(c.__name__ == "Module" and c.__module__.startswith("torch.nn") for c in type(fn).__mro__):
        raise QllmError(f"{where}: {name!r} is a torch module (a reward model): grpo takes reward functions only, not TRL's reward models; "
                        "call the model in a function of your own and return its scores")  # fmt: skip
    return fn


BUILT_IN_TOOLS = ("calculator", "lookup")


def user_tool(name: str, where: str):
    """None for a built-in tool the params can name; else the user's `package.module:function`,
    imported and described as a JSON schema (`describe`); a `QllmError` naming `where`
    if it is neither. Used when params load and by `pipelines.core.rl.tools.load`."""
    if name == "calculator":
        return None
    if name == "lookup":
        raise QllmError(f"{where}: the lookup tool answers from a table the data provides, and no params key gives one yet; "
                        "write a `package.module:function` tool that holds your table")  # fmt: skip
    if ":" not in name:
        raise QllmError(f"{where}: {name!r} is neither a built-in tool ({', '.join(BUILT_IN_TOOLS)}) nor `package.module:function`")
    fn = import_callable(name, where, what="tool function")
    describe(fn, where)
    return fn
