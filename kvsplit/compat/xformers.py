"""xFormers' ``xformers.ops.fmha.merge_attentions`` on kvsplit.

Chunks of attention [B, M, (G,) H, K] with their base-e LSE [B, (G,) H, M],
stacked ([C, ...]) or as lists of C tensors. Rows are (B, M, G*H): the LSE's
M is read through a permuted view and G and H fold into one dim of the
views, so nothing is copied while G and H of every input fold (as in
xFormers' own layouts, LSE padded along M included). As in xFormers, a row
whose chunks are all empty (LSE -inf) gives 0 and LSE -inf.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

from .._call import merge_call
from .._kernel import ROLES, call_fast, call_form
from ..config import DTYPE_PAIRS
from ..validation import LSE
from . import _checks

__all__ = ["merge_attentions"]
_ATTN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_OUT_DTYPES = tuple(dict.fromkeys(getattr(torch, b) for _, b in DTYPE_PAIRS))
Chunks = Union[torch.Tensor, Sequence[torch.Tensor]]
# A stacked call: attn_split, lse_split, attn_out, lse_out (None without write_lse).
_FORM = call_form([ROLES.PARTIAL_O, ROLES.STATS, ROLES.OUT, ROLES.OUT_STATS])
_NAMES = (("partial_o", "attn_split"), ("stats", "lse_split"), ("out", "attn_out"),
          ("out_stats", "lse_out"))


def _fold(t: torch.Tensor, g: int, name: str) -> torch.Tensor:
    """``t`` with dims g and g + 1 (G, H) as one dim of G * H: a view, or ValueError."""
    size_g, size_h = t.shape[g], t.shape[g + 1]
    if size_g == 1:
        return t.select(g, 0)
    if size_h == 1:
        return t.select(g + 1, 0)
    if t.stride(g) != size_h * t.stride(g + 1):
        raise ValueError(f"{name}: G and H must fold into one dim without a copy (stride of G = "
                         f"H * stride of H), got strides {t.stride()}")
    shape, strides = list(t.shape), list(t.stride())
    shape[g:g + 2], strides[g:g + 2] = [size_g * size_h], [strides[g + 1]]
    return t.as_strided(shape, strides)


def _chunk_lists(attn_split: Chunks, lse_split: Chunks):
    """The chunks as two lists, checked against chunk 0 in xFormers' terms."""
    for name, value in (("attn_split", attn_split), ("lse_split", lse_split)):
        if not isinstance(value, (torch.Tensor, list, tuple)):
            raise TypeError(f"{name} must be a tensor or a list of tensors, got "
                            f"{type(value).__name__}")
        if isinstance(value, torch.Tensor):
            _checks.tensor(name, value)
    attn = list(attn_split.unbind(0)) if isinstance(attn_split, torch.Tensor) else list(attn_split)
    lse = list(lse_split.unbind(0)) if isinstance(lse_split, torch.Tensor) else list(lse_split)
    if len(attn) != len(lse):
        raise ValueError(f"attn_split has {len(attn)} chunks but lse_split has {len(lse)}")
    if not attn:
        raise ValueError("attn_split is empty: nothing to merge")
    for name, chunks in (("attn_split", attn), ("lse_split", lse)):
        for i, chunk in enumerate(chunks):
            _checks.tensor(f"{name}[{i}]", chunk)
    for i, (a, s) in enumerate(zip(attn, lse)):
        if a.shape != attn[0].shape or s.shape != lse[0].shape:
            raise ValueError(f"chunk {i} has shapes {tuple(a.shape)} and {tuple(s.shape)}, chunk 0 "
                             f"{tuple(attn[0].shape)} and {tuple(lse[0].shape)}")
        if a.dtype != attn[0].dtype or s.dtype != lse[0].dtype:
            raise TypeError(f"chunk {i} has dtypes {a.dtype} and {s.dtype}, chunk 0 "
                            f"{attn[0].dtype} and {lse[0].dtype}")
    return attn, lse


def _one_layout(chunks: list[torch.Tensor], align: int) -> bool:
    """Whether kvsplit reads the chunks as they are: one strides, equally far apart in memory."""
    first = chunks[0]
    if any(c.stride() != first.stride() or c.device != first.device for c in chunks):
        return False
    addresses = [c.data_ptr() for c in chunks]
    step = addresses[1] - addresses[0] if len(chunks) > 1 else 0
    return step % align == 0 and all(b - a == step for a, b in zip(addresses, addresses[1:]))


def _outputs(shape, dtype, device, write_lse):
    """attn_out [B, M, (G,) H, K] and lse_out [B, (G,) H, M] (None without write_lse); sizes
    as integers (torch.empty parses a tuple or torch.Size slower)."""
    attn_out = torch.empty(*shape, dtype=dtype, device=device)
    lse_out = (torch.empty(shape[0], *shape[2:-1], shape[1], dtype=torch.float32, device=device)
               if write_lse else None)
    return attn_out, lse_out


