"""The run engine: a run from admission to its record (docs/architecture.md).

- ``engine``: :class:`~ephemeral.engine.engine.Engine`; its docstring walks one run from
  admission to record.
- ``runtime``: :class:`~ephemeral.engine.runtime.Runtime`, the engine plus what a serving
  process keeps beside it (watchdog, leases, recovery, images, isolation).
- ``executor``: how a run that got an execution slot is carried out (the seam to Prefect).
- ``close``: the one close of a run or session (one transaction); ``record``: a settled run
  turned into its analysis records.
- ``outcomes``: what a run came to, for grading; ``verify``: where and with what verify runs
  (an environment the agent could not shape).
"""
