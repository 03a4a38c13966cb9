"""SGLang's, xFormers' and FlashInfer's variable-length adapters against float64 references.

The references are written from the originals' own definitions (a state is
(v, lse); merged v = sum_i w_i v_i / sum_i w_i, w_i = base^(lse_i - max),
merged lse = log_base(sum_i w_i) + max), never from kvsplit: SGLang reads any
infinite LSE as empty; xFormers and FlashInfer's Triton merges give 0 and -inf
for a row with no non-empty state, as kvsplit does. Where SGLang gives NaN
(both states empty) the adapters give 0 and -inf. Every test runs on the CPU
and, marked gpu, on CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch
from cuda_profile import profiled_kernels
from state_reference import merge_reference as reference
from state_reference import seeded as gen
from torch.utils._python_dispatch import TorchDispatchMode

from kvsplit.compat import flashinfer, sglang, xformers

pytestmark = pytest.mark.usefixtures("dispatch_sandbox")
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}
LSE_TOL = 1e-4


def states(n, lead, head_dim, dtype, g, *, empty=0.15, pos_inf=0.0):
    """n random states (v in ``dtype``, float32 lse); the first row empty in every state."""
    v = torch.randn(n, *lead, head_dim, generator=g).to(dtype)
    s = torch.randn(n, *lead, generator=g) * 3
    s = s.masked_fill(torch.rand(n, *lead, generator=g) < empty, -math.inf)
    if pos_inf:
        s = s.masked_fill(torch.rand(n, *lead, generator=g) < pos_inf, math.inf)
    s.view(n, -1)[:, 0] = math.inf if pos_inf else -math.inf
    return v, s


def assert_close(out, lse, ref_out, ref_lse, *, tol=None):
    tol = tol or TOL[out.dtype]
    assert torch.allclose(out.double().cpu(), ref_out, atol=tol, rtol=tol)
    finite = torch.isfinite(ref_lse)
    assert finite.any() and not finite.all()
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    assert torch.allclose(lse.double().cpu()[finite], ref_lse[finite], atol=LSE_TOL, rtol=LSE_TOL)
    assert (lse.cpu()[~finite] == -math.inf).all()


# --- SGLang ----------------------------------------------------------------------------


@pytest.mark.parametrize("given_outputs", [False, True])
@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 128), (torch.float16, 48),
                                             (torch.float32, 96), (torch.bfloat16, 576)])
@pytest.mark.parametrize("tokens, heads", [(1, 8), (13, 16)])
def test_sglang_merge_state_v2(device, tokens, heads, dtype, head_dim, given_outputs):
    v, s = states(2, (tokens, heads), head_dim, dtype, gen("sgl", tokens, dtype, head_dim),
                  pos_inf=0.1)
    v_a, v_b, s_a, s_b = (t.clone().to(device) for t in (v[0], v[1], s[0], s[1]))
    v_merged = torch.full_like(v_a, float("nan")) if given_outputs else None
    s_merged = torch.full_like(s_a, float("nan")) if given_outputs else None
    out, lse = sglang.merge_state_v2(v_a, s_a, v_b, s_b, v_merged, s_merged)
    if given_outputs:
        assert out is v_merged and lse is s_merged
    assert out.shape == v_a.shape and out.dtype == dtype
    assert lse.shape == s_a.shape and lse.dtype == torch.float32
    assert_close(out, lse, *reference(v, s, math.e, inf_is_empty=True))
    assert torch.equal(v_a.cpu(), v[0]) and torch.equal(s_b.cpu(), s[1])  # inputs untouched


@pytest.mark.parametrize("onto", ["a", "b"])
def test_sglang_merge_state_v2_in_place(device, onto):
    """SGLang's kernel is elementwise, so an output over one input state is a valid call."""
    v, s = states(2, (9, 8), 128, torch.bfloat16, gen("sgl-inplace", onto), pos_inf=0.1)
    v_a, v_b, s_a, s_b = (t.clone().to(device) for t in (v[0], v[1], s[0], s[1]))
    target_v, target_s = (v_a, s_a) if onto == "a" else (v_b, s_b)
    out, lse = sglang.merge_state_v2(v_a, s_a, v_b, s_b, target_v, target_s)
    assert out is target_v and lse is target_s
    assert_close(out, lse, *reference(v, s, math.e, inf_is_empty=True))


