"""A saved model directory is the same bytes wherever its parts were loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO

SAVE = """
import sys
from pipelines.core.models.models import load_model_and_tokenizer, save_pretrained
model, tokenizer = load_model_and_tokenizer(sys.argv[1])
save_pretrained(model, tokenizer, sys.argv[2])
"""


def test_a_saved_tokenizer_is_the_same_bytes_in_an_offline_process_and_in_another(tiny_base, tmp_path):
    """transformers keeps `local_files_only` (true under HF_HUB_OFFLINE=1, as `qllm run` sets it
    for the stages) in a loaded tokenizer's init_kwargs and wrote it into tokenizer_config.json: the
    suite's same-bytes test found pretrain's tokenizer differing between its own process and a
    clone's `qllm run` (issue 79)."""
    saved = {}
    for offline in ("0", "1"):
        out = tmp_path / f"offline-{offline}"
        env = {**os.environ, "HF_HUB_OFFLINE": offline}
        done = subprocess.run([sys.executable, "-c", SAVE, str(tiny_base / "model"), str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        saved[offline] = (out / "tokenizer_config.json").read_bytes()
    assert saved["0"] == saved["1"]
    assert "local_files_only" not in json.loads(saved["0"])
