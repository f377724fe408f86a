"""Inspect AI sandbox provider ``ephemeral`` (``pip install ephemeral[inspect]``).

Inspect imports this module through the ``inspect_ai`` entry point (pyproject.toml), which
registers ``@sandboxenv(name="ephemeral")``; then ``inspect eval task.py --sandbox ephemeral``
runs each sample in a sandbox session (docs/integrations.md).
"""

from ephemeral.inspect_provider.config import EphemeralSandboxConfig
from ephemeral.inspect_provider.provider import EphemeralSandboxEnvironment

__all__ = ["EphemeralSandboxConfig", "EphemeralSandboxEnvironment"]