def test_sglang_merge_state_v2_converts_a_16_bit_lse(device):
    """SGLang reads s_a and s_b as float32: a bfloat16 LSE is converted, s_merged float32."""
    v, s = states(2, (5, 4), 64, torch.float16, gen("sgl-bf16-lse"))
    s = s.bfloat16().float()  # values a bfloat16 LSE holds exactly
    out, lse = sglang.merge_state_v2(v[0].to(device), s[0].bfloat16().to(device),
                                     v[1].to(device), s[1].bfloat16().to(device))
    assert lse.dtype == torch.float32
    assert_close(out, lse, *reference(v, s, math.e, inf_is_empty=True))


@pytest.mark.parametrize("output_dtype", [None, torch.float32, torch.bfloat16])
def test_sglang_merge_state(device, output_dtype):
    """The dispatcher: both outputs allocated when None, any float output converted on store."""
    v, s = states(2, (7, 8), 128, torch.float16, gen("sgl-dispatch", str(output_dtype)),
                  pos_inf=0.1)
    prefix_output, suffix_output = v[0].to(device), v[1].to(device)
    output = (None if output_dtype is None
              else torch.empty(7, 8, 128, dtype=output_dtype, device=device))
    out, lse = sglang.merge_state(prefix_output, s[0].to(device), suffix_output, s[1].to(device),
                                  output)
    assert out.dtype == (output_dtype or torch.float16) and lse.dtype == torch.float32
    assert output is None or out is output
    assert_close(out, lse, *reference(v, s, math.e, inf_is_empty=True))


def _sglang_bad_calls():
    v = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    s = torch.zeros(4, 2)
    return {
        "1-D LSE": (lambda o, l: sglang.merge_state_v2(v, s[:, 0], v, s, o, l),
                    ValueError, "s_a and s_b must be 2-D"),
        "2-D state": (lambda o, l: sglang.merge_state_v2(v[0], s, v, s, o, l),
                      ValueError, "v_a and v_b must be 3-D"),
        "mismatched dtypes": (lambda o, l: sglang.merge_state_v2(v, s, v.half(), s, o, l),
                              TypeError, "v_a and v_b must share one dtype"),
        "mismatched heads": (lambda o, l: sglang.merge_state_v2(v, s, v, s[:, :1], o, l),
                             ValueError, "shapes do not match"),
        "fp8 states": (lambda o, l: sglang.merge_state(v.to(torch.float8_e4m3fn), s,
                                                       v.to(torch.float8_e4m3fn), s, o, l),
                       TypeError, "prefix_output and suffix_output must share one dtype"),
        "float16 s_merged": (lambda o, l: sglang.merge_state_v2(v, s, v, s, o, l.half()),
                             TypeError, "s_merged must be float32"),
        "v_merged of another dtype": (lambda o, l: sglang.merge_state_v2(v, s, v, s, o.float(), l),
                                      TypeError, "v_merged must have dtype torch.bfloat16"),
        "half in place": (lambda o, l: sglang.merge_state_v2(v, s, v.clone(), s, v, l),
                          ValueError, "v_merged may be v_a itself only with s_merged being s_a"),
        "output of another shape": (lambda o, l: sglang.merge_state(v, s, v, s, o[:2], l),
                                    ValueError, "output must have shape"),
    }


@pytest.mark.parametrize("case", sorted(_sglang_bad_calls()))
def test_sglang_bad_input_is_refused_in_sglang_terms(case):
    call, error, words = _sglang_bad_calls()[case]
    out = torch.full((4, 2, 64), 7.0, dtype=torch.bfloat16)
    out_lse = torch.full((4, 2), 7.0)
    with pytest.raises(error, match=words):
        call(out, out_lse)
    assert (out == 7).all() and (out_lse == 7).all()  # nothing written


# --- xFormers --------------------------------------------------------------------------


def test_sglang_merge_state_v2_refuses_what_the_dispatcher_took():
    """The dispatcher converts on store; merge_state_v2 takes only v_a's dtype. A layout the
    dispatcher has launched (and so registered for repeated calls) is still refused by v2."""
    g = gen("sglang-v2-after-dispatcher")
    v, s = states(2, (5, 3), 64, torch.bfloat16, g)
    out = torch.empty(5, 3, 64, dtype=torch.float32)
    out_lse = torch.empty(5, 3)
    for _ in range(2):  # the second call takes the per-call path
        merged, lse = sglang.merge_state(v[0], s[0], v[1], s[1], out, out_lse)
    assert_close(merged, lse, *reference(v, s, math.e, inf_is_empty=True))
    with pytest.raises(TypeError, match="v_merged must have dtype torch.bfloat16"):
        sglang.merge_state_v2(v[0], s[0], v[1], s[1], out, out_lse)


