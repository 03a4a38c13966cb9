"""FlashInfer's cascade merges (flashinfer.cascade), base-2 LSE, on kvsplit.

Shapes as FlashInfer's: ``v`` (seq_len, num_heads, head_dim) or, for
:func:`merge_states`, (seq_len, num_states, num_heads, head_dim); ``s`` the
float32 LSE of the same leading dims. Outputs have the partials' dtype
(float32, bfloat16 or float16).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .._call import merge_call
from .._kernel import ROLES, call_fast, call_form
from ..validation import LSE, Extras, _check_grad, check_own_memory
from . import _checks

__all__ = ["merge_state", "merge_state_in_place", "merge_states", "variable_length_merge_states"]

_R = ROLES
_MERGE_STATES = call_form([_R.PARTIAL_O, _R.STATS, _R.OUT, _R.OUT_STATS])
_MERGE_STATE = call_form([_R.PARTIAL_O, _R.STATS, _R.PARTIAL_O, _R.STATS, _R.OUT, _R.OUT_STATS])
_IN_PLACE = call_form([_R.PARTIAL_O, _R.STATS, _R.PARTIAL_O, _R.STATS, _R.ROW_MASK],
                      into_first=True)
_PAIR = "(seq_len, num_heads, head_dim)"
_LSE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_STATES_NAMES = (("partial_o", "v"), ("stats", "s"), ("out", "v_merged"), ("out_stats", "s_merged"))
_STATE_NAMES = (("o_parts", ("v_a", "v_b")), ("s_parts", ("s_a", "s_b")), ("out", "v_merged"),
                ("out_stats", "s_merged"))
_IN_PLACE_NAMES = (("o_parts", ("v", "v_other")), ("s_parts", ("s", "s_other")), ("out", "v"),
                   ("out_stats", "s"), ("mask", "mask"))


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``num_states`` attention states per (position, head).

    Parameters
    ----------
    v : Tensor (seq_len, num_states, num_heads, head_dim)
    s : Tensor (seq_len, num_states, num_heads), base-2 LSE; float32 (another
        float dtype is converted, a copy, as FlashInfer does)

    Returns
    -------
    (V, S): (seq_len, num_heads, head_dim) in v's dtype and float32
    (seq_len, num_heads), base 2. As in FlashInfer, no state gives 0 and -inf,
    and one state is copied as it is.
    """
    if not (isinstance(v, torch.Tensor) and v.dim() == 4):
        _check_states(v, s)  # raises
    seq_len, num_states, num_heads, head_dim = v.shape
    v_merged = torch.empty(seq_len, num_heads, head_dim, dtype=v.dtype, device=v.device)
    s_merged = torch.empty(seq_len, num_heads, dtype=torch.float32, device=v.device)
    if not call_fast(_MERGE_STATES, v, s, v_merged, s_merged):
        _check_states(v, s)
        if num_states <= 1:  # nothing to merge: FlashInfer's own two cases
            if torch.is_grad_enabled():
                _check_grad(v, s)
            if num_states == 0:
                return v_merged.zero_(), s_merged.fill_(-math.inf)
            return v_merged.copy_(v[:, 0]), s_merged.copy_(s[:, 0])
        stats, converted = _float32(s)
        merge_call(LSE, v.permute(1, 0, 2, 3), stats.permute(1, 0, 2), 2.0, out=v_merged,
                   out_stats=s_merged, names=_STATES_NAMES,
                   register=None if converted else
                   (_MERGE_STATES, False, v, s, v_merged, s_merged))
    return v_merged, s_merged


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states (v_a, s_a) and (v_b, s_b), held in separate tensors.

    Returns ``(V, S)`` shaped like ``v_a`` and ``s_a`` (``empty_like`` of each, S
    float32). An LSE of another float dtype is converted (a copy), as FlashInfer does.
    """
    if not (isinstance(v_a, torch.Tensor) and isinstance(s_a, torch.Tensor)):
        _check_pair(("v_a", "s_a", "v_b", "s_b"), v_a, s_a, v_b, s_b)  # raises
    v_merged = torch.empty_like(v_a)
    s_merged = torch.empty_like(s_a, dtype=torch.float32)
    if not call_fast(_MERGE_STATE, v_a, s_a, v_b, s_b, v_merged, s_merged):
        _check_pair(("v_a", "s_a", "v_b", "s_b"), v_a, s_a, v_b, s_b)
        a, b, copied_v = _checks.one_layout(v_a, v_b)  # different strides: one layout
        _checks.vector_strides("v_a", a, _PAIR)  # (a copy is contiguous)
        (sa, converted_a), (sb, converted_b) = _float32(s_a), _float32(s_b)
        sa, sb, copied_s = _checks.one_layout(sa, sb)
        merge_call(LSE, (a, b), (sa, sb), 2.0, out=v_merged, out_stats=s_merged,
                   names=_STATE_NAMES,
                   register=None if copied_v or copied_s or converted_a or converted_b else
                   (_MERGE_STATE, False, v_a, s_a, v_b, s_b, v_merged, s_merged))
    return v_merged, s_merged


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor,
                         s_other: torch.Tensor, mask: Optional[torch.Tensor] = None) -> None:
    """Merge (v_other, s_other) into (v, s) in place.

    ``mask``, a bool (seq_len,) tensor, leaves the positions where it is False
    untouched (neither read nor written). ``s`` must be float32: FlashInfer
    would update a converted copy of any other dtype, losing the update.
    """
    if call_fast(_IN_PLACE, v, s, v_other, s_other, mask):
        return
    if isinstance(s, torch.Tensor) and s.dtype != torch.float32:
        raise TypeError("s must be a float32 tensor (it is updated in place)")
    _check_pair(("v", "s", "v_other", "s_other"), v, s, v_other, s_other)
    if mask is not None:
        _checks.tensor("mask", mask, dims="(seq_len,)", shape=(v.shape[0],),
                       dtypes=(torch.bool, torch.uint8), device=v.device)
    check_own_memory("v", v)  # before a copy into its strides
    _checks.vector_strides("v", v, _PAIR)
    check_own_memory("s", s)
    # The other state in v's and s's strides where its own differ (v and s are written).
    _, other, copied_v = _checks.one_layout(v, v_other, keep_first=True)
    other_s, converted = _float32(s_other)
    _, other_s, copied_s = _checks.one_layout(s, other_s, keep_first=True)
    merge_call(LSE, (v, other), (s, other_s), 2.0, out=v, out_stats=s, row_mask=mask,
               stats_in_place=True, names=_IN_PLACE_NAMES,
               register=None if copied_v or copied_s or converted else
               (_IN_PLACE, False, v, s, v_other, s_other, mask))


def variable_length_merge_states(v: torch.Tensor, s: torch.Tensor,
                                 indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a variable number of states per position (``flashinfer.triton.cascade``).

    Parameters
    ----------
    v : Tensor (nnz, num_heads, head_dim)
        The states of every position, back to back.
    s : Tensor (nnz, num_heads), float32, base-2 LSE
    indptr : Tensor (seq_len + 1,), int32 or int64
        Position i merges states ``indptr[i]`` to ``indptr[i + 1] - 1`` (lengths read
        on the device; checked on the host first, except inside a CUDA-graph capture).

    Returns
    -------
    (V, S): (seq_len, num_heads, head_dim) in v's dtype and float32 (seq_len,
    num_heads), base 2. A position with no state, or only empty ones, is 0 with
    LSE -inf, as in FlashInfer.
    """
    for name, value in (("v", v), ("s", s), ("indptr", indptr)):
        _checks.tensor(name, value)
    if v.dim() != 3 or s.dim() != 2 or v.shape[:2] != s.shape:
        raise ValueError(f"v must be (nnz, num_heads, head_dim) and s (nnz, num_heads), got "
                         f"{tuple(v.shape)} and {tuple(s.shape)}")
    if s.dtype != torch.float32:
        raise TypeError(f"s must be float32 (FlashInfer would convert a copy), got {s.dtype}")
    _checks.tensor("v", v, dtypes=_checks.STATE_DTYPES)
    _checks.head_dim("v", v, "head_dim")
    _checks.vector_strides("v", v, "(nnz, num_heads, head_dim)")
    if indptr.dim() != 1 or indptr.shape[0] < 1:
        raise ValueError(f"indptr must be 1-D (seq_len + 1,), got shape {tuple(indptr.shape)}")
    seq_len, num_heads, head_dim = indptr.shape[0] - 1, v.shape[1], v.shape[2]
    v_merged = torch.empty(seq_len, num_heads, head_dim, dtype=v.dtype, device=v.device)
    s_merged = torch.empty(seq_len, num_heads, dtype=torch.float32, device=v.device)
    merge_call(LSE, v, s, 2.0, out=v_merged, out_stats=s_merged, extras=Extras(indptr=indptr),
               names=_STATES_NAMES)
    return v_merged, s_merged


