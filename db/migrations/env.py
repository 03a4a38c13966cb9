"""Alembic environment, driven only from :mod:`kvsplit.db.migrate`.

Alembic loads this file by path, outside the package, so it imports nothing
from kvsplit: the connection and version table come in ``config.attributes``.
The caller has already begun the transaction (and, on SQLite, turned foreign
keys off), so the whole upgrade commits or rolls back as one.
"""

from alembic import context

config = context.config
connection = config.attributes.get("connection")
if connection is None:
    raise RuntimeError("kvsplit migrations run through kvsplit.db.migrate, not the alembic command")

context.configure(
    connection=connection,
    version_table=config.attributes["version_table"],
    # SQLite cannot ALTER most things; batch mode recreates the table instead.
    render_as_batch=True,
)
with context.begin_transaction():
    context.run_migrations()
