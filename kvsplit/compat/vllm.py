"""vLLM's merge_attn_states (vllm.attention.ops.merge_attn_states) on kvsplit.

Outputs (num_tokens, num_heads, head_size), LSE (num_heads, num_tokens) in
base e, head-major; a +inf LSE (FlashAttention 2's value for an empty
sequence) is read as an empty state, like -inf. The prefix and suffix merge
where they lie: no stacking (where their strides differ, both are copied into
one layout first). Both states empty: the output is 0 and the LSE
-inf (vLLM's CUDA kernel copies prefix_output there, zeros in the case it
guards against). The output may not overlap either state (vLLM's elementwise
kernels allow it): a ValueError.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .._call import merge_call
from .._kernel import ROLES, call_fast, call_form
from ..config import FP8_DTYPES
from ..validation import LSE, NO_EXTRAS, Extras
from . import _checks

__all__ = ["merge_attn_states"]

_FORM = call_form([ROLES.OUT, ROLES.PARTIAL_O, ROLES.STATS, ROLES.PARTIAL_O, ROLES.STATS,
                   ROLES.OUT_STATS, ROLES.KEY, ROLES.OUT_SCALE])
_NAMES = (("o_parts", ("prefix_output", "suffix_output")),
          ("s_parts", ("prefix_lse", "suffix_lse")), ("out", "output"),
          ("out_stats", "output_lse"), ("out_scale", "output_scale"))


def merge_attn_states(output: torch.Tensor, prefix_output: torch.Tensor, prefix_lse: torch.Tensor,
                      suffix_output: torch.Tensor, suffix_lse: torch.Tensor,
                      output_lse: Optional[torch.Tensor] = None,
                      prefill_tokens_with_context: Optional[int] = None,
                      output_scale: Optional[torch.Tensor] = None) -> None:
    """Write the merge of the prefix and suffix states into ``output`` (and ``output_lse``).

    Parameters
    ----------
    output : Tensor (num_tokens, num_heads, head_size)
        float32, bfloat16 or float16, or FP8 (e4m3fn, e4m3fnuz) with ``output_scale``.
    prefix_output, suffix_output : Tensor (num_tokens, num_heads, head_size)
        float32, bfloat16 or float16; head_size any multiple of 16 bytes of it.
    prefix_lse, suffix_lse : Tensor (num_heads, num_tokens), float32, base e
    output_lse : Tensor (num_heads, num_tokens), float32, optional
    prefill_tokens_with_context : int, optional
        Tokens from this index on take the suffix as it is (output and LSE).
    output_scale : Tensor (1,), float32, optional
        FP8 output: ``output = fp8(clamp(merged / output_scale))``.
    """
    if call_fast(_FORM, output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse,
                 prefill_tokens_with_context, output_scale):
        return
    _check(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse,
           prefill_tokens_with_context, output_scale)
    extras = (NO_EXTRAS if prefill_tokens_with_context is None and output_scale is None
              else Extras(out_scale=output_scale, pass_through_from=prefill_tokens_with_context))
    o_a, o_b, copied_o = _checks.one_layout(prefix_output, suffix_output)
    _checks.vector_strides("prefix_output", o_a, _STATES)  # (a copy is contiguous)
    s_a, s_b, copied_s = _checks.one_layout(prefix_lse, suffix_lse)
    merge_call(LSE, (o_a, o_b), (s_a.t(), s_b.t()), math.e,
               out=output, out_stats=None if output_lse is None else output_lse.t(),
               empty_stat=math.inf, extras=extras, names=_NAMES,
               register=None if copied_o or copied_s else
               (_FORM, False, output, prefix_output, prefix_lse, suffix_output, suffix_lse,
                output_lse, prefill_tokens_with_context, output_scale))


_STATES = "(num_tokens, num_heads, head_size)"
_LSES = "(num_heads, num_tokens)"


def _check(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse,
           prefill_tokens_with_context, output_scale) -> None:
    """vLLM's rules in vLLM's names and shapes."""
    _checks.tensor("prefix_output", prefix_output, dims=_STATES, dtypes=_checks.STATE_DTYPES)
    _checks.head_dim("prefix_output", prefix_output, "head_size")
    tokens, heads, _ = prefix_output.shape
    device = prefix_output.device
    _checks.same("suffix_output", suffix_output, "prefix_output", prefix_output)
    out_dtypes = _checks.STATE_DTYPES + tuple(getattr(torch, n) for n in FP8_DTYPES)
    _checks.tensor("output", output, dims=_STATES, shape=tuple(prefix_output.shape),
                   dtypes=out_dtypes, device=device)
    _checks.unit_stride("output", output, "head_size")
    _checks.vector_strides("output", output, _STATES, partial_dtype=prefix_output.dtype)
    _checks.head_dim("suffix_output", suffix_output, "head_size")
    for name, lse in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse)):
        _checks.tensor(name, lse, dims=_LSES, shape=(heads, tokens), dtypes=(torch.float32,),
                       device=device)
    if output_lse is not None:
        _checks.tensor("output_lse", output_lse, dims=_LSES, shape=(heads, tokens),
                       dtypes=(torch.float32,), device=device)
    _checks.optional_int("prefill_tokens_with_context", prefill_tokens_with_context, 0, tokens)
    if output_scale is None and output.dtype in out_dtypes[3:]:
        raise TypeError(f"output is {str(output.dtype).removeprefix('torch.')}: an FP8 output "
                        f"needs output_scale, the scale it is quantized with")
    if output_scale is not None:
        _checks.tensor("output_scale", output_scale, dtypes=(torch.float32,), device=device)
        if output_scale.numel() != 1:
            raise ValueError(f"output_scale must hold one float32 scale, got shape "
                             f"{tuple(output_scale.shape)}")
        if output.dtype not in out_dtypes[3:]:
            raise TypeError(f"output_scale is for an FP8 output; output is {output.dtype}")
