"""TensorRT-LLM's ``torch.ops.trtllm.merge_chunked_attention_for_mla`` on kvsplit.

The op folds one chunk's attention (``temp_attn``, ``temp_softmax_stats``) into
the running result (``merged_attn``, ``merged_softmax_stats``) in place, request
by request: ``merge_op[b]`` 0 leaves request b's tokens untouched, 2 copies the
chunk, anything else merges. Attention is (tokens, num_heads, head_size)
memory, *normalised*; stats are float32 (tokens, num_heads, 2) pairs (max of
the scaled logits, softmax sum), base e: a state stands for ``sum * e^max``
and merges as ``(a * sum_a e^(max_a - M) + b * sum_b e^(max_b - M)) / sum``.

One kvsplit launch serves the whole op in place: the kernel reads each
request's op from ``cu_q_seq_lens`` and ``merge_op`` on the device (a token
finds its request by bisection), reads each state's LSE from its (max, sum)
pair as max + ln(sum), and writes a merged row's stats as the pair (LSE, 1),
the same state as TensorRT-LLM's (max, sum); a copied row takes ``temp_attn``
and its pair as they are. Departure: a row with both states empty is 0 with
stats (-inf, 1) where TensorRT-LLM gives NaN.
"""

from __future__ import annotations

import math
import numbers

import torch

from .._call import merge_call
from .._kernel import ROLES, call_fast, call_form
from ..config import KernelConfig, head_dim_rule, head_dim_supported
from ..dispatch.constraints import few_mended
from ..validation import LSE, Extras
from . import _checks

__all__ = ["merge_chunked_attention_for_mla"]
_ATTN_DTYPES = (torch.float16, torch.float32, torch.bfloat16)
# The op's own arguments in its order but max_q_seq_len (checked, not keyed); the outputs
# are the first state's own tensors (into_first), not passed again.
_FORM = call_form([ROLES.PARTIAL_O, ROLES.PARTIAL_O, ROLES.STATS, ROLES.STATS, ROLES.KEY,
                   ROLES.REQUEST_STARTS, ROLES.REQUEST_OPS, ROLES.KEY, ROLES.KEY],
                  into_first=True)
_NAMES = (("o_parts", ("merged_attn", "temp_attn")),
          ("s_parts", ("merged_softmax_stats", "temp_softmax_stats")), ("out", "merged_attn"),
          ("out_stats", "merged_softmax_stats"), ("request_starts", "cu_q_seq_lens"),
          ("request_ops", "merge_op"))


