"""The parameter grid shared by the merge tests of both kernel families."""

from __future__ import annotations

import pytest
import torch

FORMATS = ["maxsum", "lse2", "lsee"]
DTYPES = [
    pytest.param((torch.bfloat16, torch.bfloat16), id="bf16-bf16"),
    pytest.param((torch.float16, torch.float16), id="fp16-fp16"),
    pytest.param((torch.float32, torch.bfloat16), id="fp32-bf16"),
    pytest.param((torch.float32, torch.float16), id="fp32-fp16"),
]
HEAD_DIMS = [64, 128, 256, 512]


def out_kwargs(rows, head_dim, out_dtype, partial_dtype, device):
    """An explicit ``out`` only where the default dtype differs (float32 -> float16)."""
    if partial_dtype == torch.float32 and out_dtype == torch.float16:
        return {"out": torch.empty(rows, head_dim, dtype=out_dtype, device=device)}
    return {}
