"""How long a test waits before it calls something hung: bounds against hanging only, never a
claim about speed (times belong in bench/). With ``stress -c 8`` beside the suite (load 25-35 on
these 2 cores) a worker's or ``serve``'s start alone took two minutes, a cluster module's setup
three, an eval fan-out 272 s: each wait below is a poll on a condition, and it returns as soon as
the condition holds."""

from __future__ import annotations

# One wait on a condition: a process up or gone, a run taken or settled, a command's exit.
PATIENCE = 900.0
# The pytest-timeout of the tests that drive real processes, Prefect servers or Harbor
# (tests/conftest.py gives it to every test under HUNG_DIRS or marked ``prefect``); a module
# fixture's setup (a cluster: PostgreSQL, Prefect and its processes) counts against its first
# test. The suite's own 300 s (pyproject.toml) stays for the rest.
HUNG_SECONDS = 2400
HUNG_DIRS = ("tests/cluster/", "tests/harbor/")
