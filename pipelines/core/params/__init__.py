"""The params: one typed, frozen section per stage (`project.Params`, the whole `params.yaml`),
the sections grouped by the family of stages that read them (`data`, `training`, `pretraining`,
`finetuning`, `preference`, `rl`, `release`), the machinery they are built on (`base`), and
reading `params.yaml`, profiles and `--set`s into them (`files`)."""
