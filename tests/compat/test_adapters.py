"""kvsplit.compat adapters against float64 references of the originals' documented math.

The references below are written from FlashInfer's, vLLM's and FlashAttention
3's own definitions (a state is (v, lse); merged v = sum_i w_i v_i / sum_i w_i
with w_i = base^(lse_i - max), merged lse = log_base(sum_i w_i) + max), never
from kvsplit. A row whose states are all empty gives v = 0 and lse = -inf
(vLLM's CUDA kernel writes the prefix's output there). Every test runs on
the CPU and, marked gpu, on CUDA (the ``device`` fixture).
"""

from __future__ import annotations

import math

import pytest
import torch
from cuda_profile import profiled_kernels
from state_reference import merge_reference as merge_states_reference
from state_reference import seeded as gen
from torch.utils._python_dispatch import TorchDispatchMode

from kvsplit.compat import flash_attn, flashinfer, vllm

pytestmark = pytest.mark.usefixtures("dispatch_sandbox")
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}
LSE_TOL = 1e-4


def random_states(n, lead, head_dim, dtype, g, *, empty=0.15, pos_inf=0.0):
    v = torch.randn(n, *lead, head_dim, generator=g).to(dtype)
    s = torch.randn(n, *lead, generator=g) * 3
    s = s.masked_fill(torch.rand(n, *lead, generator=g) < empty, -math.inf)
    if pos_inf:
        s = s.masked_fill(torch.rand(n, *lead, generator=g) < pos_inf, math.inf)
    if lead:  # one row with every state empty
        s.view(n, -1)[:, 0] = -math.inf if not pos_inf else math.inf
    return v, s


def assert_close(out, lse, ref_out, ref_lse):
    assert torch.allclose(out.double().cpu(), ref_out, atol=TOL[out.dtype], rtol=TOL[out.dtype])
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    assert torch.allclose(lse.double().cpu()[finite], ref_lse[finite], atol=LSE_TOL, rtol=LSE_TOL)
    assert (lse.cpu()[~finite] == -math.inf).all()


# --- FlashInfer ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, num_states, heads, head_dim",
                         [(1, 2, 16, 128), (5, 7, 4, 64), (3, 1, 8, 512), (2, 33, 2, 256)])
def test_flashinfer_merge_states(device, tokens, num_states, heads, head_dim, dtype):
    v, s = random_states(num_states, (tokens, heads), head_dim, dtype, gen(tokens, num_states))
    v_fi = v.permute(1, 0, 2, 3).contiguous().to(device)  # FlashInfer's [seq, states, heads, D]
    s_fi = s.permute(1, 0, 2).contiguous().to(device)
    out, lse = flashinfer.merge_states(v_fi, s_fi)
    assert out.shape == (tokens, heads, head_dim) and out.dtype == dtype
    assert lse.shape == (tokens, heads) and lse.dtype == torch.float32
    if num_states == 1:  # FlashInfer copies one state as it is, an empty one included
        assert torch.equal(out.cpu(), v[0]) and torch.equal(lse.cpu(), s[0])
        return
    assert_close(out, lse, *merge_states_reference(v, s, 2.0))


