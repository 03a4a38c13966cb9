"""TensorRT-LLM's merge_chunked_attention_for_mla adapter against a float64 reference.

The reference follows TensorRT-LLM's kernel (mlaChunkedPrefill.cu): per
request, op 0 leaves its tokens untouched, 2 copies the chunk's attention and
stats, anything else merges normalised attention with (max, sum) stats in base
e: M = max(m_a, m_b), w = l * e^(m - M), out = (w_a a + w_b b) / (w_a + w_b).
The adapter's documented departures: a merged row's stats are written as
(LSE, 1), the same state; both states empty give 0 and (-inf, 1), not NaN.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from cuda_profile import profiled_kernels
from torch.utils._python_dispatch import TorchDispatchMode

from kvsplit.compat import trtllm

pytestmark = pytest.mark.usefixtures("dispatch_sandbox")
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def pairs(tokens, heads, g):
    """Random (max, sum) stats, some empty (-inf, 0)."""
    stats = torch.stack([torch.randn(tokens, heads, generator=g) * 2,
                         0.5 + 10 * torch.rand(tokens, heads, generator=g)], dim=-1)
    empty = torch.rand(tokens, heads, generator=g) < 0.1
    stats[empty] = torch.tensor([-math.inf, 0.0])
    return stats


def reference(attn, temp, stats, temp_stats, cu, ops):
    """TensorRT-LLM's op in float64; merged stats as (LSE, 1). Returns (attn, stats)."""
    attn, stats = attn.double().clone(), stats.double().clone()
    temp, temp_stats = temp.double(), temp_stats.double()
    for b, op in enumerate(ops):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if op == 0:
            continue
        if op == 2:
            attn[rows], stats[rows] = temp[rows], temp_stats[rows]
            continue
        (m_a, l_a), (m_b, l_b) = stats[rows].unbind(-1), temp_stats[rows].unbind(-1)
        top = torch.maximum(m_a, m_b)
        safe = torch.where(top == -math.inf, torch.zeros_like(top), top)
        w_a, w_b = l_a * torch.exp(m_a - safe), l_b * torch.exp(m_b - safe)
        total = w_a + w_b
        merged = (w_a[..., None] * attn[rows] + w_b[..., None] * temp[rows]) / torch.where(
            total > 0, total, torch.ones_like(total))[..., None]
        attn[rows] = torch.where((total > 0)[..., None], merged, torch.zeros_like(merged))
        lse = torch.where(total > 0, safe + torch.log(total.clamp_min(1e-300)),
                          torch.full_like(total, -math.inf))
        stats[rows] = torch.stack([lse, torch.ones_like(lse)], dim=-1)
    return attn, stats


def case(dtype, head_size, g, *, heads=4, extra_stats=3):
    """Requests of every kind (a zero-length one included) and two tokens after the last."""
    lengths, ops = [3, 2, 0, 4, 1, 2], [1, 0, 1, 2, 7, 1]
    cu = torch.tensor([0] + lengths).cumsum(0)
    tokens = int(cu[-1]) + 2
    attn = torch.randn(tokens, heads, head_size, generator=g).to(dtype)
    temp = torch.randn(tokens, heads, head_size, generator=g).to(dtype)
    stats = pairs(tokens + extra_stats, heads, g)  # TensorRT-LLM's buffers may be longer
    temp_stats = pairs(tokens + extra_stats, heads, g)
    stats[0, 0] = temp_stats[0, 0] = torch.tensor([-math.inf, 0.0])  # both states empty
    attn[int(cu[3]):int(cu[4])] = float("nan")  # a copy row never reads merged_attn
    return attn, temp, stats, temp_stats, cu, ops


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("dtype, head_size", [(torch.bfloat16, 128), (torch.float16, 128),
                                              (torch.float32, 128), (torch.bfloat16, 512)])
