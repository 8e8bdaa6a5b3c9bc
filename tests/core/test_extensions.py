"""The extension API of the training loop: call order, state across a resume, errors, overhead."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pipelines.core.extensions import Extension, ExtensionError, Extensions, Hook
from pipelines.core.training import loop
from pipelines.core.training.checkpoint import CheckpointManager
from tests.core.training.test_loop import cfg, collate, rows, tiny_model


class Recorder(Extension):
    """Records every point it is called at."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def on_train_begin(self, state):
        self.calls.append((self.name, "begin", state.step))

    def on_gradients(self, state):
        assert all(p.grad is not None for p in self.model.parameters() if p.requires_grad)  # the step's raw gradients
        self.calls.append((self.name, "gradients", state.step))

    def on_step_end(self, state, metrics):
        self.calls.append((self.name, "step_end", state.step))

    def on_evaluate(self, state, metrics):
        assert "val/loss" in metrics
        self.calls.append((self.name, "evaluate", state.step))

    def on_save(self, state, best):
        self.calls.append((self.name, "save", state.step))

    def on_train_end(self, state, summary):
        self.calls.append((self.name, "end", summary["steps"]))


def batches():
    return loop.Batches(32, 4, 0, collate(rows()))


def val_fn(model):
    return {"val/loss": loop.mean_loss(model, loop.causal_lm_loss, [collate(rows())(list(range(4)))], torch.device("cpu"), "fp32")}


def test_points_are_called_in_order_and_extensions_in_the_listed_order(tmp_path):
    calls: list = []
    model = tiny_model()
    first, second = Recorder("first", calls), Recorder("second", calls)
    first.model = second.model = model
    loop.train(model, loop.causal_lm_loss, batches(), cfg(max_steps=4, eval_every=2, checkpoint_every=4, early_stopping_patience=0),
                   val_fn=val_fn, checkpoints=CheckpointManager(tmp_path, 2), extensions=[first, second])  # fmt: skip
    assert [(n, p, s) for n, p, s in calls if n == "first"] == [
        ("first", "begin", 0),
        ("first", "gradients", 0), ("first", "step_end", 1),
        ("first", "gradients", 1), ("first", "step_end", 2), ("first", "evaluate", 2),
        ("first", "save", 2),  # the first evaluation is a new best: checkpointed
        ("first", "gradients", 2), ("first", "step_end", 3),
        ("first", "gradients", 3), ("first", "step_end", 4), ("first", "evaluate", 4), ("first", "save", 4),
        ("first", "end", 4),
    ]  # fmt: skip
    # at every point, first before second
    assert calls[0::2] == [c for c in calls if c[0] == "first"] and calls[1::2] == [c for c in calls if c[0] == "second"]
    assert [c[1:] for c in calls[0::2]] == [c[1:] for c in calls[1::2]]


class LossSum(Extension):
    """Stateful: the number of steps it saw and the sum of their losses, restored on resume."""

    name = "loss_sum"

    def __init__(self):
        self.steps, self.total = 0, 0.0

    def on_step_end(self, state, metrics):
        self.steps += 1
        self.total += metrics["train/loss"]

    def state_dict(self):
        return {"steps": self.steps, "total": self.total}

    def load_state_dict(self, state):
        self.steps, self.total = state["steps"], state["total"]


class Killed(Exception):
    pass


def test_extension_state_resumes_exactly_after_a_crash(tmp_path):
    """A run dies after step 5 (checkpoints at 3 only, steps 4-5 lost, as with kill -9); the rerun
    resumes from step 3 with the extension's state of step 3 and ends where an uninterrupted run ends."""
    def die(state, metrics):
        if state.step == 5:
            raise Killed

    crashed = LossSum()
    with pytest.raises(ExtensionError):
        loop.train(tiny_model(), loop.causal_lm_loss, batches(), cfg(), checkpoints=CheckpointManager(tmp_path / "b", 2),
                       extensions=[crashed, Hook("on_step_end", die)])  # fmt: skip
    assert crashed.steps == 5
    assert_resumes_like_an_uninterrupted_run(tmp_path / "b")


