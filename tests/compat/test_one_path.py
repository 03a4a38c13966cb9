"""Every adapter's repeated call takes the binding's per-call path, the plain API's.

The first call of a layout is validated in Python and registered; a later
call of the same layout with fresh values in the same or other tensors is
served by the binding (``fast_info()['hits']`` counts it) and must match the
float64 reference; a call whose tensors changed in any way, or whose
addresses break a rule, is checked again, with the errors in the engine's own
argument names. SGLang's in-place merges over either state are served too.
"""

from __future__ import annotations

import math

import pytest
import torch
from state_reference import merge_reference, seeded as gen

from kvsplit import _kernel
from kvsplit.compat import flash_attn, flashinfer, sglang, vllm, xformers
from kvsplit.dispatch.dispatcher import dispatcher

pytestmark = [pytest.mark.usefixtures("dispatch_sandbox"),
              pytest.mark.skipif(not _kernel.FAST_CALL,
                                 reason="this torch has no DLPack exchange table")]
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}


@pytest.fixture(autouse=True)
def fresh_launches():
    dispatcher.launches.clear()
    yield
    dispatcher.launches.clear()


def hits() -> int:
    return _kernel.fast_info()["hits"]


def reference(vs, ss, base):
    return merge_reference(vs, ss, base, inf_is_empty=True)


def fill(tensors, seed):
    """Fresh random values into the given tensors (LSEs: some -inf)."""
    g = gen("fill", seed)
    for t in tensors:
        values = torch.randn(t.shape, generator=g) * (3 if t.dtype == torch.float32 else 1)
        if t.dtype == torch.float32 and t.dim() <= 2:
            values = values.masked_fill(torch.rand(t.shape, generator=g) < 0.1, -math.inf)
        t.copy_(values.to(t.dtype).to(t.device))


def assert_close(out, lse, ref_out, ref_lse, dtype):
    torch.testing.assert_close(out.cpu().double(), ref_out, rtol=TOL[dtype], atol=TOL[dtype])
    if lse is not None:
        torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=1e-4, atol=1e-4)


def served_twice(call, tensors, check):
    """Calls once (registers), then twice with fresh values: each served by the binding."""
    call()
    for seed in (1, 2):
        fill(tensors, seed)
        before = hits()
        result = call()
        assert hits() == before + 1, "the repeated call was not served by the binding"
        check(result)


@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_vllm(device, with_lse, dtype):
    tokens, heads, head_dim = 5, 4, 64
    g = gen("vllm", with_lse, dtype)
    po, so = (torch.randn(tokens, heads, head_dim, generator=g).to(dtype).to(device)
              for _ in range(2))
    pl, sl = (torch.randn(heads, tokens, generator=g).to(device) for _ in range(2))
    out = torch.empty(tokens, heads, head_dim, dtype=dtype, device=device)
    out_lse = torch.empty(heads, tokens, device=device) if with_lse else None

    def check(_):
        ref_out, ref_lse = reference(torch.stack([po, so]).cpu(),
                                     torch.stack([pl.t(), sl.t()]).cpu(), math.e)
        assert_close(out, None if out_lse is None else out_lse.t(), ref_out, ref_lse, dtype)

    served_twice(lambda: vllm.merge_attn_states(out, po, pl, so, sl, out_lse),
                 [po, so, pl, sl], check)


def test_flashinfer_merge_state_and_merge_states(device):
    g = gen("fi")
    v_a, v_b = (torch.randn(6, 4, 64, generator=g).bfloat16().to(device) for _ in range(2))
    s_a, s_b = (torch.randn(6, 4, generator=g).to(device) for _ in range(2))

    def check_state(result):
        ref_out, ref_lse = reference(torch.stack([v_a, v_b]).cpu(),
                                     torch.stack([s_a, s_b]).cpu(), 2.0)
        assert_close(*result, ref_out, ref_lse, torch.bfloat16)

    served_twice(lambda: flashinfer.merge_state(v_a, s_a, v_b, s_b), [v_a, v_b, s_a, s_b],
                 check_state)
    v = torch.randn(6, 3, 4, 64, generator=g).bfloat16().to(device)
    s = torch.randn(6, 3, 4, generator=g).to(device)

    def check_states(result):
        ref_out, ref_lse = reference(v.permute(1, 0, 2, 3).cpu(), s.permute(1, 0, 2).cpu(), 2.0)
        assert_close(*result, ref_out, ref_lse, torch.bfloat16)

    served_twice(lambda: flashinfer.merge_states(v, s), [v, s], check_states)


