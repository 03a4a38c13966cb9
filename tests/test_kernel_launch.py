"""kvsplit/_kernel.py: a launch takes its device and stream from the tensors, not the current
device; PDL is asked for only where the device has it; a device the build cannot run on is
refused with the cause and the remedy.

No GPU is needed: the tensors are stand-ins that report a ``cuda:1`` device,
and the binding's CUDA launcher and the stream lookup are replaced by
recorders. The two-GPU run of the same path is tests/test_merge_validation.py
on a machine with two GPUs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvsplit import _kernel, _native, merge
from kvsplit.config import NO_CUDA_KERNELS, KernelConfig, has_cuda_kernels


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
    monkeypatch.setattr(_kernel, "pdl_supported", lambda index: index == 1)
    config = KernelConfig.dsplit(4, 16, 8)
    kernel_launch = _kernel.Launch(config, 0, partial_o, stats, out, None, 0.69, sm_count=132, pdl=True)
    kernel_launch.launch(11, 22, 0, 0, 33, 0, 0.5)
    assert streams_asked == [1]  # device 1's current stream, whatever device is current
    (native, *addresses, scale, stream), = launches
    assert (native.target.device, native.target.sm_count, native.target.pdl) == (1, 132, True)
    assert stream == 1001 and addresses == [11, 22, 0, 0, 33, 0] and scale == 0.5
    assert (native.config.family, native.config.slices, native.config.kv_split,
            native.config.depth) == (config.family_code, 4, 16, 8)
    assert (native.params.rows, native.params.num_splits, native.params.head_dim) == (64, 16, 512)
    assert (native.params.o_stride_split, native.params.o_row) == (64 * 512, (512, 0, 512))


@pytest.mark.parametrize("torch_has_cuda", [True, False])
def test_a_cuda_launch_carries_its_devices_l2_size(monkeypatch, torch_has_cuda):
    """The Few kernel orders head-major rows by the L2 of the tensors' device (params.h's
    CudaTarget.l2_bytes); where torch cannot tell (a CPU build), 0: unknown."""
    sizes = {0: 40 << 20, 1: 50 << 20}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: torch_has_cuda)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(L2_cache_size=sizes[index]))
    monkeypatch.setattr(_kernel, "pdl_supported", lambda index: False)
    _kernel._l2_bytes.cache_clear()
    try:
        device = torch.device("cuda", 1)
        kernel_launch = _kernel.Launch(KernelConfig.few(1), 0, fake_tensor((2, 64, 128), torch.bfloat16, device),
                                       fake_tensor((2, 64), torch.float32, device),
                                       fake_tensor((64, 128), torch.bfloat16, device), None, 1.0, sm_count=132)
        assert kernel_launch.native.target.l2_bytes == (50 << 20 if torch_has_cuda else 0)
    finally:
        _kernel._l2_bytes.cache_clear()


def test_a_cpu_launch_never_asks_for_a_stream(monkeypatch):
    partial_o = torch.randn(2, 4, 64).bfloat16()
    stats = torch.randn(2, 4)
    out = torch.empty(4, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(_kernel, "current_stream", lambda index: (_ for _ in ()).throw(
        AssertionError("a CPU launch asked for a CUDA stream")))
    kernel_launch = _kernel.Launch(KernelConfig.kvsplit(2), 1, partial_o, stats, out, None, 1.0)
    assert not kernel_launch.is_cuda and kernel_launch.device_index == -1
    _kernel.run(kernel_launch, partial_o, stats, out, 1.0)
    assert torch.isfinite(out.float()).all()


def test_the_eager_call_launches_on_the_layouts_device_and_its_current_stream(monkeypatch):
    """kvsplit/merge.py's per-call launch, with a kept launch of a ``cuda:1`` layout."""
    device = torch.device("cuda", 1)
    partial_o = fake_tensor((16, 64, 512), torch.bfloat16, device)
    stats = fake_tensor((16, 64, 2), torch.float32, device)
    out = fake_tensor((64, 512), torch.bfloat16, device)
    for tensor, address in ((partial_o, 1 << 20), (stats, 2 << 20), (out, 3 << 20)):
        tensor.data_ptr = lambda address=address: address
    streams_asked, launches = [], []
    monkeypatch.setattr(merge, "_current_stream",
                        lambda index: streams_asked.append(index) or 1000 + index)
    kernel_launch = _kernel.Launch(KernelConfig.kvsplit(4), 0, partial_o, stats, out, None, 0.69,
                        sm_count=132)
    assert kernel_launch.native.target.device == 1
    layout = SimpleNamespace(call=lambda *args: launches.append(args),
                             device_index=kernel_launch.device_index, log2_scale=None)
    merge._launch(layout, merge.MAXSUM, partial_o, stats, 0.25, None, None, out, None, False)
    assert streams_asked == [1]
    (o, s, others, scale, stream), = launches
    assert list(o) == [1 << 20] and list(s) == [2 << 20]
    assert list(others) == [0, 0, 3 << 20, 0] and scale == 0.25 and stream == 1001


