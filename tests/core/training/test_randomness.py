"""Training stages in threads of one process draw their random numbers from their own streams."""

from __future__ import annotations

import threading

import numpy as np
import torch

from pipelines.core.models.models import seeded
from pipelines.core.training import loop, randomness
from pipelines.core.training.randomness import StageRandom, draws
from tests.core.training.test_loop import cfg, collate, rows, tiny_model


def with_attention_dropout(model, p: float = 0.3):
    """The tiny Llama with attention dropout: a function argument, not a module (only the config says so)."""
    model.config.attention_dropout = p
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = p
    return model


def test_draws_finds_dropout_modules_and_config_probabilities():
    assert not draws(tiny_model())
    assert draws(with_attention_dropout(tiny_model()))
    assert draws(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)))
    assert not draws(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)))
    assert randomness._config_dropout({"text_config": {"attn_pdrop": 0.1}})
    assert not randomness._config_dropout({"hidden_dropout": 0.0, "use_dropout": True})


def test_a_stream_is_its_seed_alone_resumes_and_leaves_the_global_generator_as_it_was():
    def draw(stream, n=3):
        with stream.step():
            return torch.rand(n).tolist()

    a, b = StageRandom(7, active=True), StageRandom(7, active=True)
    torch.manual_seed(123)
    outside = torch.get_rng_state()
    first = draw(a)
    assert torch.equal(torch.get_rng_state(), outside), "the step restores what the global generator held"
    assert draw(b) == first and draw(StageRandom(8, active=True)) != first
    saved = a.state_dict()
    expected = draw(a)
    resumed = StageRandom(0, active=True)
    resumed.load_state_dict(saved)
    assert draw(resumed) == expected


def test_inactive_stream_draws_from_the_global_generator_without_the_lock():
    torch.manual_seed(5)
    with StageRandom(7, active=False).step():
        value = torch.rand(1).item()
    torch.manual_seed(5)
    assert value == torch.rand(1).item()


def test_seeded_construction_is_its_seed_alone_and_restores_the_global_generator():
    torch.manual_seed(1)
    before = torch.get_rng_state()
    with seeded(3):
        one = torch.nn.Linear(4, 4).weight.clone()
    assert torch.equal(torch.get_rng_state(), before)
    torch.rand(10)  # whatever the global stream did meanwhile
    with seeded(3):
        assert torch.equal(torch.nn.Linear(4, 4).weight, one)


def test_runs_with_dropout_in_threads_train_what_they_train_alone():
    """`qllm run` trains independent branches in threads: two runs drawing dropout masks at once,
    and a third constructing seeded modules meanwhile, end with the weights each has alone."""
    data = rows()

    def train(seed: int) -> dict[str, torch.Tensor]:
        model = with_attention_dropout(tiny_model(seed))
        loop.train(model, loop.causal_lm_loss, loop.Batches(32, 4, seed, collate(data)), cfg(max_steps=12, eval_every=0, seed=seed))
        return model.state_dict()

    alone = {seed: train(seed) for seed in (0, 1)}
    assert any(not torch.equal(a, b) for a, b in zip(train(0).values(), with_seed_dropout_off(data).values(), strict=True)), \
        "dropout changes what is trained (the test would otherwise prove nothing)"  # fmt: skip
    together: dict[int, dict] = {}
    stop = threading.Event()

    def construct() -> None:
        while not stop.is_set():
            with seeded(9):
                torch.nn.Linear(64, 64)

    threads = [threading.Thread(target=lambda s=s: together.__setitem__(s, train(s))) for s in (0, 1)]
    builder = threading.Thread(target=construct)
    for thread in (*threads, builder):
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    builder.join()
    for seed in (0, 1):
        for name, value in alone[seed].items():
            assert torch.equal(together[seed][name], value), (seed, name)


def with_seed_dropout_off(data: np.ndarray) -> dict[str, torch.Tensor]:
    model = tiny_model(0)
    loop.train(model, loop.causal_lm_loss, loop.Batches(32, 4, 0, collate(data)), cfg(max_steps=12, eval_every=0, seed=0))
    return model.state_dict()
