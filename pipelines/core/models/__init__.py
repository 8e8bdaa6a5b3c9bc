"""Models: building, loading and saving, adapters, quantization, the pipeline's own model classes, memory estimates."""
