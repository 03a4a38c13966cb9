"""FlashAttention 3's split-KV combine (flash_attn_interface.flash_attn_combine) on kvsplit.

float32 partials (num_splits, batch, seqlen, num_heads, head_dim) and LSE
(num_splits, batch, seqlen, num_heads), base e, any strides but on head_dim;
the output is float32 (FlashAttention's default), bfloat16 or float16.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .._call import merge_call
from .._kernel import ROLES, call_fast, call_form
from ..validation import LSE
from . import _checks

__all__ = ["flash_attn_combine"]

_FORM = call_form([ROLES.PARTIAL_O, ROLES.STATS, ROLES.OUT, ROLES.OUT_STATS])
_NAMES = (("partial_o", "out_partial"), ("stats", "lse_partial"), ("out", "out"),
          ("out_stats", "softmax_lse"))
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def flash_attn_combine(out_partial: torch.Tensor, lse_partial: torch.Tensor,
                       out: Optional[torch.Tensor] = None,
                       out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine split-KV partials; returns ``(out, softmax_lse)``.

    ``out`` (batch, seqlen, num_heads, head_dim); ``softmax_lse`` float32
    (batch, seqlen, num_heads) laid out (batch, num_heads, seqlen) in memory,
    as FlashAttention returns it, base e.
    """
    if out is not None:
        _checks.tensor("out", out)
    dtype = out.dtype if out is not None else out_dtype or torch.float32
    if dtype not in _OUT_DTYPES:
        raise TypeError(f"{'out' if out is not None else 'out_dtype'} must be torch.float32, "
                        f"torch.bfloat16 or torch.float16, got {dtype}")
    if out is not None and out_dtype is not None and out_dtype != out.dtype:
        raise TypeError(f"out_dtype {out_dtype} does not match out ({out.dtype})")
    if not (isinstance(out_partial, torch.Tensor) and out_partial.dim() == 5):
        _check(out_partial, lse_partial, out)  # raises
    _, batch, seqlen, num_heads, head_dim = out_partial.shape
    if out is None:
        out = torch.empty(batch, seqlen, num_heads, head_dim, dtype=dtype,
                          device=out_partial.device)
    # (batch, seqlen, num_heads) laid out (batch, num_heads, seqlen): one allocation, no view op
    softmax_lse = torch.empty_strided((batch, seqlen, num_heads), (num_heads * seqlen, 1, seqlen),
                                      dtype=torch.float32, device=out_partial.device)
    if not call_fast(_FORM, out_partial, lse_partial, out, softmax_lse):
        _check(out_partial, lse_partial, out)
        merge_call(LSE, out_partial, lse_partial, math.e, out=out, out_stats=softmax_lse,
                   row_dims=(3,), names=_NAMES,
                   register=(_FORM, False, out_partial, lse_partial, out, softmax_lse))
    return out, softmax_lse


def _check(out_partial, lse_partial, out) -> None:
    """FlashAttention's shapes in its names (a layout's first call)."""
    _checks.tensor("out_partial", out_partial,
                   dims="(num_splits, batch, seqlen, num_heads, head_dim)",
                   dtypes=_checks.STATE_DTYPES)
    _checks.head_dim("out_partial", out_partial, "head_dim")
    if out_partial.shape[0] == 0 and math.prod(out_partial.shape[1:4]) > 0:
        raise ValueError("out_partial has num_splits = 0: nothing to combine")
    _checks.vector_strides("out_partial", out_partial,
                           "(num_splits, batch, seqlen, num_heads, head_dim)")
    _checks.tensor("lse_partial", lse_partial, dims="(num_splits, batch, seqlen, num_heads)",
                   shape=tuple(out_partial.shape[:4]), dtypes=(torch.float32,),
                   device=out_partial.device)
    if out is not None:
        _checks.tensor("out", out, dims="(batch, seqlen, num_heads, head_dim)",
                       shape=tuple(out_partial.shape[1:]), device=out_partial.device)
        _checks.unit_stride("out", out, "head_dim")
        _checks.vector_strides("out", out, "(batch, seqlen, num_heads, head_dim)",
                               partial_dtype=out_partial.dtype)
