"""What training settings and methods give on held-out questions, over seeds (mean ± sd and range,
never the best run): the pretrain -> sft defaults, curriculum, growth and memory strategies, masked
diffusion, the multimodal stage, DPO and the other preference methods, GRPO with and without tools,
and the real-model profile. Results: `benchmarks/results/quality.md`, preference-rl.md and
real-model.md.
"""
