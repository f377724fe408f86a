"""Harbor (``pip install harbor``, Python >= 3.12) runs its tasks in our sandboxes:

    harbor run -p TASK_DIR -a oracle -e ephemeral.harbor:EphemeralEnvironment -n 4

Each trial is one sandbox session (docs/integrations.md). Harbor itself is imported only here:
the rest of the package runs without it.
"""

from ephemeral.harbor.environment import EphemeralEnvironment

__all__ = ["EphemeralEnvironment"]
