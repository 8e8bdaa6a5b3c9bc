"""Moved: reading params is `pipelines.core.params.files`. This module re-exports it, for code written
against the old name, and warns; it goes in the next release."""

from __future__ import annotations

import warnings

from pipelines.core.params.files import *  # noqa: F401,F403
from pipelines.core.params.files import Layers, apply_overrides, deep_merge, load, parse_override, read_yaml, validate  # noqa: F401

warnings.warn("pipelines.core.params_file is pipelines.core.params.files now; the old name goes in the next release", DeprecationWarning, stacklevel=2)
