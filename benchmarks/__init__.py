"""Reproducible measurements, each a ratio against a baseline run in the same command, grouped by
theme: `speed` (our own code's speed), `peers` (the same work in TRL and Hugging Face `Trainer`),
`quality` (what training settings and methods give on held-out questions, over seeds), `adapters`
(LoRA, QLoRA and their rank allocations), `scale` (more data, bigger models) and `serving` (models
answering, the team's deployment). `common` holds what they share: the machine line, the per-seed
loop and the mean ± sd summary. Results: `benchmarks/RESULTS.md` and `benchmarks/results/`. Tools
that check rather than measure (the device check, same bytes across commits, the suite's times)
are in `tools/`.
"""
