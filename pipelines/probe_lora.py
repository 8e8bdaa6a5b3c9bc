"""Probe which LoRA modules matter: a short SFT run that records every candidate's gradients.

    python -m pipelines.probe_lora      # what dvc.yaml runs; writes data/probe_lora/scores.json

Runs `probe_lora.train.max_steps` steps of the SFT procedure (same data, masks, packing and
loop as `sft`/`lora`) on the LoRA base model and, for every candidate module m (each linear
layer whose name ends with one of `probe_lora.target_modules`), records the raw gradient of each
step before clipping: the accumulated gradient `G_m = Σ_b ∇W_m L_b` and the per-step energy
`g_m(b) = ‖∇W_m L_b‖²`. From them, for the `quantum_opt` stage:

- value `v[m][r] = Σ_{i≤r} σ_i(G_m)² / Σ_m ‖G_m‖²_F`: the share of all modules' gradient energy
  a rank-r update of m can capture (Eckart–Young: the best rank-r approximation of G_m keeps
  exactly its r largest squared singular values);
- cost `c[m][r] = r·(d_in + d_out)`: the trainable parameters of a rank-r adapter on m;
- redundancy `ρ[m,m'] = max(0, corr_b(Δ log g_m, Δ log g_m'))` (`probe_lora.redundancy: detrended`):
  modules whose gradient energy rises and falls together from step to step are likely to learn
  overlapping things. The correlation of the energies themselves (`energy`, the first version) is
  dominated by the downward trend every energy shares as the loss falls (mean ρ 0.93), which
  penalises every pair alike; the changes of the logs remove that trend.

The probe's weights are thrown away; only the scores are written. Only `lora.allocation:
quantum_opt` reads them (the stage lists that key in dvc.yaml): with any other allocation the
stage trains nothing and writes a README saying so.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import torch

from pipelines.core.data import chat_examples
from pipelines.core.errors import QllmError
from pipelines.core.extensions import Extension
from pipelines.core.models import adapters, quantize
from pipelines.core.models.models import CONSTRUCTION, device, load_model_and_tokenizer
from pipelines.core.outputs import atomic_dir, write_json
from pipelines.core.params.finetuning import ProbeLoraParams
from pipelines.core.quantum import qubo
from pipelines.core.run import stage
from pipelines.core.training import chunked_loss, distributed, finetune, loop, objectives

NAME = "probe_lora"
SCORES_FILE = "scores.json"
"""The file in the stage's output directory (quantum_opt reads it)."""


def candidate_modules(model: torch.nn.Module, suffixes: list[str]) -> dict[str, torch.nn.Linear]:
    """Linear layers whose name ends with one of `suffixes` (never the LM head)."""
    found = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name != "lm_head" and any(adapters.module_matches(name, s) for s in suffixes)
    }
    missing = [s for s in suffixes if not any(adapters.module_matches(n, s) for n in found)]
    if missing:
        raise QllmError(f"probe_lora.target_modules: {missing} match no linear module of the model")
    return found


class GradientRecorder(Extension):
    """A training-loop extension accumulating G_m and recording g_m(b) at every step."""

    name = "gradient_recorder"

    def __init__(self, modules: dict[str, torch.nn.Linear]):
        self.modules = modules
        self.accumulated = {name: torch.zeros_like(m.weight, dtype=torch.float32) for name, m in modules.items()}
        self.energies: dict[str, list[float]] = {name: [] for name in modules}

    def on_gradients(self, state) -> None:
        with torch.no_grad():
            for name, module in self.modules.items():
                grad = module.weight.grad.float()
                self.accumulated[name] += grad
                self.energies[name].append(float(grad.pow(2).sum()))


