"""Float64 references and partial generators, for tests, the demo and the tuner.

Everything here is plain PyTorch in float64: slow, obviously right, and the
yardstick that the kernels are held to.
"""

from __future__ import annotations

import math

import torch

_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2


def _valid_mask(num_splits: int, rows: int, split_counts, device) -> torch.Tensor:
    """(num_splits, rows) bool: split i of row r is read."""
    index = torch.arange(num_splits, device=device).unsqueeze(1)
    if split_counts is None:
        return torch.ones(num_splits, rows, dtype=torch.bool, device=device)
    return index < split_counts.to(device=device, dtype=torch.int64).unsqueeze(0)


def _merge_log2(partial_o, m2, l, sinks, split_counts):
    """Merges states (m2 in base 2, l, O) in float64; returns (out, M2, L)."""
    num_splits, rows, _ = partial_o.shape
    o = partial_o.double()
    m2 = m2.double().masked_fill(~_valid_mask(num_splits, rows, split_counts, o.device), -math.inf)
    big_m = m2.amax(dim=0) if num_splits else torch.full((rows,), -math.inf, dtype=torch.float64)
    empty = big_m == -math.inf
    safe_m = torch.where(empty, torch.zeros_like(big_m), big_m)
    w = torch.where(m2 == -math.inf, torch.zeros_like(m2), torch.exp2(m2 - safe_m))
    total = (w * l.double()).sum(dim=0)
    if sinks is not None:
        heads = sinks.numel()
        sink = sinks.double().to(o.device).repeat(rows // heads) * _LOG2E
        total = total + torch.exp2(sink - safe_m)
    out = (w.unsqueeze(-1) * o).sum(dim=0) / total.unsqueeze(-1)
    out = torch.where(empty.unsqueeze(-1), torch.zeros_like(out), out)
    total = torch.where(empty, torch.zeros_like(total), total)
    return out, big_m, total


def merge_maxsum_reference(partial_o, partial_stats, scale_log2, *, sinks=None, split_counts=None):
    """Float64 twin of :func:`kvsplit.merge_maxsum`; returns (out, stats)."""
    m2 = partial_stats[..., 0].double() * scale_log2
    out, big_m, total = _merge_log2(partial_o, m2, partial_stats[..., 1], sinks, split_counts)
    return out, torch.stack([big_m * _LN2, total], dim=-1)


def merge_lse_reference(partial_o, partial_lse, *, base=2.0, sinks=None, split_counts=None):
    """Float64 twin of :func:`kvsplit.merge_lse`; returns (out, lse in ``base``)."""
    to_log2 = 1.0 if base == 2.0 else _LOG2E
    m2 = partial_lse.double() * to_log2
    out, big_m, total = _merge_log2(partial_o, m2, torch.ones_like(m2), sinks, split_counts)
    lse2 = torch.where(total > 0, big_m + torch.log2(total), torch.full_like(big_m, -math.inf))
    return out, lse2 / to_log2


def attention_partials(q, k, v, num_splits: int, *, stats_format: str = "maxsum",
                       scale: float | None = None, base: float = 2.0):
    """Split-KV partials of single-query attention, as a decode kernel writes them.

    Parameters
    ----------
    q : Tensor (rows, head_dim)
        One query per row (rows = tokens * heads).
    k, v : Tensor (rows, kv_len, head_dim)
        Keys and values of each row; the kv_len axis is cut into
        ``num_splits`` contiguous chunks (the last ones may be empty).
    stats_format : "maxsum" or "lse"
    scale : float, optional
        Softmax scale, 1/sqrt(head_dim) by default.

    Returns
    -------
    (partial_o, stats, exact): float64 partials in the format's layout, and
    the exact attention output computed without splitting.
    """
    rows, kv_len, head_dim = k.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    logits = torch.einsum("rd,rkd->rk", q.double(), k.double()) * scale
    exact = torch.einsum("rk,rkd->rd", torch.softmax(logits, dim=-1), v.double())
    chunk = -(-kv_len // num_splits)
    partial_o = torch.zeros(num_splits, rows, head_dim, dtype=torch.float64)
    m = torch.full((num_splits, rows), -math.inf, dtype=torch.float64)
    s = torch.zeros(num_splits, rows, dtype=torch.float64)
    raw = logits / scale
    for i in range(num_splits):
        lo, hi = i * chunk, min(kv_len, (i + 1) * chunk)
        if lo >= hi:
            continue
        m[i] = raw[:, lo:hi].amax(dim=-1)
        p = torch.exp2(scale * _LOG2E * (raw[:, lo:hi] - m[i].unsqueeze(-1)))
        s[i] = p.sum(dim=-1)
        partial_o[i] = torch.einsum("rk,rkd->rd", p, v[:, lo:hi].double())
    if stats_format == "maxsum":
        return partial_o, torch.stack([m, s], dim=-1), exact
    to_log2 = 1.0 if base == 2.0 else _LOG2E
    lse2 = torch.where(s > 0, m * scale * _LOG2E + torch.log2(s.clamp_min(1e-300)),
                       torch.full_like(m, -math.inf))
    normalised = partial_o / s.clamp_min(1e-300).unsqueeze(-1)
    return normalised, lse2 / to_log2, exact


def random_partials(num_splits: int, rows: int, head_dim: int, *, stats_format: str = "maxsum",
                    generator: torch.Generator | None = None, empty_fraction: float = 0.0,
                    device: torch.device | str | None = None):
    """Random but self-consistent float32 partials: (partial_o, stats).

    maxsum: raw maxima ~ N(0, 2), sums in [1, 65), O_i = l_i * (a convex
    combination of unit values); lse: normalised O_i and lse ~ N(0, 2).
    A fraction of (split, row) entries is made empty (-inf). ``device`` (that
    of ``generator``, if given) is where the tensors are made.
    """
    g = generator
    at = {"generator": g, "device": g.device if g is not None else device}
    m = torch.randn(num_splits, rows, **at) * 2.0
    if empty_fraction:
        m = m.masked_fill(torch.rand(num_splits, rows, **at) < empty_fraction, -math.inf)
    values = torch.randn(num_splits, rows, head_dim, **at)
    if stats_format == "maxsum":
        l = 1.0 + 64.0 * torch.rand(num_splits, rows, **at)
        l = l.masked_fill(m == -math.inf, 0.0)
        return values * l.unsqueeze(-1), torch.stack([m, l], dim=-1)
    return values, m
