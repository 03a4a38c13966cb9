"""The per-call path of a layout seen before (csrc/fast_call.cpp, kvsplit/merge.py).

A call with ``out`` given whose layout the Python path validated and launched
once is served by the binding: these tests check that it computes the same
merge (float64 reference on fresh data), that every call whose tensors
changed in any way goes back through validation (the same launch only for the same
dtype, shape, strides, device, scalars and settings), and that the errors of
bad inputs stay those of the Python path. ``fast_info()['hits']`` says which
path served a call.
"""

from __future__ import annotations

import os

import pytest
import torch

import kvsplit
from kvsplit import _kernel
from kvsplit import merge as merge_module
from kvsplit.dispatch.dispatcher import dispatcher

pytestmark = pytest.mark.skipif(not _kernel.FAST_CALL,
                                reason="this torch has no DLPack exchange table")


def hits() -> int:
    return _kernel.fast_info()["hits"]


@pytest.fixture(autouse=True)
def fresh_launches():
    dispatcher.launches.clear()
    yield
    dispatcher.launches.clear()


def lse_call(merge_kit, device, *, num_splits=6, rows=10, head_dim=128, dtype=torch.bfloat16,
             seed=0):
    gen = merge_kit.generator("fast", num_splits, rows, head_dim, dtype, seed)
    partial_o, lse = merge_kit.partials("lse2", num_splits, rows, head_dim, dtype, gen)
    partial_o, lse = partial_o.to(device), lse.to(device)
    out_dtype = torch.bfloat16 if dtype == torch.float32 else dtype
    out = torch.empty(rows, head_dim, dtype=out_dtype, device=device)
    return partial_o, lse, out


def reference_of(merge_kit, partial_o, lse, **kwargs):
    return merge_kit.reference("lse2", partial_o, lse, **kwargs)[0]


def assert_merged(merge_kit, out, partial_o, lse, **kwargs):
    ref = reference_of(merge_kit, partial_o, lse, **kwargs)
    got = out.cpu().double()
    torch.testing.assert_close(got, ref, rtol=torch.finfo(out.dtype).eps, atol=1e-5)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def test_a_repeated_call_is_served_by_the_binding_and_matches_the_reference(merge_kit, device):
    partial_o, lse, out = lse_call(merge_kit, device)
    kvsplit.merge_lse(partial_o, lse, out=out)  # the Python path: validates, makes the launch, registers
    assert _kernel.fast_info()["entries"] == 1
    for seed in range(3):  # fresh values in the same tensors
        fresh = lse_call(merge_kit, device, seed=seed + 1)
        partial_o.copy_(fresh[0])
        lse.copy_(fresh[1])
        out.fill_(float("nan"))
        before = hits()
        assert kvsplit.merge_lse(partial_o, lse, out=out) is out
        assert hits() == before + 1
        sync(device)
        assert_merged(merge_kit, out, partial_o, lse)


def test_the_binding_computes_what_the_python_path_computes(merge_kit, device, monkeypatch):
    gen = merge_kit.generator("fast-maxsum", device)
    partial_o, stats = merge_kit.partials("maxsum", 16, 24, 64, torch.float16, gen)
    partial_o, stats = partial_o.to(device), stats.to(device)
    sinks = torch.randn(24, generator=gen).to(device)
    counts = torch.randint(0, 17, (24,), generator=gen, dtype=torch.int32).to(device)
    out = torch.empty(24, 64, dtype=torch.float16, device=device)
    kwargs = dict(sinks=sinks, split_counts=counts, out=out)
    kvsplit.merge_maxsum(partial_o, stats, 0.7, **kwargs)
    out.zero_()
    before = hits()
    kvsplit.merge_maxsum(partial_o, stats, 0.7, **kwargs)
    assert hits() == before + 1
    fast = out.clone()
    monkeypatch.setattr(merge_module, "_call_fast", lambda *args: False)
    out.zero_()
    kvsplit.merge_maxsum(partial_o, stats, 0.7, **kwargs)
    assert torch.equal(fast, out)
    ref = merge_kit.reference("maxsum", partial_o, stats, scale=0.7, sinks=sinks,
                                    split_counts=counts)[0]
    torch.testing.assert_close(fast.cpu().double(), ref, rtol=torch.finfo(out.dtype).eps, atol=1e-5)


