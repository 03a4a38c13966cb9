"""Peer merges that kvsplit is measured against: plain designs, not kvsplit's.

* :func:`triton_merge` -- a serial Triton merge: one program per row, the
  head dim as one vector (BLOCK_D = head_dim), the row's N splits walked in a
  loop with an online max and rescale. This is the shape of the decode
  "stage 2" reduction of several serving engines, written here from the math.
* :func:`torch_merge` -- the same merge as plain PyTorch ops;
  :func:`compiled_merge` is it under ``torch.compile`` (Inductor's fused
  reduction kernels).

Both read kvsplit's two stats formats:
  maxsum  stats (N, rows, 2) = (m_i raw logit max, l_i = sum 2^(scale_log2 (x - m_i))),
          partial_o unnormalised; scale_log2 = softmax scale * log2(e);
  lse     lse (N, rows) in base 2 or e, partial_o normalised.
and write ``out`` (rows, head_dim) in bf16/fp16 (or fp32). An empty split
has m_i / lse_i = -inf; a row with no non-empty split is 0. No sinks, no
split counts, no exported stats: these are peers for timing, held to the
float64 reference in tests/test_peers.py.

Nothing here imports kvsplit, so the module loads on a machine without its
build (tests import it by path).
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch peer still works; triton_merge raises
    triton = tl = None

LOG2E = 1.0 / math.log(2.0)


def _to_log2(stats_format: str, scale_log2: float | None, base: float) -> float:
    if stats_format == "maxsum":
        if scale_log2 is None:
            raise ValueError("maxsum needs scale_log2")
        return float(scale_log2)
    if stats_format != "lse":
        raise ValueError(f"stats_format must be 'maxsum' or 'lse', not {stats_format!r}")
    return 1.0 if base == 2.0 else math.log2(base)


if triton is not None:

    @triton.jit
    def _serial_merge_kernel(o_ptr, s_ptr, out_ptr, num_splits, o_stride_split, o_stride_row,
                             s_stride_split, s_stride_row, out_stride_row, to_log2,
                             BLOCK_D: tl.constexpr, MAXSUM: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        o_p = o_ptr + row * o_stride_row + d
        s_p = s_ptr + row * s_stride_row
        big_m = -float("inf")  # running max, base 2
        total = 0.0  # running denominator, relative to big_m
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # running numerator, relative to big_m
        for _ in range(num_splits):
            x = tl.load(s_p) * to_log2
            o = tl.load(o_p).to(tl.float32)
            new_m = tl.maximum(big_m, x)
            anchor = tl.where(new_m == -float("inf"), 0.0, new_m)  # no (-inf) - (-inf)
            alpha = tl.exp2(big_m - anchor)
            w = tl.exp2(x - anchor)
            acc = acc * alpha + w * o
            if MAXSUM:
                total = total * alpha + w * tl.load(s_p + 1)
            else:
                total = total * alpha + w
            big_m = new_m
            o_p += o_stride_split
            s_p += s_stride_split
        result = tl.where(total > 0.0, acc / total, 0.0)
        tl.store(out_ptr + row * out_stride_row + d, result.to(out_ptr.dtype.element_ty))


def default_num_warps(head_dim: int, elem_bytes: int = 2) -> int:
    """One warp per 16 bytes x 32 lanes of the row (1 for D=128 bf16, 4 for D=512)."""
    return max(1, min(8, head_dim * elem_bytes // 256))


def triton_merge(partial_o: torch.Tensor, stats: torch.Tensor, out: torch.Tensor, *,
                 stats_format: str = "lse", scale_log2: float | None = None, base: float = 2.0,
                 num_warps: int | None = None) -> torch.Tensor:
    """Serial Triton merge of (N, rows, D) partials into ``out`` (rows, D); returns ``out``.

    ``stats`` is (N, rows, 2) float32 for maxsum, (N, rows) float32 for lse;
    head_dim must be a power of two with unit stride.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    num_splits, rows, head_dim = partial_o.shape
    if head_dim & (head_dim - 1) or partial_o.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("head_dim must be a power of two with unit stride")
    maxsum = stats_format == "maxsum"
    if maxsum and stats.stride(-1) != 1:
        raise ValueError("maxsum stats need unit stride on the (m, l) axis")
    to_log2 = _to_log2(stats_format, scale_log2, base)
    if rows == 0:
        return out
    _serial_merge_kernel[(rows,)](
        partial_o, stats, out, num_splits, partial_o.stride(0), partial_o.stride(1),
        stats.stride(0), stats.stride(1), out.stride(0), to_log2,
        BLOCK_D=head_dim, MAXSUM=maxsum,
        num_warps=num_warps or default_num_warps(head_dim, partial_o.element_size()))
    return out


def torch_merge(partial_o: torch.Tensor, stats: torch.Tensor, out: torch.Tensor,
                to_log2: float, maxsum: bool) -> None:
    """The merge in plain PyTorch ops, float32 math, written into ``out``."""
    x = (stats[..., 0] if maxsum else stats) * to_log2
    big_m = x.amax(dim=0)
    anchor = torch.where(big_m == -math.inf, torch.zeros_like(big_m), big_m)
    w = torch.exp2(x - anchor)
    total = (w * stats[..., 1]).sum(dim=0) if maxsum else w.sum(dim=0)
    acc = (w.unsqueeze(-1) * partial_o.float()).sum(dim=0)
    total = total.unsqueeze(-1)
    out.copy_(torch.where(total > 0, acc / total, torch.zeros_like(acc)))


_compiled = {}


def compiled_merge(partial_o: torch.Tensor, stats: torch.Tensor, out: torch.Tensor, *,
                   stats_format: str = "lse", scale_log2: float | None = None,
                   base: float = 2.0, mode: str | None = None) -> torch.Tensor:
    """:func:`torch_merge` under ``torch.compile`` (static shapes: one compile per shape).

    ``mode`` is torch.compile's (None: default; "max-autotune-no-cudagraphs"
    tunes Inductor's kernels at a much longer compile). No CUDA graphs of its
    own: callers capture it in theirs.
    """
    fn = _compiled.get(mode)
    if fn is None:
        dynamo = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(dynamo, name):  # one entry per benchmark shape and format
                setattr(dynamo, name, max(getattr(dynamo, name), 1024))
        fn = _compiled[mode] = torch.compile(torch_merge, mode=mode, dynamic=False,
                                             fullgraph=True)
    fn(partial_o, stats, out, _to_log2(stats_format, scale_log2, base),
       stats_format == "maxsum")
    return out
