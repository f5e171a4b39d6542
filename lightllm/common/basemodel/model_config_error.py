"""The error of a checkpoint config this server cannot read or run.

Its own module so that the readers of each part of config.json (:mod:`.model_config`,
:mod:`.rope_config`) raise the same error without importing each other.
"""

from __future__ import annotations


class ModelConfigError(ValueError):
    """The checkpoint's config.json is missing something we need or holds a bad value."""