@pytest.mark.parametrize("change", ["shape", "dtype", "strides of out", "strides of partials",
                                    "resize_ in place", "as_strided_ in place", "transpose_ in place"])
def test_a_call_whose_tensors_changed_is_validated_again(merge_kit, device, change):
    partial_o, lse, out = lse_call(merge_kit, device, rows=8, head_dim=64)
    kvsplit.merge_lse(partial_o, lse, out=out)
    before = hits()
    if change == "shape":
        partial_o, lse, out = lse_call(merge_kit, device, rows=9, head_dim=64)
    elif change == "dtype":
        partial_o, out = partial_o.half(), out.half()
    elif change == "strides of out":
        out = torch.empty(64, 8, dtype=out.dtype, device=device).t()[:, :64]  # head_dim stride 8
        with pytest.raises(ValueError, match="out must have unit stride"):
            kvsplit.merge_lse(partial_o, lse, out=out)
        assert hits() == before
        return
    elif change == "strides of partials":
        wide = torch.empty(partial_o.shape[0], 8, 128, dtype=partial_o.dtype, device=device)
        wide[..., :64] = partial_o
        partial_o = wide[..., :64]
    elif change == "resize_ in place":
        out.resize_(7, 64)  # the same tensor object, now the wrong shape
        with pytest.raises(ValueError, match="out"):
            kvsplit.merge_lse(partial_o, lse, out=out)
        assert hits() == before
        return
    elif change == "as_strided_ in place":
        out.as_strided_((4, 64), (64, 1))  # the same tensor object, half its rows
        with pytest.raises(ValueError, match="out"):
            kvsplit.merge_lse(partial_o, lse, out=out)
        assert hits() == before
        return
    elif change == "transpose_ in place":
        partial_o.transpose_(0, 1)  # (rows, splits, D): now a different merge
        lse.transpose_(0, 1)
        out = torch.empty(6, 64, dtype=out.dtype, device=device)
    kvsplit.merge_lse(partial_o, lse, out=out)
    assert hits() == before  # the first call of the new layout took the Python path
    sync(device)
    assert_merged(merge_kit, out, partial_o, lse)
    out.zero_()
    kvsplit.merge_lse(partial_o, lse, out=out)  # and its second call the binding
    assert hits() == before + 1
    sync(device)
    assert_merged(merge_kit, out, partial_o, lse)


def test_bad_addresses_of_a_known_layout_raise_the_python_paths_errors(merge_kit, device):
    partial_o, lse, out = lse_call(merge_kit, device, rows=8, head_dim=64)
    kvsplit.merge_lse(partial_o, lse, out=out)
    before = hits()
    storage = torch.empty(partial_o.numel() + 8, dtype=partial_o.dtype, device=device)
    shifted = storage[1:1 + partial_o.numel()].view(partial_o.shape)  # 2 bytes off
    with pytest.raises(ValueError, match="partial_o must be 16-byte aligned"):
        kvsplit.merge_lse(shifted, lse, out=out)
    aliased = partial_o.clone()
    with pytest.raises(ValueError, match="out overlaps partial_o"):
        kvsplit.merge_lse(aliased, lse, out=aliased[0])
    with pytest.raises(ValueError, match="out overlaps partial_o"):
        kvsplit.merge_lse(aliased, lse, out=aliased[3])
    assert hits() == before


def test_grad_mode_is_checked_on_every_call(merge_kit, device):
    partial_o, lse, out = lse_call(merge_kit, device, dtype=torch.float32)
    kvsplit.merge_lse(partial_o, lse, out=out)
    wants_grad = partial_o.clone().requires_grad_()
    with torch.no_grad():
        kvsplit.merge_lse(wants_grad, lse, out=out)  # allowed: no grad mode
        before = hits()
        kvsplit.merge_lse(wants_grad, lse, out=out)
        assert hits() == before + 1
    with pytest.raises(RuntimeError, match="no backward"):
        kvsplit.merge_lse(wants_grad, lse, out=out)


