"""The machinery every params section is built on: `Section` (frozen, no unknown keys, no key set
where it would change nothing), the `AppliesWhen` conditions declared on fields, `ParamsError`, and
`field_docs`, which reads what each key means from the string under it in these modules.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pipelines.core.errors import QllmError

PARAMS_FILE = "params.yaml"


class ParamsError(QllmError, ValueError):
    """A params file or override is invalid; the message names the file, key and expectation."""


def _shown(value: Any) -> str:
    """A value as params.yaml writes it (`true`, `null`, `discopop`)."""
    return json.dumps(value) if isinstance(value, (bool, type(None))) else str(value)


@dataclass(frozen=True)
class AppliesWhen:
    """Field metadata: the key acts only when `holds(section)` is true. Set to anything but its default
    where it does not hold, it is refused by `Section` with an error naming the key and `when`, so a
    setting that would change nothing never passes silently. Declared once, on the field:

        discopop_tau: Annotated[float, only_with("loss_type", "discopop")] = Field(0.05, gt=0)

    `keys`: the sub-keys of a nested block the condition governs (`("r",)` for `adapter.r`); empty,
    the whole field. `shows`: keys of the section whose values the error quotes; `hint`: what the
    error adds. tests/core/test_config.py walks every declared field of every section and checks the
    refusal."""

    when: str
    holds: Callable[[Any], bool]
    keys: tuple[str, ...] = ()
    shows: tuple[str, ...] = ()
    hint: str = ""


def only_with(key: str, *values: Any, keys: tuple[str, ...] = (), hint: str = "") -> AppliesWhen:
    """The field acts only when the section's `key` is one of `values`."""
    shown = [_shown(v) for v in values]
    listed = shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"
    return AppliesWhen(f"{key}: {listed}", lambda section: getattr(section, key) in values, keys, (key,), hint)


WHEN_ENABLED = only_with("enabled", True, hint="to switch a block off, give it whole: `{enabled: false}` "
                                              "(e.g. --set 'dpo.adapter={enabled: false}')")  # fmt: skip
"""The settings of a block switched by its own `enabled`."""


INERT_KEY = "inert_key"
"""The pydantic error type of a key set where it would change nothing; its context names the `key`
(dotted, within the section), the `deciding` keys and the key's `default`."""


def applies_when(info) -> list[AppliesWhen]:
    """The conditions declared on a field (`FieldInfo.metadata`)."""
    return [m for m in info.metadata if isinstance(m, AppliesWhen)]


def _leaves(value: Any, prefix: str) -> dict[str, Any]:
    """A value's leaves by dotted key: a nested section's keys, or the value itself under `prefix`."""
    if isinstance(value, BaseModel):
        return {key: leaf for name in type(value).model_fields for key, leaf in _leaves(getattr(value, name), f"{prefix}.{name}").items()}
    return {prefix: value}


class Section(BaseModel):
    """Base of every params section: frozen, no unknown keys, no bool-for-number mix-ups, and no key
    set where it would change nothing (`AppliesWhen`). What a key means is the string under it
    (`field_docs`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info) -> Any:
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and annotation in (int, float):
            raise ValueError(f"expected a number, got a boolean ({value})")
        return value

    @model_validator(mode="after")
    def _only_what_acts(self) -> Section:
        for name, info in type(self).model_fields.items():
            for condition in applies_when(info):
                if condition.holds(self):
                    continue
                default = info.get_default(call_default_factory=True)
                now, then = _leaves(getattr(self, name), name), _leaves(default, name)
                governed = [f"{name}.{key}" for key in condition.keys] if condition.keys else list(now)
                changed = [key for key in governed if now.get(key) != then.get(key)]
                if changed:
                    here = ", ".join(f"{key} is {_shown(getattr(self, key))}" for key in condition.shows)
                    message = (f"{changed[0]}: applies only with {condition.when}{f' (here {here})' if here else ''}, so here it "
                               f"would change nothing: leave it at its default ({_shown(then.get(changed[0]))})"
                               f"{f'; {condition.hint}' if condition.hint else ''}")  # fmt: skip
                    # the context lets `params_file.load` tell a key a later layer made inert from one given with its switch
                    raise PydanticCustomError(INERT_KEY, "{message}", {"message": message, "key": changed[0],
                                                                      "deciding": list(condition.shows), "default": then.get(changed[0])})  # fmt: skip
        return self


def field_docs(model: type[BaseModel]) -> dict[str, str]:
    """What each key of `model` means: the string under it in its module, cleaned as a docstring (a
    section inherits its bases' keys; where both say, the section's own wins). The params reference
    reads them (docs/hooks.py).

    pydantic can attach these to the fields as it builds each model (`use_attribute_docstrings`),
    but on Python < 3.13 it finds a class's source by asking `inspect.getmodule` about each frame of
    the import, and each asking scans all of `sys.modules`: 1.0 s of CPU in every process that
    imports this module after torch (2-core EPYC, capped to AVX2), and the scan read the deferred
    bitsandbytes' `__file__`, which ran it (1.3 s more; `pipelines.DEFERRED`). Only the docs need
    the text, so it is read from the source when they ask."""
    docs: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if cls.__module__.startswith(PACKAGE):
            docs.update(_docstrings_by_class(cls.__module__).get(cls.__qualname__, {}))
    return {name: doc for name, doc in docs.items() if name in model.model_fields}


PACKAGE = __name__.rpartition(".")[0] + "."
"""`pipelines.core.params.`: the modules whose classes `field_docs` reads."""


@functools.cache
def _docstrings_by_class(module: str) -> dict[str, dict[str, str]]:
    """For each class of a params module, a string literal that follows an annotated name, by name
    (as pydantic's `use_attribute_docstrings` reads them)."""
    found: dict[str, dict[str, str]] = {}
    for node in ast.parse(Path(sys.modules[module].__file__).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef):
            docs, target = found.setdefault(node.name, {}), None
            for statement in node.body:
                value = statement.value if isinstance(statement, ast.Expr) else None
                if target and isinstance(value, ast.Constant) and isinstance(value.value, str):
                    docs[target] = inspect.cleandoc(value.value)
                target = statement.target.id if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) else None
    return found