class ActivationGradientRecorder:
    """The same record for a quantized, frozen base, whose weights have no `.grad`: each step's
    weight gradient of module m is computed from its input x and output gradient g,
    `∇W_m = Σ_tokens g xᵀ` (what autograd would accumulate into a full-precision weight)."""

    def __init__(self, modules: dict[str, torch.nn.Module]):
        self.modules = modules
        self.accumulated = {name: torch.zeros(m.out_features, m.in_features) for name, m in modules.items()}
        self.energies: dict[str, list[float]] = {name: [] for name in modules}
        self.step = {name: torch.zeros(m.out_features, m.in_features) for name, m in modules.items()}
        self.handles = [module.register_forward_hook(self._hook(name)) for name, module in modules.items()]

    def _hook(self, name: str):
        def forward(module, inputs, output):
            if not output.requires_grad:
                return
            x = inputs[0].detach()

            def backward(grad: torch.Tensor) -> None:
                g = grad.reshape(-1, grad.shape[-1]).float()
                self.step[name] += g.T @ x.reshape(-1, x.shape[-1]).float()

            output.register_hook(backward)

        return forward

    def end_step(self) -> None:
        for name, grad in self.step.items():
            self.accumulated[name] += grad
            self.energies[name].append(float(grad.pow(2).sum()))
            grad.zero_()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class FrozenGradientRecorder(GradientRecorder):
    """The record at a frozen full-precision base (`probe_lora.frozen_base`): only the candidate
    weights require gradients, and no optimizer holds state for them, so the probe keeps the
    weights, one gradient and one accumulated gradient of the probed modules, and nothing else."""

    def __init__(self, modules: dict[str, torch.nn.Linear]):
        super().__init__(modules)
        for module in modules.values():
            module.weight.requires_grad_(True)

    def end_step(self) -> None:
        self.on_gradients(None)
        for module in self.modules.values():
            module.weight.grad = None

    def close(self) -> None:
        """Nothing to release: the gradients land on the weights, no hooks were registered."""


def probe_frozen(model: torch.nn.Module, recorder, batches, cfg, what: str = "frozen base") -> tuple[object, dict]:
    """`cfg.max_steps` steps of `cfg.grad_accum_steps` micro-batches through a frozen base:
    gradients are recorded, nothing is updated (a 4-/8-bit base cannot be; a full-precision one
    with `frozen_base` need not be), so every step measures the base that LoRA will start from."""
    from tqdm.auto import tqdm

    from pipelines.core.errors import StopRequested, stop_requested

    loss_fn = chunked_loss.for_loop(objectives.chat_objective(model), model, cfg, NAME)
    model.enable_input_require_grads()  # backward reaches every layer although no weight trains
    model.train()
    losses = []
    iterator = iter(batches)
    try:
        for _ in tqdm(range(cfg.max_steps), desc=f"{NAME} ({what})", disable=not distributed.is_main()):
            total = 0.0
            for _ in range(cfg.grad_accum_steps):
                batch = loop.to_device(next(iterator), device())
                with loop.autocast(device(), cfg.precision):
                    loss, _ = loss_fn(model, batch)
                (loss / cfg.grad_accum_steps).backward()
                total += float(loss.detach()) / cfg.grad_accum_steps
            recorder.end_step()
            losses.append(total)
            if stop_requested():
                raise StopRequested(f"{NAME}: {stop_requested()} after {len(losses)} of {cfg.max_steps} probe steps (nothing to resume: a rerun probes again)")
    finally:
        recorder.close()
    return recorder, {"steps": len(losses), "train_loss": losses[-1] if losses else float("nan")}


def scores(recorder, ranks: list[int], redundancy: str = "detrended") -> dict:
    """Values, costs and redundancies from the recorded gradients (see the module docstring)."""
    total = sum(float(g.pow(2).sum()) for g in recorder.accumulated.values())
    if not total > 0:
        raise QllmError("probe_lora: all recorded gradients are zero; nothing to allocate")
    values, costs, shapes = {}, {}, {}
    for name, grad in recorder.accumulated.items():
        d_out, d_in = grad.shape
        squared = torch.linalg.svdvals(grad).pow(2).cumsum(0)
        values[name] = {r: float(squared[min(r, len(squared)) - 1]) / total for r in ranks}
        costs[name] = {r: r * (d_in + d_out) for r in ranks}
        shapes[name] = {"d_in": d_in, "d_out": d_out, "energy_share": float(squared[-1]) / total}
    names = sorted(recorder.energies)
    series = np.array([recorder.energies[n] for n in names])
    if redundancy == "detrended":
        detrended = qubo.detrended_redundancy(names, series)
        pairs = {f"{a}|{b}": detrended.get((a, b), 0.0) for a, b in itertools.combinations(names, 2)}
    else:
        with np.errstate(invalid="ignore", divide="ignore"):
            correlation = np.nan_to_num(np.corrcoef(series)) if series.shape[1] > 1 else np.zeros((len(names), len(names)))
        pairs = {f"{a}|{b}": round(max(0.0, float(correlation[i, j])), 6) for (i, a), (j, b) in itertools.combinations(enumerate(names), 2)}
    return {"ranks": ranks, "values": values, "costs": costs, "redundancy": pairs, "modules": shapes, "steps": series.shape[1]}


