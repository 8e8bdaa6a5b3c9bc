"""What the stages share: params schemas and loading, the stage contract, the training loop, models,
adapters, quantization, chat templates, data readers, tracking. Never imports a stage (tests/core/test_dag.py)."""
