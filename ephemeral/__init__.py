"""Ephemeral: run AI agents on untrusted code in disposable sandboxes under a hard money cap.

Two ideas drive the design (see docs/architecture.md):
- a run is a projection of its event log;
- secrets never enter the sandbox.
"""

__version__ = "0.1.0"
