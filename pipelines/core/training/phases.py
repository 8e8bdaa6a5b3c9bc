"""What the shared loop follows through a run: a schedule of phases.

    schedule.phases                 Phase(index, name, start, layers, ...), in step order
    schedule.phase_at(step)         the phase in force at an optimizer step
    schedule.enter(model, phase)    change the model for the phase (grow it, set what trains)
    schedule.lr_factor(phase, k)    the learning-rate factor k steps into the phase (a re-warm)
    schedule.metrics()              what the loop logs with each step
    schedule.close()                at the end of the run, however it ends

Every run has one. Plain training has `OnePhase` (a single phase from step 0 that changes
nothing); progressive growth (`progressive.Growth`) grows the model stack by stack; the
multimodal stage trains its projector, then the language model (`pipelines.multimodal.Phases`).
At each phase change the loop builds a fresh optimizer over what trains and restarts the
schedule from the phase's first step; a checkpoint records the phase, and a resume enters it
before loading the weights. A schedule whose `changes_model` is true needs one process and no
`torch.compile`, and its checkpoints keep every weight (a frozen part was trained earlier).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Phase:
    """A stretch of steps with one model shape and one set of trainable parameters."""

    index: int
    name: str
    """`train`, `stack 2/3`, `end-to-end`, `alignment`: for logs."""
    start: int
    """First optimizer step (0-based) of the phase."""
    layers: int = 0
    """Decoder layers the model has during the phase (logged at a phase change)."""
    trainable: tuple[int, int] | None = None
    """Progressive growth: decoder layers [lo, hi) train, with the head; None: all the schedule trains."""
    language_model: bool = True
    """The multimodal stage: whether the language model trains (else only the projector)."""


class Schedule(Protocol):
    phases: list[Phase]
    changes_model: bool

    def phase_at(self, step: int) -> Phase: ...

    def enter(self, model: torch.nn.Module, phase: Phase) -> None: ...

    def lr_factor(self, phase: Phase, steps_into_phase: int) -> float: ...

    def metrics(self) -> dict[str, float]: ...

    def close(self) -> None: ...


def phase_at(phases: list[Phase], step: int) -> Phase:
    """The last phase that has started by `step` (the first before any has)."""
    current = phases[0]
    for phase in phases:
        if phase.start <= step:
            current = phase
    return current


class OnePhase:
    """Plain training: one phase from step 0, nothing changed, the schedule as configured."""

    changes_model = False

    def __init__(self) -> None:
        self.phases = [Phase(0, "train", 0)]

    def phase_at(self, step: int) -> Phase:
        return self.phases[0]

    def enter(self, model: torch.nn.Module, phase: Phase) -> None:
        """Nothing: the model trains as it was handed over."""

    def lr_factor(self, phase: Phase, steps_into_phase: int) -> float:
        return 1.0

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Nothing to release."""