@pytest.mark.parametrize("with_mask", [False, True])
def test_flashinfer_merge_state_in_place(device, with_mask):
    g = gen("fi-in-place", with_mask)
    v, v_other = (torch.randn(7, 4, 64, generator=g).bfloat16().to(device) for _ in range(2))
    s, s_other = (torch.randn(7, 4, generator=g).to(device) for _ in range(2))
    mask = (torch.arange(7) % 2 == 0).to(device) if with_mask else None
    flashinfer.merge_state_in_place(v, s, v_other, s_other, mask)  # registers
    for seed in (1, 2):
        fill([v, v_other, s, s_other], seed)
        before_v, before_s = v.clone(), s.clone()
        ref_out, ref_lse = reference(torch.stack([v, v_other]).cpu(),
                                     torch.stack([s, s_other]).cpu(), 2.0)
        count = hits()
        flashinfer.merge_state_in_place(v, s, v_other, s_other, mask)
        assert hits() == count + 1
        keep = ~mask.cpu() if with_mask else torch.zeros(7, dtype=torch.bool)
        assert_close(v.cpu()[~keep], s.cpu()[~keep], ref_out[~keep], ref_lse[~keep],
                     torch.bfloat16)
        assert torch.equal(v.cpu()[keep], before_v.cpu()[keep])
        assert torch.equal(s.cpu()[keep], before_s.cpu()[keep])


@pytest.mark.parametrize("over", ["none", "a", "b"])
def test_sglang_merge_state_v2_in_place_over_either_state(device, over):
    g = gen("sglang", over)
    v_a, v_b = (torch.randn(5, 4, 64, generator=g).half().to(device) for _ in range(2))
    s_a, s_b = (torch.randn(5, 4, generator=g).to(device) for _ in range(2))
    for seed in (0, 1, 2):
        if seed:
            fill([v_a, v_b, s_a, s_b], seed)
        ref_out, ref_lse = reference(torch.stack([v_a, v_b]).cpu(),
                                     torch.stack([s_a, s_b]).cpu(), math.e)
        outs = {"none": (None, None), "a": (v_a, s_a), "b": (v_b, s_b)}[over]
        count = hits()
        v_m, s_m = sglang.merge_state_v2(v_a, s_a, v_b, s_b, *outs)
        assert hits() == count + (seed > 0)
        assert_close(v_m, s_m, ref_out, ref_lse, torch.float16)


def test_flash_attn_combine_and_xformers(device):
    g = gen("fa3")
    o = torch.randn(3, 2, 5, 4, 64, generator=g).to(device)
    lse = torch.randn(3, 2, 5, 4, generator=g).to(device)

    def check_fa3(result):
        ref_out, ref_lse = reference(o.cpu(), lse.cpu(), math.e)
        assert_close(*result, ref_out, ref_lse, torch.float32)

    served_twice(lambda: flash_attn.flash_attn_combine(o, lse), [o, lse], check_fa3)
    attn = torch.randn(3, 2, 5, 4, 64, generator=g).bfloat16().to(device)  # [C, B, M, H, K]
    xlse = torch.randn(3, 2, 4, 5, generator=g).to(device)  # [C, B, H, M]

    def check_xformers(result):
        ref_out, ref_lse = reference(attn.cpu(), xlse.permute(0, 1, 3, 2).cpu(), math.e)
        assert_close(result[0], result[1].permute(0, 2, 1), ref_out, ref_lse, torch.bfloat16)

    served_twice(lambda: xformers.merge_attentions(attn, xlse), [attn, xlse], check_xformers)