def _check(merged_attn, temp_attn, merged_softmax_stats, temp_softmax_stats, num_requests,
           cu_q_seq_lens, max_q_seq_len, merge_op, num_heads, head_size) -> None:
    """TensorRT-LLM's rules in its argument names."""
    tensors = {"merged_attn": merged_attn, "temp_attn": temp_attn,
               "merged_softmax_stats": merged_softmax_stats,
               "temp_softmax_stats": temp_softmax_stats, "cu_q_seq_lens": cu_q_seq_lens,
               "merge_op": merge_op}
    for name, value in tensors.items():
        _checks.tensor(name, value)
    for name, value in (("num_requests", num_requests), ("max_q_seq_len", max_q_seq_len),
                        ("num_heads", num_heads), ("head_size", head_size)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        least = 1 if name in ("num_heads", "head_size") else 0
        if value < least:
            raise ValueError(f"{name} must be at least {least}, got {value}")
    if merged_attn.numel() == 0 or temp_attn.numel() == 0:
        raise ValueError("merged_attn and temp_attn must not be empty")
    if merged_attn.dtype not in _ATTN_DTYPES or temp_attn.dtype != merged_attn.dtype:
        raise TypeError(f"merged_attn and temp_attn must share one dtype of float16, float32 or "
                        f"bfloat16, got {merged_attn.dtype} and {temp_attn.dtype}")
    dtype_name = str(merged_attn.dtype).removeprefix("torch.")
    if not head_dim_supported(head_size, dtype_name):
        raise ValueError(f"head_size {head_size} is not supported with {dtype_name} attention; "
                         f"use {head_dim_rule(dtype_name)}")
    # Only the Few family runs per-request ops, in place here: the dispatcher's own rule.
    if few_mended(KernelConfig.few(1), head_dim=head_size, elem_bytes=merged_attn.element_size(),
                  stats_in_place=True) is None:
        raise ValueError(f"head_size {head_size} is not supported with {dtype_name} attention by "
                         f"the in-place merge (a row in one warp: 1, 2 or 4 16-byte vectors a "
                         f"thread, a count of threads that divides 32, none idle a step; e.g. "
                         f"64, 128, 256 and 512)")
    if merged_softmax_stats.dtype != torch.float32 or temp_softmax_stats.dtype != torch.float32:
        raise TypeError(f"merged_softmax_stats and temp_softmax_stats must be float32, got "
                        f"{merged_softmax_stats.dtype} and {temp_softmax_stats.dtype}")
    for name in ("cu_q_seq_lens", "merge_op"):
        if tensors[name].dtype != torch.int64 or tensors[name].dim() != 1:
            raise TypeError(f"{name} must be a 1-D int64 tensor, got {tensors[name].dtype} "
                            f"{tuple(tensors[name].shape)}")
    if cu_q_seq_lens.shape[0] < num_requests + 1 or merge_op.shape[0] < num_requests:
        raise ValueError(f"cu_q_seq_lens needs num_requests + 1 = {num_requests + 1} entries and "
                         f"merge_op {num_requests}, got {cu_q_seq_lens.shape[0]} and "
                         f"{merge_op.shape[0]}")
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise ValueError(f"every tensor must be on one device, got {sorted(map(str, devices))}")
    row = num_heads * head_size
    tokens = merged_attn.numel() // row
    for name, per_token in (("merged_attn", row), ("temp_attn", row),
                            ("merged_softmax_stats", 2 * num_heads),
                            ("temp_softmax_stats", 2 * num_heads)):
        value = tensors[name]
        if not value.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if value.numel() % per_token or value.numel() < tokens * per_token:
            raise ValueError(f"{name} must hold whole tokens of {per_token} values and at least "
                             f"merged_attn's {tokens} tokens, got {value.numel()} values")


def merge_chunked_attention_for_mla(merged_attn: torch.Tensor, temp_attn: torch.Tensor,
                                    merged_softmax_stats: torch.Tensor,
                                    temp_softmax_stats: torch.Tensor, num_requests: int,
                                    cu_q_seq_lens: torch.Tensor, max_q_seq_len: int,
                                    merge_op: torch.Tensor, num_heads: int,
                                    head_size: int) -> None:
    """Fold (temp_attn, temp_softmax_stats) into (merged_attn, merged_softmax_stats) in place.

    Parameters
    ----------
    merged_attn, temp_attn : Tensor, contiguous, (tokens, num_heads, head_size) values
        float16, float32 or bfloat16 (one dtype), normalised attention; any shape
        holding whole tokens (TensorRT-LLM passes 2-D and 3-D tensors). head_size
        (TensorRT-LLM: 128 only) a multiple of 16 bytes up to 1024 whose row the
        in-place merge lays out in one warp: 1, 2 or 4 16-byte vectors a thread, a
        count of threads that divides 32, none idle a step (16-bit: 8-32, 56, 64,
        104-128, 232-256, 488-512, 1000-1024; not 80, 96, 192 or 576); a ValueError
        names any other.
    merged_softmax_stats, temp_softmax_stats : Tensor, float32, contiguous
        (tokens, num_heads, 2) pairs (max of the scaled logits, sum), base e; they
        may hold more tokens than merged_attn (the extra ones are not touched).
    num_requests : int
    cu_q_seq_lens : Tensor (num_requests + 1,), int64
        Request b owns tokens cu_q_seq_lens[b] to cu_q_seq_lens[b + 1] - 1. Read on
        the device only (no host copy, so a call captures into a CUDA graph), not
        checked: a token outside [cu_q_seq_lens[0], cu_q_seq_lens[num_requests]) is
        untouched, and offsets out of order give a token some request's op, never an
        access outside the tensors.
    max_q_seq_len : int
        TensorRT-LLM sizes its grid with it; its kernel covers every token of a
        request whatever it is, and so does this one (checked, not used).
    merge_op : Tensor (num_requests,), int64
        Per request: 0 skip (untouched), 2 copy temp (attention and stats as they
        are), anything else merge.
    num_heads, head_size : int

    Tokens past merged_attn's end are never touched (TensorRT-LLM writes past it).
    Merged rows' stats are written as (LSE, 1); both states empty: 0 and (-inf, 1).
    """
    # A layout seen before (max_q_seq_len is not keyed: checked here, as the Python path does).
    if type(max_q_seq_len) is int and max_q_seq_len >= 0 and call_fast(
            _FORM, merged_attn, temp_attn, merged_softmax_stats, temp_softmax_stats, num_requests,
            cu_q_seq_lens, merge_op, num_heads, head_size):
        return
    _check(merged_attn, temp_attn, merged_softmax_stats, temp_softmax_stats, num_requests,
           cu_q_seq_lens, max_q_seq_len, merge_op, num_heads, head_size)
    if num_requests == 0:
        return
    tokens = merged_attn.numel() // (num_heads * head_size)
    attn = merged_attn.view(tokens, num_heads, head_size)
    temp = temp_attn.view(-1, num_heads, head_size)[:tokens]
    stats = merged_softmax_stats.view(-1, num_heads, 2)[:tokens, :, 0]  # each pair's max
    temp_stats = temp_softmax_stats.view(-1, num_heads, 2)[:tokens, :, 0]
    extras = Extras(request_starts=cu_q_seq_lens[:num_requests + 1],
                    request_ops=merge_op[:num_requests], pair_stats=True)
    merge_call(LSE, (attn, temp), (stats, temp_stats), math.e, out=attn, out_stats=stats,
               stats_in_place=True, extras=extras, names=_NAMES,
               register=(_FORM, False, merged_attn, temp_attn, merged_softmax_stats,
                         temp_softmax_stats, num_requests, cu_q_seq_lens, merge_op, num_heads,
                         head_size))