def test_settings_and_forced_splits_key_the_layout(merge_kit, device, monkeypatch):
    partial_o, lse, out = lse_call(merge_kit, device, num_splits=16, rows=4)
    kvsplit.merge_lse(partial_o, lse, out=out)
    kvsplit.merge_lse(partial_o, lse, out=out, kv_split=2)
    assert _kernel.fast_info()["entries"] == 2  # kv_split=None and kv_split=2
    before = hits()
    mode = os.environ.get("KVSPLIT_MODE")
    monkeypatch.setenv("KVSPLIT_MODE", "off")  # K = 1 from now on
    kvsplit.merge_lse(partial_o, lse, out=out)
    assert hits() == before
    configs = {layout.kernel.config.label for layout in dispatcher.launches.values()}
    assert "kvsplit(kv_split=1)" in configs
    out.zero_()
    kvsplit.merge_lse(partial_o, lse, out=out)
    assert hits() == before + 1
    sync(device)
    assert_merged(merge_kit, out, partial_o, lse)
    if mode is None:
        monkeypatch.delenv("KVSPLIT_MODE")
    else:
        monkeypatch.setenv("KVSPLIT_MODE", mode)
    kvsplit.merge_lse(partial_o, lse, out=out)  # settings changed again: the Python path
    assert hits() == before + 1
    kvsplit.merge_lse(partial_o, lse, out=out)
    assert hits() == before + 2


def test_clearing_the_launch_table_clears_the_binding_and_a_refresh_reaches_it(merge_kit, device):
    partial_o, lse, out = lse_call(merge_kit, device)
    kvsplit.merge_lse(partial_o, lse, out=out)
    assert _kernel.fast_info()["entries"] == 1
    generation = dispatcher.launches.generation
    dispatcher.launches.clear()
    assert _kernel.fast_info()["entries"] == 0 and dispatcher.launches.generation == generation + 1
    kvsplit.merge_lse(partial_o, lse, out=out)
    dispatcher.forget()
    assert _kernel.fast_info()["entries"] == 0 and dispatcher.launches == {}


def test_a_launch_made_while_the_table_was_cleared_is_not_registered(merge_kit, device, monkeypatch):
    partial_o, lse, out = lse_call(merge_kit, device)
    launch_of = merge_module._layout_launch

    def launch_then_refresh(*args):  # a refresh thread clearing the launch table meanwhile
        layout = launch_of(*args)
        dispatcher.launches.clear()
        return layout

    monkeypatch.setattr(merge_module, "_layout_launch", launch_then_refresh)
    kvsplit.merge_lse(partial_o, lse, out=out)
    assert _kernel.fast_info()["entries"] == 0


def test_tensor_subclasses_and_unkeyable_scalars_take_the_python_path(merge_kit, device):
    partial_o, lse, out = lse_call(merge_kit, device)

    class Tagged(torch.Tensor):
        pass

    tagged = partial_o.as_subclass(Tagged)
    kvsplit.merge_lse(tagged, lse, out=out)
    kvsplit.merge_lse(tagged, lse, out=out)
    assert _kernel.fast_info()["entries"] == 0
    sync(device)
    assert_merged(merge_kit, out, partial_o, lse)
    kvsplit.merge_lse(partial_o, lse, out=out, base=2)  # an int base keys its own entry
    before = hits()
    out.zero_()
    kvsplit.merge_lse(partial_o, lse, out=out, base=2)
    assert hits() == before + 1
    sync(device)
    assert_merged(merge_kit, out, partial_o, lse)
    before = hits()
    kvsplit.merge_lse(partial_o, lse, out=out, base=2.0 + 0j)  # not a number the key holds
    assert hits() == before


def test_the_custom_op_eager_body_uses_the_binding_too(merge_kit, device):
    partial_o, lse, out = lse_call(merge_kit, device)
    torch.ops.kvsplit.merge_lse_out(partial_o, lse, 2.0, None, None, out, None, 0)
    before = hits()
    out.zero_()
    torch.ops.kvsplit.merge_lse_out(partial_o, lse, 2.0, None, None, out, None, 0)
    assert hits() == before + 1
    sync(device)
    assert_merged(merge_kit, out, partial_o, lse)


CALLS = ["stacked, LSE returned", "stacked, stats returned", "stacked, out_dtype float32",
         "two parts, out given", "two parts, out allocated", "two parts, LSE returned"]


