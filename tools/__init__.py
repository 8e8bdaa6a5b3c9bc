"""Operations tooling: commands that check, prepare or report rather than measure a feature, kept
out of `benchmarks/` so that it holds measurements only.

- `gpu_check`, `device_wheels`, `device_run.sh`: the device check (docs/development.md, "The
  device check"): the CUDA paths run on a lent GPU machine, the wheels it lacks, the script it runs;
- `same_bytes`, `same_outputs`: a change that should change nothing checked to change no stage
  output (the whole pipeline at two commits, compared byte for byte or by DVC's md5s);
- `suite_time`: where `make test`'s time goes, from the times the suite records.
"""
