"""The rules every kv_split must satisfy, whatever chose it.

A choice from the tuning database, a shipped table, the caller or the
environment is always passed through :func:`constrain`, which halves K until
all of these hold:

(a) K <= an optional upper bound (argument or ``KVSPLIT_MAX_SPLIT``);
(b) a group of 512 / K threads, 16 bytes each, holds a whole row:
    (512 / K) * 16 >= head_dim * element size;
(c) the CTA count fits the grid budget of 2 CTAs per SM (checked on GPUs only:
    the CPU implementation has no grid);
(d) K <= num_splits.

K = 1 always satisfies them, so a tampered table can only cost speed.
"""

from __future__ import annotations

KV_SPLITS = (1, 2, 4, 8, 16)
THREADS_PER_CTA = 512
BYTES_PER_THREAD = 16
CTAS_PER_SM = 2


def rows_per_cta(kv_split: int, head_dim: int, elem_bytes: int) -> int:
    """Rows one CTA covers per slice (0 when a group cannot hold a row)."""
    return (THREADS_PER_CTA // kv_split) * BYTES_PER_THREAD // (head_dim * elem_bytes)


def num_ctas(kv_split: int, head_dim: int, elem_bytes: int, rows: int) -> int:
    """Slices (CTAs before the grid cap) the kernel launches for ``rows``."""
    per_cta = rows_per_cta(kv_split, head_dim, elem_bytes)
    return -(-rows // per_cta) if per_cta else 0


def violations(kv_split: int, *, head_dim: int, elem_bytes: int, rows: int, num_splits: int,
               sm_count: int | None, max_split: int | None = None) -> list[str]:
    """Names of the constraints that ``kv_split`` breaks (empty: valid)."""
    broken = []
    if max_split is not None and kv_split > max_split:
        broken.append("max_split")
    if rows_per_cta(kv_split, head_dim, elem_bytes) < 1:
        broken.append("group_holds_row")
    if (sm_count is not None and kv_split > 1
            and num_ctas(kv_split, head_dim, elem_bytes, rows) > CTAS_PER_SM * sm_count):
        broken.append("cta_budget")
    if kv_split > max(num_splits, 1):
        broken.append("num_splits")
    return broken


def constrain(kv_split: int, *, head_dim: int, elem_bytes: int, rows: int, num_splits: int,
              sm_count: int | None, max_split: int | None = None) -> int:
    """Halve ``kv_split`` until it satisfies every constraint; never below 1."""
    if kv_split not in KV_SPLITS:
        raise ValueError(f"kv_split must be one of {KV_SPLITS}, got {kv_split!r}")
    k = kv_split
    while k > 1 and violations(k, head_dim=head_dim, elem_bytes=elem_bytes, rows=rows,
                               num_splits=num_splits, sm_count=sm_count, max_split=max_split):
        k //= 2
    return k


def valid_kv_splits(*, head_dim: int, elem_bytes: int, rows: int, num_splits: int,
                    sm_count: int | None, max_split: int | None = None) -> list[int]:
    """Every K that satisfies the constraints, ascending (always includes 1)."""
    return [k for k in KV_SPLITS
            if k == 1 or not violations(k, head_dim=head_dim, elem_bytes=elem_bytes, rows=rows,
                                        num_splits=num_splits, sm_count=sm_count,
                                        max_split=max_split)]