def xformers_chunks(num_chunks, batch, seqlen, groups, heads, head_dim, dtype, g, *, pad=0):
    """Stacked chunks [C, B, M, (G,) H, K] and LSE [C, B, (G,) H, M] (a view of a buffer padded
    along M, as xFormers' partial attention returns it), plus the reference's layout."""
    gh = (groups,) if groups else ()
    v, s = states(num_chunks, (batch, seqlen) + gh + (heads,), head_dim, dtype, g)
    lse_buffer = torch.full((num_chunks, batch) + gh + (heads, seqlen + pad), 5.0)
    lse = lse_buffer[..., :seqlen]
    lse.copy_(s.movedim(2, -1))
    return v, lse, (v, s)


def xformers_reference(v, s):
    out, lse = reference(v, s, math.e)  # lse [B, M, (G,) H]
    return out, lse.movedim(1, -1)


@pytest.mark.parametrize("write_lse", [True, False])
@pytest.mark.parametrize("dtype, output_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                                 (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("num_chunks, groups, heads, head_dim",
                         [(3, None, 8, 128), (2, 2, 4, 64), (5, 1, 3, 128), (4, 3, 1, 256)])
def test_xformers_merge_attentions_stacked(device, num_chunks, groups, heads, head_dim, dtype,
                                           output_dtype, write_lse):
    g = gen("xf", num_chunks, groups, str(dtype), str(output_dtype))
    attn, lse, (v, s) = xformers_chunks(num_chunks, 2, 5, groups, heads, head_dim, dtype, g,
                                        pad=3)
    out, out_lse = xformers.merge_attentions(attn.to(device), lse.to(device), write_lse,
                                             output_dtype)
    assert out.shape == attn.shape[1:] and out.dtype == (output_dtype or dtype)
    ref_out, ref_lse = xformers_reference(v, s)
    if not write_lse:
        assert out_lse is None
        assert torch.allclose(out.double().cpu(), ref_out, atol=TOL[out.dtype], rtol=TOL[out.dtype])
        return
    assert out_lse.shape == lse.shape[1:] and out_lse.dtype == torch.float32
    assert_close(out, out_lse, ref_out, ref_lse)


@pytest.mark.parametrize("form", ["views of one tensor", "two tensors", "one tensor twice",
                                  "scattered chunks", "stacked attn, listed lse"])
def test_xformers_merge_attentions_lists(device, form):
    n = 2 if form in ("two tensors", "one tensor twice") else 4
    attn, lse, (v, s) = xformers_chunks(n, 3, 2, 2, 4, 64, torch.float32, gen("xf-list", form))
    attn, lse = attn.to(device), lse.to(device)
    if form == "one tensor twice":  # xFormers' own test: the result is the chunk, lse + ln 2
        out, out_lse = xformers.merge_attentions([attn[0], attn[0]], [lse[0], lse[0]])
        finite = torch.isfinite(lse[0])
        assert torch.allclose(out[finite.movedim(-1, 1)], attn[0][finite.movedim(-1, 1)],
                              atol=1e-5)
        assert torch.allclose(out_lse[finite], lse[0][finite] + math.log(2), atol=1e-5)
        return
    if form == "views of one tensor":
        args = (list(attn), list(lse))
    elif form == "stacked attn, listed lse":
        args = (attn, list(lse))
    else:  # slots 0, 1, 3, 4 of one buffer: not equally far apart
        buffer = torch.empty((n + 1,) + attn.shape[1:], device=device)
        lse_buffer = torch.empty((n + 1,) + lse.shape[1:], device=device)
        slots = [0, 1, 3, 4]
        args = ([buffer[i].copy_(a) for i, a in zip(slots, attn)],
                [lse_buffer[i].copy_(x) for i, x in zip(slots, lse)])
    out, out_lse = xformers.merge_attentions(*args)
    assert_close(out, out_lse, *xformers_reference(v, s))


