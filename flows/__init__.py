"""The Prefect flows: the pipeline (`pipeline`), the sweep (`sweep`) and the task that runs one
dvc.yaml stage (`stages`). The modules that lived here before 0.2 forward from their old names
for one release (`moved`).
"""
