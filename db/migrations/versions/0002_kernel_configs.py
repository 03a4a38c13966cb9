"""Configs: a kernel family and JSON parameters replace the integer kv_split.  Existing rows become family
'kvsplit' with params {"kv_split": K}, in canonical JSON (sorted keys, no spaces): the form the ORM writes."""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"

# Per table: the integer column, the family and params columns, and the candidates' unique
# constraint before and after (results have none of their own).
_TABLES = (("tuning_results", "winner_kv_split", "winner_family", "winner_params", None, None),
           ("tuning_candidates", "kv_split", "family", "params",
            ("uq_tuning_candidates_kv_split", ["result_id", "kv_split"]),
            ("uq_tuning_candidates_config", ["result_id", "family", "params"])))
_PREFIX = '{"kv_split":'


def _table(name: str, k: str, family: str, params: str) -> sa.TableClause:
    return sa.table(name, sa.column(k, sa.Integer), sa.column(family, sa.String), sa.column(params, sa.Text))


def upgrade() -> None:
    for name, k, family, params, unique_k, unique_config in _TABLES:
        table = _table(name, k, family, params)
        op.add_column(name, sa.Column(family, sa.String(32), nullable=True))
        op.add_column(name, sa.Column(params, sa.Text(), nullable=True))
        canonical = sa.literal(_PREFIX) + sa.cast(table.c[k], sa.String) + sa.literal("}")  # {"kv_split": K}
        op.execute(table.update().values({family: "kvsplit", params: canonical}))
        with op.batch_alter_table(name) as batch:
            batch.alter_column(family, existing_type=sa.String(32), nullable=False)
            batch.alter_column(params, existing_type=sa.Text(), nullable=False)
            if unique_k:
                batch.drop_constraint(unique_k[0], type_="unique")
                batch.create_unique_constraint(*unique_config)
            batch.drop_column(k)


def downgrade() -> None:
    # Only kvsplit-family rows can go back to an integer kv_split.
    conn = op.get_bind()
    others = conn.execute(sa.text("SELECT (SELECT COUNT(*) FROM tuning_results WHERE winner_family <> 'kvsplit')"
                                  " + (SELECT COUNT(*) FROM tuning_candidates WHERE family <> 'kvsplit')")).scalar_one()
    if others:
        raise RuntimeError(f"cannot downgrade: {others} rows use a family other than kvsplit")
    for name, k, family, params, unique_k, unique_config in _TABLES:
        table = _table(name, k, family, params)
        op.add_column(name, sa.Column(k, sa.Integer(), nullable=True))
        # Strip '{"kv_split":' and '}' from the canonical JSON.
        digits = sa.func.substr(table.c[params], len(_PREFIX) + 1, sa.func.length(table.c[params]) - len(_PREFIX) - 1)
        op.execute(table.update().values({k: sa.cast(digits, sa.Integer)}))
        with op.batch_alter_table(name) as batch:
            batch.alter_column(k, existing_type=sa.Integer(), nullable=False)
            if unique_k:
                batch.drop_constraint(unique_config[0], type_="unique")
                batch.create_unique_constraint(*unique_k)
            batch.drop_column(family)
            batch.drop_column(params)
