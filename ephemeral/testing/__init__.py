"""Fakes that ship, for tests and offline runs, beside the seams they stand in for.

- ``ephemeral.testing.sandbox``: the ``fake`` sandbox driver (in memory, scripted; never an
  isolation level ``auto`` picks).
- ``ephemeral.testing.providers``: real HTTP servers on 127.0.0.1 that answer like the model
  APIs, from a script.
- ``ephemeral.testing.broker``: a run as the broker sees it (``BrokerContext``), in memory.
"""
