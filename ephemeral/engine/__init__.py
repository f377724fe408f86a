"""The run engine: a run from admission to its record (docs/architecture.md).

- ``engine``: :class:`~ephemeral.engine.engine.Engine`; its docstring walks one run from
  admission to record.
- ``runtime``: :class:`~ephemeral.engine.runtime.Runtime`, the engine plus what a serving
  process keeps beside it (watchdog, leases, recovery, images, isolation).
- ``executor``: how a run that got an execution slot is carried out (the seam to Prefect).
- ``run``: :class:`~ephemeral.engine.run.Run`, what an agent run and a sandbox session both
  hold; ``custody``: a zero-data-retention run's prompt and output, held for their one reader.
- ``grants``: the grant check runs and sessions share at admission (models, connections,
  disk).
- ``close``: the one close of a run or session (one transaction); ``record``: a settled run
  turned into its analysis records.
- ``outcomes``: what a run came to, for grading; ``verify``: where and with what verify runs
  (an environment the agent could not shape).
"""
