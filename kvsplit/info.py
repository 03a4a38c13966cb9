"""What ``kvsplit info`` reports, as a plain dictionary, and whether all is well."""

from __future__ import annotations

import os

from . import __version__, _native
from .config import NO_CUDA_KERNELS, build_hash, has_cuda_kernels
from .terminal import counted


def _database(url: str | None) -> tuple[str, str, bool]:
    """The database as given, one line on its state and whether it has a problem; never creates it."""
    from .db import NoDatabase, StoreError, open_store
    from .config import KernelConfig
    from .db.engine import parse_target, shown_as_given

    try:
        target = parse_target(url)
    except StoreError as error:
        return shown_as_given(url or os.environ.get("KVSPLIT_DB", "")), f"problem: {error}", True
    if target.memory:
        return target.shown, "in memory (every process starts it empty; nothing is kept)", False
    try:
        with open_store(url, create=False, config_type=KernelConfig) as store:
            store.check()
            results = len(store.query())
    except NoDatabase:
        return target.shown, "not created yet (kvsplit creates it at the first tuning)", False
    except StoreError as error:
        return target.shown, f"problem: {error}", True
    return target.shown, f"ok, {counted(results, 'tuning result')}", False


def _version(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def _cuda_runtime(ext) -> dict[str, str]:
    """The CUDA runtime linked into the kernels and the driver it needs."""
    runtime, driver = ext.cuda_runtime_version, ext.cuda_driver_version()
    facts = {"cuda runtime": f"{_version(runtime)} (linked statically; needs NVIDIA driver "
                             f"{ext.cuda_min_driver} or newer)"}
    if driver == 0:
        facts["cuda driver"] = "none found"
    elif driver // 1000 < runtime // 1000:
        facts["cuda driver"] = (f"CUDA {_version(driver)}: too old for this build's runtime; "
                                f"update the NVIDIA driver to {ext.cuda_min_driver} or newer")
    else:
        facts["cuda driver"] = f"CUDA {_version(driver)}"
    return facts


def collect(db_url: str | None = None) -> tuple[dict[str, str], int]:
    """The facts, and the exit code: 2 for an invalid ``KVSPLIT_*`` setting, 3 for a database problem."""
    import torch

    from . import _kernel
    from .dispatch import InvalidSetting
    from .dispatch.device import device_facts
    from .dispatch.dispatcher import read_settings, shipped_summary
    from .dispatch.refresh import refresh_interval

    ext = _native.ext()
    on_gpu = torch.cuda.is_available() and has_cuda_kernels()
    facts = {
        "version": __version__,
        # The hash that keys this machine's tunings (the GPU's when one is used).
        "build hash": build_hash(on_gpu),
        "cpu build hash": ext.cpu_build_hash,
        "cuda build hash": ext.cuda_build_hash or "-",
        "cuda kernels": "yes" if has_cuda_kernels() else f"no — {NO_CUDA_KERNELS}",
        "compiled architectures": ext.cuda_architectures or "-",
        "torch": torch.__version__,
        # Calls of a known layout with `out` given launch from the binding (csrc/fast_call.cpp).
        "per-call path": ("binding (torch's DLPack exchange table)" if _kernel.FAST_CALL
                          else "Python (this torch has no DLPack exchange table)"),
    }
    if has_cuda_kernels():
        facts.update(_cuda_runtime(ext))
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        facts["device"] = (f"{props.name} (sm_{props.major}{props.minor}, "
                           f"{props.multi_processor_count} SMs)")
        if has_cuda_kernels():
            try:
                _kernel.check_device(index)
                facts["kernels on this device"] = "yes"
            except RuntimeError as error:
                facts["kernels on this device"] = f"no — {error}"
            facts["shipped table"] = shipped_summary(device_facts(torch.device("cuda", index)))
    else:
        facts["device"] = "cpu (no CUDA device visible)"
    environ = os.environ
    facts["database"], facts["database status"], db_problem = _database(db_url)
    exit_code = 3 if db_problem else 0
    mode, max_split = environ.get("KVSPLIT_MODE"), environ.get("KVSPLIT_MAX_SPLIT")
    facts["mode"] = mode or "auto"
    facts["max kv_split"] = max_split or "-"
    for name, settings in (("mode", (mode, None)), ("max kv_split", (None, max_split))):
        try:
            read_settings(*settings)
        except InvalidSetting as error:
            facts[name] = f"invalid: {error}"
            exit_code = 2
    facts["pdl"] = "on" if environ.get("KVSPLIT_PDL") == "1" else "off"
    if environ.get("KVSPLIT_PDL", "") not in ("", "0", "1"):
        facts["pdl"] = f"invalid: KVSPLIT_PDL must be 0 or 1; got {environ['KVSPLIT_PDL']!r}"
        exit_code = 2
    if facts["pdl"] == "on" and on_gpu and not _kernel.pdl_supported(torch.cuda.current_device()):
        facts["pdl"] = "requested, but off on this GPU (compute capability 9.0 and later only)"
    try:
        interval = refresh_interval()
        facts["refresh"] = f"every {interval:g} s and on a miss" if interval else "off"
    except InvalidSetting as error:
        facts["refresh"] = f"invalid: {error}"
        exit_code = 2
    return facts, exit_code