def test_trtllm_merge_chunked_attention_for_mla(device, dtype, head_size, flat):
    attn, temp, stats, temp_stats, cu, ops = case(dtype, head_size, gen("trt", dtype, head_size))
    tokens, heads = attn.shape[:2]
    ref_attn, ref_stats = reference(attn, temp, stats[:tokens], temp_stats[:tokens], cu, ops)
    merged_attn = attn.clone().to(device)
    merged_stats = stats.clone().to(device)
    call_attn = merged_attn.view(tokens, -1) if flat else merged_attn  # TensorRT-LLM's 2-D
    assert trtllm.merge_chunked_attention_for_mla(
        call_attn, temp.to(device), merged_stats, temp_stats.to(device), len(ops), cu.to(device),
        max(3, 4), torch.tensor(ops, device=device), heads, head_size) is None
    got_attn, got_stats = merged_attn.cpu(), merged_stats.cpu()
    touched = torch.zeros(tokens, dtype=torch.bool)
    for b, op in enumerate(ops):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        touched[rows] = op != 0
        if op == 2:  # bit for bit, attention and stats
            assert torch.equal(got_attn[rows], temp[rows])
            assert torch.equal(got_stats[rows], temp_stats[rows])
    untouched = ~touched
    assert torch.equal(got_attn[untouched].nan_to_num(), attn[untouched].nan_to_num())
    assert torch.equal(got_stats[:tokens][untouched], stats[:tokens][untouched])
    assert torch.equal(got_stats[tokens:], stats[tokens:])
    tol = TOL[dtype]
    assert torch.allclose(got_attn.double(), ref_attn, atol=tol, rtol=tol, equal_nan=True)
    merged = torch.tensor([op not in (0, 2) for op in ops]).repeat_interleave(cu.diff())
    merged = torch.cat([merged, torch.zeros(2, dtype=torch.bool)])
    lse, ref_lse = got_stats[:tokens][merged][..., 0], ref_stats[merged][..., 0]
    assert (got_stats[:tokens][merged][..., 1] == 1).all()
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse)) and (lse == -math.inf).any()
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_trtllm_many_requests_find_their_ops(device, seed):
    """Requests of random lengths (empty ones included) and ops, 97 of them: each token's
    request is found on the device, by bisection, as the reference finds it."""
    g = gen("trt-many", seed)
    heads, head_size, requests = 2, 64, 97
    lengths = torch.randint(0, 4, (requests,), generator=g)
    ops = torch.randint(0, 4, (requests,), generator=g).tolist()
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]) + 1  # token 0 outside
    tokens = int(cu[-1]) + 1
    attn = torch.randn(tokens, heads, head_size, generator=g).bfloat16()
    temp = torch.randn(tokens, heads, head_size, generator=g).bfloat16()
    stats, temp_stats = pairs(tokens, heads, g), pairs(tokens, heads, g)
    ref_attn, ref_stats = reference(attn, temp, stats, temp_stats, cu, ops)
    got = [t.clone().to(device) for t in (attn, stats)]
    trtllm.merge_chunked_attention_for_mla(got[0], temp.to(device), got[1], temp_stats.to(device),
                                           requests, cu.to(device), 3,
                                           torch.tensor(ops, device=device), heads, head_size)
    got_attn, got_stats = got[0].cpu().double(), got[1].cpu().double()
    assert torch.allclose(got_attn, ref_attn, atol=2e-2, rtol=2e-2)
    assert torch.equal(got_stats.isfinite(), ref_stats.isfinite())
    finite = ref_stats.isfinite()
    assert torch.allclose(got_stats[finite], ref_stats[finite], atol=1e-5, rtol=1e-5)


def test_trtllm_repeated_calls_take_the_per_call_path(device):
    """The second call of a layout is the binding's, with fresh values in the same tensors
    and new ops, and still matches the reference; a bad max_q_seq_len is refused there too."""
    from kvsplit import _kernel

    if not _kernel.FAST_CALL:
        pytest.skip("this torch has no DLPack exchange table")
    attn, temp, stats, temp_stats, cu, ops = case(torch.bfloat16, 128, gen("trt-fast"))
    attn[attn.isnan()] = 0.0
    tokens, heads = attn.shape[:2]
    held = [t.clone().to(device) for t in (attn, temp, stats, temp_stats)]
    cu_d, ops_d = cu.to(device), torch.tensor(ops, device=device)

    def call(max_q=4):
        trtllm.merge_chunked_attention_for_mla(held[0], held[1], held[2], held[3], len(ops),
                                               cu_d, max_q, ops_d, heads, 128)

    call()
    g = gen("trt-fast-2")
    fresh = [torch.randn(attn.shape, generator=g).bfloat16(),
             torch.randn(temp.shape, generator=g).bfloat16(), pairs(stats.shape[0], heads, g),
             pairs(temp_stats.shape[0], heads, g)]
    new_ops = [2, 1, 0, 1, 2, 0]
    for t, values in zip(held, fresh):
        t.copy_(values)
    ops_d.copy_(torch.tensor(new_ops))
    before = _kernel.fast_info()["hits"]
    call()
    assert _kernel.fast_info()["hits"] == before + 1
    ref_attn, ref_stats = reference(fresh[0], fresh[1], fresh[2][:tokens], fresh[3][:tokens], cu,
                                    new_ops)
    got_attn, got_stats = held[0].cpu().double(), held[2][:tokens].cpu().double()
    assert torch.allclose(got_attn, ref_attn, atol=2e-2, rtol=2e-2)
    finite = ref_stats.isfinite()
    assert torch.equal(got_stats.isfinite(), finite)
    assert torch.allclose(got_stats[finite], ref_stats[finite], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="max_q_seq_len"):
        call(max_q=-1)


