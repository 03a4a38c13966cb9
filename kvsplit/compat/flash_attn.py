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
from ..layout import LSE

__all__ = ["flash_attn_combine"]
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def flash_attn_combine(out_partial: torch.Tensor, lse_partial: torch.Tensor,
                       out: Optional[torch.Tensor] = None,
                       out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine split-KV partials; returns ``(out, softmax_lse)``.

    ``out`` (batch, seqlen, num_heads, head_dim); ``softmax_lse`` float32
    (batch, seqlen, num_heads) laid out (batch, num_heads, seqlen) in memory,
    as FlashAttention returns it, base e.
    """
    dtype = out.dtype if out is not None else out_dtype or torch.float32
    if dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.float32, torch.bfloat16 or torch.float16, got "
                        f"{dtype}")
    if out is not None and out_dtype is not None and out_dtype != out.dtype:
        raise TypeError(f"out_dtype {out_dtype} does not match out ({out.dtype})")
    _, batch, seqlen, num_heads, head_dim = out_partial.shape
    if out is None:
        out = torch.empty(batch, seqlen, num_heads, head_dim, dtype=dtype,
                          device=out_partial.device)
    softmax_lse = torch.empty(batch, num_heads, seqlen, dtype=torch.float32,
                              device=out_partial.device).transpose(1, 2)
    merge_call(LSE, out_partial, lse_partial, math.e, out=out, out_stats=softmax_lse,
               row_dims=(3,))
    return out, softmax_lse
