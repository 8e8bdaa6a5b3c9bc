"""A trained or registered model answering: generation and the OpenAI-compatible server."""
