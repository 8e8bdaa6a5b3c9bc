"""Reliability: non-finite batches skipped or stopped, out-of-memory explained, MLflow checked first."""

from __future__ import annotations

import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from pipelines.core.errors import QllmError
from pipelines.core.extensions import Hook
from pipelines.core.params import files as params_file
from pipelines.core.params.training import TrainParams
from pipelines.core.run import preflight, tracking
from pipelines.core.training import loop
from pipelines.core.training.checkpoint import CheckpointManager
from qllm.services.local_api import free_port
from tests import numerics
from tests.core.training.test_loop import tiny_model


def cfg(**kw) -> TrainParams:
    base = dict(max_steps=6, micro_batch_size=4, warmup_steps=2, lr=0.01, eval_every=0, eval_batches=1, log_every=1,
                checkpoint_every=0, precision="fp32")
    return TrainParams(**(base | kw))


def batches(seed: int = 0) -> loop.Batches:
    starts = np.random.default_rng(seed).integers(0, 16, 32)
    data = ((starts[:, None] + np.arange(8)[None, :]) % 16).astype(np.int64)  # rows counting up mod 16
    return loop.Batches(32, 4, 0, lambda idx: {"input_ids": torch.from_numpy(data[np.sort(idx)])})


class NanGradient(torch.autograd.Function):
    """Identity forward (the loss stays finite), NaN gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def poisoned_loss(bad_calls: dict[int, str]):
    """The causal LM loss, made non-finite on the given (1-based) calls: "loss" or "grad"."""
    calls = {"n": 0}

    def loss_fn(model, batch):
        calls["n"] += 1
        loss, metrics = loop.causal_lm_loss(model, batch)
        kind = bad_calls.get(calls["n"])
        if kind == "loss":
            loss = loss * float("nan")
        elif kind == "grad":
            loss = NanGradient.apply(loss)
        return loss, metrics

    return loss_fn


# --- non-finite loss or gradient ------------------------------------------------------------------


def test_non_finite_without_skips_stops_naming_the_step_and_keeps_the_last_checkpoint(tmp_path):
    # One loss call per step (no accumulation): call 3 is step 3; checkpoints every 2 steps.
    with pytest.raises(loop.NonFiniteLossError, match=r"non-finite loss \(nan\) .* at step 3 \(skip_nonfinite is 0\)") as err:
        loop.train(tiny_model(), poisoned_loss({3: "loss"}), batches(), cfg(checkpoint_every=2),
                       checkpoints=CheckpointManager(tmp_path))
    assert isinstance(err.value, QllmError)
    assert "--set train.train.skip_nonfinite=N" in str(err.value)  # `desc` is the stage name in a stage
    assert CheckpointManager(tmp_path).latest_valid().step == 2


def test_skipped_batches_do_not_step_the_optimizer_or_schedule_and_are_counted(caplog):
    # Calls: 1 step 1 ok; 2 NaN loss (skipped, step 2 retried); 3 step 2 ok; 4 NaN gradient (skipped); 5.. ok.
    events = []
    record = Hook("on_gradients", lambda state: events.append("gradients"))
    clean = loop.train(tiny_model(), loop.causal_lm_loss, batches(), cfg())
    with caplog.at_level(logging.WARNING, logger="qllm.training"):
        result = loop.train(tiny_model(), poisoned_loss({2: "loss", 4: "grad"}), batches(), cfg(skip_nonfinite=2),
                                extensions=[record])
    assert result["steps"] == 6 and result["skipped_nonfinite"] == 2 and clean["skipped_nonfinite"] == 0
    assert "non-finite loss (nan) or gradient norm (nan) at step 2: batch skipped (no optimizer step), 1 of at most 2" in caplog.text
    assert "non-finite loss" in caplog.text and "gradient norm (nan) at step 3: batch skipped (no optimizer step), 2 of at most 2" in caplog.text
    # The schedule advanced once per real step (same learning rates as the clean run), the skipped
    # batches reached no callback, and their tokens are not counted as trained.
    assert [row[2] for row in result["history"]["train"]] == [row[2] for row in clean["history"]["train"]]  # one function of the same steps
    assert events == ["gradients"] * 6
    assert result["tokens"] == clean["tokens"] == 6 * 4 * 8
    assert np.isfinite(result["train_loss"])


def test_one_more_non_finite_batch_than_allowed_is_an_error():
    # Calls 1, 3, 5 are bad: skipped at step 1, step 2, then the third (at step 3) exceeds skip_nonfinite=2.
    with pytest.raises(loop.NonFiniteLossError, match=r"at step 3 \(non-finite batch 3 of this run; skip_nonfinite is 2\)"):
        loop.train(tiny_model(), poisoned_loss({1: "loss", 3: "grad", 5: "loss"}), batches(), cfg(skip_nonfinite=2))


def test_non_finite_error_ends_the_mlflow_run_failed(tmp_path, monkeypatch, mlflow_template_db):
    import shutil

    shutil.copy2(mlflow_template_db, tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_ids = []
    with pytest.raises(loop.NonFiniteLossError), tracking.run("pretrain", tmp_path) as tracker:
        run_ids.append(tracker.run_id)
        loop.train(tiny_model(), poisoned_loss({2: "loss", 3: "loss"}), batches(), cfg(skip_nonfinite=1), tracker=tracker)
    finished = tracking.client(tmp_path).get_run(run_ids[0])
    assert finished.info.status == "FAILED"
    assert finished.data.metrics["train/skipped_nonfinite"] == 1  # the skip was logged before the error


# --- out of memory --------------------------------------------------------------------------------


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   RuntimeError("MPS backend out of memory (MPS allocated: 9 GB)")])
def test_out_of_memory_in_a_step_names_what_is_in_force_and_how_to_fit(error):
    def loss_fn(model, batch):
        raise error

    with pytest.raises(loop.TrainingOutOfMemoryError) as err:
        loop.train(tiny_model(), loss_fn, batches(), cfg(grad_accum_steps=2), desc="sft")
    message = str(err.value)
    assert isinstance(err.value, QllmError)
    assert message.startswith("sft: out of memory at step 1 (")
    assert "micro_batch_size 4, grad_accum_steps 2, batch input_ids shape (4, 8) (sequence length 8)" in message
    # halve the micro-batch, double the accumulation: the global batch of 8 sequences is kept
    assert "global batch of 8 sequences (e.g. --set sft.train.micro_batch_size=2 --set sft.train.grad_accum_steps=4)" in message
    assert "--set sft.train.gradient_checkpointing=true" in message
    assert err.value.__context__ is None  # raised outside the handler: the failed step's tensors are freed


@pytest.mark.parametrize(("micro", "accum", "expected"), [(16, 1, "=8 --set x.train.grad_accum_steps=2"),
                                                        (6, 2, "=3 --set x.train.grad_accum_steps=4"),
                                                        (5, 1, "=1 --set x.train.grad_accum_steps=5")])
def test_out_of_memory_advice_keeps_the_global_batch_exactly(micro, accum, expected):
    message = loop.out_of_memory_message("x", cfg(micro_batch_size=micro, grad_accum_steps=accum), None, 1, torch.OutOfMemoryError())
    assert f"global batch of {micro * accum} sequences (e.g. --set x.train.micro_batch_size{expected})" in message
    assert message.startswith("x: out of memory at step 1 (OutOfMemoryError) with micro_batch_size")


def test_out_of_memory_with_one_sequence_per_batch_suggests_checkpointing_only():
    message = loop.out_of_memory_message("x", cfg(micro_batch_size=1, gradient_checkpointing=False), None, 1, torch.OutOfMemoryError())
    assert "micro_batch_size=" not in message and "gradient_checkpointing=true" in message


def test_out_of_memory_in_the_optimizer_step_is_explained_too(monkeypatch):
    def step(self, closure=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    with pytest.raises(loop.TrainingOutOfMemoryError, match=r"out of memory at step 1 .* micro_batch_size 4, grad_accum_steps 1"):
        loop.train(tiny_model(), loop.causal_lm_loss, batches(), cfg())


def test_other_runtime_errors_pass_through_unchanged():
    def loss_fn(model, batch):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as err:
        loop.train(tiny_model(), loss_fn, batches(), cfg())
    assert not isinstance(err.value, QllmError)


def test_gradient_checkpointing_trains_the_same_and_is_switched_off_after():
    seen = []
    record = Hook("on_gradients", lambda state: seen.append(state_model.is_activation_checkpointing))
    plain = loop.train(tiny_model(), loop.causal_lm_loss, batches(), cfg(max_steps=3))
    state_model = tiny_model()
    checkpointed = loop.train(state_model, loop.causal_lm_loss, batches(), cfg(max_steps=3, gradient_checkpointing=True),
                                  extensions=[record])
    assert seen == [True, True, True] and not state_model.is_activation_checkpointing
    losses = lambda r: [row[1] for row in r["history"]["train"]]  # noqa: E731
    # the recomputed forward may round otherwise: 3 steps of the backward's chain and AdamW (tests/numerics.py)
    n = numerics.model_roundings(state_model.config, 8, tokens=4 * 8, backward=True) + numerics.OPTIMIZER_STEP
    assert losses(checkpointed) == numerics.approx(losses(plain), n=n, steps=3)


def test_shipped_params_default_to_no_skips_and_no_checkpointing():
    from pathlib import Path


    params, _ = params_file.load(Path(__file__).resolve().parents[3])
    for section in ("pretrain", "sft", "probe_lora", "lora", "dpo"):
        train = getattr(params, section).train
        assert train.skip_nonfinite == 0 and train.gradient_checkpointing is False, section


# --- MLflow tracking preflight --------------------------------------------------------------------


@pytest.fixture
def health_server():
    """A local HTTP server whose /health answers with the status in `server.status`."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            time.sleep(self.server.delay)
            self.send_response(self.server.status)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args):
            """No request lines on stderr: the test output is about the preflight, not the server."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.status, server.delay = 200, 0.0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_unreachable_server_fails_fast_with_what_to_do_and_no_credentials(tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:s3cret@127.0.0.1:{port}/")
    started = time.perf_counter()
    with pytest.raises(QllmError) as err:
        preflight.check_tracking(tmp_path)
    assert time.perf_counter() - started < 5
    message = str(err.value)
    assert message.startswith(f"MLflow tracking server http://127.0.0.1:{port}/ is unreachable (")
    assert "mlflow server --host 127.0.0.1" in message and "unset MLFLOW_TRACKING_URI" in message and "sqlite:///mlflow.db" in message
    assert "alice" not in message and "s3cret" not in message


def test_a_server_slower_than_the_probe_fails_with_the_setting_to_raise(tmp_path, monkeypatch, health_server):
    uri = f"http://127.0.0.1:{health_server.server_port}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    health_server.delay = 1.0
    monkeypatch.setenv(preflight.PROBE_TIMEOUT_ENV, "0.2")
    with pytest.raises(QllmError, match=r"is unreachable \(.*timed out.*raise \$QLLM_TRACKING_PROBE_TIMEOUT, now 0\.2 s\)"):
        preflight.check_tracking(tmp_path)
    monkeypatch.setenv(preflight.PROBE_TIMEOUT_ENV, "5")
    assert preflight.check_tracking(tmp_path) == uri


def test_reachable_server_passes_and_a_failing_gateway_does_not(tmp_path, monkeypatch, health_server):
    uri = f"http://127.0.0.1:{health_server.server_port}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert preflight.check_tracking(tmp_path) == uri
    health_server.status = 401  # an auth challenge: a server is there, MLflow handles the rest
    preflight.check_tracking(tmp_path)
    health_server.status = 503
    with pytest.raises(QllmError, match=r"is unreachable \(HTTP 503"):
        preflight.check_tracking(tmp_path)


def test_sqlite_store_must_be_writable(tmp_path, monkeypatch):
    assert preflight.check_tracking(tmp_path) == f"sqlite:///{tmp_path / 'mlflow.db'}"  # the default store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'new' / 'dir' / 'mlflow.db'}")
    preflight.check_tracking(tmp_path)  # missing directories are created by MLflow's client
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}")
    with pytest.raises(QllmError, match=r"cannot be written: .*a-file is not a directory"):
        preflight.check_tracking(tmp_path)


def test_qllm_run_stops_before_any_stage_when_mlflow_is_unreachable(project, monkeypatch, capsys):
    from qllm.cli import main

    port = free_port()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"https://bob:hunter2@127.0.0.1:{port}")
    started = time.perf_counter()
    code = main(["run", "--project-dir", str(project)])
    assert time.perf_counter() - started < 10
    err = capsys.readouterr().err
    assert code != 0
    assert f"error: MLflow tracking server https://127.0.0.1:{port} is unreachable" in err
    assert "bob" not in err and "hunter2" not in err
    assert sorted(p.name for p in (project / "data").iterdir()) == ["sources"]  # no stage wrote anything
    assert not (project / ".qllm").exists() and not (project / "dvc.lock").exists()


def test_the_flow_checks_tracking_before_any_stage(project, monkeypatch):
    from flows.pipeline import pipeline

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(QllmError, match="is unreachable"):
        pipeline.fn(project_dir=str(project))  # the flow body: a deployment run skips `qllm run`'s check
    assert sorted(p.name for p in (project / "data").iterdir()) == ["sources"]
