"""First schema: results and candidates store an integer kv_split.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "devices",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("cc_major", sa.Integer(), nullable=False),
        sa.Column("cc_minor", sa.Integer(), nullable=False),
        sa.Column("sm_count", sa.Integer(), nullable=False),
        sa.UniqueConstraint("name", "cc_major", "cc_minor", "sm_count", name="uq_devices_identity"),
    )
    op.create_table(
        "kernel_builds",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("build_hash", sa.String(128), nullable=False),
        sa.Column("library_version", sa.String(64), nullable=False),
        sa.UniqueConstraint("build_hash", name="uq_kernel_builds_build_hash"),
    )
    op.create_table(
        "tuning_results",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("device_id", sa.Integer(), sa.ForeignKey("devices.id", ondelete="CASCADE",
                                                           name="fk_tuning_results_device_id"), nullable=False),
        sa.Column("build_id", sa.Integer(), sa.ForeignKey("kernel_builds.id", ondelete="CASCADE",
                                                          name="fk_tuning_results_build_id"), nullable=False),
        sa.Column("head_dim", sa.Integer(), nullable=False),
        sa.Column("partial_dtype", sa.String(16), nullable=False),
        sa.Column("out_dtype", sa.String(16), nullable=False),
        sa.Column("stats_format", sa.String(16), nullable=False),
        sa.Column("num_splits", sa.Integer(), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("winner_kv_split", sa.Integer(), nullable=False),
        sa.Column("l2_state", sa.String(8), nullable=False),
        sa.Column("repeats", sa.Integer(), nullable=False),
        sa.Column("noise_margin", sa.Float(), nullable=False),
        sa.Column("tool_version", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.UniqueConstraint("device_id", "build_id", "head_dim", "partial_dtype", "out_dtype", "stats_format",
                            "num_splits", "rows", name="uq_tuning_results_key"),
    )
    op.create_table(
        "tuning_candidates",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("result_id", sa.Integer(), sa.ForeignKey("tuning_results.id", ondelete="CASCADE",
                                                           name="fk_tuning_candidates_result_id"), nullable=False),
        sa.Column("kv_split", sa.Integer(), nullable=False),
        sa.Column("median_us", sa.Float(), nullable=False),
        sa.Column("p10_us", sa.Float(), nullable=False),
        sa.Column("p90_us", sa.Float(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("matched", sa.Boolean(), nullable=False),
        sa.UniqueConstraint("result_id", "kv_split", name="uq_tuning_candidates_kv_split"),
    )


def downgrade() -> None:
    for table in ("tuning_candidates", "tuning_results", "kernel_builds", "devices"):
        op.drop_table(table)
