"""What engines call beyond the power-of-two head dims and 16-bit outputs: any head dim
of whole 16-byte vectors, float32 and FP8 outputs (per-tensor and per-group scales),
pass-through rows and variable-length states, on the CPU twin and on CUDA, in every
kernel family (each config pinned through ``KVSPLIT_MODE``), against float64.

The configs of the DSplit family are written out here from its rules, independently
of dispatch/: a slice is ceil(vectors / slices) vectors (no slice empty), on a power
of two of 4..32 lanes of which more than half hold a vector; a CTA has 32..512 threads.
A Few thread holds 1, 2 or 4 of a row's V vectors, on ceil(V / vectors) threads a row,
with no step of a row empty.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import kvsplit
from kvsplit import reference
from kvsplit.config import KVSPLIT, KernelConfig, legal_configs

pytestmark = pytest.mark.usefixtures("dispatch_sandbox")

# (head_dim, partial dtype): the sizes engines use beyond 64/128/256/512, and the ends.
SHAPES = [(8, torch.bfloat16), (32, torch.bfloat16), (48, torch.float16), (80, torch.bfloat16),
          (96, torch.float16), (112, torch.bfloat16), (192, torch.bfloat16),
          (576, torch.bfloat16), (1024, torch.bfloat16), (4, torch.float32), (96, torch.float32),
          (200, torch.float32), (1024, torch.float32)]
FP8 = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}
OUT_TOL = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 1e-6}


def dsplit_configs(head_dim: int, elem_bytes: int, num_splits: int) -> list[KernelConfig]:
    vectors = head_dim * elem_bytes // 16
    configs = []
    for slices in (1, 2, 4, 8, 16):
        per_slice = -(-vectors // slices)
        if per_slice * (slices - 1) >= vectors:
            continue
        lanes = 1 << (per_slice - 1).bit_length()
        if not (4 <= lanes <= 32 and 2 * per_slice > lanes):
            continue
        for kv_split in (1, 2, 4, 8, 16, 32, 64, 128):
            if 32 <= lanes * kv_split <= 512 and kv_split <= num_splits:
                configs += [KernelConfig.dsplit(slices, kv_split, depth) for depth in (4, 16)]
    return configs


def kvsplit_configs(head_dim: int, elem_bytes: int, num_splits: int) -> list[KernelConfig]:
    """The KvSplit configs the kernel layer takes (its check: worked cases in
    tests/test_config.py), at most num_splits groups."""
    return [c for c in legal_configs(head_dim, elem_bytes, (KVSPLIT,)) if c.kv_split <= num_splits]


def few_configs(head_dim: int, elem_bytes: int) -> list[KernelConfig]:
    vectors = head_dim * elem_bytes // 16
    return [KernelConfig.few(v) for v in (1, 2, 4) if (v - 1) * -(-vectors // v) < vectors]


def pin(monkeypatch, config: KernelConfig) -> None:
    modes = {"dsplit": f"dsplit:{config.slices}:{config.kv_split}:{config.depth}",
             "few": f"few:{config.vectors}"}
    monkeypatch.setenv("KVSPLIT_MODE", modes.get(config.family, str(config.kv_split)))


def some_configs(head_dim, dtype, num_splits, device, gen) -> list[KernelConfig]:
    """KvSplit K = 1, the largest legal KvSplit K, the Few configs of one and of the most
    vectors a thread and, on CUDA, three DSplit configs."""
    elem = dtype.itemsize
    kv = kvsplit_configs(head_dim, elem, num_splits)
    few = few_configs(head_dim, elem)
    configs = [kv[0], kv[-1], few[0], few[-1]]
    ds = dsplit_configs(head_dim, elem, num_splits)
    if device == "cuda" and ds:
        picks = torch.randint(0, len(ds), (3,), generator=gen).tolist()
        configs += [ds[0], ds[-1]] + [ds[i] for i in picks]
    return list(dict.fromkeys(configs))


def assert_close_to(out, ref, out_dtype):
    got = out.cpu().double()
    tol = OUT_TOL[out_dtype]
    torch.testing.assert_close(got, ref, rtol=tol, atol=1e-5)


@pytest.mark.parametrize("head_dim, dtype", SHAPES, ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("fmt", ["maxsum", "lsee"])
@pytest.mark.parametrize("with_sinks", [True, False], ids=["sinks", "no-sinks"])
def test_head_dims_and_output_dtypes_match_reference(device, fmt, head_dim, dtype, with_sinks,
                                                     merge_kit, monkeypatch):
    # Without sinks a plain DSplit call takes its lean kernel of the output dtype.
    gen = merge_kit.generator("coverage", fmt, head_dim, str(dtype), with_sinks)
    num_splits, rows, heads = int(torch.randint(2, 40, (), generator=gen)), 12, 4
    partial_o, stats = merge_kit.partials(fmt, num_splits, rows, head_dim, dtype, gen)
    sinks = torch.randn(heads, generator=gen) if with_sinks else None
    scale = merge_kit.scale_log2(gen)
    ref_out, ref_stats = merge_kit.reference(fmt, partial_o, stats, scale=scale, sinks=sinks)
    partial_o, stats = partial_o.to(device), stats.to(device)
    sinks = sinks.to(device) if with_sinks else None
    for config in some_configs(head_dim, dtype, num_splits, device, gen):
        pin(monkeypatch, config)
        for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
            out, out_stats = merge_kit.merge(fmt, partial_o, stats, scale=scale, sinks=sinks,
                                             out_dtype=out_dtype)
            assert out.dtype == out_dtype and out.shape == (rows, head_dim)
            assert_close_to(out, ref_out, out_dtype)
            torch.testing.assert_close(out_stats.cpu().double(), ref_stats.float().double(),
                                       rtol=1e-5, atol=1e-6)


def fp8_reference(values: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """values / scale clamped to the format's range, rounded to ``fp8`` (as float64)."""
    limit = FP8[fp8]
    return (values / scale).clamp(-limit, limit).float().to(fp8).double()


