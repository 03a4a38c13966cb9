"""Two-state adapters given states of different strides, and outputs whose elements share
memory.

The engines' two-state merges take each state as it lies: a prefix and a suffix may
come from buffers of different widths, one LSE transposed and the other not. kvsplit
reads its parts at their distance apart with one set of strides, so the adapters copy
such a pair into one layout; the result must be the float64 reference's, on the first
call and on later calls of the same tensors with fresh values. An output with a stride
of 0 on a dim of more than one element (an expanded tensor) would have stores race: it
is refused, naming the engine's argument, before anything is written.
"""

from __future__ import annotations

import math

import pytest
import torch
from state_reference import merge_reference
from state_reference import seeded as gen

import kvsplit
from kvsplit.compat import flash_attn, flashinfer, sglang, vllm

pytestmark = pytest.mark.usefixtures("dispatch_sandbox")
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}


def wide(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t``'s values in a slice of a tensor twice as wide on ``dim`` (other strides)."""
    shape = list(t.shape)
    shape[dim] *= 2
    buffer = torch.full(shape, float("nan"), dtype=t.dtype, device=t.device)
    view = buffer.narrow(dim, 0, t.shape[dim])
    view.copy_(t)
    return view


def assert_merged(out, lse, v, s, base, inf_is_empty=False):
    ref_v, ref_s = merge_reference(v, s, base, inf_is_empty=inf_is_empty)
    tol = TOL[out.dtype]
    torch.testing.assert_close(out.cpu().double(), ref_v, atol=tol, rtol=tol)
    if lse is not None:
        torch.testing.assert_close(lse.cpu().double(), ref_s, atol=1e-4, rtol=1e-4)


def vllm_call(v, s, device, layout):
    prefix_output, suffix_output = v[0].to(device), v[1].to(device)
    prefix_lse, suffix_lse = s[0].t().contiguous().to(device), s[1].t().contiguous().to(device)
    if layout == "sliced":
        suffix_output, prefix_lse = wide(suffix_output, 2), wide(prefix_lse, 1)
    else:  # the suffix LSE a transposed view of a token-major tensor
        suffix_lse = s[1].contiguous().to(device).t()
    output = torch.empty_like(prefix_output)
    output_lse = torch.empty(prefix_lse.shape, device=device)

    def call():
        vllm.merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
                               output_lse)
        return output, output_lse.t()
    return call, (prefix_output, suffix_output), (prefix_lse.t(), suffix_lse.t()), math.e


def pair_call(merge, base, sliced, transposed):
    """An adapter of two states (v_a, s_a, v_b, s_b): ``sliced`` the (name, dim) pairs
    taken from wider buffers, ``transposed`` the LSE made a transposed view."""
    def make(v, s, device, layout):
        held = dict(v_a=v[0].to(device), v_b=v[1].to(device), s_a=s[0].to(device),
                    s_b=s[1].to(device))
        if layout == "sliced":
            for name, dim in sliced:
                held[name] = wide(held[name], dim)
        else:
            held[transposed] = held[transposed].t().contiguous().t()
        return ((lambda: merge(held["v_a"], held["s_a"], held["v_b"], held["s_b"])),
                (held["v_a"], held["v_b"]), (held["s_a"], held["s_b"]), base)
    return make


def flashinfer_in_place_call(v, s, device, layout):
    v_other, s_other = v[1].to(device), s[1].to(device)
    if layout == "sliced":
        v_other, s_other = wide(v_other, 2), wide(s_other, 1)
    else:
        s_other = s[1].t().contiguous().to(device).t()
    v_out, s_out = v[0].clone().to(device), s[0].clone().to(device)
    first = (v[0].clone().to(device), s[0].clone().to(device))  # the state before the merge

    def call():
        v_out.copy_(first[0])
        s_out.copy_(first[1])
        flashinfer.merge_state_in_place(v_out, s_out, v_other, s_other)
        return v_out, s_out
    return call, (first[0], v_other), (first[1], s_other), 2.0


