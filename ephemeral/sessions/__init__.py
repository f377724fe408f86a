"""Sandbox sessions: a sandbox a client drives, stored as a run of kind session
(docs/architecture.md).

- ``requests``: what a client sends (``SessionRequest``, ``ExecRequest``) and their size bounds.
- ``manager``: :class:`~ephemeral.sessions.manager.Sessions` and a live session (``Live``).
- ``placement``: sessions placed on worker hosts, for API processes in dispatch mode.
- ``host``: a worker host's side of placed sessions.
- ``link``: the internal channel between them (signed frames over a ``Transport``).
"""
