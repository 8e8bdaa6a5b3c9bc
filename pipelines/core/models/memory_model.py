"""The memory extension: a Llama with product-key memory layers, a model class of its own.

A product-key memory (Lample et al., NeurIPS 2019, "Large Memory Layers with Product Keys";
Berges et al. 2024, "Memory Layers at Scale") is a table of `num_keys**2` learned value vectors
addressed by a query: the query is split in two halves, each half is scored against `num_keys`
sub-keys, and the best `topk` of each side combine into `topk**2` candidates of which the best
`topk` are read (a softmax over their scores weights the values). Per token only `heads * topk`
rows of the table are touched, so the table can be large for little compute. As in "Memory
Layers at Scale" the read values are gated (`silu(W_g x)`) and projected back to the hidden size;
the memory's output is added to the MLP's in each of `memory_layers`.

`QllmMemoryLlamaForCausalLM` is a `LlamaForCausalLM` whose config (`model_type:
qllm_memory_llama`) lists the memory layers and sizes, so that `save_pretrained` writes the
memory with the model and `from_pretrained` restores it:

- inside the pipeline the classes are registered with `AutoConfig`/`AutoModelForCausalLM` on
  import (`pipelines.core.models.models` imports this module), so stages load it like any causal LM;
- elsewhere, the saved directory carries this file (`auto_map`, transformers' custom-code
  mechanism): `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`.

This file therefore imports only torch and transformers.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM


class QllmMemoryConfig(LlamaConfig):
    """`LlamaConfig` plus the product-key memory settings."""

    model_type = "qllm_memory_llama"

    def __init__(self, memory_layers: list[int] | None = None, memory_num_keys: int = 64, memory_heads: int = 2,
                 memory_key_dim: int = 32, memory_topk: int = 8, **kwargs) -> None:  # fmt: skip
        self.memory_layers = list(memory_layers or [])
        self.memory_num_keys = memory_num_keys
        self.memory_heads = memory_heads
        self.memory_key_dim = memory_key_dim
        self.memory_topk = memory_topk
        super().__init__(**kwargs)


class ProductKeyMemory(nn.Module):
    """`num_keys**2` values of `hidden` dimensions, `heads` product-key lookups of `topk` rows each."""

    def __init__(self, hidden: int, num_keys: int, heads: int, key_dim: int, topk: int) -> None:
        super().__init__()
        if key_dim % 2:
            raise ValueError(f"memory_key_dim must be even (two half-keys), got {key_dim}")
        if topk > num_keys:
            raise ValueError(f"memory_topk ({topk}) must not exceed memory_num_keys ({num_keys})")
        self.num_keys, self.heads, self.half, self.topk = num_keys, heads, key_dim // 2, topk
        self.query = nn.Linear(hidden, heads * key_dim, bias=False)
        self.query_norm = nn.LayerNorm(key_dim, elementwise_affine=False)  # Lample et al. normalise the query (BatchNorm there)
        self.keys = nn.Parameter(torch.empty(heads, 2, num_keys, self.half))
        self.values = nn.EmbeddingBag(num_keys * num_keys, hidden, mode="sum")
        self.gate = nn.Linear(hidden, hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.reset_memory()
        self.last_indices: torch.Tensor | None = None
        """The rows read by the latest forward, `[tokens, heads * topk]` (for usage statistics)."""

    def reset_memory(self) -> None:
        nn.init.uniform_(self.keys, -1 / math.sqrt(self.half), 1 / math.sqrt(self.half))
        nn.init.normal_(self.values.weight, std=self.values.weight.shape[1] ** -0.5)

    def lookup(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(row indices, weights), each `[tokens, heads, topk]`, for `x` of `[tokens, hidden]`."""
        query = self.query_norm(self.query(x).view(-1, self.heads, 2 * self.half)).view(-1, self.heads, 2, self.half)
        keys = self.keys.to(query.dtype)
        left = torch.einsum("nhd,hkd->nhk", query[:, :, 0], keys[:, 0])  # [tokens, heads, num_keys]
        right = torch.einsum("nhd,hkd->nhk", query[:, :, 1], keys[:, 1])
        left_scores, left_index = left.topk(self.topk, dim=-1)
        right_scores, right_index = right.topk(self.topk, dim=-1)
        scores = (left_scores[..., :, None] + right_scores[..., None, :]).flatten(-2)  # topk**2 candidates
        rows = (left_index[..., :, None] * self.num_keys + right_index[..., None, :]).flatten(-2)
        best, position = scores.topk(self.topk, dim=-1)
        return rows.gather(-1, position), torch.softmax(best.float(), dim=-1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        rows, weights = self.lookup(x)
        flat = rows.reshape(x.shape[0], -1)
        self.last_indices = flat.detach()
        read = self.values(flat, per_sample_weights=weights.reshape(x.shape[0], -1).to(self.values.weight.dtype))
        return self.out(read.to(x.dtype) * nn.functional.silu(self.gate(x))).reshape(shape)


def _add_memory(mlp: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of a memory layer's MLP: its output plus the memory's (a copied layer reads its own `mlp.memory`)."""
    return output + mlp.memory(args[0])


class QllmMemoryLlamaForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` with a `ProductKeyMemory` beside the MLP of each layer in `config.memory_layers`
    (parameters `model.layers.<i>.mlp.memory.*`; every other name as in Llama)."""

    config_class = QllmMemoryConfig

    def __init__(self, config: QllmMemoryConfig) -> None:
        super().__init__(config)
        for index in config.memory_layers:
            if not 0 <= index < config.num_hidden_layers:
                raise ValueError(f"memory_layers: layer {index} does not exist (the model has {config.num_hidden_layers} layers)")
            mlp = self.model.layers[index].mlp
            mlp.memory = ProductKeyMemory(config.hidden_size, config.memory_num_keys, config.memory_heads, config.memory_key_dim,
                                          config.memory_topk)  # fmt: skip
            mlp.register_forward_hook(_add_memory)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, ProductKeyMemory):
            module.reset_memory()

    def memories(self) -> dict[int, ProductKeyMemory]:
        return {index: self.model.layers[index].mlp.memory for index in self.config.memory_layers}


AutoConfig.register(QllmMemoryConfig.model_type, QllmMemoryConfig, exist_ok=True)
AutoModelForCausalLM.register(QllmMemoryConfig, QllmMemoryLlamaForCausalLM, exist_ok=True)
QllmMemoryConfig.register_for_auto_class()
QllmMemoryLlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")