def test_request_options_are_checked_before_anything_is_written():
    """The general call's per-request options, given wrong, raise naming them."""
    from kvsplit._call import merge_call
    from kvsplit.validation import LSE, Extras

    a, b = torch.zeros(4, 2, 64), torch.zeros(4, 2, 64)
    sa, sb = torch.zeros(4, 2, 2)[..., 0], torch.zeros(4, 2, 2)[..., 0]
    starts, ops = torch.tensor([0, 4]), torch.tensor([1])
    bad = [(Extras(request_starts=starts), "go together"),
           (Extras(request_starts=starts.int(), request_ops=ops), "request_starts must be"),
           (Extras(request_starts=torch.tensor([0, 2, 4]), request_ops=ops), "one more entry"),
           (Extras(request_starts=starts, request_ops=ops[:, None]), "request_ops must be")]
    for extras, words in bad:
        out = torch.full_like(a, 7.0)
        with pytest.raises(ValueError, match=words):
            merge_call(LSE, (a, b), (sa, sb), math.e, out=out, extras=extras)
        assert (out == 7.0).all()
    with pytest.raises(ValueError, match="take LSE stats"):
        from kvsplit.validation import MAXSUM
        merge_call(MAXSUM, (a, b), (torch.zeros(4, 2, 2), torch.zeros(4, 2, 2)), 0.5,
                   extras=Extras(request_starts=starts, request_ops=ops))
    with pytest.raises(ValueError, match="two splits"):
        merge_call(LSE, (a, b, a), (sa, sb, sa), math.e, extras=Extras(request_starts=starts,
                                                                    request_ops=ops))
    with pytest.raises(ValueError, match="two splits"):  # pair stats alone: the same kernel
        merge_call(LSE, torch.stack([a, b, a]), torch.zeros(3, 4, 2, 2)[..., 0], math.e,
                   extras=Extras(pair_stats=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_trtllm_chunked_prefill_gives_full_attention(device, dtype):
    """Three chunks of K/V, as TensorRT-LLM's chunked prefill folds them: copy, merge, merge.
    The (LSE, 1) stats written by one call are the running state of the next."""
    g = gen("trt-chunks", dtype)
    tokens, heads, head_size, kv_len, scale = 5, 2, 128, 24, 128 ** -0.5
    q = torch.randn(tokens, heads, head_size, generator=g, dtype=torch.float64)
    k = torch.randn(kv_len, heads, head_size, generator=g, dtype=torch.float64)
    v = torch.randn(kv_len, heads, head_size, generator=g, dtype=torch.float64)
    logits = torch.einsum("thd,khd->thk", q, k) * scale
    exact = torch.einsum("thk,khd->thd", logits.softmax(-1), v)
    merged_attn = torch.empty(tokens, heads, head_size, dtype=dtype, device=device)
    merged_stats = torch.empty(tokens, heads, 2, device=device)
    cu = torch.tensor([0, 2, tokens], device=device)
    for i, chunk in enumerate(torch.arange(kv_len).chunk(3)):
        part = logits[..., chunk]
        top = part.amax(-1)
        p = torch.exp(part - top[..., None])
        total = p.sum(-1)
        temp = (torch.einsum("thk,khd->thd", p, v[chunk]) / total[..., None]).to(dtype).contiguous()
        temp_stats = torch.stack([top, total], dim=-1).float()
        op = torch.tensor([2 if i == 0 else 1] * 2, device=device)
        trtllm.merge_chunked_attention_for_mla(merged_attn, temp.to(device), merged_stats,
                                               temp_stats.to(device), 2, cu, 3, op, heads,
                                               head_size)
    tol = TOL[dtype]
    assert torch.allclose(merged_attn.double().cpu(), exact, atol=tol, rtol=tol)
    full_lse = torch.logsumexp(logits, dim=-1)
    got_lse = merged_stats[..., 0].double().cpu() + merged_stats[..., 1].double().cpu().log()
    assert torch.allclose(got_lse, full_lse, atol=1e-5, rtol=1e-5)


def test_trtllm_no_request_touches_nothing():
    attn, temp, stats, temp_stats, cu, ops = case(torch.bfloat16, 128, gen("trt-none"))
    merged_attn, merged_stats = attn.clone(), stats.clone()
    trtllm.merge_chunked_attention_for_mla(merged_attn, temp, merged_stats, temp_stats, 0, cu, 0,
                                           torch.tensor(ops), 4, 128)
    assert torch.equal(merged_attn.nan_to_num(), attn.nan_to_num())
    assert torch.equal(merged_stats, stats)


def _bad_calls():
    attn = torch.zeros(6, 4, 128, dtype=torch.bfloat16)
    stats = torch.zeros(6, 4, 2)
    cu, op = torch.tensor([0, 2, 6]), torch.tensor([1, 2])

    def call(**changes):
        args = dict(merged_attn=attn, temp_attn=attn.clone(), merged_softmax_stats=stats,
                    temp_softmax_stats=stats.clone(), num_requests=2, cu_q_seq_lens=cu,
                    max_q_seq_len=4, merge_op=op, num_heads=4, head_size=128)
        args.update(changes)
        return lambda: trtllm.merge_chunked_attention_for_mla(**args)

    return {
        "mismatched dtypes": (call(temp_attn=attn.half()), TypeError,
                              "merged_attn and temp_attn must share one dtype"),
        "float64 stats": (call(temp_softmax_stats=stats.double()), TypeError,
                          "temp_softmax_stats must be float32"),
        "int32 cu_q_seq_lens": (call(cu_q_seq_lens=cu.int()), TypeError,
                                "cu_q_seq_lens must be a 1-D int64 tensor"),
        "short merge_op": (call(merge_op=op[:1]), ValueError, "merge_op 2"),
        "strided merged_attn": (call(merged_attn=attn.transpose(0, 1)), ValueError,
                                "merged_attn must be contiguous"),
        "partial token": (call(head_size=120), ValueError, "merged_attn must hold whole tokens"),
        "short stats": (call(merged_softmax_stats=stats[:3]), ValueError,
                        "merged_softmax_stats must hold whole tokens"),
        "no heads": (call(num_heads=0), ValueError, "num_heads must be at least 1"),
        "bool head_size": (call(head_size=True), TypeError, "head_size must be an int"),
        "empty merged_attn": (call(merged_attn=attn[:0]), ValueError, "must not be empty"),
        "unsupported head_size": (call(head_size=100), ValueError, "head_size 100 is not"),
    }


@pytest.mark.parametrize("name", sorted(_bad_calls()))
def test_trtllm_bad_input_is_refused_in_trtllm_terms(name):
    call, error, words = _bad_calls()[name]
    with pytest.raises(error, match=words):
        call()


def test_trtllm_checks_before_writing():
    attn = torch.full((6, 4, 128), 3.0, dtype=torch.bfloat16)
    stats = torch.full((6, 4, 2), 3.0)
    with pytest.raises(TypeError):
        trtllm.merge_chunked_attention_for_mla(attn, attn.clone(), stats, stats.double(), 1,
                                               torch.tensor([0, 6]), 6, torch.tensor([1]), 4, 128)
    assert (attn == 3).all() and (stats == 3).all()


@pytest.mark.parametrize("head_size", [40, 96, 192, 576])
def test_trtllm_head_size_the_in_place_merge_cannot_take(head_size):
    """A head size whose row the in-place kernel cannot lay out: a ValueError naming
    head_size, nothing written (on the CPU, whose configs follow the CUDA kernel's rules)."""
    device = "cpu"
    attn = torch.full((6, 2, head_size), 3.0, dtype=torch.bfloat16, device=device)
    stats = torch.full((6, 2, 2), 3.0, device=device)
    with pytest.raises(ValueError, match=f"^head_size {head_size} is not supported with "
                                         f"bfloat16 attention by the in-place merge"):
        trtllm.merge_chunked_attention_for_mla(attn, attn.clone(), stats, stats.clone(), 1,
                                               torch.tensor([0, 6], device=device), 6,
                                               torch.tensor([1], device=device), 2, head_size)
    assert (attn == 3).all() and (stats == 3).all()


class _Ops(TorchDispatchMode):
    """Records the element count of every floating-point tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if isinstance(result, torch.Tensor) and result.is_floating_point():
            self.ops.append((func.__name__, result.numel(), result.data_ptr(),
                             result.untyped_storage().data_ptr()))
        return result


def test_trtllm_makes_no_tensor(device):
    """No helper tensor at all (views of the caller's only): the attention merges and
    copies where it lies, and the stats are read and written as pairs in place."""
    attn, temp, stats, temp_stats, cu, ops = case(torch.bfloat16, 128, gen("trt-copy"))
    args = [t.to(device) for t in (attn, temp, stats, temp_stats)]
    trtllm.merge_chunked_attention_for_mla(args[0], args[1], args[2], args[3], len(ops),
                                           cu.to(device), 4, torch.tensor(ops, device=device),
                                           4, 128)
    with _Ops() as recorded:
        trtllm.merge_chunked_attention_for_mla(args[0], args[1], args[2], args[3], len(ops),
                                               cu.to(device), 4, torch.tensor(ops, device=device),
                                               4, 128)
    owned = {t.untyped_storage().data_ptr() for t in args}
    made = [op for op in recorded.ops if op[3] not in owned]
    assert not made, made


def _gpu_call(device):
    attn, temp, stats, temp_stats, cu, ops = case(torch.bfloat16, 128, gen("trt-gpu"))
    attn[attn.isnan()] = 0.0
    tensors = [t.to(device) for t in (attn, temp, stats, temp_stats)]
    cu, op = cu.to(device), torch.tensor(ops, device=device)

    def call():
        trtllm.merge_chunked_attention_for_mla(tensors[0], tensors[1], tensors[2], tensors[3],
                                               len(ops), cu, 4, op, 4, 128)
    return call, tensors


@pytest.mark.gpu
def test_trtllm_is_one_kernel_launch(cuda_device):
    """Requests, ops and (max, sum) pairs are read by the kernel itself: one launch, no
    elementwise helper and no host round trip."""
    call, _ = _gpu_call(cuda_device)
    call()
    torch.cuda.synchronize()
    kernels, _ = profiled_kernels(call)
    assert len(kernels) == 1 and "kvsplit" in kernels[0], kernels


@pytest.mark.gpu
def test_trtllm_replays_in_a_cuda_graph(cuda_device):
    call, tensors = _gpu_call(cuda_device)
    start = [t.clone() for t in tensors]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    for t, values in zip(tensors, start):
        t.copy_(values)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for t, values in zip(tensors, start):
        t.copy_(values)
    graph.replay()
    replayed = [t.clone() for t in tensors[::2]]
    for t, values in zip(tensors, start):
        t.copy_(values)
    call()
    for got, want in zip(replayed, tensors[::2]):
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_trtllm_per_call_path_writes_the_tensors_of_each_call(device):
    """The op passes its outputs once (merged_attn and its stats): a later call of the same
    layout on other tensors is served by the binding, merges into those, and leaves the
    tensors of the call that registered alone."""
    from kvsplit import _kernel

    if not _kernel.FAST_CALL:
        pytest.skip("this torch has no DLPack exchange table")

    def tensors(seed):
        attn, temp, stats, temp_stats, cu, ops = case(torch.bfloat16, 128, gen("trt-other", seed))
        attn[attn.isnan()] = 0.0
        return [t.to(device) for t in (attn, temp, stats, temp_stats)], cu, ops

    def call(held, cu, ops):
        trtllm.merge_chunked_attention_for_mla(held[0], held[1], held[2], held[3], len(ops),
                                               cu.to(device), 4, torch.tensor(ops, device=device),
                                               held[0].shape[1], 128)

    registered, cu, ops = tensors(1)
    call(registered, cu, ops)
    kept = [t.clone() for t in registered]
    other, _, _ = tensors(2)
    tokens = other[0].shape[0]
    ref_attn, ref_stats = reference(other[0].cpu(), other[1].cpu(), other[2][:tokens].cpu(),
                                    other[3][:tokens].cpu(), cu, ops)
    before = _kernel.fast_info()["hits"]
    call(other, cu, ops)
    assert _kernel.fast_info()["hits"] == before + 1
    assert torch.allclose(other[0].cpu().double(), ref_attn, atol=2e-2, rtol=2e-2)
    got = other[2][:tokens].cpu().double()
    finite = ref_stats.isfinite()
    assert torch.equal(got.isfinite(), finite)
    assert torch.allclose(got[finite], ref_stats[finite], atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(registered, kept))
