"""Where things are: the project a directory belongs to, and the paths users give relative to it.

Light on purpose (no pydantic, no DVC): the stages that read the world import it on every run.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.core.outputs import read_json

MARKER = ".qllm-workspace.json"
"""In a run workspace (`.qllm/runs/<hash>/`): the project that created it."""


def project_root(path: Path | str = ".") -> Path:
    """The project a directory belongs to: itself, or the project that created the workspace."""
    path = Path(path).resolve()
    marker = path / MARKER
    if marker.exists():
        return Path(read_json(marker)["project_root"])
    return path


def project_path(path: Path | str, root: Path | str) -> Path:
    """A path a user gave on the command line or in params: absolute, or relative to the project
    `root`, never to the current directory. Kept as typed where the two mean the same (root is the
    current directory), so messages show it as the user wrote it."""
    path = Path(path).expanduser()
    if path.is_absolute() or Path(root).resolve() == Path.cwd().resolve():
        return path
    return Path(root) / path


def named(path: Path, root: Path) -> str:
    """`path` as users name it in messages and records: relative to the project `root` (with `/`),
    else as given."""
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
