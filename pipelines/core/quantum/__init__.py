"""LoRA rank allocation as a QUBO: the problem, its solvers, and the allocation while training."""
