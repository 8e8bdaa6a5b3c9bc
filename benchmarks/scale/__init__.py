"""The pipeline at larger sizes: the data stages' seconds and peak memory on N MB of extra text,
and the fine-tuning stages on bases with the exact shapes of real models (Qwen2.5-0.5B and -1.5B),
LoRA against QLoRA's memory. Results: `benchmarks/results/scale.md`.
"""
