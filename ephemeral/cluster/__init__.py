"""Scale-out: several processes serving one API (docs/deploy.md, "Scale-out: many hosts").

- ``leases``: a worker process's own lease, renewed from a thread while its event loop turns.
- ``outbox``: the admission outbox of dispatch mode (no admitted run without a Prefect task run).
- ``sharing``: what every process of a cluster must share, checked at start.
"""
