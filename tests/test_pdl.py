"""Programmatic dependent launch (KVSPLIT_PDL=1): same results, chained after a producer."""

from __future__ import annotations

import pytest
import torch

import kvsplit
from kvsplit.reference import merge_maxsum_reference, random_partials

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("dispatch_sandbox")]


@pytest.mark.parametrize("kv_split, mode", [(1, None), (4, None), (8, None),
                                           (None, "dsplit:4:16"), (None, "dsplit:2:32"),
                                           (None, "few:1"), (None, "few:4")])
def test_pdl_chained_after_a_producer(cuda_device, monkeypatch, kv_split, mode):
    """The producer writes the partials right before the merge: PDL must wait for it."""
    monkeypatch.setenv("KVSPLIT_PDL", "1")
    if mode:
        monkeypatch.setenv("KVSPLIT_MODE", mode)
    g = torch.Generator().manual_seed(kv_split or 99)
    source_o, stats = random_partials(40, 48, 512, generator=g)
    source = source_o.to("cuda", torch.bfloat16)
    stats = stats.cuda()
    partial_o = torch.zeros_like(source)
    out = torch.full((48, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # keep the producer late
        partial_o.copy_(source)
        kvsplit.merge_maxsum(partial_o, stats, 0.3, out=out, kv_split=kv_split)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    ref, _ = merge_maxsum_reference(source.cpu(), stats.cpu(), 0.3)
    error = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert error < 4e-3


@pytest.mark.parametrize("mode", ["4", "dsplit:2:8", "few:2"])
def test_pdl_inside_a_cuda_graph(cuda_device, monkeypatch, mode):
    monkeypatch.setenv("KVSPLIT_PDL", "1")
    monkeypatch.setenv("KVSPLIT_MODE", mode)
    g = torch.Generator().manual_seed(3)
    o, stats = random_partials(16, 64, 128, generator=g)
    o, stats = o.to("cuda", torch.bfloat16), stats.cuda()
    static_o = torch.empty_like(o)
    out = torch.empty(64, 128, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        static_o.copy_(o)
        kvsplit.merge_maxsum(static_o, stats, 0.5, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_o.copy_(o * 1)
        kvsplit.merge_maxsum(static_o, stats, 0.5, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = merge_maxsum_reference(o.cpu(), stats.cpu(), 0.5)
    assert ((out.double().cpu() - ref).norm() / ref.norm()).item() < 4e-3


@pytest.mark.parametrize("num_splits, rows, head_dim", [
    (2, 35, 128), (2, 35, 80), (4, 35, 128), (3, 35, 64), (2, 8192, 128), (8, 512, 128)])
def test_pdl_chained_after_a_producer_on_the_lean_instances(cuda_device, monkeypatch,
                                                            num_splits, rows, head_dim):
    """Few's lean kernel and its packed pair, divided pair and four-state instances (whose
    threads past the rows leave before the merge): with PDL each waits for the producer of
    its partials, as the general kernel does."""
    from cuda_profile import profiled_kernels

    monkeypatch.setenv("KVSPLIT_PDL", "1")
    monkeypatch.setenv("KVSPLIT_MODE", "few:1")
    g = torch.Generator().manual_seed(num_splits * rows + head_dim)
    source_o, stats = random_partials(num_splits, rows, head_dim, generator=g)
    source = source_o.to("cuda", torch.bfloat16)
    stats = stats.cuda()
    ref, _ = merge_maxsum_reference(source.cpu(), stats.cpu(), 0.3)
    partial_o = torch.zeros_like(source)
    out = torch.full((rows, head_dim), float("nan"), dtype=torch.bfloat16, device="cuda")
    kvsplit.merge_maxsum(partial_o, stats, 0.3, out=out)  # the layout's first call

    def chained():
        partial_o.zero_()
        out.fill_(float("nan"))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)  # keep the producer late
            partial_o.copy_(source)
            kvsplit.merge_maxsum(partial_o, stats, 0.3, out=out)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    names, _ = profiled_kernels(chained)
    merges = [name for name in names if "few_" in name]
    assert len(merges) == 1 and "few_kernel" not in merges[0], names
    error = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert error < 4e-3
