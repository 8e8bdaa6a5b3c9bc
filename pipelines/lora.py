"""LoRA fine-tuning with PEFT on chat data: the SFT procedure with adapters instead of all weights.

    python -m pipelines.lora       # what dvc.yaml runs; writes data/models/lora/

Same data, masking, packing and loop as `sft` (`pipelines.core.training.finetune`); only the model wrapper
differs: `peft.get_peft_model` with a `LoraConfig` built from `lora.*` (r, lora_alpha,
lora_dropout, target_modules, layers_to_transform, rank_pattern/alpha_pattern, bias, use_rslora)
plus the embedding rows of `lora.adapter.trainable_tokens` (the chat markers, which the pretrained base
has never seen).

With `lora.allocation: qubo_in_loop` (the default: the QUBO re-solved every `adaptive.every`
steps) and `adalora` (PEFT's AdaLoRA) every module starts at rank `adaptive.init_r` and the budget,
the parameters of rank `adapter.r` on every module, is allocated while training
(`pipelines.core.quantum.rank_allocation`); with `quantum_opt` the targeted modules and their ranks
come from `data/quantum_opt/allocation.json` (`apply_allocation`); `uniform` uses rank `r` on every
`target_modules` entry. Every allocation scales each module's update by `lora_alpha` over the uniform
rank of its budget, whatever rank the module gets.

Output: a PEFT adapter directory (`PeftModel.from_pretrained(base, "data/models/lora")`, or
`AutoPeftModelForCausalLM.from_pretrained` from the project root: the adapter records its base as
the relative path `data/models/pretrain`) plus, with `lora.adapter.merge: true`, the adapter merged into
the base as a full model in `data/models/lora/merged/`.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.core.errors import QllmError
from pipelines.core.models import adapters, model_source, quantize
from pipelines.core.outputs import read_json
from pipelines.core.params.finetuning import LoraParams
from pipelines.core.quantum import rank_allocation
from pipelines.core.run import stage
from pipelines.core.training import finetune

NAME = "lora"
SECTION = "lora.adapter"
"""Where the adapter's settings are in params (errors name their keys under it)."""
ADAPTIVE = ("adalora", "qubo_in_loop")
"""The allocations made while training (`pipelines.core.quantum.rank_allocation`)."""
ALLOCATION_FILE = "allocation.json"
"""The file of quantum_opt's output directory that gives the modules and their ranks."""


def apply_allocation(params: LoraParams, allocation: dict, where: str | Path = ALLOCATION_FILE) -> LoraParams:
    """Target exactly the allocated modules with their ranks. The per-module alphas keep the update
    scale `lora_alpha / budget_rank` of the uniform adapter of the same parameter budget (the
    allocation's `budget_rank`) at every rank; with rsLoRA the scaling alpha/sqrt(r) already adapts
    to each rank. `where`: the allocation's file, for the error message."""
    ranks = {module: int(rank) for module, rank in allocation["rank_pattern"].items() if rank > 0}
    if not ranks:
        raise QllmError(f"{where}: no module was given a rank; use lora.allocation: uniform or a larger quantum_opt budget")
    if "budget_rank" not in allocation:
        raise QllmError(f"{where}: no budget_rank (the uniform rank of the allocation's budget): it was written by an older quantum_opt; "
                        "rerun quantum_opt (qllm run reruns it)")  # fmt: skip
    adapter = params.adapter
    alphas = {} if adapter.use_rslora else {m: adapter.lora_alpha * r / allocation["budget_rank"] for m, r in ranks.items()}
    allocated = adapter.model_copy(update={"target_modules": sorted(ranks), "rank_pattern": ranks, "alpha_pattern": alphas})
    return params.model_copy(update={"adapter": allocated})


def run(chat_dir: Path, out: Path, params: LoraParams, tracker=None, checkpoint_dir: Path | None = None, base_for_users: str | None = None,
        replay_answers: Path | None = None) -> dict:  # fmt: skip
    """`base_for_users`: how the adapter names its base (default: `params.base_model`, as given);
    `replay_answers`: the run's `base_answers` output (`lora.replay`)."""
    if base_for_users is None:
        base_for_users = params.base_model
    adapter = params.adapter
    qconfig = quantize.from_params(adapter.base_quantization, params.train.precision, SECTION)
    quantized_base = (params.base_model, qconfig) if qconfig is not None else None
    wrap, extensions = adapters.wrap(adapter, SECTION), None
    if params.allocation in ADAPTIVE:  # SVD-form adapters whose ranks are allocated while they train
        steps = params.train.max_steps
        wrap = rank_allocation.wrap(adapter, params.adaptive, steps, SECTION)
        if params.allocation == "adalora":
            def extensions(model, tracker):
                return [rank_allocation.AdaLoraSchedule(model, tracker)]
        else:
            def extensions(model, tracker):
                return [rank_allocation.QuboReallocation(model, params.adaptive, adapter.r, steps, tracker, NAME)]
    return finetune.run(
        chat_dir, out, params, wrap=wrap, save=adapters.save(base_for_users, adapter.merge, quantized_base),
        tracker=tracker, checkpoint_dir=checkpoint_dir, desc=NAME, quantization=adapter.base_quantization, quantization_section=SECTION, extensions=extensions,
        lora_rank=trained_rank(params), replay_answers=replay_answers,
    )


def trained_rank(params: LoraParams) -> int:
    """The largest rank a module trains at, which the memory estimate counts on every module: the
    in-training allocations' starting rank `adaptive.init_r`, else the largest of `r` and the
    per-module ranks (quantum_opt's, once `apply_allocation` has set them)."""
    if params.allocation in ADAPTIVE:
        return params.adaptive.init_r
    return max([params.adapter.r, *params.adapter.rank_pattern.values()]) if params.allocation == "uniform" else max(params.adapter.rank_pattern.values())


def body(ctx: stage.StageContext) -> dict:

    declared = ctx.params.base_model
    params = finetune.resolve_base(ctx, ctx.input("models/pretrain"))
    record = model_source.pointed(params.base_model)
    if record is not None:  # fine-tuning mode: the adapter names the user's base, as they name it
        declared = record["name"]
    if params.allocation == "quantum_opt":  # the allocation file is a dependency: in the fingerprint already
        path = ctx.input("quantum_opt") / ALLOCATION_FILE
        allocation = read_json(path)
        params = apply_allocation(params, allocation, path.relative_to(ctx.root))
        ctx.log.info("lora: %d modules with ranks from quantum_opt (%s)", len(params.adapter.rank_pattern), allocation["solver"])
    metrics = run(ctx.input("chat"), ctx.output(), params, ctx.tracker, ctx.checkpoint_dir, base_for_users=declared, replay_answers=ctx.input("base_answers"))
    ctx.log.info(
        "lora: %d of %d parameters trainable (%.2f%%), %d steps, val/loss %.4f",
        metrics["trainable_parameters"], metrics["total_parameters"], 100 * metrics["trainable_fraction"],
        metrics["steps"], metrics.get("val/loss", float("nan")),
    )
    return metrics


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
