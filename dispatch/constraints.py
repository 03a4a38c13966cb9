"""Policy on top of the kernel layer: which legal config a call may run.

What the kernels can run at all (legal values, a KvSplit group holding a
whole row, a DSplit slice's lanes, a CTA's threads) is the kernel layer's
to say: :mod:`kvsplit.config` asks the compiled module's check. This
module adds the policy. A choice from the tuning database, a shipped table,
the caller or the environment is always passed through :func:`constrain_config`,
which halves kv_split until all of these hold:

(a) kv_split <= an optional upper bound (argument or ``KVSPLIT_MAX_SPLIT``);
(b) the config is legal (the kernel layer's rules);
(c) KvSplit on GPUs: the CTA count fits the grid budget of 2 CTAs per SM
    (the CPU implementation has no grid; DSplit's grid loops);
(d) kv_split <= num_splits.

A DSplit config that halving cannot mend runs as the KvSplit config of the
same kv_split (at most 16), constrained; KvSplit K = 1 always satisfies
everything, so a tampered table can only cost speed.

A Few config (every state of a few vectors in one thread) has no group
count: it is mended by halving its vectors per thread until it is legal
(one vector always is), and runs any number of states, in rounds. Policy,
not a kernel rule: it is offered (valid_configs, so the tuner's
candidates) only to calls of at most :data:`FEW_MAX_SPLITS` states.
"""

from __future__ import annotations

from ..config import (DSPLIT, DTYPE_BYTES, FAMILIES, FEW, KVSPLIT, LIMITS, KernelConfig, check,
                      check_call, dsplit_slice_elems, kvsplit_rows_per_band, legal_configs)

KV_SPLITS: tuple[int, ...] = FAMILIES[KVSPLIT]["kv_split"]
DSPLIT_SLICES: tuple[int, ...] = FAMILIES[DSPLIT]["slices"]
DSPLIT_KV_SPLITS: tuple[int, ...] = FAMILIES[DSPLIT]["kv_split"]
DSPLIT_DEPTHS: tuple[int, ...] = FAMILIES[DSPLIT]["depth"]
FEW_VECTORS: tuple[int, ...] = FAMILIES[FEW]["vectors"]
CTAS_PER_SM: int = LIMITS["kvsplit_ctas_per_sm"]
#: The most states of a call to which the Few family is offered (a policy, not a kernel limit).
FEW_MAX_SPLITS = 16

kvsplit_config = KernelConfig.kvsplit


def rows_per_cta(kv_split: int, head_dim: int, elem_bytes: int) -> int:
    """Rows one KvSplit CTA covers per band (0 when a group cannot hold a row)."""
    return kvsplit_rows_per_band(head_dim, elem_bytes, kv_split)


