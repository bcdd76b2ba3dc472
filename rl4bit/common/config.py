"""What every config section shares: ConfigError and the common value checks.

The sections themselves live beside the code that takes them (`rl4bit.trainer.config`,
`rl4bit.sampler.config`, `rl4bit.trainer.recipe`); `rl4bit.config` gathers them into the job's tree.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A bad configuration value; the message names the key path and the fix."""


def positive(obj: Any, path: str, *names: str) -> None:
    """ConfigError naming the first of `names` (fields of `obj`, under key path `path`) that is not > 0."""
    for name in names:
        v = getattr(obj, name)
        if v <= 0:
            raise ConfigError(f"{path}.{name}: {v} must be > 0")
