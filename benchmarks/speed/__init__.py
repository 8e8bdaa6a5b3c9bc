"""Speed of our own code against a baseline in the same process: the shared training loop against
a bare PyTorch loop (tokens/s), one optimizer step, the extension API's dispatch, bf16 against fp32
matrix products, stages sharing the cores, DPO and GRPO reference log-probs cached or live,
multi-turn episodes with the KV cache kept, and a tiny `qllm run` before and after a change.
Results: `benchmarks/results/speed.md` (and preference-rl.md, suite.md).
"""
