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
The second kernel family's rules and :func:`constrain_config`, which applies
either family's, follow below.
"""

from __future__ import annotations

from typing import NamedTuple

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


# -- configs of both families -------------------------------------------------------------
#
# The DSplit family (csrc/include/kvsplit/merge_dsplit.cuh) splits a row's head
# dim across `slices` CTAs, each holding `kv_split` groups of `lanes` threads
# (16 bytes each) for one slice, loading `depth` partials per round. Its rules:
# (a) kv_split <= the upper bound and (d) kv_split <= num_splits, as above;
# (e) a slice is 4..32 vectors of 16 bytes (a group within one warp; thinner
#     slices measured slower), a power of two;
# (f) a CTA has 32..512 threads: lanes * kv_split;
# (g) depth is 4 or 8 (a stored depth of anything else runs as 4).
# Its grid loops, so it has no CTA budget. A DSplit config that cannot be
# mended by halving kv_split falls back to the KvSplit family.

KVSPLIT, DSPLIT = 0, 1
FAMILY_NAMES = ("kvsplit", "dsplit")
DSPLIT_SLICES = (1, 2, 4, 8, 16)
DSPLIT_KV_SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)
DSPLIT_DEPTHS = (4, 8)
DSPLIT_MIN_LANES, DSPLIT_MAX_LANES = 4, 32
DSPLIT_MIN_THREADS, DSPLIT_MAX_THREADS = 32, 512


class Config(NamedTuple):
    """What the kernel runs: a family and its parameters (hashable, cheap to unpack)."""

    family: int   # KVSPLIT or DSPLIT
    slices: int   # CTAs per row (1 for KvSplit)
    kv_split: int  # groups per CTA, each merging every kv_split-th partial
    depth: int = 4  # partials loaded per round trip (KvSplit: 4)

    @property
    def family_name(self) -> str:
        return FAMILY_NAMES[self.family]

    @property
    def label(self) -> str:
        if self.family == KVSPLIT:
            return f"kvsplit(kv_split={self.kv_split})"
        return f"dsplit(depth={self.depth}, kv_split={self.kv_split}, slices={self.slices})"

    def params(self) -> dict[str, int]:
        """The database's parameters of this config."""
        if self.family == KVSPLIT:
            return {"kv_split": self.kv_split}
        return {"depth": self.depth, "kv_split": self.kv_split, "slices": self.slices}


def kvsplit_config(kv_split: int) -> Config:
    return Config(KVSPLIT, 1, kv_split)


def config_from(family: str, params: dict) -> Config | None:
    """The Config of a stored (family, params), or None for a family this build lacks."""
    if family == "kvsplit" and "kv_split" in params:
        return kvsplit_config(int(params["kv_split"]))
    if family == "dsplit" and {"kv_split", "slices"} <= set(params):
        return Config(DSPLIT, int(params["slices"]), int(params["kv_split"]),
                      int(params.get("depth", 4)))
    return None


def dsplit_lanes(head_dim: int, elem_bytes: int, slices: int) -> int:
    """Threads per group (16-byte vectors per slice) when D / slices makes a valid slice, else 0."""
    row_bytes = head_dim * elem_bytes
    if slices < 1 or row_bytes % (16 * slices):
        return 0
    lanes = row_bytes // (16 * slices)
    if lanes & (lanes - 1) or not DSPLIT_MIN_LANES <= lanes <= DSPLIT_MAX_LANES:
        return 0
    return lanes


def dsplit_violations(slices: int, kv_split: int, *, head_dim: int, elem_bytes: int,
                      num_splits: int, max_split: int | None = None) -> list[str]:
    """Names of the DSplit rules that (slices, kv_split) breaks (empty: valid)."""
    broken = []
    if max_split is not None and kv_split > max_split:
        broken.append("max_split")
    lanes = dsplit_lanes(head_dim, elem_bytes, slices)
    if not lanes:
        broken.append("slice_width")
    elif not DSPLIT_MIN_THREADS <= lanes * kv_split <= DSPLIT_MAX_THREADS:
        broken.append("cta_threads")
    if kv_split > max(num_splits, 1):
        broken.append("num_splits")
    return broken


def constrain_config(config: Config, *, head_dim: int, elem_bytes: int, rows: int,
                     num_splits: int, sm_count: int | None, max_split: int | None = None) -> Config:
    """A config that satisfies its family's rules: ``config`` mended by halving kv_split.

    Unknown families, invalid slices and DSplit configs that halving cannot
    mend become the KvSplit config of the same kv_split (capped at 16), constrained.
    """
    shape = dict(head_dim=head_dim, elem_bytes=elem_bytes, num_splits=num_splits,
                 max_split=max_split)
    family, slices, k, depth = config
    if family == DSPLIT and slices in DSPLIT_SLICES and k in DSPLIT_KV_SPLITS:
        while k > 1 and dsplit_violations(slices, k, **shape):
            k //= 2
        if not dsplit_violations(slices, k, **shape):
            return Config(DSPLIT, slices, k, depth if depth in DSPLIT_DEPTHS else 4)
    k = max((s for s in KV_SPLITS if s <= config.kv_split), default=1)
    return kvsplit_config(constrain(k, head_dim=head_dim, elem_bytes=elem_bytes, rows=rows,
                                    num_splits=num_splits, sm_count=sm_count, max_split=max_split))


def valid_configs(*, head_dim: int, elem_bytes: int, rows: int, num_splits: int,
                  sm_count: int | None, max_split: int | None = None,
                  families: tuple[int, ...] = (KVSPLIT, DSPLIT)) -> list[Config]:
    """Every config of ``families`` that satisfies its rules (KvSplit K = 1 always)."""
    configs = []
    if KVSPLIT in families:
        configs += [kvsplit_config(k) for k in valid_kv_splits(
            head_dim=head_dim, elem_bytes=elem_bytes, rows=rows, num_splits=num_splits,
            sm_count=sm_count, max_split=max_split)]
    if DSPLIT in families:
        configs += [Config(DSPLIT, p, k, d) for p in DSPLIT_SLICES for k in DSPLIT_KV_SPLITS
                    if not dsplit_violations(p, k, head_dim=head_dim, elem_bytes=elem_bytes,
                                             num_splits=num_splits, max_split=max_split)
                    for d in DSPLIT_DEPTHS]
    return configs
