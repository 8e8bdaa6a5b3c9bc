"""benchmarks/ by theme, tools/ beside it (issue 79): no measurement loose at benchmarks/'s top,
each theme a package whose `__init__.py` says what it measures, and the scaffolding the benchmarks
used to repeat (the machine line, the per-seed loop, the mean ± sd summary) in
benchmarks/common.py alone, and used from there."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

BENCHMARKS, TOOLS = REPO / "benchmarks", REPO / "tools"
THEMES = ("speed", "peers", "quality", "adapters", "scale", "serving")
TOP = {"__init__.py", "common.py", "RESULTS.md", "results", *THEMES}
CENTRAL = {"cpu", "cpu_name", "cpu_kind", "cpu_flags", "cpuinfo", "machine_line", "per_seed", "sd", "mean_sd", "spread", "_spread"}
"""What benchmarks/common.py defines, or what a copy of it was called: no other module may define one."""


def modules() -> list[Path]:
    return sorted(p for top in (BENCHMARKS, TOOLS) for p in top.rglob("*.py") if "__pycache__" not in p.parts)


def docstring_only(path: Path) -> str | None:
    """The module's docstring if that is all it holds, else None."""
    tree = ast.parse(path.read_text())
    only = len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr)
    return ast.get_docstring(tree) if only else None


def test_the_top_of_benchmarks_holds_no_loose_measurement():
    loose = sorted(p.name for p in BENCHMARKS.iterdir() if p.name not in TOP and p.name != "__pycache__")
    assert not loose, f"benchmarks/ holds only the shared helper, RESULTS.md, results/ and the themes; move {loose} into a theme (or tools/)"


def test_every_theme_and_tools_is_a_package_that_says_what_it_holds():
    for folder in [*(BENCHMARKS / theme for theme in THEMES), TOOLS]:
        init = folder / "__init__.py"
        assert init.is_file(), f"{folder.relative_to(REPO)}: no __init__.py"
        text = docstring_only(init)
        assert text and len(text.split()) >= 20, f"{init.relative_to(REPO)}: a paragraph saying what it measures, and nothing else"
        assert [p for p in folder.glob("*.py") if p.name != "__init__.py"], f"{folder.relative_to(REPO)}: empty"
    assert not [p for p in BENCHMARKS.glob("*/*/") if p.name != "__pycache__"], "one level of themes"


def test_the_tests_mirror_the_themes_and_tools():
    for folder in [*(BENCHMARKS / theme for theme in THEMES), TOOLS]:
        mirror = REPO / "tests" / folder.relative_to(REPO)
        for test in mirror.glob("test_*.py"):
            name = test.stem.removeprefix("test_").removesuffix("_bench")
            assert (folder / f"{name}.py").exists() or (folder / f"{name}.sh").exists(), f"{test.relative_to(REPO)} tests no module of {folder.relative_to(REPO)}"
    assert (REPO / "tests/tools/__init__.py").exists() and all((REPO / "tests/benchmarks" / t / "__init__.py").exists() for t in THEMES if (REPO / "tests/benchmarks" / t).exists())


def test_the_scaffolding_is_defined_once_in_common():
    for path in modules():
        if path == BENCHMARKS / "common.py":
            continue
        tree = ast.parse(path.read_text())
        defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
        assert not defined & CENTRAL, f"{path.relative_to(REPO)} defines {sorted(defined & CENTRAL)}: use benchmarks.common's"
        stdev = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in ("stdev", "pstdev")]
        assert not stdev, f"{path.relative_to(REPO)}:{stdev[0]}: a standard deviation by hand; benchmarks.common.sd / mean_sd"
        cpuinfo = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value == "/proc/cpuinfo"]
        assert not cpuinfo, f"{path.relative_to(REPO)}:{cpuinfo[0]}: /proc/cpuinfo read again; benchmarks.common.cpu / cpu_name / cpu_flags"


def test_every_helper_of_common_is_used_by_a_benchmark():
    """(or by common itself: `cpu_kind` makes `cpu`)"""
    tree = ast.parse((BENCHMARKS / "common.py").read_text())
    within = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    public = {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and node.name not in within}
    used: set[str] = set()
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "benchmarks.common":
                used |= {alias.name for alias in node.names}
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "common":
                used.add(node.attr)
    assert public <= used, f"benchmarks/common.py: {sorted(public - used)} used by no benchmark"
