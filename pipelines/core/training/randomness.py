"""Each training stage draws its random numbers from its own stream, though stages share a process.

    random = StageRandom(cfg.seed, active=draws(model, loss_fn, batches))
    with random.step():          # one optimizer step's forward/backward (and a GRPO generation)
        ...
    checkpoint["rng"] = random.state_dict()

`qllm run` trains independent branches of the DAG in threads of one process
(`pipelines.core.run.repro`), and torch has one global generator per device: dropout masks (the
modules and the attention functions' `dropout_p`) and GRPO's sampling draw from it. Two stages
drawing from it at once interleave their draws in the order the thread scheduler picks, so what
each trains depends on the machine's load, and a stage seeding it (`torch.manual_seed`) resets the
other's stream. tests/e2e/test_pipeline_e2e.py (same bytes) found it on a busy CI machine: the lora stage's
adapter initialisation drew what GRPO's sampler, running beside it, had left.

Two rules keep every stage a function of its seed alone:
- random construction (initial weights, adapters) runs in `models.seeded(seed)`: under
  `models.CONSTRUCTION`, in a fork of the global generators that is restored after;
- a training run whose steps draw random numbers keeps its generator states here and swaps them
  into torch's global generators for each step, holding the same lock. Runs whose steps draw
  nothing (the default: no dropout; GRPO and masked diffusion aside) take no lock and overlap freely; runs that draw
  take turns step by step with each other and with model construction.
Anything else a stage does in its thread draws from a generator of its own (e.g. the timed product
of `pipelines.core.models.footprint`): a draw from the global one outside the lock lands, now and
then, inside another stage's construction. tests/e2e/test_pipeline_e2e.py records every such draw.
Checkpoints save this stream, so a resumed run draws what it would have.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from pipelines.core.models.models import CONSTRUCTION

DROPOUT_MODULES = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)


def _config_dropout(config: Any) -> bool:
    """A (nested) model config with a dropout probability above 0 (`attention_dropout`, `attn_pdrop`, ...)."""
    if isinstance(config, dict):
        return any(_config_dropout(value) if isinstance(value, dict) else
                   (isinstance(key, str) and ("dropout" in key or "pdrop" in key) and isinstance(value, int | float) and not isinstance(value, bool) and value > 0)
                   for key, value in config.items())  # fmt: skip
    return False


def draws(model: torch.nn.Module, *parts: Any) -> bool:
    """Whether training `model` draws random numbers: a dropout module with p > 0 (LoRA's
    `lora_dropout` among them), a config's dropout probability above 0 (attention dropout is a
    function argument, not a module), or one of `parts` (the loss function, the batches) marked
    `draws = True` (the masked-diffusion objective's time steps and masks, GRPO's samples)."""
    if any(getattr(part, "draws", False) for part in parts):
        return True
    if any(isinstance(module, DROPOUT_MODULES) and module.p > 0 for module in model.modules()):
        return True
    return any(_config_dropout(module.config.to_dict()) for module in model.modules() if hasattr(getattr(module, "config", None), "to_dict"))


def _cuda() -> bool:
    return torch.cuda.is_available()


def _global_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if _cuda():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_global_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and _cuda():
        torch.cuda.set_rng_state_all(state["cuda"])


class StageRandom:
    """One training run's random stream (see the module docstring); `active`: its steps draw."""

    def __init__(self, seed: int, active: bool) -> None:
        self.active = active
        with CONSTRUCTION, torch.random.fork_rng(devices=range(torch.cuda.device_count()) if _cuda() else []):
            torch.manual_seed(seed)
            self._state = _global_state()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Torch's global generators hold this run's stream within (and the lock is held), and
        what they held before is restored after."""
        if not self.active:
            yield
            return
        with CONSTRUCTION:
            outer = _global_state()
            _set_global_state(self._state)
            try:
                yield
            finally:
                self._state = _global_state()
                _set_global_state(outer)

    def state_dict(self) -> dict[str, Any]:
        """The stream's position (tensors: loadable with `torch.load(weights_only=True)`)."""
        return dict(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream from `state_dict()`'s (or an older checkpoint's global `rng`, whose
        `torch`/`cuda` entries were the run's stream then)."""
        self._state = {key: state[key] for key in ("torch", "cuda") if key in state}
