"""The benchmarks' reference kernels (csrc/cuda/probe.cu) do what their tables claim.

The read probe must really read the partials (its stores depend on them), and
the producer must write every partial and stat with values an attention
kernel could give, so that a chained merge has real work. They live in
kvsplit._bench, which wheels leave out: these tests skip without it.
"""

from __future__ import annotations

import pytest
import torch

from kvsplit import _kernel, _native

pytestmark = pytest.mark.gpu


@pytest.fixture
def bench(cuda_device):
    try:
        return _native.bench()
    except ImportError as error:
        pytest.skip(str(error))


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


@pytest.mark.parametrize("num_splits, out_dtype", [(24, torch.bfloat16), (2, torch.bfloat16),
                                                  (2, torch.float32)])
def test_read_probe_writes_what_it_read(bench, num_splits, out_dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    o = torch.randn(num_splits, 32, 128, generator=g, device="cuda").to(torch.bfloat16)
    stats = torch.randn(num_splits, 32, 2, generator=g, device="cuda")
    out = torch.full((32, 128), float("nan"), dtype=out_dtype, device="cuda")
    out_bytes = out.numel() * out.element_size()
    bench.launch_read_probe(o.data_ptr(), o.numel() * 2, stats.data_ptr(), stats.numel() * 4,
                            out.data_ptr(), out_bytes, stream())
    torch.cuda.synchronize()
    # Thread c stores the first chunk it loaded, chunk c of the partials, and only that: there
    # are at least as many threads as output chunks, even where the output is over a quarter
    # of the inputs (two states) or as large as the partials (a float32 output).
    assert torch.equal(out.flatten().view(torch.uint8), o.flatten().view(torch.uint8)[:out_bytes])


@pytest.mark.parametrize("pdl", [False, True])
def test_producer_fills_partials_and_stats(bench, pdl):
    pdl = pdl and _kernel.pdl_supported(torch.cuda.current_device())
    o = torch.full((16, 64, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    stats = torch.full((16, 64, 2), float("nan"), device="cuda")
    bench.launch_producer(o.data_ptr(), o.numel(), stats.data_ptr(), 16 * 64, 7, pdl, stream())
    torch.cuda.synchronize()
    assert not o.isnan().any() and not stats.isnan().any()
    assert o.abs().max() <= 1 and o.float().std() > 0.5
    assert stats[..., 0].abs().max() <= 2 and stats[..., 1].min() >= 1
    assert stats[..., 1].max() <= 65
    again = torch.empty_like(o)
    bench.launch_producer(again.data_ptr(), o.numel(), stats.data_ptr(), 16 * 64, 8, pdl,
                          stream())
    torch.cuda.synchronize()
    assert not torch.equal(again, o)  # the seed changes the values