@pytest.mark.parametrize("call", CALLS)
def test_calls_that_export_stats_or_hold_two_parts_are_served_by_the_binding(merge_kit, device,
                                                                            call):
    """The second call of a layout exporting its stats, writing another out dtype, or in two
    parts is the binding's, and merges fresh values as the float64 reference does."""
    fmt = "maxsum" if "stats returned" in call else "lse2"
    gen = merge_kit.generator("fast-served", call)
    num_splits = 2 if "parts" in call else 5
    heads, head_dim = 6, 96

    def merge(o, s):
        if "parts" in call:
            o, s = [o[0].clone(), o[1].clone()], [s[0].clone(), s[1].clone()]
            out = (torch.empty(heads, head_dim, dtype=torch.bfloat16, device=device)
                   if "out given" in call else None)
            return lambda: kvsplit.merge_lse(o, s, out=out, return_lse="LSE" in call), o, s
        if fmt == "maxsum":
            return lambda: kvsplit.merge_maxsum(o, s, 0.9, return_stats=True), o, s
        if "out_dtype" in call:
            return lambda: kvsplit.merge_lse(o, s, out_dtype=torch.float32), o, s
        return lambda: kvsplit.merge_lse(o, s, return_lse=True), o, s

    partial_o, stats = merge_kit.partials(fmt, num_splits, heads, head_dim, torch.bfloat16, gen)
    run, held_o, held_s = merge(partial_o.to(device), stats.to(device))
    run()  # the Python path: validates, launches, registers
    fresh_o, fresh_s = merge_kit.partials(fmt, num_splits, heads, head_dim, torch.bfloat16, gen)
    for i in range(num_splits):
        held_o[i].copy_(fresh_o[i])
        held_s[i].copy_(fresh_s[i])
    before = hits()
    result = run()
    assert hits() == before + 1
    out, out_stats = result if isinstance(result, tuple) else (result, None)
    sync(device)
    ref_out, ref_stats = merge_kit.reference(fmt, fresh_o, fresh_s, scale=0.9)
    assert out.dtype == (torch.float32 if "out_dtype" in call else torch.bfloat16)
    torch.testing.assert_close(out.cpu().double(), ref_out, rtol=2 ** -8, atol=1e-5)
    if out_stats is not None:
        torch.testing.assert_close(out_stats.cpu().double(), ref_stats.float().double(),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("option", ["pass_through_from", "indptr", "out_scale"])
def test_an_option_is_never_served_by_a_plain_calls_launch(merge_kit, device, option):
    """A call with an option after plain calls of the same tensors (whose launch the binding
    holds) gets the option: pass-through rows, variable-length states, an FP8 scale."""
    gen = merge_kit.generator("fast-option", option)
    tokens, heads, head_dim = 5, 4, 64
    partial_o, lse = merge_kit.partials("lse2", 2, tokens * heads, head_dim, torch.bfloat16, gen)
    o = partial_o.view(2, tokens, heads, head_dim).to(device)
    s = lse.view(2, tokens, heads).to(device)
    merged, _ = merge_kit.reference("lse2", partial_o, lse)
    merged = merged.view(tokens, heads, head_dim)
    if option == "out_scale":
        out = torch.empty(tokens, heads, head_dim, dtype=torch.float8_e4m3fn, device=device)
        for _ in range(2):
            kvsplit.merge_lse(o, s, out=out)  # FP8 out at scale 1, registered
        scale = torch.tensor([0.25])
        kvsplit.merge_lse(o, s, out=out, out_scale=scale.to(device))
        expected = (merged / 0.25).clamp(-448, 448).to(torch.float8_e4m3fn).double()
        got = out.cpu().double()
        # within one e4m3 step of the reference rounded the same way
        assert ((got - expected).abs() <= expected.abs() * 2 ** -3 + 2 ** -9).all()
        return
    if option == "pass_through_from":
        out = torch.empty(tokens, heads, head_dim, dtype=torch.bfloat16, device=device)
        for _ in range(2):
            kvsplit.merge_lse(o, s, out=out)
        kvsplit.merge_lse(o, s, out=out, pass_through_from=2)
        expected = torch.cat([merged[:2], o[1, 2:].cpu().double()])
        torch.testing.assert_close(out.cpu().double(), expected, rtol=2 ** -8, atol=1e-5)
        return
    # indptr over the same (states, rows, D) tensor: token t merges states indptr[t]..
    states = o.view(2, tokens * heads, head_dim)[:, :heads]  # 2 states of 4 heads
    states_lse = s.view(2, tokens * heads)[:, :heads]
    for _ in range(2):
        kvsplit.merge_lse(states, states_lse)  # out allocated, registered
    indptr = torch.tensor([0, 1, 1, 2], dtype=torch.int64, device=device)
    out = kvsplit.merge_lse(states, states_lse, indptr=indptr)
    assert out.shape == (3, heads, head_dim)
    sync(device)
    alone = [merge_kit.reference("lse2", states[i:i + 1], states_lse[i:i + 1])[0] for i in (0, 1)]
    expected = torch.stack([alone[0], torch.zeros(heads, head_dim, dtype=torch.float64), alone[1]])
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2 ** -8, atol=1e-5)


