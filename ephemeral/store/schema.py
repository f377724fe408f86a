"""Tables of the operational store (orgs, keys, runs, events, ledger, idempotency, transcripts).

Tables are created with ``create_all`` when the store opens, and :func:`upgrade` then makes an
older database current with additive steps only (a new nullable column, a wider string). The
first change that is not additive needs Alembic (``render_as_batch=True`` for SQLite).

Money is integer micro-dollars in BIGINT columns. The CHECK constraints are a backstop; the
conditional ``UPDATE … RETURNING`` statements in :mod:`ephemeral.store.ledger` are what keep
concurrent writers from overdrawing.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect

metadata = sa.MetaData()

LEDGER_KINDS = ("model", "web", "compute", "reserve", "refund", "settle", "credit")
CHARGE_KINDS = ("model", "web", "compute")

# Plain JSON, not JSONB: the policy is returned exactly as stored, key order included.
JSONType = sa.JSON()


class UTCDateTime(sa.TypeDecorator[datetime]):
    """Aware UTC datetimes in and out, whatever the backend keeps.

    SQLite has no time zones: values are stored as naive UTC so that string comparison (used by
    the run list cursor) orders them correctly.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the store; use ephemeral.ids.utcnow()")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _kinds(column: str, kinds: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(k) for k in kinds)})"


