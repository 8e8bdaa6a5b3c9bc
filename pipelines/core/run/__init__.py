"""Running a stage: the stage runner, DVC reproduction, MLflow tracking, lineage, resources, plots."""