@pytest.mark.parametrize("fmt", ["maxsum", "lse2"])
@pytest.mark.parametrize("layout", ["stacked", "two parts"])
@pytest.mark.parametrize("out_given", [True, False], ids=["out", "no out"])
@pytest.mark.parametrize("returned", [True, False], ids=["stats", "no stats"])
@pytest.mark.parametrize("option", [None, "pass_through_from", "out_dtype"])
def test_every_call_variant_merges_alike_on_every_path(merge_kit, device, monkeypatch, fmt,
                                                       layout, out_given, returned, option):
    """A public call's first call (validated), later calls (the binding's, where it serves
    them) and calls with the per-call path off give the same bits, and match the float64
    reference, whatever mix of layout, outputs and options the call has."""
    gen = merge_kit.generator("variants", fmt, layout, out_given, returned, option)
    tokens, heads, head_dim = 3, 4, 64
    partial_o, stats = merge_kit.partials(fmt, 2, tokens * heads, head_dim, torch.bfloat16, gen)
    o = partial_o.view(2, tokens, heads, head_dim).to(device)
    s = stats.view(2, tokens, heads, *stats.shape[2:]).to(device)
    if layout == "two parts":
        o, s = [o[0].clone(), o[1].clone()], [s[0].clone(), s[1].clone()]
    out_dtype = torch.float32 if option == "out_dtype" else torch.bfloat16
    out = torch.empty(tokens, heads, head_dim, dtype=out_dtype, device=device) if out_given else None
    kwargs = dict(out=out)
    if option == "pass_through_from":
        kwargs["pass_through_from"] = 1
    if option == "out_dtype" and not out_given:
        kwargs["out_dtype"] = torch.float32
    if fmt == "maxsum":
        def call():
            return kvsplit.merge_maxsum(o, s, 0.8, return_stats=returned, **kwargs)
    else:
        def call():
            return kvsplit.merge_lse(o, s, base=2.0, return_lse=returned, **kwargs)

    def run():
        result = call()
        out_, stats_ = result if returned else (result, None)
        sync(device)
        return out_.cpu().clone(), None if stats_ is None else stats_.cpu().clone()

    first, second, third = run(), run(), run()
    monkeypatch.setattr(merge_module, "_call_fast", lambda *args: False)
    python = run()
    for other in (second, third, python):
        assert torch.equal(first[0], other[0])
        assert (first[1] is None) == (other[1] is None)
        if first[1] is not None:
            assert torch.equal(first[1], other[1])
    ref_out, ref_stats = merge_kit.reference(fmt, partial_o, stats, scale=0.8)
    if option == "pass_through_from":
        if fmt == "maxsum":
            last_out, last_stats = merge_kit.reference(fmt, partial_o[1:], stats[1:], scale=0.8)
        else:
            last_out, last_stats = partial_o[1].double(), stats[1].double()
        ref_out = torch.cat([ref_out[:heads], last_out[heads:]])
        ref_stats = torch.cat([ref_stats[:heads], last_stats[heads:]])
    assert first[0].dtype == out_dtype
    torch.testing.assert_close(first[0].reshape(ref_out.shape).double(), ref_out, rtol=2 ** -8,
                               atol=1e-5)
    if returned:
        torch.testing.assert_close(first[1].reshape(ref_stats.shape).double(),
                                   ref_stats.float().double(), rtol=1e-5, atol=1e-6)


