"""Adapters and their ranks: LoRA rank allocations at one parameter budget (QUBO, greedy, uniform,
AdaLoRA, random), the QUBO's solvers against the MILP optimum, QLoRA against LoRA (memory, step
time, quality, merging) and the fused adapter forms against PEFT's. Results:
`benchmarks/results/adapters.md`.
"""
