"""The same work done by the pipeline and by the tools users would pick instead: the training loop
against Hugging Face `Trainer`, and the sft, dpo (with KTO, ORPO, SimPO) and grpo stages against
TRL's trainers, with the same model, data and settings: step time, reference log-probs, loss and
reward curves, held-out answers. Results: `benchmarks/results/peers.md`.
"""