def test_fast_init_refuses_what_is_not_an_exchange_table():
    ext = _kernel._ext
    assert ext.fast_init(None, torch.Tensor, torch.is_grad_enabled) is False
    assert ext.fast_init(object(), torch.Tensor, torch.is_grad_enabled) is False
    assert _kernel.fast_info()["enabled"]  # the table set at import stays


@pytest.mark.gpu
def test_the_binding_launches_on_the_current_stream(merge_kit, cuda_device):
    partial_o, lse, out = lse_call(merge_kit, "cuda", rows=64, head_dim=512)
    kvsplit.merge_lse(partial_o, lse, out=out)
    fresh_o, fresh_lse, _ = lse_call(merge_kit, "cuda", rows=64, head_dim=512, seed=9)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    before = hits()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the copy lands long after a launch on another stream would
        partial_o.copy_(fresh_o)
        lse.copy_(fresh_lse)
        kvsplit.merge_lse(partial_o, lse, out=out)
    assert hits() == before + 1
    torch.cuda.synchronize()
    assert_merged(merge_kit, out, fresh_o, fresh_lse)


@pytest.mark.gpu
def test_the_binding_captures_into_a_cuda_graph(merge_kit, cuda_device):
    partial_o, lse, out = lse_call(merge_kit, "cuda", rows=32, head_dim=128)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kvsplit.merge_lse(partial_o, lse, out=out)  # launch and registration outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    before = hits()
    with torch.cuda.graph(graph):
        kvsplit.merge_lse(partial_o, lse, out=out)
    assert hits() == before + 1
    for seed in (3, 4):
        fresh_o, fresh_lse, _ = lse_call(merge_kit, "cuda", rows=32, head_dim=128, seed=seed)
        partial_o.copy_(fresh_o)
        lse.copy_(fresh_lse)
        graph.replay()
        torch.cuda.synchronize()
        assert_merged(merge_kit, out, fresh_o, fresh_lse)


@pytest.mark.gpu
def test_two_parts_returning_their_lse_capture_into_a_cuda_graph(merge_kit, cuda_device):
    """The per-call path of a call in two parts that allocates its output and LSE, captured:
    each replay merges the parts' fresh values into the outputs allocated at capture."""
    gen = merge_kit.generator("capture-parts")
    partial_o, lse = merge_kit.partials("lse2", 2, 48, 128, torch.bfloat16, gen)
    parts = [partial_o[0].cuda(), partial_o[1].cuda()]
    lses = [lse[0].cuda(), lse[1].cuda()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kvsplit.merge_lse(parts, lses, return_lse=True)  # launch and registration
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    before = hits()
    with torch.cuda.graph(graph):
        out, out_lse = kvsplit.merge_lse(parts, lses, return_lse=True)
    assert hits() == before + 1
    for _ in range(2):
        fresh_o, fresh_lse = merge_kit.partials("lse2", 2, 48, 128, torch.bfloat16, gen)
        for i in range(2):
            parts[i].copy_(fresh_o[i])
            lses[i].copy_(fresh_lse[i])
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = merge_kit.reference("lse2", fresh_o, fresh_lse)
        merge_kit.assert_matches_reference(out, out_lse, ref_out, ref_lse)


def test_a_call_without_out_is_served_by_the_binding_too(merge_kit, device):
    """The output the call allocates registers like a given one: later calls allocate
    the same and are served by the binding, each a new tensor."""
    partial_o, lse, _ = lse_call(merge_kit, device)
    first = kvsplit.merge_lse(partial_o, lse)
    for seed in range(2):
        fresh = lse_call(merge_kit, device, seed=seed + 1)
        partial_o.copy_(fresh[0])
        lse.copy_(fresh[1])
        before = hits()
        out = kvsplit.merge_lse(partial_o, lse)
        assert hits() == before + 1 and out is not first
        sync(device)
        assert_merged(merge_kit, out, partial_o, lse)