orgs = sa.Table(
    "orgs",
    metadata,
    sa.Column("id", sa.String(40), primary_key=True),
    sa.Column("name", sa.String(200), nullable=False, unique=True),
    sa.Column("balance_micros", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("reserved_micros", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.CheckConstraint("reserved_micros >= 0", name="orgs_reserved_nonneg"),
    sa.CheckConstraint("reserved_micros <= balance_micros", name="orgs_no_overdraft"),
)

api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("id", sa.String(40), primary_key=True),
    sa.Column("org_id", sa.String(40), sa.ForeignKey("orgs.id"), nullable=False, index=True),
    sa.Column("member", sa.String(320), nullable=False),
    sa.Column("prefix", sa.String(16), nullable=False, index=True),
    sa.Column("hash", sa.String(64), nullable=False, unique=True),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("revoked_at", UTCDateTime, nullable=True),
)

runs = sa.Table(
    "runs",
    metadata,
    sa.Column("id", sa.String(40), primary_key=True),
    sa.Column("org_id", sa.String(40), sa.ForeignKey("orgs.id"), nullable=False),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("model", sa.String(200), nullable=False),
    sa.Column("prompt", sa.Text, nullable=True),
    sa.Column("policy", JSONType, nullable=False),
    sa.Column("labels", JSONType, nullable=False),
    sa.Column("isolation", sa.String(40), nullable=True),
    # the sandbox runtime's version line ("runsc version 0.0~20221219.0"), host-measured
    sa.Column("runtime", sa.String(200), nullable=True),
    sa.Column("sandbox_id", sa.String(200), nullable=True),
    # the image the sandbox ran (name) and its definition's hash, set when the sandbox is ready
    sa.Column("image", sa.String(1024), nullable=True),  # a built name or an OCI reference
    sa.Column("image_hash", sa.String(64), nullable=True),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("started_at", UTCDateTime, nullable=True),
    sa.Column("ended_at", UTCDateTime, nullable=True),
    sa.Column("termination_reason", sa.String(40), nullable=True),
    sa.Column("termination_detail", sa.Text, nullable=True),
    sa.Column("usage", JSONType, nullable=False),
    sa.Column("reserved_micros", sa.BigInteger, nullable=False),
    sa.Column("charged_micros", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("refunded_micros", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("breakdown", JSONType, nullable=False),
    sa.Column("settled_at", UTCDateTime, nullable=True),
    sa.Column("output", sa.Text, nullable=True),
    sa.Column("owner", sa.String(300), nullable=True),
    sa.Column("idempotency_key", sa.String(255), nullable=True),
    sa.Column("erased_at", UTCDateTime, nullable=True),
    # The per-run event counter: bumping it row-locks the run, which serialises appends.
    sa.Column("last_seq", sa.Integer, nullable=False, server_default="0"),
    # 'session' for a sandbox session (ephemeral.sessions.manager); NULL is a run
    sa.Column("kind", sa.String(16), nullable=True),
    # Scale-out (docs/deploy.md): the host executing the run, the lease it renews on it, and a
    # cancel request any process may set for that host to act on.
    sa.Column("host", sa.String(100), nullable=True),
    sa.Column("lease_renewed_at", UTCDateTime, nullable=True),
    sa.Column("lease_expires_at", UTCDateTime, nullable=True),
    sa.Column("cancel_requested_at", UTCDateTime, nullable=True),
    # Set once the run's analysis records are written (after its close): recovery records a
    # settled run whose process died before this, so every run is recorded exactly once.
    sa.Column("recorded_at", UTCDateTime, nullable=True),
    # The admission outbox (ephemeral.cluster.outbox): when the run's Prefect task run was created
    # (NULL: not yet, or handed back by a draining worker), and which hand-over this is (its
    # task run's id is derived from the run id and this number, so a re-drive is idempotent).
    sa.Column("dispatched_at", UTCDateTime, nullable=True),
    sa.Column("dispatches", sa.Integer, nullable=True),
    sa.CheckConstraint("reserved_micros >= 0", name="runs_reserved_nonneg"),
    sa.CheckConstraint(
        "charged_micros >= 0 AND charged_micros <= reserved_micros", name="runs_charged_in_budget"
    ),
    sa.CheckConstraint("refunded_micros >= 0", name="runs_refunded_nonneg"),
    sa.Index("runs_org_created", "org_id", "created_at", "id"),
    sa.Index("runs_status", "status"),
)

run_events = sa.Table(
    "run_events",
    metadata,
    sa.Column("run_id", sa.String(40), sa.ForeignKey("runs.id"), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True),
    sa.Column("type", sa.String(64), nullable=False),
    sa.Column("at", sa.String(32), nullable=False),
    sa.Column("data", JSONType, nullable=False),
    sa.CheckConstraint("seq >= 1", name="run_events_seq_positive"),
)

ledger = sa.Table(
    "ledger",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("org_id", sa.String(40), sa.ForeignKey("orgs.id"), nullable=False),
    # NULL for org credits, which belong to no run.
    sa.Column("run_id", sa.String(40), sa.ForeignKey("runs.id"), nullable=True, index=True),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("amount_micros", sa.BigInteger, nullable=False),
    sa.Column("idempotency_key", sa.String(300), nullable=False, unique=True),
    sa.Column("note", sa.String(500), nullable=True),
    sa.Column("at", UTCDateTime, nullable=False),
    sa.CheckConstraint(_kinds("kind", LEDGER_KINDS), name="ledger_kind"),
    sa.CheckConstraint("kind = 'credit' OR amount_micros >= 0", name="ledger_amount_nonneg"),
)

idempotency = sa.Table(
    "idempotency",
    metadata,
    sa.Column("org_id", sa.String(40), sa.ForeignKey("orgs.id"), primary_key=True),
    sa.Column("key", sa.String(255), primary_key=True),
    sa.Column("body_hash", sa.String(128), nullable=True),
    sa.Column("run_id", sa.String(40), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False, index=True),
    sa.CheckConstraint("state IN ('admitting', 'done')", name="idempotency_state"),
)

run_transcripts = sa.Table(
    "run_transcripts",
    metadata,
    sa.Column("run_id", sa.String(40), sa.ForeignKey("runs.id"), primary_key=True),
    sa.Column("messages", JSONType, nullable=False),
    sa.Column("updated_at", UTCDateTime, nullable=False),
)

# Broker connections (one per org and name). ``sealed_headers`` is a Fernet token made by
# ``ephemeral.broker.secrets``; the store never holds a credential in plaintext.
connections = sa.Table(
    "connections",
    metadata,
    sa.Column("org_id", sa.String(40), sa.ForeignKey("orgs.id"), primary_key=True),
    sa.Column("name", sa.String(63), primary_key=True),
    sa.Column("base_url", sa.String(2048), nullable=False),
    sa.Column("header_names", JSONType, nullable=False),
    sa.Column("sealed_headers", sa.Text, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
)

# Zero-data-retention content crossing processes (a prompt to the worker, an output to its
# reader): a Fernet token, deleted when read or past ``expires_at``; never plaintext at rest.
sealed_content = sa.Table(
    "sealed_content",
    metadata,
    sa.Column("run_id", sa.String(40), sa.ForeignKey("runs.id"), primary_key=True),
    sa.Column("kind", sa.String(16), primary_key=True),
    sa.Column("sealed", sa.Text, nullable=False),
    sa.Column("expires_at", UTCDateTime, nullable=False, index=True),
    sa.CheckConstraint("kind IN ('prompt', 'output')", name="sealed_content_kind"),
)


# Facts every process of a cluster must agree on (ephemeral.cluster.sharing): the records root's
# marker, the seal key's fingerprint. The first process to start writes them.
cluster_facts = sa.Table(
    "cluster_facts",
    metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("value", sa.String(200), nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
)


# Worker hosts that take sandbox sessions (ephemeral.sessions.placement): where each one's internal
# channel listens, which process is there, its session slots, and a heartbeat like a lease.
worker_hosts = sa.Table(
    "worker_hosts",
    metadata,
    sa.Column("host", sa.String(100), primary_key=True),
    sa.Column("address", sa.String(100), nullable=False),
    sa.Column("instance", sa.String(64), nullable=False),
    sa.Column("session_slots", sa.Integer, nullable=False),
    sa.Column("sessions_live", sa.Integer, nullable=False),
    sa.Column("heartbeat_at", UTCDateTime, nullable=False),
    sa.Column("expires_at", UTCDateTime, nullable=False),
)


# One row per worker process: its liveness, apart from the run rows (ephemeral.cluster.leases).
process_leases = sa.Table(
    "process_leases",
    metadata,
    sa.Column("owner", sa.String(300), primary_key=True),
    sa.Column("host", sa.String(100), nullable=False),
    sa.Column("renewed_at", UTCDateTime, nullable=False),
    sa.Column("expires_at", UTCDateTime, nullable=False),
)


def upgrade(conn: sa.Connection) -> None:
    """Bring a database made by an older release up to :data:`metadata`, additively.

    Adds every nullable column the database lacks and widens string columns that have grown
    (PostgreSQL enforces lengths; SQLite does not). Idempotent; runs on every open.
    """
    inspector = sa.inspect(conn)
    for table in metadata.sorted_tables:
        have = {c["name"]: c for c in inspector.get_columns(table.name)}
        for column in table.columns:
            ddl_type = column.type.compile(dialect=conn.dialect)
            if column.name not in have:
                if not column.nullable:
                    raise RuntimeError(
                        f"{table.name}.{column.name}: not additive, needs a migration"
                    )
                conn.execute(
                    sa.text(f"ALTER TABLE {table.name} ADD COLUMN {column.name} {ddl_type}")
                )
                if (table.name, column.name) == ("runs", "recorded_at"):
                    # Every run an older release settled was recorded at its close.
                    conn.execute(
                        sa.text(
                            "UPDATE runs SET recorded_at = settled_at WHERE settled_at IS NOT NULL"
                        )
                    )
                if (table.name, column.name) == ("runs", "dispatched_at"):
                    # An older release handed every run over as it admitted it: none is the
                    # outbox's to re-drive (that would make a second task run).
                    conn.execute(sa.text("UPDATE runs SET dispatched_at = created_at"))
                continue
            old = getattr(have[column.name]["type"], "length", None)
            new = getattr(column.type, "length", None)
            if conn.dialect.name == "postgresql" and old and new and old < new:
                conn.execute(
                    sa.text(f"ALTER TABLE {table.name} ALTER COLUMN {column.name} TYPE {ddl_type}")
                )