def assert_resumes_like_an_uninterrupted_run(checkpoints: Path) -> None:
    """Resuming from `checkpoints` (step 3 of 6) ends with the extension state of a straight run."""
    straight = LossSum()
    loop.train(tiny_model(), loop.causal_lm_loss, batches(), cfg(), extensions=[straight])
    resumed = LossSum()
    result = loop.train(tiny_model(), loop.causal_lm_loss, batches(), cfg(), checkpoints=CheckpointManager(checkpoints, 2), extensions=[resumed])
    assert result["steps"] == 6 and resumed.steps == straight.steps == 6
    assert resumed.total == straight.total  # resuming is exact: the same losses added in the same order


def test_extension_state_resumes_exactly_after_kill_9(tmp_path):
    """A real SIGKILL of the training process after step 5 (checkpoint at step 3): the rerun
    restores the extension's state of step 3 and ends with an uninterrupted run's state."""
    script = textwrap.dedent(f"""
        import os, signal
        from pipelines.core.training import loop
        from pipelines.core.training.checkpoint import CheckpointManager
        from pipelines.core.extensions import Hook
        from tests.core.test_extensions import LossSum, batches
        from tests.core.training.test_loop import cfg, tiny_model

        def kill(state, metrics):
            if state.step == 5:
                os.kill(os.getpid(), signal.SIGKILL)

        loop.train(tiny_model(), loop.causal_lm_loss, batches(), cfg(), checkpoints=CheckpointManager({str(tmp_path / "run")!r}, 2),
                       extensions=[LossSum(), Hook("on_step_end", kill)])
    """)
    repo = Path(__file__).resolve().parents[2]
    killed = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    assert_resumes_like_an_uninterrupted_run(tmp_path / "run")


def test_an_exception_in_an_extension_stops_training_with_its_name(tmp_path):
    class Broken(Extension):
        name = "broken"

        def on_evaluate(self, state, metrics):
            raise ValueError("no room for the report")

    with pytest.raises(ExtensionError, match=r"train: extension 'broken' failed in on_evaluate: ValueError: no room for the report") as err:
        loop.train(tiny_model(), loop.causal_lm_loss, batches(), cfg(), val_fn=val_fn, checkpoints=CheckpointManager(tmp_path, 2),
                       extensions=[Broken()])  # fmt: skip
    assert isinstance(err.value.__cause__, ValueError)
    assert CheckpointManager(tmp_path, 2).latest_valid() is None  # it failed at step 3's evaluation, before step 3's checkpoint


def test_extension_names_are_unique_and_points_known():
    with pytest.raises(ExtensionError, match="extension names must be unique within a run .*: loss_sum"):
        Extensions([LossSum(), LossSum()])
    with pytest.raises(ValueError, match="unknown extension point 'on_batch'"):
        Hook("on_batch", print)


def test_early_stopping_is_an_extension():
    stopped = loop.train(tiny_model(), loop.causal_lm_loss, batches(), cfg(max_steps=30, eval_every=1, early_stopping_patience=1, lr=0.5),
                             val_fn=val_fn)  # fmt: skip
    assert stopped["stopped_early"] and stopped["steps"] < 30


def test_per_step_overhead_is_under_one_percent_of_a_training_step():
    """Dispatching the per-step points to three no-op extensions costs under 1% of a step of the
    tiniest model (a default pretrain step is far longer)."""

    class Noop(Extension):
        def on_gradients(self, state):
            pass

        def on_step_end(self, state, metrics):
            pass

    hooks = Extensions([Noop(), type("B", (Noop,), {"name": "b"})(), type("C", (Noop,), {"name": "c"})()])
    state, metrics = loop.TrainState(), {}
    started = time.perf_counter()
    for _ in range(2000):
        hooks.call("on_gradients", state)
        hooks.call("on_step_end", state, metrics)
    dispatch = (time.perf_counter() - started) / 2000
    result = loop.train(tiny_model(), loop.causal_lm_loss, batches(), cfg(max_steps=20, eval_every=0, checkpoint_every=0))
    step = result["train_seconds"] / result["steps"]
    assert dispatch < 0.01 * step, f"dispatch {dispatch * 1e6:.1f} us per step vs a {step * 1e3:.2f} ms step"
