"""The masked-diffusion objective: time steps, masks, the 1/t weighting, bidirectional attention,
NELBO validation, training and exact resume, generation by iterative unmasking, save and load."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipelines.core.data import chat_examples
from pipelines.core.extensions import ExtensionError, Hook
from pipelines.core.models.diffusion_model import QllmDiffusionLlamaForMaskedDiffusion
from pipelines.core.models.models import build_llama, load_causal_lm
from pipelines.core.params.pretraining import DiffusionParams, ModelParams
from pipelines.core.training import diffusion, loop, objectives
from pipelines.core.training.checkpoint import CheckpointManager
from tests import numerics
from tests.conftest import load_with_remote_code
from tests.core.training.test_loop import FakeTokenizer, Interrupt, cfg, collate

MASK_ID = 15  # the FakeTokenizer's 16 ids: the patterns below use 0..14


class MaskTokenizer(FakeTokenizer):
    def convert_tokens_to_ids(self, token):
        return MASK_ID if token == diffusion.MASK else 2


def mdm(seed: int = 0, layers: int = 2):
    params = ModelParams(hidden_size=32, intermediate_size=64, num_layers=layers, num_heads=2, num_kv_heads=2)
    return build_llama(params, MaskTokenizer(), max_positions=16, seed=seed, diffusion=DiffusionParams(unmask_steps=4), mask_token_id=MASK_ID)


def patterns(n: int, seq: int = 8, seed: int = 0) -> np.ndarray:
    """Rows counting up modulo 15 from a random start (the mask id 15 never occurs)."""
    starts = np.random.default_rng(seed).integers(0, 15, n)
    return ((starts[:, None] + np.arange(seq)[None, :]) % 15).astype(np.int64)


def test_discrete_fractions_are_interpolated_between_the_listed_steps():
    table = diffusion.fraction_table(DiffusionParams(time_steps="discrete"))  # {0: 0.15, 5: 0.5, 9: 0.9}
    # float64 interpolation (a difference, a division, a product and a sum) against the decimals
    assert table == numerics.approx([0.15, 0.22, 0.29, 0.36, 0.43, 0.5, 0.6, 0.7, 0.8, 0.9], n=4, dtype=torch.float64)
    held = diffusion.fraction_table(DiffusionParams(time_steps="discrete", num_time_steps=4, time_step_mask_fractions={1: 0.2, 2: 0.4}))
    assert held == [0.2, 0.2, 0.4, 0.4]  # the listed values themselves, held before the first and after the last listed step


def test_antithetic_time_steps_are_evenly_spread():
    t, steps = diffusion.sample_time_steps(8, DiffusionParams(eps=0.001), torch.Generator().manual_seed(0))
    assert steps is None and bool(((t >= 0.001) & (t <= 1)).all())
    u = torch.sort((t - 0.001) / 0.999).values
    # one draw, spread by 1/B: the shift, the scale to [eps, 1] and back, their constants and the difference, in fp32
    numerics.assert_close_as(u[1:] - u[:-1], torch.full((7,), 1 / 8), n=10, magnitude=1.0)
    t, steps = diffusion.sample_time_steps(10, DiffusionParams(time_steps="discrete"), torch.Generator().manual_seed(0))
    assert sorted(steps.tolist()) == list(range(10))  # stratified over the 10 steps: each once
    assert t.tolist() == numerics.approx([diffusion.fraction_table(DiffusionParams())[k] for k in steps.tolist()], n=1)  # the table in fp32


def test_the_one_over_t_weighting_matches_the_docstring_example():
    """Two rows of 4 tokens; row 1 at t=0.5 masks 2 tokens (CE 1.0 and 3.0), row 2 at t=0.25 masks 1
    (CE 2.0): (4.0/0.5 + 2.0/0.25) / 8 = 2.0 nats per token."""
    ce = torch.tensor([[1.0, 0.0, 3.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    masked = torch.tensor([[True, False, True, False], [False, True, False, False]])
    # two classes, the target 0 with probability exp(-ce): logits (log p, log(1 - p))
    p = torch.exp(-ce).clamp(max=1 - 1e-7)
    logits = torch.stack([p.log(), (1 - p).log()], -1)
    loss = diffusion.weighted_loss(logits, torch.zeros(2, 4, dtype=torch.long), masked, torch.tensor([0.5, 0.25]), torch.ones(2, 4, dtype=torch.bool))
    # fp32: each CE back from its logits (exp, log, log(1 - p), a two-term log-softmax: 5 functions and
    # 4 operations), weighted, summed and divided by 8, on terms whose absolute sum over 8 is 2
    assert float(loss) == numerics.approx(2.0, n=5 * numerics.FUNCTION + 4 + 3 + 2)


def test_discrete_masks_are_a_function_of_the_row_and_step_and_only_where_maskable():
    ids = torch.from_numpy(patterns(4))
    maskable = torch.ones_like(ids, dtype=torch.bool)
    maskable[:, :3] = False  # e.g. a prompt: never masked
    t, steps = torch.full((4,), 0.9), torch.tensor([1, 1, 2, 2])
    first = diffusion.mask_positions(ids, maskable, t, steps)
    torch.manual_seed(123)  # the global generator plays no part
    assert torch.equal(first, diffusion.mask_positions(ids, maskable, t, steps))
    assert not first[:, :3].any() and first.any()
    assert not torch.equal(first, diffusion.mask_positions(ids, maskable, t, torch.tensor([2, 2, 1, 1])))


def test_attention_is_bidirectional_for_masked_diffusion_and_causal_otherwise():
    model = mdm().eval()
    causal = build_llama(ModelParams(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2), MaskTokenizer(), 16, 0).eval()
    causal.load_state_dict(model.state_dict())
    ids = torch.from_numpy(patterns(2))
    changed = ids.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 15  # token j = 6
    with torch.no_grad():
        # beyond two orders of the forward's chain (tests/numerics.py)
        tol = numerics.tolerance(numerics.model_roundings(model.config, ids.shape[1]), magnitude=float(model(input_ids=ids).logits.abs().max()))
        for i in range(6):  # every position i < j sees the change with bidirectional attention, none with causal
            assert (model(input_ids=ids).logits[:, i] - model(input_ids=changed).logits[:, i]).abs().max() > tol
            assert torch.equal(causal(input_ids=ids).logits[:, i], causal(input_ids=changed).logits[:, i])
    with pytest.raises(ValueError, match="predicts the token at each position"):
        model(input_ids=ids, labels=ids)


def train_mdm(directory=None, stop_at=None, steps=8, params=None, lr=0.01, micro_batch_size=4):
    model, data = mdm(), patterns(64)
    objective = diffusion.Objective(params or DiffusionParams(), MASK_ID)
    val = objectives.nelbo_fn(objective, [{"input_ids": torch.from_numpy(patterns(8, seed=1))}], "fp32")

    def stopper(state, metrics):
        if state.step == stop_at:
            raise Interrupt

    c = cfg(max_steps=steps, lr=lr, micro_batch_size=micro_batch_size, eval_every=max(4, steps // 4), checkpoint_every=2)
    checkpoints = CheckpointManager(directory, 2) if directory else None
    result = loop.train(model, objective, loop.Batches(64, micro_batch_size, 0, collate(data)), c, val_fn=val, checkpoints=checkpoints,
                            extensions=[Hook("on_step_end", stopper)])  # fmt: skip
    return model, result, val


@pytest.fixture(scope="module")
def trained():
    """1,000 steps of 16 rows at lr 0.003 on the counting rows (about 3 s on 2 cores): learnt to a
    margin, so what the tests below assert holds on every CPU's kernels. With 500 steps of 4 rows
    at lr 0.01 the right next tokens had probabilities of 0.4-0.6, and an AVX2-only CPU generated
    [1, 2, 3, 4] where an AVX512 one generated [7, 8, 9, 10]; this recipe gave every right token
    p >= 0.78 with all four masked, on 3 seeds, on both kinds (AVX2 imitated with ONEDNN_MAX_CPU_ISA)."""
    model, result, _ = train_mdm(steps=1000, lr=0.003, micro_batch_size=16)
    return model.eval(), result


def test_validation_is_a_fixed_monte_carlo_estimate_and_training_lowers_it(trained):
    model = mdm()
    val = objectives.nelbo_fn(diffusion.Objective(DiffusionParams(), MASK_ID), [{"input_ids": torch.from_numpy(patterns(8, seed=1))}], "fp32")
    first, again = val(model), val(model)
    assert first == again and first["val/perplexity"] == math.exp(first["val/nelbo"])  # the same float through math.exp
    assert first["val/nelbo"] > 0.8 * math.log(16)  # an untrained model: about uniform over the 16 ids
    assert trained[1]["val/nelbo"] < 0.25 * first["val/nelbo"]


@pytest.mark.parametrize("time_steps", ["continuous", "discrete"])
def test_resume_is_bitwise_exact(tmp_path, time_steps):
    params = DiffusionParams(time_steps=time_steps)
    reference, result, _ = train_mdm(tmp_path / "straight", params=params)
    with pytest.raises(ExtensionError):
        train_mdm(tmp_path / "killed", stop_at=5, params=params)
    resumed, resumed_result, _ = train_mdm(tmp_path / "killed", params=params)
    for (name, a), (_, b) in zip(reference.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert resumed_result["val/loss"] == result["val/loss"]


def test_generation_unmasks_a_learned_pattern_and_stops_at_the_stop_token(trained):
    model = trained[0]
    prompt = torch.tensor([[3, 4, 5, 6], [9, 10, 11, 12]])
    right = torch.tensor([[7, 8, 9, 10], [13, 14, 0, 1]])
    with torch.no_grad():  # the margin the exact answers below stand on: each right token is the argmax with everything masked
        p = model(input_ids=torch.cat([prompt, torch.full((2, 4), MASK_ID)], 1)).logits.softmax(-1)[:, 4:]
    assert p.gather(-1, right[..., None]).min() > 0.6, p.gather(-1, right[..., None])[..., 0]
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4)
    assert torch.equal(out[:, :4], prompt) and not (out == MASK_ID).any()
    assert out[:, 4:].tolist() == [[7, 8, 9, 10], [13, 14, 0, 1]]  # counting on, modulo 15
    assert torch.equal(model.generate(prompt, max_new_tokens=4), out)  # greedy: deterministic
    blocks = model.generate(prompt, max_new_tokens=4, block_length=2, unmask_steps=4)
    assert blocks[:, 4:].tolist() == [[7, 8, 9, 10], [13, 14, 0, 1]]
    cut = model.generate(prompt, max_new_tokens=4, eos_token_id=[8, 14], pad_token_id=1)
    assert cut[:, 4:].tolist() == [[7, 8, 1, 1], [13, 14, 1, 1]]  # everything after the first stop token is padding


def test_saved_model_says_its_objective_and_loads_both_ways(tmp_path):
    import json

    model = mdm().eval()
    model.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m/config.json").read_text())
    assert config["objective"] == "masked_diffusion" and config["mask_token_id"] == MASK_ID
    assert config["model_type"] == "qllm_diffusion_llama" and (tmp_path / "m/diffusion_model.py").exists()
    loaded = load_causal_lm(tmp_path / "m")
    assert isinstance(loaded, QllmDiffusionLlamaForMaskedDiffusion)
    ids = torch.from_numpy(patterns(2))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        assert torch.equal(loaded.eval()(input_ids=ids).logits, expected)
    name, imported, total = load_with_remote_code(tmp_path / "m", ids.tolist())  # without the pipeline
    # another process: the forward's chain and the sum of the logits (tests/numerics.py)
    n = numerics.model_roundings(model.config, ids.shape[1]) + expected.numel()
    assert name == "QllmDiffusionLlamaForMaskedDiffusion" and not imported and total == numerics.approx(expected.sum().item(), n=n, magnitude=float(expected.abs().sum()))


def test_the_whole_pipeline_runs_a_masked_diffusion_model_end_to_end(tmp_path, mlflow_template_db):
    """pretrain (masked diffusion) -> sft (answer tokens masked) -> probe_lora / lora -> ref_logprobs /
    dpo (ELBO log-probabilities) -> evaluate (iterative-unmasking answers, NELBO bound) -> register."""
    from pathlib import Path

    from pipelines.core import dag
    from pipelines.core.models.models import load_model_and_tokenizer
    from pipelines.core.outputs import read_json
    from pipelines.core.run import repro
    from tests.conftest import make_project

    overlay = {"train_tokenizer": {"mask_token": True}, "pretrain": {"objective": "masked_diffusion", "diffusion": {"unmask_steps": 4}},
               "grpo": {"enabled": False}}  # GRPO samples left to right (refused with masked diffusion: tests/core/test_config.py)
    root = make_project(tmp_path / "project", mlflow_template_db, overlay)
    try:
        outcomes = {name: repro.reproduce(root, name).status for name in dag.stages(Path(__file__).resolve().parents[3])}
    finally:
        repro.close(root)
    assert set(outcomes.values()) == {"ran"}, outcomes
    model, tokenizer = load_model_and_tokenizer(root / "data/models/sft")
    assert isinstance(model, QllmDiffusionLlamaForMaskedDiffusion) and model.config.mask_token_id == tokenizer.mask_token_id
    assert tokenizer.mask_token == diffusion.MASK and tokenizer.mask_token_id == len(tokenizer) - 1  # after the trained vocabulary
    pretrain = read_json(root / "data/metrics/pretrain.json")
    assert pretrain["objective"] == "masked_diffusion" and pretrain["val/nelbo"] == pretrain["val/loss"] > 0
    evaluated = read_json(root / "data/metrics/evaluate.json")
    for name in ("sft", "lora", "dpo"):
        assert 0 <= evaluated[name]["exact_match"] <= 1 and evaluated[name]["val_perplexity"] > 1
    assert "grpo" not in evaluated and (root / "data/models/grpo/README.md").exists()  # switched off: a README, skipped by evaluate
    predictions = (root / "data/evaluate/sft/predictions.jsonl").read_text().splitlines()
    assert predictions and all(diffusion.MASK not in json_line for json_line in predictions)
    # qllm generate, from the directory and from the registry: the same model, the same (greedy) answer
    from qllm.serving import generation

    local = generation.generate(*generation.load(str(root / "data/models/dpo"), root), "What is 2 plus 3?", max_new_tokens=6)
    registered = generation.generate(*generation.load("models:/qllm/1", root), "What is 2 plus 3?", max_new_tokens=6)
    assert registered == local and diffusion.MASK not in local


def test_fine_tuning_masks_answer_tokens_only():
    """SFT of a masked-diffusion model: prompt and padding stay visible and unscored."""
    objective = objectives.chat_objective(mdm())
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 1, 1]]), "labels": torch.tensor([[-100, -100, 7, 8, -100, -100]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]])}  # fmt: skip
    assert objective.maskable(batch).tolist() == [[False, False, True, True, False, False]]
    masked = diffusion.mask_positions(batch["input_ids"], objective.maskable(batch), torch.tensor([1.0]), None)
    assert masked.tolist() == [[False, False, True, True, False, False]]  # t = 1: every answer token, never the prompt
    assert objectives.chat_objective(build_llama(ModelParams(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                                             num_kv_heads=2), MaskTokenizer(), 16, 0)) is chat_examples.chat_loss  # fmt: skip


def test_frozen_trunk_cache_serves_masked_diffusion_by_row_and_time_step():
    """Discrete time steps: a row's masked input is a function of (row, step), so the frozen trunk's
    activations repeat; training with and without the cache gives the same weights."""
    from pipelines.core.params.pretraining import ActivationCacheParams, ProgressiveParams
    from pipelines.core.training import progressive

    params = DiffusionParams(time_steps="discrete", num_time_steps=2, time_step_mask_fractions={0: 0.3, 1: 0.6})

    def run(cache: bool):
        model, data = mdm(), patterns(16)
        grow = ProgressiveParams(enabled=True, stacks=[1, 1], steps_per_stack=12, activation_cache=ActivationCacheParams(enabled=cache))
        c = cfg(max_steps=24, lr=0.01, eval_every=0, checkpoint_every=0)
        growth = progressive.Growth(grow, c, model, "test")
        hits = []
        watch = Hook("on_step_end", lambda state, metrics: state.step == 23 and growth.cache and hits.append(growth.cache.hits))
        loop.train(model, diffusion.Objective(params, MASK_ID), loop.Batches(16, 4, 0, collate(data)), c, schedule=growth,
                       extensions=[watch])  # fmt: skip
        return model, hits

    plain, _ = run(False)
    cached, hits = run(True)
    # cached activations come from other batches: 24 steps whose backward passes may round otherwise (tests/numerics.py)
    n = numerics.model_roundings(plain.config, 8, tokens=4 * 8, backward=True) + numerics.OPTIMIZER_STEP
    for (name, a), (_, b) in zip(plain.state_dict().items(), cached.state_dict().items(), strict=True):
        numerics.assert_within(b, a, numerics.weights_tolerance(n, steps=24, lr=0.01), name)
    assert hits and hits[0] > 0  # 12 frozen steps x 4 rows over 16 distinct rows x 2 steps: repeats hit
