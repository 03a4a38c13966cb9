"""kvsplit/_kernel.py: a launch takes its device and stream from the tensors, not the current device.

No GPU is needed: the tensors are stand-ins that report a ``cuda:1`` device,
and the binding's CUDA launcher and the stream lookup are replaced by
recorders. The two-GPU run of the same path is tests/test_merge_validation.py
on a machine with two GPUs.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvsplit import _kernel, merge
from kvsplit.config import KernelConfig


def fake_tensor(shape, dtype, device):
    strides, step = [], 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= size
    return SimpleNamespace(shape=torch.Size(shape), dtype=dtype, device=device,
                           stride=lambda *dim: tuple(strides) if not dim else strides[dim[0]],
                           numel=lambda: step)


def test_a_cuda_launch_goes_to_the_tensors_device_and_its_current_stream(monkeypatch):
    device = torch.device("cuda", 1)
    partial_o = fake_tensor((16, 64, 512), torch.bfloat16, device)
    stats = fake_tensor((16, 64, 2), torch.float32, device)
    out = fake_tensor((64, 512), torch.bfloat16, device)
    streams_asked, launches = [], []
    monkeypatch.setattr(_kernel, "current_stream",
                        lambda index: streams_asked.append(index) or 1000 + index)
    monkeypatch.setattr(_kernel, "merge_cuda", lambda *args: launches.append(args))
    config = KernelConfig.dsplit(4, 16, 8)
    plan = _kernel.Plan(config, 0, partial_o, stats, out, None, 0.69, sm_count=132, pdl=True)
    plan.launch(11, 22, 0, 0, 33, 0, 0.5)
    assert streams_asked == [1]  # device 1's current stream, whatever device is current
    (native, *addresses, scale, stream), = launches
    assert (native.target.device, native.target.sm_count, native.target.pdl) == (1, 132, True)
    assert stream == 1001 and addresses == [11, 22, 0, 0, 33, 0] and scale == 0.5
    assert (native.config.family, native.config.slices, native.config.kv_split,
            native.config.depth) == (config.family_code, 4, 16, 8)
    assert (native.params.rows, native.params.num_splits, native.params.head_dim) == (64, 16, 512)
    assert (native.params.o_stride_split, native.params.o_row) == (64 * 512, (512, 0, 512))


def test_a_cpu_plan_never_asks_for_a_stream(monkeypatch):
    partial_o = torch.randn(2, 4, 64).bfloat16()
    stats = torch.randn(2, 4)
    out = torch.empty(4, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(_kernel, "current_stream", lambda index: (_ for _ in ()).throw(
        AssertionError("a CPU launch asked for a CUDA stream")))
    plan = _kernel.Plan(KernelConfig.kvsplit(2), 1, partial_o, stats, out, None, 1.0)
    assert not plan.is_cuda and plan.device_index == -1
    _kernel.run(plan, partial_o, stats, out, 1.0)
    assert torch.isfinite(out.float()).all()


def test_the_eager_call_launches_on_the_plans_device_and_its_current_stream(monkeypatch):
    """kvsplit/merge.py's per-call launch, with a cached plan of a ``cuda:1`` layout."""
    device = torch.device("cuda", 1)
    partial_o = fake_tensor((16, 64, 512), torch.bfloat16, device)
    stats = fake_tensor((16, 64, 2), torch.float32, device)
    out = fake_tensor((64, 512), torch.bfloat16, device)
    for tensor, address in ((partial_o, 1 << 20), (stats, 2 << 20), (out, 3 << 20)):
        tensor.data_ptr = lambda address=address: address
    streams_asked, launches = [], []
    monkeypatch.setattr(merge, "_current_stream",
                        lambda index: streams_asked.append(index) or 1000 + index)
    plan = _kernel.Plan(KernelConfig.kvsplit(4), 0, partial_o, stats, out, None, 0.69,
                        sm_count=132)
    assert plan.native.target.device == 1
    layout = SimpleNamespace(call=lambda *args: launches.append(args),
                             device_index=plan.device_index, log2_scale=None)
    merge._launch(layout, merge.MAXSUM, partial_o, stats, 0.25, None, None, out, None, False)
    assert streams_asked == [1]
    (o, s, others, scale, stream), = launches
    assert list(o) == [1 << 20] and list(s) == [2 << 20]
    assert list(others) == [0, 0, 3 << 20, 0] and scale == 0.25 and stream == 1001
