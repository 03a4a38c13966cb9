"""What ``kvsplit info`` reports, as a plain dictionary."""

from __future__ import annotations

from . import __version__, _native


def collect() -> dict[str, str]:
    import torch

    ext = _native.ext()
    facts = {
        "version": __version__,
        "build hash": ext.build_hash,
        "cuda kernels": "yes" if _native.has_cuda_kernels() else "no (CPU implementation only)",
        "compiled architectures": ext.cuda_architectures or "-",
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        facts["device"] = (f"{props.name} (sm_{props.major}{props.minor}, "
                           f"{props.multi_processor_count} SMs)")
    else:
        facts["device"] = "cpu (no CUDA device visible)"
    return facts
