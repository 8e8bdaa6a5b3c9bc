"""Params of `grpo`: reward functions, tools and environments, and the GRPO losses.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from pipelines.core import extensions
from pipelines.core.errors import QllmError
from pipelines.core.extensions import user_reward, user_tool
from pipelines.core.params.base import AppliesWhen, Section
from pipelines.core.params.finetuning import LoraAdapterParams, adapter_moved
from pipelines.core.params.training import TrainParams


class RewardParams(Section):
    """One reward function of `grpo.rewards` and its weight."""

    function: str = Field(min_length=1)
    """A built-in reward (`exact_match`, `strict_match`, `format`, `environment`: the environment's `reward()`) or a user's `package.module:function` (importable
    from the project, e.g. a module next to params.yaml; plain or `async def`), called as TRL calls one
    (`prompts`, `completions`, `completion_ids`, `trainer_state`, `log_extra`, `log_metric`, and the
    records' columns `answer`, `id`, `source`, `split`, and `candidates`). Reward models are refused."""
    weight: float = 1.0
    """The function's weight in the summed reward (TRL's `reward_weights`)."""

    @field_validator("function")
    @classmethod
    def _loads(cls, name: str) -> str:
        try:
            user_reward(name, "function")
        except QllmError as exc:
            raise ValueError(str(exc)) from None
        return name

    @property
    def name(self) -> str:
        """What its metrics are logged under (`rewards/<name>/mean`): the function's own name, as TRL's."""
        return self.function.rpartition(":")[2]


WITH_TOOLS = AppliesWhen("tools listed in `functions` or an `environment`", lambda s: s.enabled, shows=("functions", "environment"))
"""Episode settings, which one-turn rollouts (no tool) do not read."""


class ToolsParams(Section):
    """Tools the model may call: multi-turn episodes in GRPO's rollouts, and in evaluate's answers to
    the held-out questions that offer tools (docs/grpo.md "Tools")."""

    functions: list[str] = []
    """`calculator` (built in: exact arithmetic) or a user's `package.module:function` with type hints and a
    Google-style docstring (its JSON schema is made from them, as TRL's tools); each is imported and described when
    params load. Empty: one-turn rollouts, as without tools."""
    max_turns: Annotated[int, WITH_TOOLS] = Field(3, ge=2)
    """The model's turns per episode, its calls and its answer; an episode still calling tools at the last one is truncated."""
    timeout_seconds: Annotated[float, WITH_TOOLS] = Field(5.0, gt=0)
    """A call running longer is abandoned and the model reads a time-out error."""
    style: Annotated[Literal["auto", "hermes", "llama3"], WITH_TOOLS] = "auto"
    """How calls are written: `hermes` (`<tool_call>` blocks: Qwen2.5, Hermes), `llama3` (one JSON object: Llama 3.1),
    or `auto`, from the chat template."""
    environment: str | None = None
    """A user's environment class, `package.module:Class`, for tools with a state: a new instance per episode
    (constructed with no arguments), `reset(record)` on the question's record if it has one, its public methods
    the tools (beside `functions`; type hints and docstrings, as a function tool's), and `reward()`, if it has
    one, the episode's own reward, which the `environment` reward function reads (docs/grpo.md "Environments").
    None: each call runs the named function, with no state."""

    @field_validator("functions")
    @classmethod
    def _load(cls, names: list[str]) -> list[str]:
        loaded = []
        for i, name in enumerate(names):
            try:
                fn = user_tool(name, f"functions[{i}]")
            except QllmError as exc:
                raise ValueError(str(exc)) from None
            loaded.append(name if fn is None else fn.__name__)
        if len(set(loaded)) != len(loaded):
            raise ValueError(f"functions: two tools share a name ({', '.join(sorted({n for n in loaded if loaded.count(n) > 1}))})")
        return names

    @field_validator("environment")
    @classmethod
    def _environment(cls, name: str | None) -> str | None:
        if name is not None:
            try:
                extensions.environment_tools(name, "environment")
            except QllmError as exc:
                raise ValueError(str(exc)) from None
        return name

    @property
    def enabled(self) -> bool:
        """Episodes with tools: `functions` or an `environment` given."""
        return bool(self.functions or self.environment)


class GrpoParams(Section):
    """Reinforcement learning with verifiable rewards (GRPO and its Dr. GRPO and DAPO losses, as
    TRL's `GRPOTrainer`) from the SFT model, on the chat records' questions (docs/grpo.md)."""

    enabled: bool = True
    """Train the GRPO model. Off: the stage writes only a README (no cost)."""
    rewards: list[RewardParams] = Field(default_factory=lambda: [RewardParams(function="exact_match")], min_length=1)
    """Reward functions and weights; each is checked (imported, signature) when params load."""
    group_size: int = Field(8, ge=2)
    """Completions sampled per prompt (TRL's `num_generations`); the advantages are normalised
    within each group. `train.micro_batch_size` counts completions and must be a multiple of it."""
    max_completion_length: int = Field(16, ge=1)
    """Tokens a completion may have; one that reaches it without a stop token is truncated. With
    tools, each of the model's turns, and the tools' answers between two turns (cut to fit, saying so)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the rollouts (TRL's default 1.0)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling of the rollouts (1.0: off)."""
    beta: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the reference (the SFT model); 0, TRL's default, loads no
    reference. With > 0, the reference log-probabilities are computed once per generation."""
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = "dapo"
    """How the per-token loss is averaged (TRL's names; docs/grpo.md): grpo per completion then
    over completions, dr_grpo over completions x max_completion_length, dapo (TRL's default) over
    the generation batch's completion tokens, bnpo over the micro-batch's."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide the centred rewards by the group's standard deviation (GRPO), the batch's, or not at
    all (Dr. GRPO)."""
    epsilon: float = Field(0.2, gt=0, lt=1)
    """The ratio clipping range's lower side (and upper, unless `epsilon_high` is set)."""
    epsilon_high: float | None = Field(None, gt=0)
    """The upper side (DAPO's clip-higher uses 0.28); None: `epsilon`."""
    num_iterations: int = Field(1, ge=1)
    """Optimizer steps per generation (GRPO's mu): more than 1 reuses each batch of completions,
    with the ratio to the policy that generated them clipped."""
    mask_truncated_completions: bool = False
    """Leave truncated completions (no stop token within `max_completion_length`) out of the loss (DAPO)."""
    log_completions_every: int = Field(10, ge=0)
    """Log a table of sample completions with their rewards to MLflow every N steps (0: never)."""
    adapter: LoraAdapterParams = LoraAdapterParams()
    """A LoRA adapter on the policy (`enabled: true`; the same block as `lora.adapter`), or all its
    weights trained (`enabled: false`)."""
    tools: ToolsParams = ToolsParams()
    train: TrainParams = TrainParams()

    @model_validator(mode="before")
    @classmethod
    def _lora_moved(cls, data: Any) -> Any:
        return adapter_moved(data, "grpo")

    @model_validator(mode="after")
    def _environment_reward(self) -> GrpoParams:
        listed = [f"rewards[{i}]" for i, spec in enumerate(self.rewards) if spec.function == "environment"]
        if listed and self.tools.environment is None:
            raise ValueError(f"{listed[0]}: `environment` is the episode's reward from its environment's `reward()`, and "
                             "`tools.environment` names none; set it, or list another reward")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _batches_hold_groups(self) -> GrpoParams:
        names = [r.name for r in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"rewards: two functions share a name ({', '.join(names)}), so their metrics would too")
        if self.train.micro_batch_size % self.group_size:
            raise ValueError(f"train.micro_batch_size ({self.train.micro_batch_size}) counts completions and must be a multiple of group_size "
                             f"({self.group_size}), so that each micro-batch holds whole groups")  # fmt: skip
        if self.train.loss_chunk_tokens:
            raise ValueError("train.loss_chunk_tokens: grpo does not chunk its loss (it scores its completions' tokens itself); set it to 0")
        if self.train.nproc > 1:
            raise ValueError("train.nproc: grpo runs in one process (its rollouts are generated where it trains); set it to 1")
        return self
