"""The memory extension's loop side: how much of each memory table training reads.

The model side is `pipelines.core.models.memory_model` (the product-key memory and the model class that
saves and loads it). `MemoryUsage` is a training-loop extension (`pipelines.core.extensions`) that
`pretrain` adds when `model.memory.enabled`: after each optimizer step it marks the rows the step's
last micro-batch read, and with the training metrics it reports, per memory layer,
`memory/usage_layer<i>`: the share of the table's rows read at least once since the previous log
(Lample et al. report this "memory usage"; a collapsed memory reads few rows). It runs before the
loggers, which then log the numbers with the rest.
"""

from __future__ import annotations

from typing import Any

import torch

from pipelines.core.extensions import Extension


class MemoryUsage(Extension):
    name = "memory_usage"

    def __init__(self, model: torch.nn.Module) -> None:
        self.memories = model.memories()
        self.read = {index: torch.zeros(memory.num_keys**2, dtype=torch.bool) for index, memory in self.memories.items()}
        self.logged = -1

    def on_step_end(self, state, metrics: dict[str, float]) -> None:
        if state.step == self.logged:  # on_log already counted this step
            return
        for index, memory in self.memories.items():
            if memory.last_indices is not None:
                self.read[index][memory.last_indices.reshape(-1).cpu()] = True

    def on_log(self, state, metrics: dict[str, float], step: int) -> None:
        if "train/loss" not in metrics:  # validation and skipped-batch reports
            return
        for index, memory in self.memories.items():
            if memory.last_indices is not None:  # the step just logged (on_step_end comes after on_log)
                self.read[index][memory.last_indices.reshape(-1).cpu()] = True
            metrics[f"memory/usage_layer{index}"] = float(self.read[index].float().mean())
            self.read[index].zero_()
        self.logged = state.step

    def state_dict(self) -> dict[str, Any]:
        return {str(index): read.clone() for index, read in self.read.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for index in self.read:
            if str(index) in state:
                self.read[index] = state[str(index)].clone()