@pytest.mark.parametrize("lse_dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_flashinfer_converts_another_lse_dtype(device, lse_dtype):
    """FlashInfer converts an LSE of another float dtype to float32 (a copy) in merge_state,
    merge_states and merge_state_in_place's other state; the merged LSE is float32."""
    v, s = random_states(3, (5, 4), 128, torch.bfloat16, gen("lse-dtype", lse_dtype))
    s = s.to(lse_dtype)
    ref_v, ref_s = merge_states_reference(v, s.float(), 2.0)
    out, lse = flashinfer.merge_states(v.permute(1, 0, 2, 3).contiguous().to(device),
                                       s.permute(1, 0, 2).contiguous().to(device))
    assert lse.dtype == torch.float32
    assert_close(out, lse, ref_v, ref_s)
    ref_v, ref_s = merge_states_reference(v[:2], s[:2].float(), 2.0)
    out, lse = flashinfer.merge_state(*(t.to(device) for t in (v[0], s[0], v[1], s[1])))
    assert lse.dtype == torch.float32 and lse.shape == s[0].shape
    assert_close(out, lse, ref_v, ref_s)
    target_v, target_s = v[0].clone().to(device), s[0].float().to(device)
    flashinfer.merge_state_in_place(target_v, target_s, v[1].to(device), s[1].to(device))
    assert_close(target_v, target_s, ref_v, ref_s)


def test_flashinfer_merge_states_of_no_state_and_one():
    """No state: 0 and -inf. One state: copied as it is, +inf and NaN LSEs included."""
    out, lse = flashinfer.merge_states(torch.randn(4, 0, 2, 16).half(), torch.randn(4, 0, 2))
    assert (out == 0).all() and out.shape == (4, 2, 16) and (lse == -math.inf).all()
    v = torch.randn(3, 1, 2, 16).half()
    s = torch.tensor([math.inf, -math.inf, math.nan, 1.5, -2.0, 0.0]).view(3, 1, 2)
    out, lse = flashinfer.merge_states(v, s)
    assert torch.equal(out, v[:, 0])
    assert torch.equal(lse.isnan(), s[:, 0].isnan())
    assert torch.equal(lse[~lse.isnan()], s[:, 0][~s[:, 0].isnan()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shared", [False, True])
def test_flashinfer_merge_state(device, dtype, shared):
    tokens, heads, head_dim = 6, 8, 128
    v, s = random_states(2, (tokens, heads), head_dim, dtype, gen("pair", dtype))
    if shared:  # two views of one buffer, the second before the first
        v_buf, s_buf = v.flip(0).contiguous().to(device), s.flip(0).contiguous().to(device)
        v_a, v_b, s_a, s_b = v_buf[1], v_buf[0], s_buf[1], s_buf[0]
    else:
        v_a, v_b, s_a, s_b = (t.clone().to(device) for t in (v[0], v[1], s[0], s[1]))
    out, lse = flashinfer.merge_state(v_a, s_a, v_b, s_b)
    assert out.shape == v_a.shape and lse.shape == s_a.shape
    assert_close(out, lse, *merge_states_reference(v, s, 2.0))


@pytest.mark.parametrize("head_dim", [128, 512])
@pytest.mark.parametrize("with_mask", [False, True])
def test_flashinfer_merge_state_in_place(device, head_dim, with_mask):
    tokens, heads, dtype = 9, 4, torch.bfloat16
    v, s = random_states(2, (tokens, heads), head_dim, dtype, gen("inplace", head_dim))
    target_v, target_s = v[0].clone().to(device), s[0].clone().to(device)
    other_v, other_s = v[1].clone().to(device), s[1].clone().to(device)
    mask = (torch.arange(tokens) % 3 != 1).to(device) if with_mask else None
    flashinfer.merge_state_in_place(target_v, target_s, other_v, other_s, mask)
    ref_v, ref_s = merge_states_reference(v, s, 2.0)
    if with_mask:  # masked-off positions are untouched, bit for bit
        keep = ~mask.cpu()
        assert torch.equal(target_v.cpu()[keep], v[0][keep])
        assert torch.equal(target_s.cpu()[keep], s[0][keep])
        ref_v[keep], ref_s[keep] = v[0][keep].double(), s[0][keep].double()
        finite_rows = torch.isfinite(ref_s)
        assert_close(target_v.cpu()[~keep], target_s.cpu()[~keep], ref_v[~keep], ref_s[~keep])
        assert finite_rows.any()
    else:
        assert_close(target_v, target_s, ref_v, ref_s)
    assert torch.equal(other_v.cpu(), v[1]) and torch.equal(other_s.cpu(), s[1])


# --- vLLM ------------------------------------------------------------------------------


@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("tokens, heads, head_dim", [(1, 16, 128), (7, 32, 128), (64, 8, 512)])
def test_vllm_merge_attn_states(device, tokens, heads, head_dim, with_lse):
    dtype = torch.bfloat16
    v, s = random_states(2, (tokens, heads), head_dim, dtype, gen("vllm", tokens), pos_inf=0.15)
    prefix_output, suffix_output = v[0].clone().to(device), v[1].clone().to(device)
    prefix_lse = s[0].t().contiguous().to(device)  # vLLM's head-major [heads, tokens]
    suffix_lse = s[1].t().contiguous().to(device)
    output = torch.empty_like(prefix_output)
    output_lse = torch.empty(heads, tokens, device=device) if with_lse else None
    assert vllm.merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
                                  output_lse) is None
    ref_v, ref_s = merge_states_reference(v, s, math.e, inf_is_empty=True)
    assert_close(output, output_lse.t() if with_lse else ref_s.float(), ref_v, ref_s)


@pytest.mark.parametrize("prefill_tokens_with_context", [0, 5, 12])
@pytest.mark.parametrize("head_dim, dtype", [(96, torch.float32), (48, torch.float16),
                                             (192, torch.bfloat16)])
def test_vllm_pass_through_and_fp8_output(device, head_dim, dtype, prefill_tokens_with_context):
    """vLLM's eight-argument call: tokens from prefill_tokens_with_context on copy the suffix
    (output and LSE, +inf included); output_scale gives fp8(clamp(merged / scale))."""
    tokens, heads, p = 12, 4, prefill_tokens_with_context
    v, s = random_states(2, (tokens, heads), head_dim, dtype, gen("vllm8", head_dim, p),
                         pos_inf=0.15)
    ref_v, ref_s = merge_states_reference(v, s, math.e, inf_is_empty=True)
    ref_v[p:], ref_s[p:] = v[1][p:].double(), s[1][p:].double()
    scale = torch.tensor([0.02])
    expected = (ref_v / 0.02).clamp(-448, 448).float().to(torch.float8_e4m3fn).double()
    output = torch.empty(tokens, heads, head_dim, dtype=torch.float8_e4m3fn, device=device)
    output_lse = torch.empty(heads, tokens, device=device)
    vllm.merge_attn_states(output, v[0].to(device), s[0].t().contiguous().to(device),
                           v[1].to(device), s[1].t().contiguous().to(device), output_lse, p,
                           scale.to(device))
    got = output.cpu().double()
    ulp = torch.exp2(torch.floor(torch.log2(got.abs().clamp_min(2 ** -6))) - 3)
    assert ((got - expected).abs() <= ulp + 2 ** -9).all()
    lse = output_lse.t().cpu().double()
    same = torch.isfinite(ref_s) | (ref_s == math.inf)
    torch.testing.assert_close(lse[same], ref_s[same], rtol=1e-5, atol=1e-5)
    assert (lse[~same] == -math.inf).all()


# --- FlashAttention 3 ------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits, batch, seqlen, heads, head_dim",
                         [(3, 2, 3, 4, 128), (5, 4, 1, 8, 64), (2, 1, 6, 2, 256)])
def test_flash_attn_combine(device, num_splits, batch, seqlen, heads, head_dim, out_dtype):
    g = gen("fa3", num_splits, batch, seqlen)
    v, s = random_states(num_splits, (batch, seqlen, heads), head_dim, torch.float32, g)
    out_partial = v.to(device)
    # FlashAttention's LSE is contiguous along seqlen: (splits, batch, heads, seqlen) transposed.
    lse_partial = s.permute(0, 1, 3, 2).contiguous().permute(0, 1, 3, 2).to(device)
    out, lse = flash_attn.flash_attn_combine(out_partial, lse_partial, out_dtype=out_dtype)
    assert out.shape == (batch, seqlen, heads, head_dim) and out.dtype == out_dtype
    assert lse.shape == (batch, seqlen, heads) and lse.stride() == (heads * seqlen, 1, seqlen)
    assert_close(out, lse, *merge_states_reference(v, s, math.e))


def test_flash_attn_combine_returns_float32_by_default():
    g = gen("fa3-default")
    v, s = random_states(3, (1, 2, 2), 64, torch.float32, g)
    out, lse = flash_attn.flash_attn_combine(v, s)
    assert out.dtype == torch.float32
    assert_close(out, lse, *merge_states_reference(v, s, math.e))


@pytest.mark.parametrize("shape", [(2, 2, 0, 3), (2, 2, 5, 0), (2, 0, 5, 3)])
def test_flash_attn_combine_of_no_rows(shape):
    """No rows (seqlen, heads or batch 0): empty outputs, as FlashAttention 3 returns."""
    out, lse = flash_attn.flash_attn_combine(torch.randn(*shape, 16), torch.randn(*shape))
    assert out.shape == shape[1:] + (16,) and lse.shape == shape[1:]
    with pytest.raises(ValueError, match="^out_partial has num_splits = 0"):
        flash_attn.flash_attn_combine(torch.randn(0, 1, 2, 3, 16), torch.randn(0, 1, 2, 3))


def test_flash_attn_combine_refuses_an_output_dtype_it_cannot_write():
    out_partial = torch.zeros(2, 1, 1, 2, 64)
    with pytest.raises(TypeError, match="out_dtype"):
        flash_attn.flash_attn_combine(out_partial, torch.zeros(2, 1, 1, 2), out_dtype=torch.int8)


# --- zero copy -------------------------------------------------------------------------

_COPIES = ("copy", "clone", "contiguous", "stack", "cat", "_to_copy", "index")


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _calls(device):
    tokens, heads, head_dim = 4, 8, 128
    v, s = random_states(3, (tokens, heads), head_dim, torch.bfloat16, gen("copy"))
    v, s = v.to(device), s.to(device)
    lse_hm = s.transpose(1, 2).contiguous()  # [3, heads, tokens]
    out = torch.empty_like(v[0])
    out_lse = torch.empty(heads, tokens, device=device)
    fa_o = v.float().view(3, 2, 2, heads, head_dim)
    fa_s = s.view(3, 2, 2, heads)
    return {
        "merge_states": lambda: flashinfer.merge_states(v.transpose(0, 1), s.transpose(0, 1)),
        "merge_state": lambda: flashinfer.merge_state(v[0], s[0], v[1], s[1]),
        "merge_state_in_place": lambda: flashinfer.merge_state_in_place(v[0], s[0], v[1], s[1]),
        "merge_attn_states": lambda: vllm.merge_attn_states(out, v[0], lse_hm[0], v[1],
                                                            lse_hm[1], out_lse),
        "flash_attn_combine": lambda: flash_attn.flash_attn_combine(fa_o, fa_s,
                                                                    out_dtype=torch.bfloat16),
    }


ALLOCATIONS = {"merge_states": 2, "merge_state": 2, "merge_state_in_place": 0,
               "merge_attn_states": 0, "flash_attn_combine": 2}


@pytest.mark.parametrize("adapter", sorted(ALLOCATIONS))
def test_adapters_copy_nothing(device, adapter):
    call = _calls(device)[adapter]
    call()  # the layout's launch is made (and its config chosen) outside the recording
    with _Ops() as ops:
        call()
    copies = [n for n in ops.names if any(word in n for word in _COPIES)]
    assert not copies, copies
    allocations = [n for n in ops.names if n.startswith(("empty", "zeros", "full"))]
    assert len(allocations) == ALLOCATIONS[adapter], ops.names


@pytest.mark.gpu
@pytest.mark.parametrize("adapter", sorted(ALLOCATIONS))
def test_adapters_launch_one_kernel(cuda_device, adapter):
    call = _calls(cuda_device)[adapter]
    call()
    torch.cuda.synchronize()
    kernels, _ = profiled_kernels(call)
    assert len(kernels) == 1, kernels