def _float32(lse: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """An LSE as float32, and whether that took a conversion (FlashInfer converts too)."""
    return (lse, False) if lse.dtype == torch.float32 else (lse.float(), True)


def _check_pair(names, v_a, s_a, v_b, s_b) -> None:
    """Two states (seq_len, num_heads, head_dim) with float LSEs (seq_len, num_heads)."""
    na, sa, nb, sb = names
    _checks.tensor(na, v_a, dims=_PAIR, dtypes=_checks.STATE_DTYPES)
    _checks.head_dim(na, v_a, "head_dim")
    _checks.tensor(sa, s_a, dims="(seq_len, num_heads)", shape=tuple(v_a.shape[:2]),
                   dtypes=_LSE_DTYPES, device=v_a.device)
    _checks.same(nb, v_b, na, v_a)
    _checks.head_dim(nb, v_b, "head_dim")
    _checks.same(sb, s_b, sa, s_a, dtypes=_LSE_DTYPES)


def _check_states(v, s) -> None:
    _checks.tensor("v", v, dims="(seq_len, num_states, num_heads, head_dim)",
                   dtypes=_checks.STATE_DTYPES)
    _checks.head_dim("v", v, "head_dim")
    _checks.vector_strides("v", v, "(seq_len, num_states, num_heads, head_dim)")
    _checks.tensor("s", s, dims="(seq_len, num_states, num_heads)", shape=tuple(v.shape[:3]),
                   dtypes=_LSE_DTYPES, device=v.device)
