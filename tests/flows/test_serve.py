"""flows/serve.py's own helpers, without starting servers (the servers themselves: tests/e2e/test_team.py)."""

from __future__ import annotations

import os
import stat

from flows import serve


def test_the_team_profiles_secrets_file_never_holds_them_readable_by_others(tmp_path, monkeypatch):
    """A secrets file left with wider permissions (0644) is replaced by a new 0600 file: the passwords
    are written into that file only, never into the old one (opened with O_TRUNC and chmodded after)."""
    path = tmp_path / "secrets.json"
    path.write_text("{}")
    os.chmod(path, 0o644)
    seen = []
    real = os.fdopen

    def spying_fdopen(fd, *args, **kwargs):
        seen.append(stat.S_IMODE(os.fstat(fd).st_mode))
        return real(fd, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", spying_fdopen)
    serve._private(path, '{"mlflow": "s3cret"}')
    assert seen == [0o600] and stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == '{"mlflow": "s3cret"}'
