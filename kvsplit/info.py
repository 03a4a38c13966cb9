"""What ``kvsplit info`` reports, as a plain dictionary."""

from __future__ import annotations

import os

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
    from .db import resolve_url
    from .db.engine import display_url

    environ = os.environ
    facts["database"] = display_url(resolve_url(environ.get("KVSPLIT_DB")))
    facts["mode"] = environ.get("KVSPLIT_MODE") or "auto"
    facts["max kv_split"] = environ.get("KVSPLIT_MAX_SPLIT") or "-"
    facts["pdl"] = "on" if environ.get("KVSPLIT_PDL") == "1" else "off"
    return facts
