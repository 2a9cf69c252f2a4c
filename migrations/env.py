"""Alembic environment for the batchrun ledger.

The ledger upgrades itself when opened (``batchrun.ledger.engine``), passing its
open connection in ``config.attributes["connection"]``; ``batchrun db upgrade``
does the same. Running ``alembic`` by hand needs ``-x url=...``.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from batchrun.ledger.models import metadata

config = context.config
target_metadata = metadata


def run_migrations(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    run_migrations(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("alembic: pass the ledger with -x url=sqlite:///path/to/ledger.db")
    engine = create_engine(url)
    with engine.begin() as conn:
        run_migrations(conn)