def merge_attentions(attn_split: Chunks, lse_split: Chunks, write_lse: bool = True,
                     output_dtype: Optional[torch.dtype] = None
                     ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Merge attention computed on C chunks of K/V for the same queries.

    ``out = sum_i exp(lse_i) * attn_i / sum_i exp(lse_i)``,
    ``lse = log(sum_i exp(lse_i))``.

    Parameters
    ----------
    attn_split : Tensor [C, B, M, (G,) H, K] or a list of C tensors [B, M, (G,) H, K]
        float32, float16 or bfloat16; K a multiple of 16 bytes, up to 1024.
    lse_split : Tensor [C, B, (G,) H, M] or a list of C tensors [B, (G,) H, M]
        float32, base e; -inf marks an empty chunk.
    write_lse : bool
        Also return the merged LSE.
    output_dtype : torch.dtype, optional
        The output's dtype: attn_split's by default; float32, float16, bfloat16 or FP8.

    Returns
    -------
    (attn_out [B, M, (G,) H, K], lse_out [B, (G,) H, M] float32 or None).

    A list whose chunks have different strides, or (more than two) do not lie
    equally far apart in memory, is stacked first: one copy of each list.
    """
    attn_out = lse_out = None
    if (isinstance(attn_split, torch.Tensor) and isinstance(lse_split, torch.Tensor)
            and attn_split.dim() in (5, 6) and attn_split.dtype in _ATTN_DTYPES
            and (output_dtype is None or output_dtype in _OUT_DTYPES)):
        # Perhaps a layout seen before: allocate and try the binding's per-call path.
        attn_out, lse_out = _outputs(attn_split.shape[1:], output_dtype or attn_split.dtype,
                                     attn_split.device, write_lse)
        if call_fast(_FORM, attn_split, lse_split, attn_out, lse_out):
            return attn_out, lse_out
    if isinstance(attn_split, torch.Tensor) and isinstance(lse_split, torch.Tensor):
        attn, lse = _checks.tensor("attn_split", attn_split), _checks.tensor("lse_split", lse_split)
        if attn.dim() != lse.dim() + 1 or attn.dim() not in (5, 6):
            raise ValueError(f"attn_split {tuple(attn.shape)} and lse_split {tuple(lse.shape)}: "
                             "expected [C, B, M, (G,) H, K] and [C, B, (G,) H, M]")
        if attn.shape[:2] != lse.shape[:2] or attn.shape[3:-1] != lse.shape[2:-1] or (
                attn.shape[2] != lse.shape[-1]):
            raise ValueError(f"incompatible shapes: attn_split {tuple(attn.shape)}, lse_split "
                             f"{tuple(lse.shape)}")
        if attn.shape[0] == 0:
            raise ValueError("attn_split is empty: nothing to merge")
    else:
        chunks, lse_chunks = _chunk_lists(attn_split, lse_split)
        a0, s0 = chunks[0], lse_chunks[0]
        if a0.dim() != s0.dim() + 1 or a0.dim() not in (4, 5):
            raise ValueError(f"attn_split[0] {tuple(a0.shape)} and lse_split[0] "
                             f"{tuple(s0.shape)}: expected [B, M, (G,) H, K] and [B, (G,) H, M]")
        if a0.shape[:1] != s0.shape[:1] or a0.shape[2:-1] != s0.shape[1:-1] or (
                a0.shape[1] != s0.shape[-1]):
            raise ValueError(f"incompatible shapes: attn_split[0] {tuple(a0.shape)}, "
                             f"lse_split[0] {tuple(s0.shape)}")
        attn, lse = chunks, lse_chunks
        if not (_one_layout(chunks, 16) and _one_layout(lse_chunks, 4)):
            attn, lse = torch.stack(chunks), torch.stack(lse_chunks)
    stacked = isinstance(attn, torch.Tensor)
    dtype, lse_dtype = attn[0].dtype, lse[0].dtype
    if dtype not in _ATTN_DTYPES:
        raise TypeError(f"attn_split must be float32, float16 or bfloat16, got {dtype}")
    if lse_dtype != torch.float32:
        raise TypeError(f"lse_split must be float32, got {lse_dtype}")
    out_dtype = output_dtype or dtype
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"output_dtype must be one of {', '.join(map(str, _OUT_DTYPES))}, got "
                        f"{out_dtype}")
    shape = tuple(attn[0].shape)  # [B, M, (G,) H, K]
    grouped = len(shape) == 5
    dims = "C, B, M, G, H, K" if grouped else "C, B, M, H, K"
    first, first_name = (attn, "attn_split") if stacked else (attn[0], "attn_split[0]")
    _checks.head_dim(first_name, first, "K")
    _checks.vector_strides(first_name, first, f"[{dims if stacked else dims[3:]}]")
    if attn_out is None or attn_out.dtype != out_dtype:
        attn_out, lse_out = _outputs(shape, out_dtype, attn[0].device, write_lse)

    def rows(t: torch.Tensor, lead: int, name: str, is_lse: bool = False) -> torch.Tensor:
        """[(C,) B, M, G*H(, K)] after ``lead`` leading dims: M moved next to B, G and H folded."""
        t = t.movedim(-1, lead + 1) if is_lse else t
        return _fold(t, lead + 2, name) if grouped else t

    given = stacked and isinstance(attn_split, torch.Tensor)  # stacked by the caller
    if stacked:
        parts_o, parts_s = rows(attn, 1, "attn_split"), rows(lse, 1, "lse_split", True)
    else:
        parts_o = [rows(c, 0, "attn_split") for c in attn]
        parts_s = [rows(c, 0, "lse_split", True) for c in lse]
    merge_call(LSE, parts_o, parts_s, math.e, out=rows(attn_out, 0, "attn_out"),
               out_stats=None if lse_out is None else rows(lse_out, 0, "lse_out", True),
               row_dims=(3,), names=_NAMES if given else None,
               register=(_FORM, False, attn, lse, attn_out, lse_out) if given else None)
    return attn_out, lse_out
