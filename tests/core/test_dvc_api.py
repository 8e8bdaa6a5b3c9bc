"""pipelines/core/dvc_api.py is the one door to DVC: nothing else imports it, and the private
names it needs exist in the DVC installed, which is one of the versions pyproject.toml pins."""

from __future__ import annotations

import ast
import inspect
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from pipelines.core import dvc_api

REPO = Path(__file__).resolve().parents[2]
DVC_PACKAGES = {"dvc", "dvc_data", "dvc_objects"}


def test_only_dvc_api_imports_dvc():
    importers = []
    for path in (REPO / "pipelines").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else [a.name for a in getattr(node, "names", [])] if isinstance(node, ast.Import) else []
            if any(n.split(".")[0] in DVC_PACKAGES for n in names):
                importers.append(path.relative_to(REPO).as_posix())
    assert set(importers) == {"pipelines/core/dvc_api.py"}


def test_the_pin_is_the_tested_range_and_the_installed_dvc_is_in_it():
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (pinned,) = [d for d in dependencies if re.match(r"dvc[<>=]", d)]
    assert SpecifierSet(pinned.removeprefix("dvc")) == SpecifierSet(",".join(dvc_api.TESTED))
    assert version("dvc") in SpecifierSet(",".join(dvc_api.TESTED)), f"DVC {version('dvc')} is not a tested version {dvc_api.TESTED}"


def test_the_private_names_used_are_there_with_the_signatures_used():
    from dvc.dependency import param
    from dvc.stage import cache

    assert list(inspect.signature(cache._can_hash).parameters) == ["stage"]
    assert list(inspect.signature(cache._get_stage_hash).parameters) == ["stage"]
    assert list(inspect.signature(param.load_path).parameters)[:2] == ["fs_path", "fs"]
    assert list(inspect.signature(param.read_param_file).parameters) == ["fs", "path", "key_paths", "flatten", "load_kwargs"]  # DVC's, also once wrapped
    from dvc import output

    assert list(inspect.signature(output.Output._build).parameters) == ["self", "args", "no_progress_bar", "kwargs"]  # DVC's, also once wrapped
    assert list(inspect.signature(output.build).parameters)[:4] == ["odb", "path", "fs", "name"]  # what _build calls: (odb, fs_path, fs, hash_name)
    from dvc.stage import serialize
    from dvc.utils import strictyaml
    from dvc.utils.serialize import _yaml

    assert list(inspect.signature(strictyaml.load).parameters) == ["path", "schema", "fs", "encoding", "round_trip"]  # DVC's, also once wrapped
    assert list(inspect.signature(_yaml.parse_yaml).parameters)[:2] == ["text", "path"]
    assert list(inspect.signature(_yaml._dump).parameters) == ["data", "stream"]
    assert list(inspect.signature(serialize.to_lockfile).parameters)[0] == "stage"


def test_a_run_workspace_gets_the_projects_remotes_at_their_levels_with_absolute_paths(tmp_path):
    """Run workspaces (`.qllm/runs/<hash>`) push and restore as the project does: they carry its
    remotes and default remote; a relative local path names the same place from the workspace;
    credentials stay in config.local."""
    from configobj import ConfigObj

    (tmp_path / ".dvc").mkdir()
    (tmp_path / ".dvc" / "config").write_text("[core]\n    remote = team\n    analytics = false\n['remote \"team\"']\n    url = ../../storage\n")
    (tmp_path / ".dvc" / "config.local").write_text("['remote \"team\"']\n    password = s3cret\n")
    files = dvc_api.workspace_config(tmp_path, tmp_path / "cache")
    repo, local = (ConfigObj(text.splitlines()) for text in (files["config"], files["config.local"]))
    assert repo["core"] == {"no_scm": "true", "remote": "team"} and repo["cache"] == {"dir": str(tmp_path / "cache")}
    assert repo['remote "team"'] == {"url": str((tmp_path / ".dvc" / "../../storage").resolve())}
    assert local['remote "team"'] == {"password": "s3cret"}
    (tmp_path / ".dvc" / "config").write_text("")
    (tmp_path / ".dvc" / "config.local").unlink()
    assert dvc_api.workspace_config(tmp_path, tmp_path / "cache") == {"config": f"[core]\n    no_scm = true\n[cache]\n    dir = {tmp_path / 'cache'}\n"}


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_a_run_workspace_keeps_the_remotes_credentials_owner_only(project, tmp_path, umask):
    """Outputs follow the umask (a shared checkout reads them), but config.local holds a remote's
    password: copied into a run workspace it stays 0600 whatever the umask, also when it replaces
    a copy that had wider permissions."""
    import os
    import sys

    from pipelines.core import workspace
    from tests.conftest import run

    run([sys.executable, "-m", "dvc", "remote", "add", "-d", "team", "ssh://dvc.example.com/srv/dvc"], project)
    run([sys.executable, "-m", "dvc", "remote", "modify", "--local", "team", "password", "s3cret"], project)
    os.chmod(project / ".dvc" / "config.local", 0o600)
    ws = tmp_path / "ws"
    old = os.umask(umask)
    try:
        workspace._sync(project, ws, {"x": 1})
        assert (ws / ".dvc" / "config.local").stat().st_mode & 0o777 == 0o600
        assert (ws / ".dvc" / "config").stat().st_mode & 0o777 == 0o666 & ~umask  # no secret: as a plain write
        os.chmod(ws / ".dvc" / "config.local", 0o644)  # an older copy, readable by others
        workspace._sync(project, ws, {"x": 1})
        assert (ws / ".dvc" / "config.local").stat().st_mode & 0o777 == 0o600
        assert "s3cret" in (ws / ".dvc" / "config.local").read_text()
    finally:
        os.umask(old)


@pytest.mark.parametrize("analytics_off", [True, False])
def test_the_suites_in_process_dvc_init_makes_what_the_cli_makes(tmp_path, analytics_off):
    """tests/conftest.py `init_dvc` (every test project's `dvc init`, in the test's process) writes
    the files `dvc init` and `dvc config core.analytics false` write, byte for byte, staged alike."""
    import subprocess
    import sys

    from tests.conftest import init_dvc, run

    by_cli, in_process = tmp_path / "cli", tmp_path / "in_process"
    for root in (by_cli, in_process):
        root.mkdir()
        run(["git", "init", "-q"], root)
    run([sys.executable, "-m", "dvc", "init", "-q"], by_cli)
    if analytics_off:
        run([sys.executable, "-m", "dvc", "config", "core.analytics", "false"], by_cli)
    init_dvc(in_process, analytics_off=analytics_off)

    def made(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and ".git" not in p.parts and p.name != "btime"}

    def staged(root: Path) -> str:
        return subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, check=True).stdout

    assert made(in_process) == made(by_cli) and ".dvc/config" in made(by_cli)
    assert staged(in_process) == staged(by_cli)
