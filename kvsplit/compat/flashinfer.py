"""FlashInfer's cascade merges (flashinfer.cascade), base-2 LSE, on kvsplit.

Shapes as FlashInfer's: ``v`` (seq_len, num_heads, head_dim) or, for
:func:`merge_states`, (seq_len, num_states, num_heads, head_dim); ``s`` the
float32 LSE of the same leading dims. Outputs have the partials' dtype
(bfloat16 or float16: kvsplit writes no float32).
"""

from __future__ import annotations

from typing import Optional

import torch

from .._call import merge_call
from ..layout import LSE

__all__ = ["merge_state", "merge_state_in_place", "merge_states"]


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``num_states`` attention states per (position, head).

    Parameters
    ----------
    v : Tensor (seq_len, num_states, num_heads, head_dim)
    s : Tensor (seq_len, num_states, num_heads), float32, base-2 LSE

    Returns
    -------
    (V, S): (seq_len, num_heads, head_dim) in v's dtype and float32
    (seq_len, num_heads), base 2.
    """
    seq_len, _, num_heads, head_dim = v.shape
    v_merged = torch.empty(seq_len, num_heads, head_dim, dtype=v.dtype, device=v.device)
    s_merged = torch.empty(seq_len, num_heads, dtype=torch.float32, device=v.device)
    merge_call(LSE, v.permute(1, 0, 2, 3), s.permute(1, 0, 2), 2.0, out=v_merged,
               out_stats=s_merged)
    return v_merged, s_merged


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states (v_a, s_a) and (v_b, s_b), held in separate tensors.

    Returns ``(V, S)`` shaped like ``v_a`` and ``s_a`` (``empty_like`` of each).
    """
    v_merged = torch.empty_like(v_a)
    s_merged = torch.empty_like(s_a)
    merge_call(LSE, (v_a, v_b), (s_a, s_b), 2.0, out=v_merged, out_stats=s_merged)
    return v_merged, s_merged


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor,
                         s_other: torch.Tensor, mask: Optional[torch.Tensor] = None) -> None:
    """Merge (v_other, s_other) into (v, s) in place.

    ``mask``, a bool (seq_len,) tensor, leaves the positions where it is False
    untouched (neither read nor written). ``s`` must be float32: FlashInfer
    would update a converted copy of any other dtype, losing the update.
    """
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
        raise TypeError("s must be a float32 tensor (it is updated in place)")
    merge_call(LSE, (v, v_other), (s, s_other), 2.0, out=v, out_stats=s, row_mask=mask,
               stats_in_place=True)
