"""What users run besides the Prefect flows: the `qllm` command (`cli`), model serving (`serving`),
MLflow read-back (`registry`) and the services a team runs (`services`). The library is `pipelines`."""
