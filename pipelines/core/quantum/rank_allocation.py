"""LoRA ranks allocated while training: AdaLoRA (the peer) and the QUBO re-solved inside the loop.

Both train SVD-form adapters (PEFT's AdaLoRA: `ΔW = P Λ Q` per module, every module starting at
rank `init_r`, an orthogonality penalty on P and Q) and mask rank components (zero entries of Λ,
`lora_E`) so that the adapters end within a budget. They differ in how they choose:

- `AdaLoraSchedule` (`lora.allocation: adalora`): PEFT's own `RankAllocator`, called after every
  optimizer step as PEFT documents: a component's importance is the smoothed sensitivity
  |θ·∇θ| of its Λ entry and its P/Q rows times its uncertainty; the total rank budget falls
  from `init_r` per module to `adapter.r` per module on a cubic schedule between `tinit` and
  `max_steps - tfinal`, each time keeping the most important components across all modules.
- `QuboReallocation` (`lora.allocation: qubo_in_loop`): the quantum training agent's
  `if should_optimize(): quantum_optimize(context)`. Every `every` steps in the same window it
  turns the same running importances into the QUBO of `pipelines.core.quantum.qubo`: the value of rank r
  for module m is the share of all importance its r best components hold, the cost r·(d_in+d_out)
  parameters, the redundancy between two modules the correlation of their gradient energies'
  step-to-step changes (log, first differences: detrended, so the common downward drift of all
  energies is not mistaken for shared information); solved within the *parameter* budget of rank
  `adapter.r` on every module, with the chosen solver, and each solve's energy, feasibility,
  gap to the MILP optimum and wall time logged to MLflow. Each module keeps its r best
  components, the others are masked after every step until the next solve.

Both are extensions (`pipelines.core.extensions`) whose state (importances, energies, masks) is
saved in every checkpoint: a run resumes exactly across re-allocations.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from pipelines.core.extensions import Extension
from pipelines.core.models import fused_adapters
from pipelines.core.params.finetuning import AdaptiveParams, LoraAdapterParams

log = logging.getLogger("qllm.rank_allocation")

ADAPTER = "default"


def adalora_config(adapter: LoraAdapterParams, adaptive: AdaptiveParams, max_steps: int, trainable_token_ids: list[int] = ()):
    """PEFT's `AdaLoraConfig`: `adapter.target_modules` at rank `init_r`, target average rank
    `adapter.r` (the budget), the schedule of `adaptive` over `max_steps`. AdaLoRA scales its update
    by `lora_alpha / init_r` at every rank; `lora_alpha` is set so that this is
    `adapter.lora_alpha / adapter.r`, the scale of the uniform adapter of the same budget, which every
    allocation of the lora stage keeps (as `lora.apply_allocation` does per module)."""
    from peft import AdaLoraConfig

    return AdaLoraConfig(
        init_r=adaptive.init_r, target_r=adapter.r, tinit=adaptive.tinit, tfinal=adaptive.tfinal, deltaT=adaptive.every,
        beta1=adaptive.beta1, beta2=adaptive.beta2, orth_reg_weight=adaptive.orth_reg_weight, total_step=max_steps,
        lora_alpha=adapter.lora_alpha * adaptive.init_r / adapter.r, lora_dropout=adapter.lora_dropout, target_modules=list(adapter.target_modules),
        trainable_token_indices={"embed_tokens": list(trainable_token_ids)} if trainable_token_ids else None, task_type="CAUSAL_LM",
    )  # fmt: skip


def wrap(adapter: LoraAdapterParams, adaptive: AdaptiveParams, max_steps: int, section: str = "lora.adapter"):
    """`(model, tokenizer) -> PeftModel` with SVD-form (AdaLoRA) adapters on `adapter.target_modules`,
    each computed in fewer passes (`fused_adapters.fuse`)."""
    from pipelines.core.models import adapters

    def apply(model: torch.nn.Module, tokenizer) -> torch.nn.Module:
        from peft import get_peft_model

        adapters.check_targets(model, adapter, section)
        peft_model = get_peft_model(model, adalora_config(adapter, adaptive, max_steps, adapters.token_ids(tokenizer, adapter.trainable_tokens, section)))
        fused_adapters.fuse(peft_model)
        return peft_model

    return apply


def svd_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The adapted modules (those with `lora_E`), by name without the PEFT prefix."""
    return {name.removeprefix("base_model.model."): module for name, module in model.named_modules()
            if hasattr(module, "lora_E") and ADAPTER in getattr(module, "lora_E", {})}  # fmt: skip


def active_ranks(model: torch.nn.Module) -> dict[str, int]:
    """Rank components in use (non-zero Λ entries) per adapted module."""
    return {name: int((module.lora_E[ADAPTER] != 0).sum()) for name, module in svd_modules(model).items()}


def active_parameters(model: torch.nn.Module) -> int:
    """Parameters of the components in use: r·(d_in + d_out) per module (as the budget counts them)."""
    total = 0
    for module in svd_modules(model).values():
        d_in, d_out = module.lora_A[ADAPTER].shape[1], module.lora_B[ADAPTER].shape[0]
        total += int((module.lora_E[ADAPTER] != 0).sum()) * (d_in + d_out)
    return total


