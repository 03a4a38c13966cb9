"""What ``kvsplit info`` reports, as a plain dictionary."""

from __future__ import annotations

import os

from . import __version__, _native
from .config import build_hash, has_cuda_kernels


def collect() -> dict[str, str]:
    import torch

    ext = _native.ext()
    on_gpu = torch.cuda.is_available() and has_cuda_kernels()
    facts = {
        "version": __version__,
        # The hash that keys this machine's tunings (the GPU's when one is used).
        "build hash": build_hash(on_gpu),
        "cpu build hash": ext.cpu_build_hash,
        "cuda build hash": ext.cuda_build_hash or "-",
        "cuda kernels": "yes" if has_cuda_kernels() else "no (CPU implementation only)",
        "compiled architectures": ext.cuda_architectures or "-",
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        facts["device"] = (f"{props.name} (sm_{props.major}{props.minor}, "
                           f"{props.multi_processor_count} SMs)")
    else:
        facts["device"] = "cpu (no CUDA device visible)"
    from .db import resolve_url
    from .db.engine import display_url

    environ = os.environ
    facts["database"] = display_url(resolve_url(environ.get("KVSPLIT_DB")))
    facts["mode"] = environ.get("KVSPLIT_MODE") or "auto"
    facts["max kv_split"] = environ.get("KVSPLIT_MAX_SPLIT") or "-"
    facts["pdl"] = "on" if environ.get("KVSPLIT_PDL") == "1" else "off"
    return facts
