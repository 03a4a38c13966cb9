"""First schema: results and candidates store an integer kv_split."""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None


def _create(name: str, columns: dict, *constraints: sa.Constraint) -> None:
    # An integer id, then the columns, all NOT NULL (a tuple: the type and a foreign key).
    op.create_table(name, sa.Column("id", sa.Integer(), primary_key=True),
                    *(sa.Column(n, *(t if isinstance(t, tuple) else (t,)), nullable=False) for n, t in columns.items()),
                    *constraints)


def _parent(table: str, name: str) -> tuple:
    return sa.Integer(), sa.ForeignKey(f"{table}.id", ondelete="CASCADE", name=name)


def upgrade() -> None:
    _create("devices", {"name": sa.String(128), "cc_major": sa.Integer(), "cc_minor": sa.Integer(),
                        "sm_count": sa.Integer()},
            sa.UniqueConstraint("name", "cc_major", "cc_minor", "sm_count", name="uq_devices_identity"))
    _create("kernel_builds", {"build_hash": sa.String(128), "library_version": sa.String(64)},
            sa.UniqueConstraint("build_hash", name="uq_kernel_builds_build_hash"))
    key = ("device_id", "build_id", "head_dim", "partial_dtype", "out_dtype", "stats_format", "num_splits", "rows")
    _create("tuning_results", {
        "device_id": _parent("devices", "fk_tuning_results_device_id"),
        "build_id": _parent("kernel_builds", "fk_tuning_results_build_id"),
        "head_dim": sa.Integer(), "partial_dtype": sa.String(16), "out_dtype": sa.String(16),
        "stats_format": sa.String(16), "num_splits": sa.Integer(), "rows": sa.Integer(),
        "winner_kv_split": sa.Integer(), "l2_state": sa.String(8), "repeats": sa.Integer(),
        "noise_margin": sa.Float(), "tool_version": sa.String(64), "created_at": sa.DateTime(),
        "updated_at": sa.DateTime(),
    }, sa.UniqueConstraint(*key, name="uq_tuning_results_key"))
    _create("tuning_candidates", {
        "result_id": _parent("tuning_results", "fk_tuning_candidates_result_id"), "kv_split": sa.Integer(),
        "median_us": sa.Float(), "p10_us": sa.Float(), "p90_us": sa.Float(), "samples": sa.Integer(),
        "matched": sa.Boolean(),
    }, sa.UniqueConstraint("result_id", "kv_split", name="uq_tuning_candidates_kv_split"))


def downgrade() -> None:
    for table in ("tuning_candidates", "tuning_results", "kernel_builds", "devices"):
        op.drop_table(table)
