"""The CUDA peer merges of benchmarks/peer_kernels.cu against the float64 reference, on the GPU.

They are only timed next to kvsplit (benchmarks/bench_few.py), but a peer that merged
something else would make the timing meaningless: each is held here to the float64
merge of attention states, with empty states, a head-major LSE, more heads than one
CTA of FlashInfer's design holds, and head dims past 32 vectors a row.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
from pathlib import Path

import pytest
import torch

from state_reference import merge_reference, seeded

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)
if shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
    pytest.skip("no nvcc to build the peers", allow_module_level=True)

_spec = importlib.util.spec_from_file_location(
    "kvsplit_bench_peers_cuda", Path(__file__).resolve().parents[1] / "benchmarks" / "peers_cuda.py")
peers_cuda = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peers_cuda)

SHAPES = [(1, 8, 64), (7, 3, 80), (33, 128, 128), (4, 16, 512), (2, 5, 576)]


def states(n, tokens, heads, head_dim, dtype, key, *, empty=-math.inf):
    """(n, tokens, heads, head_dim) states and a head-major (n, tokens, heads) LSE view;
    token 0 has no non-empty state, and some others are empty."""
    g = seeded(*key)
    v = torch.randn(n, tokens, heads, head_dim, generator=g).to(dtype)
    s = 3 * torch.randn(n, tokens, heads, generator=g)
    s[torch.rand(n, tokens, heads, generator=g) < 0.2] = empty
    s[:, 0] = empty
    s = s.permute(0, 2, 1).contiguous().permute(0, 2, 1)  # head-major, as vLLM keeps it
    return v, s


def check(out, out_lse, ref, ref_lse, dtype):
    torch.testing.assert_close(out.cpu().double(), ref, rtol=2 * torch.finfo(dtype).eps,
                               atol=1e-5)
    torch.testing.assert_close(out_lse.cpu().double(), ref_lse.float().double(), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-D{}".format(*s))
def test_two_state_vllm(shape, dtype):
    v, s = states(2, *shape, dtype, ("vllm", shape, str(dtype)), empty=math.inf)
    ref, ref_lse = merge_reference(v, s, math.e, inf_is_empty=True)
    v, s = v.cuda(), s.cuda()
    out = torch.full(v.shape[1:], float("nan"), dtype=dtype, device="cuda")
    out_lse = torch.full(s.shape[1:], float("nan"), device="cuda")
    peers_cuda.two_state_vllm(v[0], s[0], v[1], s[1], out, out_lse)
    check(out, out_lse, ref, ref_lse, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-D{}".format(*s))
def test_two_state_flashinfer(shape, dtype):
    v, s = states(2, *shape, dtype, ("flashinfer-2", shape, str(dtype)))
    ref, ref_lse = merge_reference(v, s, 2.0)
    v, s = v.cuda(), s.cuda()
    out = torch.full(v.shape[1:], float("nan"), dtype=dtype, device="cuda")
    out_lse = torch.full(s.shape[1:], float("nan"), device="cuda")
    peers_cuda.two_state_flashinfer(v[0], s[0], v[1], s[1], out, out_lse)
    check(out, out_lse, ref, ref_lse, dtype)


@pytest.mark.parametrize("n", [1, 2, 5, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-D{}".format(*s))
def test_states_flashinfer(shape, n):
    v, s = states(n, *shape, torch.bfloat16, ("flashinfer-n", shape, n))
    ref, ref_lse = merge_reference(v, s, 2.0)
    v, s = v.cuda(), s.cuda()
    out = torch.full(v.shape[1:], float("nan"), dtype=torch.bfloat16, device="cuda")
    out_lse = torch.full(s.shape[1:], float("nan"), device="cuda")
    peers_cuda.states_flashinfer(v, s, out, out_lse)
    check(out, out_lse, ref, ref_lse, torch.bfloat16)