def budget(model: torch.nn.Module, rank: int) -> int:
    """The parameter budget: rank `rank` on every adapted module."""
    return sum(rank * (m.lora_A[ADAPTER].shape[1] + m.lora_B[ADAPTER].shape[0]) for m in svd_modules(model).values())


def _tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().cpu().clone() for name, tensor in state.items()}


class _Logging(Extension):
    """Allocation metrics to the stage's MLflow run (when there is one) and the log."""

    def __init__(self, model: torch.nn.Module, tracker=None) -> None:
        self.model, self.tracker = model, tracker

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.tracker is not None:
            self.tracker.log_metrics(metrics, step=step)

    def on_train_end(self, state, result: dict[str, Any]) -> None:
        result.update(summary(self.model))


def summary(model: torch.nn.Module) -> dict[str, float]:
    """What the allocation ended with, for the stage's metrics."""
    ranks = active_ranks(model)
    return {"allocation/active_parameters": active_parameters(model), "allocation/active_ranks": sum(ranks.values()),
            "allocation/modules_with_rank": sum(1 for r in ranks.values() if r > 0)}  # fmt: skip


class AdaLoraSchedule(_Logging):
    """PEFT's AdaLoRA rank allocation in the shared loop (see the module docstring)."""

    name = "adalora"

    def __init__(self, model: torch.nn.Module, tracker=None) -> None:
        super().__init__(model, tracker)
        self.peft = model.base_model  # AdaLoraModel: update_and_allocate, rankallocator, peft_config

    def on_optimizer_step(self, state) -> None:
        config = self.peft.peft_config[ADAPTER]
        self.peft.update_and_allocate(state.step)
        if state.step % config.deltaT == 0 or state.step == config.total_step - config.tfinal:
            self._log({"allocation/active_parameters": float(active_parameters(self.model)),
                       "allocation/active_ranks": float(sum(active_ranks(self.model).values()))}, state.step + 1)  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        allocator = self.peft.rankallocator
        pattern = self.peft.peft_config[ADAPTER].rank_pattern
        return {"ipt": _tensors(allocator.ipt), "exp_avg_ipt": _tensors(allocator.exp_avg_ipt), "exp_avg_unc": _tensors(allocator.exp_avg_unc),
                "rank_pattern": {k: [bool(x) for x in v] for k, v in (pattern or {}).items()}}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        allocator = self.peft.rankallocator
        device = next(self.model.parameters()).device
        for field in ("ipt", "exp_avg_ipt", "exp_avg_unc"):
            setattr(allocator, field, {name: tensor.to(device) for name, tensor in state[field].items()})
        self.peft.peft_config[ADAPTER].rank_pattern = dict(state["rank_pattern"]) or None


