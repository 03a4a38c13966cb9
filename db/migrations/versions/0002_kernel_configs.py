"""Configs: a kernel family and JSON parameters replace the integer kv_split.

Existing rows become family 'kvsplit' with params {"kv_split": K}.  The params
text is canonical JSON (sorted keys, no spaces), the form the ORM writes.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def _params_from(column: sa.ColumnElement) -> sa.ColumnElement:
    # '{"kv_split":' || K || '}' -- the canonical JSON of {"kv_split": K}.
    return sa.literal('{"kv_split":') + sa.cast(column, sa.String) + sa.literal("}")


def upgrade() -> None:
    results = sa.table("tuning_results", sa.column("winner_kv_split", sa.Integer),
                       sa.column("winner_family", sa.String), sa.column("winner_params", sa.Text))
    candidates = sa.table("tuning_candidates", sa.column("kv_split", sa.Integer), sa.column("family", sa.String),
                          sa.column("params", sa.Text))
    op.add_column("tuning_results", sa.Column("winner_family", sa.String(32), nullable=True))
    op.add_column("tuning_results", sa.Column("winner_params", sa.Text(), nullable=True))
    op.execute(results.update().values(winner_family="kvsplit", winner_params=_params_from(results.c.winner_kv_split)))
    with op.batch_alter_table("tuning_results") as batch:
        batch.alter_column("winner_family", existing_type=sa.String(32), nullable=False)
        batch.alter_column("winner_params", existing_type=sa.Text(), nullable=False)
        batch.drop_column("winner_kv_split")

    op.add_column("tuning_candidates", sa.Column("family", sa.String(32), nullable=True))
    op.add_column("tuning_candidates", sa.Column("params", sa.Text(), nullable=True))
    op.execute(candidates.update().values(family="kvsplit", params=_params_from(candidates.c.kv_split)))
    with op.batch_alter_table("tuning_candidates") as batch:
        batch.alter_column("family", existing_type=sa.String(32), nullable=False)
        batch.alter_column("params", existing_type=sa.Text(), nullable=False)
        batch.drop_constraint("uq_tuning_candidates_kv_split", type_="unique")
        batch.create_unique_constraint("uq_tuning_candidates_config", ["result_id", "family", "params"])
        batch.drop_column("kv_split")


def downgrade() -> None:
    # Only kvsplit-family rows can go back to an integer kv_split.
    conn = op.get_bind()
    others = conn.execute(sa.text("SELECT (SELECT COUNT(*) FROM tuning_results WHERE winner_family <> 'kvsplit')"
                                  " + (SELECT COUNT(*) FROM tuning_candidates WHERE family <> 'kvsplit')")).scalar_one()
    if others:
        raise RuntimeError(f"cannot downgrade: {others} rows use a family other than kvsplit")
    results = sa.table("tuning_results", sa.column("winner_kv_split", sa.Integer), sa.column("winner_params", sa.Text))
    candidates = sa.table("tuning_candidates", sa.column("kv_split", sa.Integer), sa.column("params", sa.Text))
    prefix = len('{"kv_split":')

    def k_of(column: sa.ColumnElement) -> sa.ColumnElement:
        # Strip '{"kv_split":' and '}' from the canonical JSON.
        digits = sa.func.substr(column, prefix + 1, sa.func.length(column) - prefix - 1)
        return sa.cast(digits, sa.Integer)

    op.add_column("tuning_results", sa.Column("winner_kv_split", sa.Integer(), nullable=True))
    op.execute(results.update().values(winner_kv_split=k_of(results.c.winner_params)))
    with op.batch_alter_table("tuning_results") as batch:
        batch.alter_column("winner_kv_split", existing_type=sa.Integer(), nullable=False)
        batch.drop_column("winner_family")
        batch.drop_column("winner_params")

    op.add_column("tuning_candidates", sa.Column("kv_split", sa.Integer(), nullable=True))
    op.execute(candidates.update().values(kv_split=k_of(candidates.c.params)))
    with op.batch_alter_table("tuning_candidates") as batch:
        batch.alter_column("kv_split", existing_type=sa.Integer(), nullable=False)
        batch.drop_constraint("uq_tuning_candidates_config", type_="unique")
        batch.create_unique_constraint("uq_tuning_candidates_kv_split", ["result_id", "kv_split"])
        batch.drop_column("family")
        batch.drop_column("params")
