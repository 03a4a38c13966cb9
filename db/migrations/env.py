"""Alembic environment, run only by :mod:`kvsplit.db.migrate` in the transaction it began (on SQLite with foreign
keys off); loaded by path, outside the package, it gets the connection and version table in ``config.attributes``."""

from alembic import context

config = context.config
if config.attributes.get("connection") is None:
    raise RuntimeError("kvsplit migrations run through kvsplit.db.migrate, not the alembic command")
# SQLite cannot ALTER most things: batch mode recreates the table instead.
context.configure(connection=config.attributes["connection"], version_table=config.attributes["version_table"],
                  render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