def _xformers_bad_calls():
    attn = torch.zeros(2, 1, 3, 4, 64)
    lse = torch.zeros(2, 1, 4, 3)
    return {
        "LSE of the wrong rank": (lambda: xformers.merge_attentions(attn, lse[0]), ValueError,
                                  "expected"),
        "LSE of other sizes": (lambda: xformers.merge_attentions(attn, lse[..., :2]), ValueError,
                               "incompatible shapes"),
        "chunk counts differ": (lambda: xformers.merge_attentions(list(attn), [lse[0]]),
                                ValueError, "attn_split has 2 chunks but lse_split has 1"),
        "chunks differ": (lambda: xformers.merge_attentions([attn[0], attn[1][:, :2]], list(lse)),
                          ValueError, "chunk 1 has shapes"),
        "empty list": (lambda: xformers.merge_attentions([], []), ValueError, "empty"),
        "float16 LSE": (lambda: xformers.merge_attentions(attn, lse.half()), TypeError,
                        "lse_split must be float32"),
        "integer output_dtype": (lambda: xformers.merge_attentions(attn, lse,
                                                                   output_dtype=torch.int8),
                                 TypeError, "output_dtype"),
        "float64 chunks": (lambda: xformers.merge_attentions(attn.double(), lse), TypeError,
                           "attn_split must be float32"),
    }


@pytest.mark.parametrize("case", sorted(_xformers_bad_calls()))
def test_xformers_bad_input_is_refused_in_xformers_terms(case):
    call, error, words = _xformers_bad_calls()[case]
    with pytest.raises(error, match=words):
        call()


# --- FlashInfer's variable-length merge ------------------------------------------------


@pytest.mark.parametrize("indptr_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 128), (torch.float16, 64),
                                             (torch.float32, 256)])
def test_flashinfer_variable_length_merge_states(device, dtype, head_dim, indptr_dtype):
    g = gen("varlen", str(dtype), str(indptr_dtype))
    lengths = [3, 0, 1, 7, 2, 1]
    indptr = torch.tensor([0] + lengths).cumsum(0)
    nnz, heads = int(indptr[-1]), 4
    v, s = states(1, (nnz, heads), head_dim, dtype, g, empty=0.2)
    v, s = v[0], s[0]
    s[int(indptr[2])] = -math.inf  # a position whose one state is empty
    out, lse = flashinfer.variable_length_merge_states(v.to(device), s.to(device),
                                                       indptr.to(device, indptr_dtype))
    assert out.shape == (len(lengths), heads, head_dim) and out.dtype == dtype
    assert lse.shape == (len(lengths), heads) and lse.dtype == torch.float32
    ref_out = torch.zeros(len(lengths), heads, head_dim, dtype=torch.float64)
    ref_lse = torch.full((len(lengths), heads), -math.inf, dtype=torch.float64)
    for p in range(len(lengths)):
        a, b = int(indptr[p]), int(indptr[p + 1])
        if b > a:
            ref_out[p], ref_lse[p] = reference(v[a:b], s[a:b], 2.0)
    assert_close(out, lse, ref_out, ref_lse)


def test_flashinfer_variable_length_refuses_bad_input():
    v, s = torch.zeros(4, 2, 64, dtype=torch.bfloat16), torch.zeros(4, 2)
    indptr = torch.tensor([0, 4])
    with pytest.raises(ValueError, match=r"v must be \(nnz, num_heads, head_dim\)"):
        flashinfer.variable_length_merge_states(v, s[:, 0], indptr)
    with pytest.raises(ValueError, match="indptr must be 1-D"):
        flashinfer.variable_length_merge_states(v, s, indptr[None])
    with pytest.raises(ValueError, match="indptr ends at 5"):
        flashinfer.variable_length_merge_states(v, s, torch.tensor([0, 5]))
    with pytest.raises(TypeError, match="s must be float32"):
        flashinfer.variable_length_merge_states(v, s.half(), indptr)


# --- zero copy, one launch, CUDA graphs ------------------------------------------------

_COPIES = ("copy", "clone", "contiguous", "stack", "cat", "_to_copy", "index")