def num_ctas(kv_split: int, head_dim: int, elem_bytes: int, rows: int) -> int:
    """Bands (CTAs before the grid cap) the KvSplit kernel launches for ``rows``."""
    per_cta = rows_per_cta(kv_split, head_dim, elem_bytes)
    return -(-rows // per_cta) if per_cta else 0


def violations(kv_split: int, *, head_dim: int, elem_bytes: int, rows: int, num_splits: int,
               sm_count: int | None, max_split: int | None = None) -> list[str]:
    """Names of the constraints that KvSplit ``kv_split`` breaks (empty: valid): the kernel
    layer's rule (``group_holds_row``: the binding's check), ``max_split``, ``cta_budget``
    and ``num_splits``."""
    broken = []
    if max_split is not None and kv_split > max_split:
        broken.append("max_split")
    rule = check(kvsplit_config(kv_split), head_dim, elem_bytes)
    if rule is not None:
        broken.append(rule)
    elif (sm_count is not None and kv_split > 1
            and num_ctas(kv_split, head_dim, elem_bytes, rows) > CTAS_PER_SM * sm_count):
        broken.append("cta_budget")
    if kv_split > max(num_splits, 1):
        broken.append("num_splits")
    return broken


def constrain(kv_split: int, *, head_dim: int, elem_bytes: int, rows: int, num_splits: int,
              sm_count: int | None, max_split: int | None = None) -> int:
    """Halve KvSplit ``kv_split`` until it satisfies every constraint; never below 1."""
    if kv_split not in KV_SPLITS:
        raise ValueError(f"kv_split must be one of {KV_SPLITS}, got {kv_split!r}")
    k = kv_split
    while k > 1 and violations(k, head_dim=head_dim, elem_bytes=elem_bytes, rows=rows,
                               num_splits=num_splits, sm_count=sm_count, max_split=max_split):
        k //= 2
    return k


def valid_kv_splits(*, head_dim: int, elem_bytes: int, rows: int, num_splits: int,
                    sm_count: int | None, max_split: int | None = None) -> list[int]:
    """Every KvSplit K that satisfies the constraints, ascending (always includes 1)."""
    return [k for k in KV_SPLITS
            if k == 1 or not violations(k, head_dim=head_dim, elem_bytes=elem_bytes, rows=rows,
                                        num_splits=num_splits, sm_count=sm_count,
                                        max_split=max_split)]


def dsplit_violations(config: KernelConfig, *, head_dim: int, elem_bytes: int, num_splits: int,
                      max_split: int | None = None) -> list[str]:
    """Names of the rules that DSplit ``config`` breaks (empty: valid): the kernel layer's
    (``slice_width``, ``cta_threads``, ...), ``max_split`` and ``num_splits``."""
    broken = []
    if max_split is not None and config.kv_split > max_split:
        broken.append("max_split")
    rule = check(config, head_dim, elem_bytes)
    if rule is not None:
        broken.append(rule)
    if config.kv_split > max(num_splits, 1):
        broken.append("num_splits")
    return broken


def few_mended(config: KernelConfig, *, head_dim: int, elem_bytes: int,
               stats_in_place: bool = False, quant_group: int = 0) -> KernelConfig | None:
    """The Few config nearest ``config`` that the kernel layer runs at ``head_dim`` with
    the call's rules (an in-place stats export, per-group FP8 scales of ``quant_group``
    elements): ``config`` itself, else other vectors per thread (fewest halvings or
    doublings first, fewer first); None when none does."""
    def distance(vectors: int) -> tuple[int, int]:
        return abs(vectors.bit_length() - config.vectors.bit_length()), vectors

    for vectors in sorted(FEW_VECTORS, key=distance):
        mended = KernelConfig.few(vectors)
        if (check(mended, head_dim, elem_bytes) is None
                and check_call(mended, head_dim, elem_bytes, stats_in_place=stats_in_place,
                               quant_group=quant_group) is None):
            return mended
    return None


def constrain_config(config: KernelConfig, *, head_dim: int, elem_bytes: int, rows: int,
                     num_splits: int, sm_count: int | None,
                     max_split: int | None = None) -> KernelConfig:
    """``config`` mended by halving kv_split until it satisfies its family's constraints
    (a Few config: by halving its vectors per thread)."""
    if config.family == FEW:
        vectors = config.vectors
        while vectors > 1 and check(KernelConfig.few(vectors), head_dim, elem_bytes) is not None:
            vectors //= 2
        mended = KernelConfig.few(vectors)
        if check(mended, head_dim, elem_bytes) is None:
            return mended
        config = kvsplit_config(1)  # a head dim no kernel takes: the launch will say so
    if config.family == DSPLIT:
        rules = dict(head_dim=head_dim, elem_bytes=elem_bytes, num_splits=num_splits,
                     max_split=max_split)
        k = config.kv_split
        while True:
            mended = KernelConfig.dsplit(config.slices, k, config.depth)
            if not dsplit_violations(mended, **rules):
                return mended
            if k == 1:
                break
            k //= 2
    k = max(s for s in KV_SPLITS if s <= config.kv_split)
    return kvsplit_config(constrain(k, head_dim=head_dim, elem_bytes=elem_bytes, rows=rows,
                                    num_splits=num_splits, sm_count=sm_count, max_split=max_split))


def in_place_config(config: KernelConfig, *, head_dim: int, elem_bytes: int, rows: int,
                    num_splits: int, sm_count: int | None) -> KernelConfig:
    """``config`` for a call that exports its stats into split 0's (an in-place merge):
    a row must stay inside one CTA, so a DSplit row's slices become more groups of one
    CTA (the kernel layer refuses slices > 1 there); a Few row's threads must share a
    warp, so its vectors per thread change (few_mended), or KvSplit K = 1 runs it."""
    if config.family == FEW:
        return few_mended(config, head_dim=head_dim, elem_bytes=elem_bytes,
                          stats_in_place=True) or kvsplit_config(1)
    if config.family != DSPLIT or config.slices == 1:
        return config
    groups = min(config.kv_split * config.slices, max(DSPLIT_KV_SPLITS))
    return constrain_config(KernelConfig.dsplit(1, groups, config.depth), head_dim=head_dim,
                            elem_bytes=elem_bytes, rows=rows, num_splits=num_splits,
                            sm_count=sm_count)


def few_only_config(config: KernelConfig, *, head_dim: int, elem_bytes: int,
                    stats_in_place: bool) -> KernelConfig:
    """``config`` for a call only the Few family runs (per-request ops, (max, sum) pair
    stats): a Few config as it is (mended for an in-place export), any other the Few
    config of one vector a thread, so mended."""
    few = config if config.family == FEW else KernelConfig.few(1)
    return few_mended(few, head_dim=head_dim, elem_bytes=elem_bytes,
                      stats_in_place=stats_in_place) or few


def group_quant_config(config: KernelConfig, *, head_dim: int, elem_bytes: int, rows: int,
                       num_splits: int, sm_count: int | None, quant_group: int) -> KernelConfig:
    """``config`` for a call with per-group FP8 scales: the lanes of one group of
    ``quant_group`` elements reduce its maximum by shuffles, so a DSplit slice must
    hold whole groups; otherwise the row's slices become more groups of one CTA, or,
    where a row does not fit one, the KvSplit config of as many groups. A Few step of a
    row must hold whole groups: its vectors per thread change (few_mended; one vector
    always fits)."""
    if config.family == FEW:
        return few_mended(config, head_dim=head_dim, elem_bytes=elem_bytes,
                          quant_group=quant_group) or kvsplit_config(1)
    if (config.family != DSPLIT or config.slices == 1
            or dsplit_slice_elems(head_dim, elem_bytes, config.slices) % quant_group == 0):
        return config
    rules = dict(head_dim=head_dim, elem_bytes=elem_bytes, rows=rows, num_splits=num_splits,
                 sm_count=sm_count)
    groups = min(config.kv_split * config.slices, max(DSPLIT_KV_SPLITS))
    mended = constrain_config(KernelConfig.dsplit(1, groups, config.depth), **rules)
    if mended.family == DSPLIT and mended.slices == 1:
        return mended
    return constrain_config(kvsplit_config(max(k for k in KV_SPLITS if k <= groups)), **rules)


def valid_configs(*, head_dim: int, elem_bytes: int, rows: int, num_splits: int,
                  sm_count: int | None, max_split: int | None = None,
                  families: tuple[str, ...] = (KVSPLIT, DSPLIT, FEW)) -> list[KernelConfig]:
    """Every legal config of ``families`` that satisfies the constraints (KvSplit K = 1
    always; Few configs up to :data:`FEW_MAX_SPLITS` states)."""
    configs = []
    if KVSPLIT in families:
        configs += [kvsplit_config(k) for k in valid_kv_splits(
            head_dim=head_dim, elem_bytes=elem_bytes, rows=rows, num_splits=num_splits,
            sm_count=sm_count, max_split=max_split)]
    if DSPLIT in families:
        configs += [c for c in legal_configs(head_dim, elem_bytes, (DSPLIT,))
                    if not dsplit_violations(c, head_dim=head_dim, elem_bytes=elem_bytes,
                                             num_splits=num_splits, max_split=max_split)]
    if FEW in families and num_splits <= FEW_MAX_SPLITS:
        configs += legal_configs(head_dim, elem_bytes, (FEW,))
    return configs


def configs_for_key(key, *, is_cuda: bool, max_split: int | None = None,
                    shape: tuple[int, int] | None = None) -> list[KernelConfig]:
    """The configs a tuner may time at tuning ``key``: every family on a GPU, KvSplit on
    the CPU. ``shape``, the (rows, num_splits) that the key is profiled at (at most the
    key's values): only the configs that the constraints allow at both."""
    families = (KVSPLIT, DSPLIT, FEW) if is_cuda else (KVSPLIT,)
    configs = valid_configs(head_dim=key.head_dim, elem_bytes=DTYPE_BYTES[key.partial_dtype],
                            rows=key.rows, num_splits=key.num_splits,
                            sm_count=key.device.sm_count if is_cuda else None,
                            max_split=max_split, families=families)
    if shape is None:
        return configs
    rows, num_splits = shape
    allowed = set(valid_configs(head_dim=key.head_dim, elem_bytes=DTYPE_BYTES[key.partial_dtype],
                                rows=rows, num_splits=num_splits,
                                sm_count=key.device.sm_count if is_cuda else None,
                                max_split=max_split, families=families))
    return [c for c in configs if c in allowed]