class QuboReallocation(_Logging):
    """The QUBO re-solved every `every` steps on the running statistics (see the module docstring)."""

    name = "qubo_reallocation"

    def __init__(self, model: torch.nn.Module, adaptive: AdaptiveParams, budget_rank: int, max_steps: int, tracker=None,
                 section: str = "lora") -> None:  # fmt: skip
        super().__init__(model, tracker)
        self.params, self.max_steps = adaptive, max_steps
        self.setting = f"{section}.adaptive"  # where its settings are, for messages
        self.modules = svd_modules(model)
        self.names = sorted(self.modules)
        self.shapes = {n: (m.lora_A[ADAPTER].shape[1], m.lora_B[ADAPTER].shape[0]) for n, m in self.modules.items()}
        self.budget = budget(model, budget_rank)
        self.ranks = [r for r in adaptive.ranks if r <= adaptive.init_r]
        self.importance = {n: torch.zeros(adaptive.init_r) for n in self.names}
        self.uncertainty = {n: torch.zeros(adaptive.init_r) for n in self.names}
        self.energies: list[list[float]] = []
        self.keep: dict[str, torch.Tensor] | None = None  # per module, the components kept (None: all)
        self.solves = 0

    # ------------------------------------------------------------------ statistics of each step
    def _record(self) -> None:
        beta1, beta2 = self.params.beta1, self.params.beta2
        energy = []
        with torch.no_grad():
            for name in self.names:
                module = self.modules[name]
                a, b, e = module.lora_A[ADAPTER], module.lora_B[ADAPTER], module.lora_E[ADAPTER]
                grads = [p.grad for p in (a, b, e)]
                if any(g is None for g in grads):
                    energy.append(0.0)
                    continue
                # AdaLoRA's sensitivity of a component: |θ·∇θ| of its Λ entry plus the mean over its P row and Q column
                score = ((e * grads[2]).abs().view(-1) + (a * grads[0]).abs().mean(1) + (b * grads[1]).abs().mean(0)).float().cpu()
                self.uncertainty[name] = beta2 * self.uncertainty[name] + (1 - beta2) * (score - self.importance[name]).abs()
                self.importance[name] = beta1 * self.importance[name] + (1 - beta1) * score
                energy.append(float(sum(g.float().pow(2).sum() for g in grads)))
        self.energies.append(energy)
        window = max(2 * self.params.every, 8)
        del self.energies[:-window]

    def _scores(self) -> dict[str, torch.Tensor]:
        return {n: self.importance[n] * self.uncertainty[n] for n in self.names}

    # ------------------------------------------------------------------ the problem and its solve
    def problem(self) -> tuple[dict, dict, dict]:
        """(values, costs, redundancy) from the running statistics."""
        from pipelines.core.quantum import qubo

        scores = self._scores()
        total = float(sum(s.sum() for s in scores.values())) or 1.0
        values, costs = {}, {}
        for name in self.names:
            ordered = torch.sort(scores[name], descending=True).values.cumsum(0)
            d_in, d_out = self.shapes[name]
            values[name] = {r: float(ordered[r - 1]) / total for r in self.ranks}
            costs[name] = {r: r * (d_in + d_out) for r in self.ranks}
        return values, costs, qubo.detrended_redundancy(self.names, np.array(self.energies).T)

    def solve(self, step: int, last: bool = False) -> None:
        """Re-allocate at `step` (1-based); `last`: the final re-allocation, whose gaps to the MILP
        reference are logged (`reference_timeout`)."""
        from pipelines.core.quantum import qubo

        values, costs, redundancy = self.problem()
        started = time.perf_counter()
        allocation = qubo.allocate_ranks(values, costs, self.budget, redundancy, lam=self.params.lam, solver=self.params.solver,
                                         seed=self.solves, timeout=self.params.timeout, num_reads=self.params.num_reads or None,
                                         setting=f"{self.setting}.timeout")  # fmt: skip
        seconds = time.perf_counter() - started
        gap = bound_gap = None
        if last and self.params.reference_timeout and self.params.solver != "milp":
            # only measures: None (logged) where HiGHS finds nothing in time on this machine; training goes on
            reference = qubo.reference(values, costs, self.budget, redundancy, lam=self.params.lam, timeout=self.params.reference_timeout,
                                       setting=f"{self.setting}.reference_timeout")  # fmt: skip
            if reference is not None:
                gap, bound_gap = qubo.gaps(allocation, reference)
        scores = self._scores()
        self.keep = {}
        for name in self.names:
            keep = torch.zeros(self.params.init_r, dtype=torch.bool)
            keep[torch.argsort(scores[name], descending=True, stable=True)[: allocation[name]]] = True
            self.keep[name] = keep
        self.solves += 1
        self._apply()
        metrics = {"qubo/energy": allocation.energy if allocation.energy is not None else float("nan"),
                   "qubo/feasible": float(allocation.feasible), "qubo/objective": allocation.objective,
                   "qubo/wall_seconds": seconds, "qubo/active_parameters": float(allocation.cost),
                   "qubo/modules_with_rank": float(sum(1 for r in allocation.values() if r > 0))}  # fmt: skip
        if gap is not None:
            metrics["qubo/gap_to_milp"] = gap
        if bound_gap is not None:
            metrics["qubo/gap_to_bound"] = bound_gap
        self._log(metrics, step)
        reference_note = "" if gap is None else f" (MILP at its limit: {100 * gap:+.2f}%" + ("" if bound_gap is None else f"; within {100 * bound_gap:.2f}% of the optimum") + ")"
        log.info("step %d: QUBO re-allocation %d (%s): %d of %d parameters on %d modules, objective %.4f%s, %.2f s", step, self.solves,
                 allocation.solver, allocation.cost, self.budget, metrics["qubo/modules_with_rank"], allocation.objective, reference_note, seconds)  # fmt: skip

    def _apply(self) -> None:
        """Zero the Λ entries of the components not kept (AdaLoRA's masking)."""
        if self.keep is None:
            return
        with torch.no_grad():
            for name, keep in self.keep.items():
                entries = self.modules[name].lora_E[ADAPTER]
                entries.masked_fill_(~keep.to(entries.device).view_as(entries), 0.0)

    def due(self, step: int) -> bool:
        """`should_optimize()`: a solve at the steps `tinit`, `tinit + every`, ... before the final `tfinal` steps."""
        last = self.max_steps - self.params.tfinal
        return self.params.tinit <= step <= last and ((step - self.params.tinit) % self.params.every == 0 or step == last)

    def on_optimizer_step(self, state) -> None:
        step = state.step  # 0-based index of the step just taken
        if step < self.max_steps - self.params.tfinal:
            self._record()
        if self.due(step):
            self.solve(step + 1, last=step == self.max_steps - self.params.tfinal)
        else:
            self._apply()

    # ------------------------------------------------------------------ exact resume
    def state_dict(self) -> dict[str, Any]:
        return {"importance": _tensors(self.importance), "uncertainty": _tensors(self.uncertainty), "energies": [list(e) for e in self.energies],
                "keep": None if self.keep is None else _tensors(self.keep), "solves": self.solves}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.importance, self.uncertainty = dict(state["importance"]), dict(state["uncertainty"])
        self.energies = [list(e) for e in state["energies"]]
        self.keep = None if state["keep"] is None else dict(state["keep"])
        self.solves = int(state["solves"])