def run(chat_dir: Path, out: Path, params: ProbeLoraParams, tracker=None) -> dict:
    cfg = params.train
    qconfig = quantize.from_params(params, params.train.precision, NAME)
    frozen = qconfig is not None or params.frozen_base
    train_rows, _, data_metrics, estimates = finetune.rows_and_estimate(params, chat_dir, params if qconfig is not None else None, NAME, probe=frozen)
    model, tokenizer = load_model_and_tokenizer(params.base_model) if qconfig is None else quantize.load(params.base_model, qconfig, NAME)
    batches = loop.Batches(len(train_rows), cfg.micro_batch_size, cfg.seed, chat_examples.collate(train_rows, tokenizer.pad_token_id, params.packing))
    if frozen:  # gradients at the frozen base (see probe_frozen)
        if distributed.world_size() > 1:
            raise QllmError(f"{NAME}: a frozen-base probe records one process's gradients; set probe_lora.train.nproc to 1")
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        if qconfig is not None:
            recorder, what = ActivationGradientRecorder(candidate_modules(model, params.target_modules)), "quantized base"
        else:
            with CONSTRUCTION:
                model = model.to(device())
            if cfg.gradient_checkpointing:
                loop.activation_checkpointing(model, True, NAME)
            recorder, what = FrozenGradientRecorder(candidate_modules(model, params.target_modules)), "frozen base"
        recorder, result = probe_frozen(model, recorder, batches, cfg, what)
    else:
        with CONSTRUCTION:
            model = model.to(device())
        recorder = GradientRecorder(candidate_modules(model, params.target_modules))
        loss_fn = chunked_loss.for_loop(objectives.chat_objective(model), model, cfg, NAME)
        result = loop.train(model, loss_fn, batches, cfg, tracker=tracker, extensions=[recorder], desc=NAME)
        result.pop("history")  # the probe's weights and curves are thrown away
    table = scores(recorder, params.ranks, params.redundancy)
    if distributed.is_main():  # under torchrun, rank 0 alone writes the output
        with atomic_dir(out) as tmp:
            write_json(tmp / SCORES_FILE, table)
    top = sorted(table["modules"].items(), key=lambda item: -item[1]["energy_share"])
    return {
        "steps": result["steps"],
        "train_loss": result["train_loss"],
        "modules": len(table["values"]),
        "top_module": top[0][0],
        "top_energy_share": round(top[0][1]["energy_share"], 4),
        "mean_redundancy": round(float(np.mean(list(table["redundancy"].values()) or [0.0])), 4),
        "data/train_examples": data_metrics["data/train_examples"],
        "frozen_base": frozen,
        **estimates,
    }


UNUSED_README = """\
# LoRA probe not run

`lora.allocation` is not `quantum_opt`: the lora stage allocates its ranks itself (or uses
uniform ranks), so no static allocation needs these scores. For the static QUBO allocation
(this probe, then quantum_opt): `lora.allocation: quantum_opt` (docs/lora.md, "LoRA rank allocation as a QUBO").
"""


def body(ctx: stage.StageContext) -> dict:
    allocation = ctx.param("lora.allocation")
    if allocation != "quantum_opt":  # only the static allocation reads the scores
        stage.placeholder(ctx, UNUSED_README)  # the same bytes for every other allocation
        ctx.log.info("probe_lora: not needed (lora.allocation is %s)", allocation)
        return {"used": False}
    params = finetune.resolve_base(ctx, ctx.input("models/pretrain"))
    out = ctx.output()
    metrics = run(ctx.input("chat"), out, params, ctx.tracker)
    ctx.tracker.log_artifact(out / SCORES_FILE)
    ctx.log.info(
        "probed %d modules over %d steps; most gradient energy in %s (%.1f%%), mean redundancy %.3f",
        metrics["modules"], metrics["steps"], metrics["top_module"], 100 * metrics["top_energy_share"], metrics["mean_redundancy"],
    )
    return {"used": True, **metrics}


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