ADAPTERS = {"vllm": vllm_call,
            "sglang": pair_call(sglang.merge_state_v2, math.e, [("v_a", 2), ("s_b", 1)], "s_b"),
            "flashinfer": pair_call(flashinfer.merge_state, 2.0, [("v_b", 1), ("s_a", 0)], "s_a"),
            "flashinfer_in_place": flashinfer_in_place_call}


@pytest.mark.parametrize("layout", ["sliced", "transposed"])
@pytest.mark.parametrize("tokens", [1, 6])
@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_two_states_of_different_strides_merge(device, adapter, tokens, layout):
    heads, head_dim = 4, 64
    g = gen("strides", adapter, tokens, layout)
    v = torch.randn(2, tokens, heads, head_dim, generator=g).bfloat16()
    s = torch.randn(2, tokens, heads, generator=g) * 3
    call, vs, ss, base = ADAPTERS[adapter](v, s, device, layout)
    for round_ in range(3):  # the layout's first call, a repeat, then fresh values
        if round_ == 2:
            for held in (*vs, *ss):
                held.copy_(torch.randn(held.shape, generator=g).to(held.dtype))
        out, lse = call()
        if device == "cuda":
            torch.cuda.synchronize()
        assert_merged(out, lse, torch.stack([t.cpu() for t in vs]),
                      torch.stack([t.cpu() for t in ss]), base, inf_is_empty=base == math.e)


def expanded(shape, dtype, device, dim=0):
    """A tensor of ``shape`` at stride 0 on ``dim`` over one row of memory (sentinel 7)."""
    row = list(shape)
    row[dim] = 1
    return torch.full(row, 7.0, dtype=dtype, device=device).expand(shape)


def refusals(device):
    tokens, heads, head_dim = 5, 2, 64
    g = gen("expanded")
    v = torch.randn(2, tokens, heads, head_dim, generator=g, device="cpu").to(device)
    s = torch.randn(2, tokens, heads, generator=g).to(device)
    lse_hm = s.transpose(1, 2).contiguous()  # vLLM's (heads, tokens)
    out_v = expanded((tokens, heads, head_dim), torch.float32, device)
    out_s = expanded((tokens, heads), torch.float32, device)
    return [
        ("output", out_v, lambda: vllm.merge_attn_states(out_v, v[0], lse_hm[0], v[1],
                                                         lse_hm[1])),
        ("output_lse", out_s, lambda: vllm.merge_attn_states(
            torch.empty_like(v[0]), v[0], lse_hm[0], v[1], lse_hm[1], out_s.t())),
        ("v_merged", out_v, lambda: sglang.merge_state_v2(v[0], s[0], v[1], s[1], out_v,
                                                          torch.empty_like(s[0]))),
        ("v_merged", out_v, lambda: sglang.merge_state_v2(out_v, s[0], v[1], s[1], out_v, s[0])),
        ("v", out_v, lambda: flashinfer.merge_state_in_place(out_v, s[0].clone(), v[1], s[1])),
        ("s", out_s, lambda: flashinfer.merge_state_in_place(v[0].clone(), out_s, v[1], s[1])),
        ("out", out_v, lambda: flash_attn.flash_attn_combine(
            v.unsqueeze(1), s.unsqueeze(1), out=out_v.unsqueeze(0))),
        ("out", out_v, lambda: kvsplit.merge_lse(v, s, out=out_v)),
        ("out", out_v, lambda: kvsplit.merge_lse(v, s, out=out_v, pass_through_from=2)),
    ]


@pytest.mark.parametrize("case", range(9))
def test_outputs_whose_elements_share_memory_are_refused(device, case):
    name, target, call = refusals(device)[case]
    with pytest.raises(ValueError, match=rf"^{name} has stride 0"):
        call()
    assert (target == 7.0).all(), f"{name} was written before the refusal"
