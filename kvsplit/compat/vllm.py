"""vLLM's merge_attn_states (vllm.attention.ops.merge_attn_states) on kvsplit.

Outputs (num_tokens, num_heads, head_size), LSE (num_heads, num_tokens) in
base e, head-major; a +inf LSE (FlashAttention 2's value for an empty
sequence) is read as an empty state, like -inf. The prefix and suffix merge
where they lie: no stacking. Both states empty: the output is 0 and the LSE
-inf (vLLM's kernels give NaN there).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .._call import merge_call
from ..layout import LSE, NO_EXTRAS, Extras

__all__ = ["merge_attn_states"]


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
    extras = (NO_EXTRAS if prefill_tokens_with_context is None and output_scale is None
              else Extras(out_scale=output_scale, pass_through_from=prefill_tokens_with_context))
    merge_call(LSE, (prefix_output, suffix_output), (prefix_lse.t(), suffix_lse.t()), math.e,
               out=output, out_stats=None if output_lse is None else output_lse.t(),
               empty_stat=math.inf, extras=extras)
