"""vLLM's merge_attn_states (vllm.attention.ops.merge_attn_states) on kvsplit.

Outputs (num_tokens, num_heads, head_size), LSE (num_heads, num_tokens) in
base e, head-major; a +inf LSE (FlashAttention 2's value for an empty
sequence) is read as an empty state, like -inf. The prefix and suffix merge
where they lie: no stacking.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .._call import merge_call
from ..layout import LSE

__all__ = ["merge_attn_states"]


def merge_attn_states(output: torch.Tensor, prefix_output: torch.Tensor, prefix_lse: torch.Tensor,
                      suffix_output: torch.Tensor, suffix_lse: torch.Tensor,
                      output_lse: Optional[torch.Tensor] = None) -> None:
    """Write the merge of the prefix and suffix states into ``output`` (and ``output_lse``).

    Parameters
    ----------
    output, prefix_output, suffix_output : Tensor (num_tokens, num_heads, head_size)
        bfloat16 or float16 (kvsplit writes no float32).
    prefix_lse, suffix_lse : Tensor (num_heads, num_tokens), float32, base e
    output_lse : Tensor (num_heads, num_tokens), float32, optional
    """
    merge_call(LSE, (prefix_output, suffix_output), (prefix_lse.t(), suffix_lse.t()), math.e,
               out=output, out_stats=None if output_lse is None else output_lse.t(),
               empty_stat=math.inf)
