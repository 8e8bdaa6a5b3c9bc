"""The documentation site (mkdocs.yml, docs/) builds with strict link and anchor checks, and its
generated pages say what the code says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_site_builds_strictly_and_the_params_reference_is_the_schemas(tmp_path):
    site = tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=REPO, capture_output=True,
                           text=True, env=os.environ | {"NO_MKDOCS_2_WARNING": "1"}, timeout=300)  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    assert "WARNING" not in built.stderr
    params = (site / "reference/params/index.html").read_text()
    from pipelines.core.params.base import field_docs
    from pipelines.core.params.finetuning import SftParams
    from pipelines.core.params.project import Params
    from pipelines.core.params.training import TrainParams

    for section in Params.model_fields:
        assert f"<code>{section}</code>" in params, section
    assert "loss_chunk_tokens" in params and field_docs(TrainParams)["loss_chunk_tokens"].split()[0] in params
    assert SftParams.__name__ in params
    index = (site / "index.html").read_text()
    assert 'href="data/"' in index and 'href="results/"' in index  # the README's links, made the site's


def test_the_readme_is_one_screenful_and_links_every_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 260
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", readme))
    assert pages <= linked, f"pages the README does not link: {sorted(pages - linked)}"


def test_the_readme_names_every_package_in_one_hop():
    """The README's "Where things are" table names every Python package of the library, the flows
    and the applications: each in its own row, or a sub-package by name in its parent's row."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Where things are") :]
    section = section[: section.index("\n## ")]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w/]+/)` \| (.*) \|$", section, re.M)}
    packages = sorted(p.parent.relative_to(REPO).as_posix() + "/" for top in ("pipelines", "flows", "qllm") for p in (REPO / top).rglob("__init__.py"))
    assert "pipelines/core/rl/" in packages and "qllm/serving/" in packages
    for package in packages:
        parent = package.rstrip("/").rpartition("/")[0] + "/"
        name = package.rstrip("/").rpartition("/")[2] + "/"
        assert package in rows or f"`{name}`" in rows.get(parent, ""), f"README, Where things are: {package} is not in the table"


def test_every_python_dash_m_command_in_the_docs_names_a_module_that_exists():
    """The docs' commands survive moves: each `python -m X` in the README, the docs and the results
    pages names a module (or package with `__main__`) of this repository or an installed package."""
    import importlib.util

    pages = [REPO / "README.md", *(REPO / "docs").glob("*.md"), REPO / "benchmarks/RESULTS.md", *(REPO / "benchmarks/results").glob("*.md")]
    missing = {}
    for page in pages:
        for name in set(re.findall(r"python -m ([A-Za-z_][\w.]*[A-Za-z_\d])", page.read_text())):
            if name.startswith(("pipelines.", "flows.", "qllm.", "benchmarks.", "tools.")):
                found = (REPO / f"{name.replace('.', '/')}.py").is_file() or (REPO / name.replace(".", "/") / "__main__.py").is_file()
            else:
                found = importlib.util.find_spec(name.split(".")[0]) is not None
            if not found:
                missing.setdefault(page.relative_to(REPO).as_posix(), []).append(name)
    assert not missing, missing
