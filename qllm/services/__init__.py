"""The services a run or a team uses: the Prefect API and worker, MLflow's server, PostgreSQL, a TLS front."""