def test_per_call_errors_name_the_engines_arguments(device):
    """A layout seen before whose addresses break a rule: the binding raises, in vLLM's
    and SGLang's names, and writes nothing."""
    tokens, heads, head_dim = 4, 2, 64
    g = gen("errors")
    store = torch.randn(3 * tokens * heads * head_dim + 8, generator=g).bfloat16().to(device)
    po = store[:tokens * heads * head_dim].view(tokens, heads, head_dim)
    so = store[tokens * heads * head_dim:2 * tokens * heads * head_dim].view(po.shape)
    pl, sl = (torch.randn(heads, tokens, generator=g).to(device) for _ in range(2))
    out = torch.empty_like(po)
    vllm.merge_attn_states(out, po, pl, so, sl)  # registers the layout
    with pytest.raises(ValueError, match="output overlaps prefix_output"):
        vllm.merge_attn_states(po, po, pl, so, sl)
    lse_out = torch.empty(heads, tokens, device=device)
    vllm.merge_attn_states(out, po, pl, so, sl, lse_out)
    with pytest.raises(ValueError, match="output_lse overlaps suffix_lse"):
        vllm.merge_attn_states(out, po, pl, so, sl, sl)
    odd = store[1:1 + tokens * heads * head_dim].view(po.shape)  # 2 bytes off: misaligned
    with pytest.raises(ValueError, match="prefix_output must be 16-byte aligned"):
        vllm.merge_attn_states(out, odd, pl, so, sl)
    with pytest.raises(ValueError, match="prefix_output and suffix_output: parts must lie a "
                                         "multiple of 16 bytes apart"):
        vllm.merge_attn_states(out, po, pl, odd, sl)
    v_m = torch.empty_like(po)
    s_m = torch.empty(tokens, heads, device=device)
    sglang.merge_state_v2(po, pl.t().contiguous(), so, sl.t().contiguous(), v_m, s_m)
    s_a = pl.t().contiguous()
    with pytest.raises(ValueError, match="v_merged may be v_a itself only with s_merged being s_a"):
        sglang.merge_state_v2(po, s_a, so, sl.t().contiguous(), po, s_m)


def test_flashinfer_in_place_writes_the_tensors_of_each_call(device):
    """merge_state_in_place passes its outputs once, as the first state: a later call of the
    same layout on other tensors is served by the binding and writes into its own first
    state, leaving the tensors of the call that registered alone."""
    g = gen("into-first")
    first = [torch.randn(7, 4, 64, generator=g).bfloat16().to(device) for _ in range(2)]
    first += [torch.randn(7, 4, generator=g).to(device) for _ in range(2)]
    v, v_other, s, s_other = first
    flashinfer.merge_state_in_place(v, s, v_other, s_other)  # registers
    held = [t.clone() for t in first]
    other = [torch.empty_like(t) for t in first]
    fill(other, 3)
    ref_out, ref_lse = reference(torch.stack(other[:2]).cpu(), torch.stack(other[2:]).cpu(), 2.0)
    count = hits()
    flashinfer.merge_state_in_place(other[0], other[2], other[1], other[3])
    assert hits() == count + 1
    assert_close(other[0], other[2], ref_out, ref_lse, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(first, held))


def test_a_form_that_merges_into_its_first_part_names_no_outputs():
    roles = _kernel.ROLES
    two = [roles.PARTIAL_O, roles.STATS, roles.PARTIAL_O, roles.STATS]
    for bad, options in ((two + [roles.OUT], {}), (two, {"in_place": True}),
                         ([roles.PARTIAL_O, roles.STATS], {})):
        with pytest.raises(ValueError, match="merges into its first part"):
            _kernel.call_form(bad, into_first=True, **options)
    form = _kernel.call_form([roles.PARTIAL_O, roles.STATS, roles.PARTIAL_O, roles.STATS],
                             into_first=True)
    tensors = [torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2),
               torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2)]
    with pytest.raises(ValueError, match="takes its parts in order"):
        _kernel.call_add(None, True, form, *tensors)
