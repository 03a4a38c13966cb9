"""SGLang's two-state merges on kvsplit: ``sgl_kernel.merge_state_v2`` and the dispatcher
``sglang.srt.layers.attention.merge_state.merge_state``.

States (num_tokens, num_heads, head_size) in float32, float16 or bfloat16 with
a float32 LSE (num_tokens, num_heads), token-major, base e. SGLang's kernels
map every infinite LSE to -inf, so +inf (an empty sequence's value in
FlashAttention 2) reads as an empty state here too. The two states merge
where they lie (no stacking); any strides but on head_size (SGLang's CUDA
kernel wants contiguous tensors). Where SGLang's kernels give NaN (both
states empty), these give 0 and an LSE of -inf.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .._call import merge_call
from .._kernel import ROLES, call_fast, call_form
from ..validation import LSE, check_own_memory
from . import _checks

__all__ = ["merge_state", "merge_state_v2"]
_STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (v_a, s_a, v_b, s_b, v_merged, s_merged); the output may be either state itself. One
# form (registry of layouts seen) per function: the dispatcher takes output dtypes that
# merge_state_v2 refuses, so a layout one has launched must not pass the other's checks.
_ROLES = [ROLES.PARTIAL_O, ROLES.STATS, ROLES.PARTIAL_O, ROLES.STATS, ROLES.OUT,
          ROLES.OUT_STATS]
_FORM_V2 = call_form(_ROLES, in_place=True)
_FORM_DISPATCHER = call_form(_ROLES, in_place=True)
_STATES = "(num_tokens, num_heads, head_size)"


def _check(names, v_a, s_a, v_b, s_b, v_merged, s_merged, any_out_dtype) -> None:
    """SGLang's rules in SGLang's names (``names``: v_a, s_a, v_b, s_b, v_merged, s_merged
    as the caller calls them)."""
    na, sa, nb, sb, nv, ns = names
    for i, (name, value) in enumerate(zip(names, (v_a, s_a, v_b, s_b, v_merged, s_merged))):
        if i < 4 or value is not None:
            _checks.tensor(name, value)
    if v_a.dim() != 3 or v_b.dim() != 3:
        raise ValueError(f"{na} and {nb} must be 3-D {_STATES}, got "
                         f"{tuple(v_a.shape)} and {tuple(v_b.shape)}")
    if s_a.dim() != 2 or s_b.dim() != 2:
        raise ValueError(f"{sa} and {sb} must be 2-D (num_tokens, num_heads), got "
                         f"{tuple(s_a.shape)} and {tuple(s_b.shape)}")
    if v_a.shape != v_b.shape or s_a.shape != s_b.shape or s_a.shape != v_a.shape[:2]:
        raise ValueError(f"shapes do not match: {na} {tuple(v_a.shape)}, {sa} {tuple(s_a.shape)}, "
                         f"{nb} {tuple(v_b.shape)}, {sb} {tuple(s_b.shape)}")
    if v_a.dtype not in _STATE_DTYPES or v_b.dtype != v_a.dtype:
        raise TypeError(f"{na} and {nb} must share one dtype of float32, float16 or bfloat16, "
                        f"got {v_a.dtype} and {v_b.dtype}")
    _checks.head_dim(na, v_a, "head_size")
    _checks.head_dim(nb, v_b, "head_size")
    if not s_a.is_floating_point() or not s_b.is_floating_point():
        raise TypeError(f"{sa} and {sb} must be floating point, got {s_a.dtype} and {s_b.dtype}")
    devices = {t.device for t in (v_a, s_a, v_b, s_b, v_merged, s_merged) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"every tensor must be on one device, got {sorted(map(str, devices))}")
    if v_merged is not None:
        allowed = _STATE_DTYPES if any_out_dtype else (v_a.dtype,)
        if v_merged.dtype not in allowed:
            raise TypeError(f"{nv} must have dtype {' or '.join(map(str, allowed))}, got "
                            f"{v_merged.dtype}")
        if v_merged.shape != v_a.shape:
            raise ValueError(f"{nv} must have shape {tuple(v_a.shape)}, got "
                             f"{tuple(v_merged.shape)}")
        _checks.unit_stride(nv, v_merged, "head_size")
        _checks.vector_strides(nv, v_merged, _STATES, partial_dtype=v_a.dtype)
    if s_merged is not None:
        if s_merged.dtype != torch.float32:
            raise TypeError(f"{ns} must be float32, got {s_merged.dtype}")
        if s_merged.shape != s_a.shape:
            raise ValueError(f"{ns} must have shape {tuple(s_a.shape)}, got "
                             f"{tuple(s_merged.shape)}")


def _given(form, v_a, s_a, v_b, s_b, v_merged, s_merged) -> bool:
    """Whether a call given both outputs was launched on the per-call path (a layout seen
    before); the public functions try it before anything else."""
    return (v_merged is not None and s_merged is not None
            and call_fast(form, v_a, s_a, v_b, s_b, v_merged, s_merged))


def _merge_pair(form, names, v_a, s_a, v_b, s_b, v_merged, s_merged, any_out_dtype):
    """The call that _given did not launch: outputs allocated where missing, then the
    per-call path for those, else checks, plan and launch."""
    if ((v_merged is None or s_merged is None)
            and isinstance(v_a, torch.Tensor) and isinstance(s_a, torch.Tensor)):
        if v_merged is None:
            v_merged = torch.empty_like(v_a)
        if s_merged is None:
            s_merged = torch.empty_like(s_a, dtype=torch.float32)
        if call_fast(form, v_a, s_a, v_b, s_b, v_merged, s_merged):  # a layout seen before
            return v_merged, s_merged
    _check(names, v_a, s_a, v_b, s_b, v_merged, s_merged, any_out_dtype)
    args = (v_a, s_a, v_b, s_b, v_merged, s_merged)
    # SGLang reads the LSE as float32 (a converted copy of any other dtype, as SGLang makes).
    copied = s_a.dtype != torch.float32 or s_b.dtype != torch.float32
    s_a = s_a if s_a.dtype == torch.float32 else s_a.float()
    s_b = s_b if s_b.dtype == torch.float32 else s_b.float()
    # An output over an input is an elementwise in-place merge in SGLang. kvsplit writes in
    # place over the first state only, and over its output and LSE together: put that state
    # first (the merge is symmetric).
    # (Empty tensors share address 0: they are not each other.)
    on_a = v_merged.numel() > 0 and v_merged.data_ptr() == v_a.data_ptr()
    on_b = v_merged.numel() > 0 and v_merged.data_ptr() == v_b.data_ptr()
    na, sa, nb, sb, nv, ns = names
    if on_b:
        v_a, s_a, v_b, s_b = v_b, s_b, v_a, s_a
        na, sa, nb, sb = nb, sb, na, sa
    in_place = on_a or on_b
    if in_place and s_merged.data_ptr() != s_a.data_ptr():
        raise ValueError(f"{nv} may be {na} itself only with {ns} being {sa} (an in-place merge)")
    # States of different strides: copied into one layout (in place, the written one's).
    check_own_memory(nv, v_merged)
    check_own_memory(ns, s_merged)
    v_a, v_b, copied_v = _checks.one_layout(v_a, v_b, keep_first=in_place)
    _checks.vector_strides(na, v_a, _STATES)  # the layout both are read in (a copy's passes)
    s_a, s_b, copied_s = _checks.one_layout(s_a, s_b, keep_first=in_place)
    copied = copied or copied_v or copied_s
    merge_call(LSE, (v_a, v_b), (s_a, s_b), math.e, out=v_merged, out_stats=s_merged,
               empty_stat=math.inf, stats_in_place=in_place,
               names=(("o_parts", (na, nb)), ("s_parts", (sa, sb)), ("out", nv),
                      ("out_stats", ns)),
               register=None if copied else (form, on_b) + args)
    return v_merged, s_merged


def merge_state_v2(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor,
                   v_merged: Optional[torch.Tensor] = None,
                   s_merged: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the states (v_a, s_a) and (v_b, s_b); returns ``(v_merged, s_merged)``.

    Parameters
    ----------
    v_a, v_b : Tensor (num_tokens, num_heads, head_size)
        float32, float16 or bfloat16; head_size a multiple of 16 bytes, up to 1024.
    s_a, s_b : Tensor (num_tokens, num_heads), base-e LSE
        float32 (another float dtype is converted, a copy, as SGLang does); +inf and
        -inf mark an empty state.
    v_merged : Tensor like v_a, optional
        Written in place when given (``empty_like(v_a)`` otherwise); v_a's dtype.
        It may be v_a (or v_b) itself when s_merged is s_a (or s_b).
    s_merged : Tensor (num_tokens, num_heads), float32, optional
        Written in place when given; always written.

    Returns
    -------
    (v_merged, s_merged). Both states empty: 0 and -inf (SGLang: NaN).
    """
    if _given(_FORM_V2, v_a, s_a, v_b, s_b, v_merged, s_merged):
        return v_merged, s_merged
    return _merge_pair(_FORM_V2, ("v_a", "s_a", "v_b", "s_b", "v_merged", "s_merged"), v_a, s_a,
                       v_b, s_b, v_merged, s_merged, any_out_dtype=False)


def merge_state(prefix_output: torch.Tensor, prefix_lse: torch.Tensor,
                suffix_output: torch.Tensor, suffix_lse: torch.Tensor,
                output: Optional[torch.Tensor] = None,
                output_lse: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's dispatcher: :func:`merge_state_v2` on any device and head size kvsplit takes.

    Returns ``(output, output_lse)``, both always written (allocated when None).
    ``output`` may be float32, float16 or bfloat16 whatever the states' dtype,
    converted on store as SGLang's Triton path does (its CUDA path takes only the
    states' dtype). FP8 states and head sizes that are not a multiple of 16 bytes,
    which SGLang sends to its Triton kernel, are refused.
    """
    if _given(_FORM_DISPATCHER, prefix_output, prefix_lse, suffix_output, suffix_lse, output,
              output_lse):
        return output, output_lse
    return _merge_pair(_FORM_DISPATCHER, ("prefix_output", "prefix_lse", "suffix_output",
                                          "suffix_lse", "output", "output_lse"),
                       prefix_output, prefix_lse, suffix_output, suffix_lse, output, output_lse,
                       any_out_dtype=True)