def assert_fp8_within_one_ulp(out: torch.Tensor, expected: torch.Tensor, fp8: torch.dtype):
    """Each FP8 value equals the expected one or a neighbour (one ulp) of it."""
    got = out.cpu().double()
    # e4m3: 3 mantissa bits, so one ulp is 2^(floor(log2 |x|) - 3), at least the subnormal step.
    tiny = 2.0 ** (-9 if fp8 == torch.float8_e4m3fn else -10)
    magnitude = torch.maximum(got.abs(), expected.abs()).clamp_min(tiny)
    ulp = torch.exp2(torch.floor(torch.log2(magnitude)) - 3).clamp_min(tiny)
    assert ((got - expected).abs() <= ulp * 1.0001).all(), (got - expected).abs().max()


@pytest.mark.parametrize("fp8", list(FP8), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("head_dim, dtype", [(128, torch.bfloat16), (96, torch.float16),
                                             (576, torch.bfloat16), (64, torch.float32)],
                         ids=lambda v: str(v).removeprefix("torch."))
def test_fp8_output_with_one_scale(device, fp8, head_dim, dtype, merge_kit, monkeypatch):
    gen = merge_kit.generator("fp8", str(fp8), head_dim, str(dtype))
    num_splits, rows = 9, 16
    partial_o, lse = merge_kit.partials("lsee", num_splits, rows, head_dim, dtype, gen)
    partial_o = partial_o * 300  # some values past the format's range: clamped, never NaN
    ref_out, ref_lse = merge_kit.reference("lsee", partial_o, lse)
    scale = torch.tensor([0.75])
    expected = fp8_reference(ref_out, 0.75, fp8)
    for config in some_configs(head_dim, dtype, num_splits, device, gen):
        pin(monkeypatch, config)
        out, out_lse = kvsplit.merge_lse(partial_o.to(device), lse.to(device), base=math.e,
                                         out_dtype=fp8, out_scale=scale.to(device),
                                         return_lse=True)
        assert out.dtype == fp8 and not out.float().isnan().any()
        assert_fp8_within_one_ulp(out.float(), expected, fp8)
        torch.testing.assert_close(out_lse.cpu().double(), ref_lse.float().double(), rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("scales_dtype, ue8m0", [(torch.float32, False), (torch.float32, True),
                                                 (torch.float8_e8m0fnu, False)],
                         ids=["float32", "float32-ue8m0", "e8m0"])
@pytest.mark.parametrize("quant_group", [64, 128])
@pytest.mark.parametrize("head_dim", [128, 192, 512, 576])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_fp8_output_with_per_group_scales(device, head_dim, quant_group, scales_dtype, ue8m0,
                                          dtype, merge_kit, monkeypatch):
    """Per-group scales from bf16 partials (a group of 64 is 8 lanes of 16-byte vectors)
    and float32 ones (16 lanes)."""
    if head_dim % quant_group:
        pytest.skip("the group must divide head_dim")
    fp8 = torch.float8_e4m3fn
    gen = merge_kit.generator("fp8-group", head_dim, quant_group, str(scales_dtype), ue8m0,
                              str(dtype))
    num_splits, tokens, heads = 6, 5, 3
    rows = tokens * heads
    partial_o, lse = merge_kit.partials("lse2", num_splits, rows, head_dim, dtype, gen)
    # Groups of very different magnitudes, one all zero (in the partials' own dtype).
    partial_o = (partial_o.float() * torch.logspace(-3, 3, head_dim // quant_group)
                 .repeat_interleave(quant_group)).to(dtype)
    partial_o[:, 0, :quant_group] = 0
    ref_out, _ = merge_kit.reference("lse2", partial_o, lse)
    groups = ref_out.view(rows, -1, quant_group)
    ref_scales = groups.abs().amax(-1).clamp_min(1e-10) / 448.0
    if ue8m0 or scales_dtype != torch.float32:
        ref_scales = torch.exp2(torch.ceil(torch.log2(ref_scales)))
    expected = fp8_reference(groups, ref_scales.unsqueeze(-1), fp8).view(rows, head_dim)
    view = lambda t: t.view(num_splits, tokens, heads, *t.shape[2:])  # noqa: E731
    assert partial_o.dtype == dtype
    for config in some_configs(head_dim, dtype, num_splits, device, gen):
        pin(monkeypatch, config)
        # Column-major scales, as DeepGEMM reads them: (tokens, heads, groups) with groups slowest.
        scales = torch.full((head_dim // quant_group, tokens, heads), 7.0).to(
            device=device, dtype=scales_dtype).permute(1, 2, 0)
        out = kvsplit.merge_lse(view(partial_o).to(device), view(lse).to(device),
                                out_dtype=fp8, group_scales=scales, quant_group=quant_group,
                                ue8m0=ue8m0)
        got_scales = scales.float().cpu().reshape(rows, -1).double()
        torch.testing.assert_close(got_scales, ref_scales, rtol=1e-6, atol=0)
        assert_fp8_within_one_ulp(out.float().reshape(rows, head_dim), expected, fp8)


@pytest.mark.parametrize("scales_layout", ["padded-tokens", "head-major"])
def test_per_group_scales_of_any_strides(device, scales_layout, merge_kit, monkeypatch):
    """Per-group scales whose rows are not one stride apart (a token stride other than
    heads x the head stride) next to partials and outputs that are: each scale lands at
    its own (token, head, group), in every family (flat rows once wrote them at
    row x head stride)."""
    fp8, quant_group, head_dim = torch.float8_e4m3fn, 64, 128
    gen = merge_kit.generator("group-scale-strides", scales_layout)
    num_splits, tokens, heads = 3, 5, 4
    rows = tokens * heads
    partial_o, lse = merge_kit.partials("lse2", num_splits, rows, head_dim, torch.bfloat16, gen)
    ref_out, _ = merge_kit.reference("lse2", partial_o, lse)
    ref_scales = ref_out.view(rows, -1, quant_group).abs().amax(-1).clamp_min(1e-10) / 448.0
    view = lambda t: t.view(num_splits, tokens, heads, *t.shape[2:])  # noqa: E731
    groups = head_dim // quant_group
    for config in some_configs(head_dim, torch.bfloat16, num_splits, device, gen):
        pin(monkeypatch, config)
        if scales_layout == "padded-tokens":  # (tokens, heads + 1, groups), the last head unused
            storage = torch.full((tokens, heads + 1, groups), 7.0, device=device)
            scales = storage[:, :heads]
        else:  # (heads, tokens, groups) seen as (tokens, heads, groups)
            storage = torch.full((heads, tokens, groups), 7.0, device=device)
            scales = storage.transpose(0, 1)
        kvsplit.merge_lse(view(partial_o).to(device), view(lse).to(device), out_dtype=fp8,
                          group_scales=scales, quant_group=quant_group)
        torch.testing.assert_close(scales.cpu().reshape(rows, groups).double(), ref_scales,
                                   rtol=1e-6, atol=0)
        if scales_layout == "padded-tokens":
            assert (storage[:, heads] == 7.0).all(), f"{config.label} wrote past the heads"


@pytest.mark.parametrize("fmt", ["maxsum", "lsee"])
@pytest.mark.parametrize("head_dim", [96, 128])
def test_pass_through_rows_take_the_last_split_as_it_is(device, fmt, head_dim, merge_kit,
                                                        monkeypatch):
    """Tokens from P on: the last split's output (maxsum: over its sum) and stats as they are,
    an empty or +inf LSE included (vLLM copies the suffix state)."""
    gen = merge_kit.generator("pass-through", fmt, head_dim)
    num_splits, tokens, heads = 2, 9, 4
    rows = tokens * heads
    partial_o, stats = merge_kit.partials(fmt, num_splits, rows, head_dim, torch.bfloat16, gen,
                                          empty_fraction=0.3)
    if fmt != "maxsum":  # vLLM's empty suffix: +inf, in the last token (always passed through)
        stats[-1, -heads:] = math.inf
    scale = merge_kit.scale_log2(gen)
    merged_out, merged_stats = merge_kit.reference(fmt, partial_o, stats, scale=scale)
    if fmt == "maxsum":
        last_out, last_stats = merge_kit.reference(fmt, partial_o[-1:], stats[-1:], scale=scale)
    else:
        last_out, last_stats = partial_o[-1].double(), stats[-1].double()
    sinks = torch.randn(heads, generator=gen) if fmt == "maxsum" else None
    if sinks is not None:
        merged_out, merged_stats = merge_kit.reference(fmt, partial_o, stats, scale=scale,
                                                       sinks=sinks)
    for p in (0, 4, tokens - 1):
        cut = p * heads
        ref_out = torch.cat([merged_out[:cut], last_out[cut:]])
        ref_stats = torch.cat([merged_stats[:cut], last_stats[cut:]])
        for config in some_configs(head_dim, torch.bfloat16, num_splits, device, gen):
            pin(monkeypatch, config)
            out, out_stats = merge_kit.merge(
                fmt, partial_o.view(num_splits, tokens, heads, head_dim).to(device),
                stats.view(num_splits, tokens, heads, *stats.shape[2:]).to(device), scale=scale,
                pass_through_from=p, sinks=None if sinks is None else sinks.to(device))
            out, out_stats = out.reshape(rows, head_dim).cpu(), out_stats.reshape(ref_stats.shape)
            torch.testing.assert_close(out.double(), ref_out, rtol=2 ** -8, atol=1e-5)
            torch.testing.assert_close(out_stats.cpu().double(), ref_stats.float().double(),
                                       rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("indptr_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("fmt", ["maxsum", "lse2"])
def test_variable_length_states(device, fmt, indptr_dtype, merge_kit, monkeypatch):
    gen = merge_kit.generator("varlen", fmt, str(indptr_dtype))
    heads, head_dim = 3, 80
    lengths = [3, 0, 1, 17, 5, 0, 2]
    indptr = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    nnz = int(indptr[-1])
    partial_o, stats = merge_kit.partials(fmt, nnz, heads, head_dim, torch.bfloat16, gen)
    scale = merge_kit.scale_log2(gen)
    ref_out, ref_stats = [], []
    for t in range(len(lengths)):
        a, b = int(indptr[t]), int(indptr[t + 1])
        if a == b:
            ref_out.append(torch.zeros(heads, head_dim, dtype=torch.float64))
            ref_stats.append(merge_kit.reference(fmt, partial_o[:1], stats[:1].clone().fill_(
                -math.inf) if fmt != "maxsum" else torch.stack(
                    [torch.full((1, heads), -math.inf), torch.zeros(1, heads)], -1),
                scale=scale)[1])
        else:
            o, s = merge_kit.reference(fmt, partial_o[a:b], stats[a:b], scale=scale)
            ref_out.append(o)
            ref_stats.append(s)
    ref_out, ref_stats = torch.stack(ref_out), torch.stack(ref_stats)
    for config in some_configs(head_dim, torch.bfloat16, 4, device, gen):
        pin(monkeypatch, config)
        out, out_stats = merge_kit.merge(fmt, partial_o.to(device), stats.to(device), scale=scale,
                                         indptr=indptr.to(device=device, dtype=indptr_dtype))
        assert out.shape == (len(lengths), heads, head_dim)
        merge_kit.assert_matches_reference(out.reshape(-1, head_dim),
                                           out_stats.reshape(-1, *ref_stats.shape[2:]),
                                           ref_out.reshape(-1, head_dim),
                                           ref_stats.reshape(-1, *ref_stats.shape[2:]))


def lse_args(head_dim=64, dtype=torch.bfloat16, num_splits=3, rows=4):
    return torch.zeros(num_splits, rows, head_dim, dtype=dtype), torch.zeros(num_splits, rows)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(out_dtype=torch.float8_e4m3fn, out_scale=torch.ones(2)), ValueError, "out_scale"),
    (dict(out_dtype=torch.float8_e4m3fn, out_scale=torch.ones(1, dtype=torch.float64)), TypeError,
     "out_scale"),
    (dict(out_dtype=torch.bfloat16, out_scale=torch.ones(1)), ValueError, "out_scale"),
    (dict(out_dtype=torch.float8_e4m3fn, group_scales=torch.ones(4, 1), quant_group=96),
     ValueError, "quant_group"),
    (dict(out_dtype=torch.float8_e4m3fn, group_scales=torch.ones(4, 2), quant_group=64),
     ValueError, "group_scales"),
    (dict(out_dtype=torch.float8_e4m3fn, group_scales=torch.ones(4, 1, dtype=torch.float16),
          quant_group=64), TypeError, "group_scales"),
    (dict(out_dtype=torch.float8_e4m3fn, quant_group=64), ValueError, "group_scales"),
    (dict(out_dtype=torch.bfloat16, ue8m0=True), ValueError, "ue8m0 rounds per-group scales"),
    (dict(out_dtype=torch.float8_e4m3fn, out_scale=torch.ones(1), ue8m0=True), ValueError,
     "ue8m0 rounds per-group scales"),
    (dict(pass_through_from=5), ValueError, "pass_through_from"),
    (dict(pass_through_from=-1), ValueError, "pass_through_from"),
    (dict(pass_through_from=1.5), TypeError, "pass_through_from"),
    (dict(out_dtype=torch.float64), TypeError, "out_dtype"),
])
def test_bad_options_are_refused_before_anything_is_written(kwargs, error, words):
    partial_o, lse = lse_args()
    before = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(error, match=words):
        kvsplit.merge_lse(partial_o, lse, **kwargs)
    for name, value in before.items():
        assert torch.equal(kwargs[name], value), f"{name} was written"


def grad_forms():
    """Calls of the general path (list parts, options, adapters) as (name, inputs, call,
    names of the inputs to mark): call(inputs) writes inputs["out"]."""
    gen = torch.Generator().manual_seed(7)
    splits, tokens, heads, dim = 3, 6, 2, 64

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    def inputs(**more):
        return dict(o=rand(splits, tokens, heads, dim), lse=rand(splits, tokens, heads),
                    out=torch.full((tokens, heads, dim), 7.0), **more)

    from kvsplit.compat import vllm, xformers
    parts = inputs(o1=rand(tokens, heads, dim))
    return [
        ("two parts", parts,
         lambda x: kvsplit.merge_lse([x["o"][0], x["o1"]], [x["lse"][0], x["lse"][1]], out=x["out"]),
         ["o1", "lse"]),
        ("pass-through rows", inputs(),
         lambda x: kvsplit.merge_lse(x["o"], x["lse"], pass_through_from=2, out=x["out"]),
         ["o", "lse"]),
        ("sinks and pass-through rows", inputs(sinks=rand(heads)),
         lambda x: kvsplit.merge_lse(x["o"], x["lse"], sinks=x["sinks"], pass_through_from=2,
                                     out=x["out"]), ["sinks"]),
        ("fp8 output", inputs(scale=torch.tensor([0.5])) | dict(
            out=torch.zeros(tokens, heads, dim, dtype=torch.float8_e4m3fn)),
         lambda x: kvsplit.merge_lse(x["o"], x["lse"], out_scale=x["scale"], out=x["out"]),
         ["lse"]),
        ("indptr", dict(o=rand(5, heads, dim), lse=rand(5, heads),
                        out=torch.full((3, heads, dim), 7.0)),
         lambda x: kvsplit.merge_lse(x["o"], x["lse"], indptr=torch.tensor([0, 2, 2, 5]),
                                     out=x["out"]), ["lse"]),
        ("vllm", dict(o=rand(2, tokens, heads, dim), lse=rand(2, heads, tokens),
                      out=torch.full((tokens, heads, dim), 7.0)),
         lambda x: vllm.merge_attn_states(x["out"], x["o"][0], x["lse"][0], x["o"][1],
                                          x["lse"][1]), ["lse", "o"]),
        ("xformers", dict(o=rand(2, 1, tokens, heads, dim), lse=rand(2, 1, heads, tokens),
                          out=torch.full((1, tokens, heads, dim), 7.0)),
         lambda x: x["out"].copy_(xformers.merge_attentions(x["o"], x["lse"])[0]), ["lse"]),
    ]


@pytest.mark.parametrize("form", range(len(grad_forms())),
                         ids=[form[0] for form in grad_forms()])
def test_an_input_that_requires_grad_is_refused_in_every_call_form(form):
    name, tensors, call, marked = grad_forms()[form]
    call(tensors)  # the layout's first call (later ones may take the binding's path)
    expected = tensors["out"].clone()
    for mark in marked:
        wants_grad = dict(tensors, **{mark: tensors[mark].clone().requires_grad_()})
        wants_grad["out"] = torch.full_like(tensors["out"], 7.0)
        with pytest.raises(RuntimeError, match="no backward"):
            call(wants_grad)
        assert torch.equal(wants_grad["out"].float(), torch.full_like(expected, 7.0).float()), \
            f"{name}: out written before {mark} was refused"
        with torch.no_grad():
            call(wants_grad)
        assert torch.equal(wants_grad["out"].float(), expected.float()), name


@pytest.mark.parametrize("indptr, words", [
    (torch.tensor([0, 2, 1, 3], dtype=torch.int32), "non-decreasing"),
    (torch.tensor([0, 2, 4], dtype=torch.int32), "past the 3 states"),
    (torch.tensor([-1, 2], dtype=torch.int64), "non-decreasing"),
    (torch.tensor([0.0, 1.0]), "int32 or int64"),
    (torch.tensor([[0, 1]], dtype=torch.int32), "1-D"),
])
def test_bad_indptr_is_refused(indptr, words):
    partial_o, lse = torch.zeros(3, 64, dtype=torch.bfloat16), torch.zeros(3)
    with pytest.raises(ValueError, match=words):
        kvsplit.merge_lse(partial_o, lse, indptr=indptr)


@pytest.mark.parametrize("fmt, stats_shape, words", [
    ("lse", (2, 2), "partial_lse must be (nnz, heads), (3, 2) for partial_o (3, 2, 64), got (2, 2)"),
    ("lse", (3,), "partial_lse must be (nnz, heads), (3, 2) for partial_o (3, 2, 64), got (3,)"),
    ("maxsum", (3, 2, 3),
     "partial_stats must be (nnz, heads, 2), (3, 2, 2) for partial_o (3, 2, 64), got (3, 2, 3)"),
])
def test_indptr_stats_of_another_shape_are_named_as_given(fmt, stats_shape, words):
    """The stats of variable-length states against partial_o's rows, in the shapes the
    caller passed (not the (nnz, tokens, ...) views the call makes of them)."""
    partial_o = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    out = torch.full((2, 2, 64), 7.0, dtype=torch.bfloat16)
    call = kvsplit.merge_lse if fmt == "lse" else (
        lambda o, s, **kw: kvsplit.merge_maxsum(o, s, 1.0, **kw))
    with pytest.raises(ValueError, match="^with indptr, " + re.escape(words) + "$"):
        call(partial_o, torch.zeros(stats_shape), indptr=torch.tensor([0, 1, 3]), out=out)
    assert (out == 7).all()


@pytest.mark.parametrize("heads", [0, 3])
def test_pass_through_rows_of_no_heads_or_some(heads):
    """Pass-through counts tokens whatever the heads: no heads is an empty merge."""
    gen = torch.Generator().manual_seed(heads)
    partial_o = torch.randn(2, 4, heads, 64, generator=gen).bfloat16()
    lse = torch.randn(2, 4, heads, generator=gen)
    out = kvsplit.merge_lse(partial_o, lse, pass_through_from=2)
    assert out.shape == (4, heads, 64)
    ref = reference.merge_lse_reference(partial_o.reshape(2, 4 * heads, 64),
                                        lse.reshape(2, 4 * heads))[0].reshape(4, heads, 64)
    ref[2:] = partial_o[1, 2:].double()
    torch.testing.assert_close(out.double(), ref, rtol=2 ** -8, atol=1e-5)
    with pytest.raises(ValueError, match=r"pass_through_from must be 0\.\.4"):
        kvsplit.merge_lse(partial_o, lse, pass_through_from=5)


@pytest.mark.parametrize("head_dim, dtype", [(4, torch.bfloat16), (100, torch.bfloat16),
                                             (2, torch.float32), (1028, torch.bfloat16)])
def test_head_dim_not_whole_vectors_is_refused(head_dim, dtype):
    partial_o, lse = lse_args(head_dim, dtype)
    with pytest.raises(ValueError, match=rf"head_dim {head_dim} is not supported"):
        kvsplit.merge_lse(partial_o, lse)