@pytest.mark.parametrize("major, minor, pdl", [(8, 0, False), (8, 6, False), (8, 9, False),
                                                (9, 0, True), (10, 0, True), (12, 0, True)])
def test_pdl_is_asked_for_only_from_compute_capability_9(monkeypatch, major, minor, pdl):
    """KVSPLIT_PDL=1 on an A100 or an L4 launches without PDL (the kernels' griddepcontrol is
    compiled for sm_90 and later only)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (major, minor))
    _kernel.pdl_supported.cache_clear()
    try:
        device = torch.device("cuda", 0)
        kernel_launch = _kernel.Launch(KernelConfig.kvsplit(4), 0, fake_tensor((16, 64, 512), torch.bfloat16, device),
                            fake_tensor((16, 64, 2), torch.float32, device),
                            fake_tensor((64, 512), torch.bfloat16, device), None, 0.69,
                            sm_count=132, pdl=True)
        assert kernel_launch.native.target.pdl is pdl
    finally:
        _kernel.pdl_supported.cache_clear()


def test_a_device_the_build_cannot_run_on_is_refused_with_cause_and_remedy(monkeypatch):
    """On this machine no CUDA driver loads: the CUDA runtime reports what an outdated
    driver does, and a build without CUDA kernels says so; each names the remedy."""
    monkeypatch.setattr(_kernel, "_RUNNABLE", set())
    with pytest.raises(RuntimeError) as raised:
        _kernel.check_device(0)
    message = str(raised.value)
    if has_cuda_kernels():
        ext = _native.ext()
        assert "cudaErrorInsufficientDriver" in message or "cudaErrorNoDevice" in message
        if "cudaErrorInsufficientDriver" in message:
            assert f"needs driver {ext.cuda_min_driver} or newer" in message
            assert "Update the NVIDIA driver" in message
    else:
        assert message == NO_CUDA_KERNELS
        assert "no CUDA kernels" in message and "binary wheel" in message and "nvcc" in message
    assert _kernel._RUNNABLE == set()  # a refusal is not remembered as a pass


@pytest.mark.skipif(not has_cuda_kernels(), reason="a build without CUDA kernels has no CUDA errors")
@pytest.mark.parametrize("code, shown", [
    (35, ("cudaErrorInsufficientDriver", "driver 580 or newer", "Update the NVIDIA driver",
          "build kvsplit from source")),
    (209, ("cudaErrorNoKernelImageForDevice", "it was built for", "CUDAARCHS")),
    (222, ("cudaErrorUnsupportedPtxVersion", "Update the driver")),
    (803, ("cudaErrorSystemDriverMismatch", "Reboot")),
])
def test_cuda_errors_of_an_install_that_does_not_fit_name_cause_and_remedy(code, shown):
    message = _native.ext().cuda_error_message(code)
    for words in shown:
        assert words in message, message
    if code == 209:
        assert _native.ext().cuda_architectures in message


def fake_cuda_tensors(*shapes, dtype=torch.float32):
    """CUDA tensors without a GPU: torch.compile's fake tensors (shape, strides, dtype and
    device, no memory)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return [torch.empty(shape, dtype=dtype, device="cuda") for shape in shapes]


def test_a_cuda_merge_that_cannot_run_raises_cause_and_remedy(monkeypatch):
    """kvsplit.merge_maxsum of CUDA tensors, without a GPU: a build without CUDA kernels says
    so (install the wheel, or nvcc and rebuild); a build with them meets no driver here, which
    the CUDA runtime reports as an outdated one (update the driver). Before any dispatch."""
    import kvsplit

    monkeypatch.setattr(_kernel, "_RUNNABLE", set())
    (partial_o,) = fake_cuda_tensors((4, 8, 64), dtype=torch.bfloat16)
    (stats,) = fake_cuda_tensors((4, 8, 2))
    expected = (r"no CUDA kernels \(.*\): install kvsplit's binary wheel, or install the CUDA "
                r"toolkit \(nvcc\) and rebuild" if not has_cuda_kernels()
                else r"cudaError(InsufficientDriver|NoDevice)")
    with pytest.raises(RuntimeError, match=expected):
        kvsplit.merge_maxsum(partial_o, stats, 0.1)
