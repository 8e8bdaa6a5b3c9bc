"""MkDocs hooks: pages generated at build time, so they cannot drift from their sources.

- `index.md`: the README (its links rewritten for the site);
- `results.md`: `benchmarks/RESULTS.md`, today's headline figures;
- `results/<theme>.md`: `benchmarks/results/<theme>.md`, the detailed page of each theme (the links of both
  rewritten for the site, so they work on GitHub and on the site alike);
- `reference/params.md`: every params key, from the pydantic schemas of `pipelines/core/params/`
  (types, defaults and the attribute docstrings the schemas carry).
"""

from __future__ import annotations

import re
import sys
import types
import typing
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


def _index() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    text = text.replace("](docs/", "](").replace("](benchmarks/RESULTS.md)", "](results.md)")
    return text.replace("](benchmarks/results/", "](results/")


def _results() -> list[tuple[str, str]]:
    """`benchmarks/RESULTS.md` as `results.md`, and each `benchmarks/results/<theme>.md` as `results/<theme>.md`:
    one folder up on the site than in the repository, so their links to the docs, the README and each other move."""
    pages = [("results.md", (ROOT / "benchmarks/RESULTS.md").read_text(encoding="utf-8")
              .replace("](../docs/", "](").replace("](../README.md)", "](index.md)"))]
    for path in sorted((ROOT / "benchmarks/results").glob("*.md")):
        text = path.read_text(encoding="utf-8").replace("](../RESULTS.md", "](../results.md")
        text = text.replace("](../../docs/", "](../").replace("](../../README.md)", "](../index.md)")
        pages.append((f"results/{path.name}", text))
    return pages


def _type(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" if a is not None else "`null`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in args)
    if origin in (list, dict, tuple):
        return f"{origin.__name__}[{', '.join(_type(a) for a in args)}]"
    if annotation is type(None):
        return "`null`"
    return getattr(annotation, "__name__", str(annotation)).replace("|", "\\|")


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if hasattr(value, "model_dump"):
        return "(section)"
    shown = repr(value) if not isinstance(value, str) else f'"{value}"'
    shown = {"None": "null", "True": "true", "False": "false"}.get(shown, shown)
    return "`" + (shown if len(shown) <= 60 else shown[:57] + "...") + "`"


def _models(annotation) -> list:
    from pydantic import BaseModel

    found = []
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            found.append(candidate)
    return found


def _params_page() -> str:
    sys.path.insert(0, str(ROOT))
    from pipelines.core.params.base import applies_when, field_docs
    from pipelines.core.params.project import Params

    out = ["# Parameters", "",
           "Every key of `params.yaml` (and of `--set`, `--params` files), generated from the pydantic schemas in "
           "`pipelines/core/params/` when the site is built: type, default and what it means. A nested section's "
           "keys are listed once, under its schema's name. A key marked *only with ...* acts only under that "
           "condition; set to another value than its default elsewhere, it is refused by name.", ""]  # fmt: skip
    seen, todo = set(), []
    out += ["## Stages", "", "| section | schema | what it is |", "|---|---|---|"]
    for name, field in Params.model_fields.items():
        (model,) = _models(field.annotation)[:1] or [None]
        out.append(f"| `{name}` | [{model.__name__}](#{model.__name__.lower()}) | {((model.__doc__ or '').strip().splitlines() or [''])[0]} |")
        todo.append(model)
    while todo:
        model = todo.pop(0)
        if model in seen:
            continue
        seen.add(model)
        out += ["", f"## {model.__name__}", "", (model.__doc__ or "").strip(), "", "| key | type | default | meaning |", "|---|---|---|---|"]
        docs = field_docs(model)
        for key, field in model.model_fields.items():
            nested = _models(field.annotation)
            kind = ", ".join(f"[{m.__name__}](#{m.__name__.lower()})" for m in nested) or _type(field.annotation)
            only = "; ".join(f"only with {c.when}" + (f" ({', '.join(c.keys)})" if c.keys else "") for c in applies_when(field))
            meaning = re.sub(r"\s+", " ", (f"*{only[0].upper()}{only[1:]}.* " if only else "") + (field.description or docs.get(key, ""))).replace("|", "\\|")
            out.append(f"| `{key}` | {kind} | {_default(field)} | {meaning} |")
            todo += [m for m in nested if m not in seen]
    return "\n".join(out) + "\n"


def on_files(files, config):
    for path, content in (("index.md", _index()), *_results(), ("reference/params.md", _params_page())):
        files.append(File.generated(config, path, content=content))
    return files
