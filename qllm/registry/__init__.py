"""Reading back what MLflow recorded: a registered model's lineage, runs side by side."""
