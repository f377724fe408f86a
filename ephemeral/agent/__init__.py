"""The agent step of an agent run (docs/architecture.md).

- ``loop``: our loop (model step, tool steps, verify, settle) and ``AgentRun``.
- ``command``: the run's own program (``agent:``) in place of our loop.
- ``retry``: retries for transient model errors, inside the run's deadline.
"""
