"""Resumable training checkpoints: safetensors weights + tensor-only training state, checksummed.

Layout (one directory per checkpoint, written to a temporary name and renamed when complete)::

    <dir>/step-00000200/model.safetensors   the trainable weights (all of them for full training,
                                            the adapter for LoRA; tied tensors stored once)
                        state.pt            optimizer, scheduler, scaler, the run's random stream, data position,
                                            loop state: loaded with torch.load(weights_only=True)
                        manifest.json       step + SHA-256 of both files, written last
    <dir>/best.json                         which step holds the best validation loss

Only the newest `keep_last` checkpoints and the best one are kept. A checkpoint whose manifest is
missing or whose checksums do not match (a crash mid-write, a truncated file) is skipped with a
warning and the previous one is used.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipelines.core.outputs import sha256_file

log = logging.getLogger("qllm.checkpoint")

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
MANIFEST = "manifest.json"


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Trainable parameters by name (`named_parameters` lists a tied tensor once)."""
    return {name: p.detach().contiguous() for name, p in model.named_parameters() if p.requires_grad}


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path


class CheckpointManager:
    """Save, rotate and find the newest valid checkpoint in one directory."""

    def __init__(self, directory: Path | str, keep_last: int = 2, all_weights: bool = False):
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.all_weights = all_weights
        """Save every parameter, not only the trainable ones (progressive growth: a frozen trunk was
        trained in an earlier phase)."""

    def weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """What a checkpoint holds of `model`: its trainable parameters (or all with `all_weights`)."""
        if self.all_weights:
            return {name: p.detach().contiguous() for name, p in model.named_parameters()}
        return trainable_state(model)

    def list(self) -> list[Checkpoint]:
        """Completed checkpoint directories, oldest first (validity is checked on load)."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.glob("step-*"):
            suffix = path.name.removeprefix("step-")
            if path.is_dir() and suffix.isdigit():
                found.append(Checkpoint(int(suffix), path))
        return sorted(found, key=lambda c: c.step)

    @property
    def best_step(self) -> int | None:
        try:
            return json.loads((self.directory / "best.json").read_text())["step"]
        except (FileNotFoundError, ValueError, KeyError):
            return None

    def save(self, step: int, model: torch.nn.Module, state: dict[str, Any], best: bool = False) -> Path:
        """Write `step-<step>` atomically, mark it best if asked, prune old ones."""
        from safetensors.torch import save_file

        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"step-{step:08d}"
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step-{step:08d}-", dir=self.directory))
        try:
            save_file(self.weights(model), str(tmp / MODEL_FILE))
            torch.save(state, tmp / STATE_FILE)
            manifest = {"step": step, "files": {name: sha256_file(tmp / name) for name in (MODEL_FILE, STATE_FILE)}}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if best:
            best_file = self.directory / "best.json"
            best_file.with_suffix(".tmp").write_text(json.dumps({"step": step}))
            os.replace(best_file.with_suffix(".tmp"), best_file)
        self._prune()
        return final

    def _prune(self) -> None:
        keep = {c.step for c in self.list()[-self.keep_last :]}
        if self.best_step is not None:
            keep.add(self.best_step)
        for checkpoint in self.list():
            if checkpoint.step not in keep:
                shutil.rmtree(checkpoint.path, ignore_errors=True)
        for stale in self.directory.glob(".tmp-step-*"):
            shutil.rmtree(stale, ignore_errors=True)

    @staticmethod
    def verify(path: Path) -> bool:
        """True if the manifest exists and both files match their recorded checksums."""
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            return all(sha256_file(path / name) == digest for name, digest in manifest["files"].items())
        except (OSError, ValueError, KeyError):
            return False

    def load(self, path: Path, model: torch.nn.Module) -> dict[str, Any]:
        """Load the trainable weights into `model` and return the training state (no pickle:
        safetensors and torch.load(weights_only=True))."""
        from safetensors.torch import load_file

        tensors = load_file(str(path / MODEL_FILE))
        expected = set(self.weights(model))
        if set(tensors) != expected:
            raise ValueError(f"checkpoint {path} does not match the model's trainable parameters "
                             f"(missing {sorted(expected - set(tensors))[:3]}, unexpected {sorted(set(tensors) - expected)[:3]})")
        with torch.no_grad():
            parameters = dict(model.named_parameters())
            for name, tensor in tensors.items():
                parameters[name].copy_(tensor)
        return self.read_state(path)

    @staticmethod
    def read_state(path: Path) -> dict[str, Any]:
        """The training state of a checkpoint alone (what a resume must know before it loads the weights)."""
        return torch.load(path / STATE_FILE, weights_only=True, map_location="cpu")

    def latest_valid(self, step: int | None = None) -> Checkpoint | None:
        """Newest checkpoint (or the one at `step`) that passes `verify`; warns about bad ones."""
        candidates = [c for c in reversed(self.list()) if step is None or c.step == step]
        for checkpoint in candidates:
            if self.verify(checkpoint.path):
                return checkpoint
            log.warning("checkpoint %s is incomplete or corrupt (checksum mismatch); trying the previous one", checkpoint.path)
        return None
