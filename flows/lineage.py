"""Moved to `qllm.registry.lineage` (0.2); this old name forwards to it for one release (`flows.moved`)."""

from flows.moved import forward

forward(__name__, __spec__)
