"""Models served and the team's deployment: generation speed in-process, through MLflow's model
server, the OpenAI-compatible server and llama.cpp; what authentication costs the team's MLflow
server; a second machine restoring every stage from the DVC remote; a sweep on one worker against
two. Results: `benchmarks/results/serving.md` and deployments.md.
"""
