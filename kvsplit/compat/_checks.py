"""Argument checks in an engine's own terms, for the adapters' first call of a layout.

An adapter checks its arguments with these before it hands them to the general
call, so that a bad input is a ValueError or TypeError naming the argument as
the engine's users know it, with the shapes as they pass them (vLLM's
head-major LSE as ``(num_heads, num_tokens)``, not the view kvsplit merges).
A call of a layout seen before never gets here: the binding serves it.
"""

from __future__ import annotations

import numbers
from typing import Optional, Sequence

import torch

from ..config import head_dim_rule, head_dim_supported
from ..validation import _store_bytes, check_dense, misaligned_dim, same_layout

STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def tensor(name: str, value, *, dims: Optional[str] = None, shape: Optional[tuple] = None,
           dtypes: Optional[Sequence[torch.dtype]] = None,
           device: Optional[torch.device] = None) -> torch.Tensor:
    """Checks ``value``: a tensor, ``dims`` the dim names as the engine writes them
    (``"(num_tokens, num_heads, head_size)"``), ``shape`` its exact shape (sizes
    given by other arguments), ``dtypes`` the allowed ones, ``device``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    check_dense(name, value)
    if dims is not None:
        rank = sum(1 for part in dims.strip("()").split(",") if part.strip())
        if value.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {dims}, got shape {tuple(value.shape)}")
    if shape is not None and tuple(value.shape) != tuple(shape):
        what = f" {dims}" if dims else ""
        raise ValueError(f"{name} must have shape{what} {tuple(shape)}, got {tuple(value.shape)}")
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_names(dtypes)}; got "
                        f"{str(value.dtype).removeprefix('torch.')}")
    if device is not None and value.device != device:
        raise ValueError(f"{name} is on {value.device}, the other tensors on {device}")
    return value


def same(name: str, value, like_name: str, like: torch.Tensor, *,
         dtypes: Optional[Sequence[torch.dtype]] = None) -> torch.Tensor:
    """``value`` has ``like``'s shape and device, and its dtype unless ``dtypes`` are given."""
    tensor(name, value, shape=tuple(like.shape), device=like.device,
           dtypes=dtypes if dtypes is not None else (like.dtype,))
    return value


def optional_int(name: str, value, low: int, high: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be {low}..{high}, got {value}")


def one_layout(first: torch.Tensor, second: torch.Tensor, *,
               keep_first: bool = False) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Two states of one shape and dtype in one layout: the kernels read the second at its
    distance from the first, with the first's strides. Where the strides differ (on a dim
    of more than one element), both are made contiguous, or with ``keep_first`` (an
    in-place merge writes the first) the second is copied into the first's strides.
    Returns the pair and whether it copied; a call that copied registers nothing for the
    per-call path (its layout is the copy's, not the caller's tensors')."""
    if same_layout(first, second):
        return first, second, False
    if keep_first:
        copy = torch.empty_strided(first.shape, first.stride(), dtype=second.dtype,
                                   device=second.device)
        return first, copy.copy_(second), True
    return first.contiguous(), second.contiguous(), True


def head_dim(name: str, value: torch.Tensor, what: str) -> None:
    """The last dim of states ``value`` (``what``, as the engine calls it): one the kernels
    take (:func:`kvsplit.config.head_dim_supported`), at unit stride."""
    dtype = str(value.dtype).removeprefix("torch.")
    if not head_dim_supported(value.shape[-1], dtype):
        raise ValueError(f"{name}: {what} {value.shape[-1]} is not supported with {dtype} "
                         f"states; use {head_dim_rule(dtype)}")
    unit_stride(name, value, what)


def unit_stride(name: str, value: torch.Tensor, what: str) -> None:
    """``value``'s last dim (``what``) at unit stride, as the kernels read and write it."""
    if value.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride on {what} (its last dim), got "
                         f"strides {value.stride()}")


def vector_strides(name: str, value: torch.Tensor, dims: str, *,
                   partial_dtype: Optional[torch.dtype] = None) -> None:
    """Every dim of ``value`` but the last (of more than one element) steps whole vectors:
    16 bytes for states, for an output (``partial_dtype``: the states' dtype) the bytes
    that 16 bytes of states become. ``dims``: the dim names as the engine writes them."""
    unit = 16 if partial_dtype is None else _store_bytes(partial_dtype, value.dtype)
    dim = misaligned_dim(value, unit)
    if dim is not None:
        names = [part.strip() for part in dims.strip("()[]").split(",")]
        stride = value.stride(dim)
        raise ValueError(f"{name}: the stride of {names[dim]} is {stride} elements, "
                         f"{stride * value.element_size()} bytes, not a multiple of {unit} "
                         f"bytes (strides {value.stride()})")