class _Ops(TorchDispatchMode):
    """Records (op name, whether it made floating-point data) of every op."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.ops.append((func.__name__, isinstance(result, torch.Tensor)
                         and result.is_floating_point()))
        return result


def _calls(device):
    """adapter name -> (call, tensors it allocates)."""
    v, s = states(3, (4, 8), 128, torch.bfloat16, gen("copy"), pos_inf=0.1)
    v, s = v.to(device), s.to(device)
    out, out_lse = torch.empty_like(v[0]), torch.empty_like(s[0])
    attn, lse, _ = xformers_chunks(3, 2, 4, 2, 4, 64, torch.float32, gen("copy-xf"), pad=2)
    attn, lse = attn.to(device), lse.to(device)
    indptr = torch.tensor([0, 3, 3, 7, 12], device=device)
    return {
        "sglang.merge_state_v2": (lambda: sglang.merge_state_v2(v[0], s[0], v[1], s[1]), 2),
        "sglang.merge_state_v2 given outputs": (
            lambda: sglang.merge_state_v2(v[0], s[0], v[1], s[1], out, out_lse), 0),
        "sglang.merge_state_v2 in place": (
            lambda: sglang.merge_state_v2(v[2], s[2], v[1], s[1], v[2], s[2]), 0),
        "sglang.merge_state": (lambda: sglang.merge_state(v[0], s[0], v[1], s[1], out), 1),
        "xformers stacked": (lambda: xformers.merge_attentions(attn, lse), 2),
        "xformers list": (lambda: xformers.merge_attentions(list(attn), list(lse)), 2),
        "xformers two chunks, no lse": (
            lambda: xformers.merge_attentions([attn[0], attn[2]], [lse[0], lse[2]],
                                              write_lse=False), 1),
        "flashinfer.variable_length_merge_states": (
            lambda: flashinfer.variable_length_merge_states(v.view(12, 8, 128), s.view(12, 8),
                                                            indptr), 2),
    }


CALLS = sorted(_calls("cpu"))


@pytest.mark.parametrize("adapter", CALLS)
def test_adapters_copy_nothing(device, adapter):
    call, allocations = _calls(device)[adapter]
    call()  # the layout's launch is made (and its config chosen) outside the recording
    with _Ops() as ops:
        call()
    # Floating-point data only: the variable-length call reads indptr on the host.
    copies = [n for n, floats in ops.ops if floats and any(word in n for word in _COPIES)]
    assert not copies, copies
    made = [n for n, _ in ops.ops if n.startswith(("empty", "zeros", "full"))]
    assert len(made) == allocations, ops.ops


def test_scattered_xformers_chunks_are_stacked_once():
    """The documented exception: more than two chunks not equally far apart are stacked."""
    attn, lse, (v, s) = xformers_chunks(3, 1, 2, None, 2, 64, torch.float32, gen("scattered"))
    buffer = torch.empty((4,) + attn.shape[1:])
    chunks = [buffer[i].copy_(a) for i, a in zip([0, 1, 3], attn)]
    with _Ops() as ops:
        out, out_lse = xformers.merge_attentions(chunks, list(lse))
    assert [n for n, _ in ops.ops if n.startswith("stack")], ops.ops
    assert_close(out, out_lse, *xformers_reference(v, s))


@pytest.mark.gpu
@pytest.mark.parametrize("adapter", CALLS)
def test_adapters_launch_one_kernel(cuda_device, adapter):
    call, _ = _calls(cuda_device)[adapter]
    call()
    torch.cuda.synchronize()
    kernels, _ = profiled_kernels(call, ignore=("Memcpy", "Memset"))  # indptr's host check
    assert len(kernels) == 1, kernels


@pytest.mark.gpu
@pytest.mark.parametrize("adapter", CALLS)
def test_adapters_replay_in_a_cuda_graph(cuda_device, adapter):
    """Captured once, replayed on new values of its tensors: what the eager call gives."""
    call, _ = _calls(cuda_device)[adapter]
    inputs = [t for t in _inputs_of(call) if t.is_floating_point()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # the launch is made outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    for t in inputs:  # new values; infinite ones (empty states) stay as they are
        t.copy_(torch.where(torch.isfinite(t), t * 0.5 + 0.25, t))
    fresh = [t.clone() for t in inputs]
    graph.replay()
    replayed = [t.clone() for t in _flat(captured)]
    for t, values in zip(inputs, fresh):  # an in-place call changed its inputs: restore them
        t.copy_(values)
    expected = _flat(call())
    assert replayed and len(replayed) == len(expected)
    for got, want in zip(replayed, expected):
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


def _inputs_of(call):
    """The tensors a call closes over (its inputs and given outputs), each once."""
    seen, tensors = set(), []
    for cell in call.__closure__ or ():
        value = cell.cell_contents
        for t in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                tensors.append(t)
    return tensors


def _flat(result):
    return [t for t in (result if isinstance(result, tuple) else (result,)) if t is not None]
