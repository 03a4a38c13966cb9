"""The CUDA peer merges of benchmarks/peer_kernels.cu, built and called from Python.

* :func:`two_state_vllm` -- vLLM's merge_attn_states design: one thread per 16 bytes
  of a (token, head) row, both LSEs (natural log, +inf empty) read per thread.
* :func:`two_state_flashinfer` -- FlashInfer's merge_state design: one CTA per token,
  one warp-wide vector per (token, head), both states loaded up front (base-2 LSE).
* :func:`states_flashinfer` -- FlashInfer's merge_states design for N states: the same
  geometry, the online update over the states in order (base-2 LSE).

States and outputs are bf16 or fp16 (token, head, head_dim) views with unit stride on
head_dim and 16-byte aligned rows; LSEs float32 (token, head) views of any strides; the
merged LSE (optional) is a contiguous float32 (tokens, heads). The library is built once
per source text with the machine's nvcc (``nvcc`` on PATH or ``$CUDACXX``) into
/tmp/kvsplit-peers and loaded with ctypes: a benchmark kernel, never the product's.
Nothing here imports kvsplit.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess

import torch

SOURCE = pathlib.Path(__file__).resolve().with_name("peer_kernels.cu")
FOLDER = pathlib.Path("/tmp/kvsplit-peers")


class RowLayout(ctypes.Structure):
    """peer_kernels.cu's RowLayout, field for field."""

    _fields_ = [("tokens", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int32),
                ("o_token", ctypes.c_int64), ("o_head", ctypes.c_int64),
                ("lse_token", ctypes.c_int64), ("lse_head", ctypes.c_int64),
                ("out_token", ctypes.c_int64), ("out_head", ctypes.c_int64)]


def _nvcc() -> str:
    found = os.environ.get("CUDACXX") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not pathlib.Path(found).exists():
        raise RuntimeError("no nvcc (CUDACXX, PATH or /usr/local/cuda/bin) to build the peers")
    return found


@functools.cache
def library() -> ctypes.CDLL:
    """The peers' shared library for this GPU, built on first use."""
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}{'a' if major == 9 else ''}"
    text = SOURCE.read_bytes()
    digest = hashlib.sha256(text + arch.encode()).hexdigest()[:16]
    FOLDER.mkdir(exist_ok=True)
    target = FOLDER / f"peers-{digest}.so"
    if not target.exists():
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([_nvcc(), "-O3", "-std=c++17", "-lineinfo",
                        f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xcompiler", "-fPIC",
                        "-shared", "-o", str(partial), str(SOURCE)], check=True)
        partial.replace(target)
    lib = ctypes.CDLL(str(target))
    pointer, stream = ctypes.c_void_p, ctypes.c_void_p
    lib.peer_two_state_vllm.argtypes = [pointer] * 6 + [RowLayout, ctypes.c_int, stream]
    lib.peer_two_state_flashinfer.argtypes = [pointer] * 6 + [RowLayout, ctypes.c_int, stream]
    lib.peer_states_flashinfer.argtypes = [pointer, pointer, ctypes.c_int, ctypes.c_int64,
                                           ctypes.c_int64, pointer, pointer, RowLayout,
                                           ctypes.c_int, stream]
    for fn in (lib.peer_two_state_vllm, lib.peer_two_state_flashinfer,
               lib.peer_states_flashinfer):
        fn.restype = ctypes.c_int
    return lib


def _layout(o: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> RowLayout:
    tokens, heads, head_dim = o.shape
    if o.dtype not in (torch.bfloat16, torch.float16) or out.dtype != o.dtype:
        raise ValueError("the peers take bf16 or fp16 states and an output of the same dtype")
    if o.stride(-1) != 1 or out.stride(-1) != 1 or head_dim % 8:
        raise ValueError("head_dim must be whole 16-byte vectors with unit stride")
    if lse.dtype != torch.float32 or tuple(lse.shape) != (tokens, heads):
        raise ValueError("lse must be float32 (tokens, heads)")
    return RowLayout(tokens, heads, head_dim, o.stride(0), o.stride(1), lse.stride(0),
                     lse.stride(1), out.stride(0), out.stride(1))


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _check(error: int, name: str) -> None:
    if error:
        raise RuntimeError(f"{name}: CUDA error {error}")


def _out_lse(out_lse, tokens, heads):
    if out_lse is not None and (out_lse.dtype != torch.float32 or not out_lse.is_contiguous()
                                or tuple(out_lse.shape) != (tokens, heads)):
        raise ValueError("out_lse must be a contiguous float32 (tokens, heads)")
    return _address(out_lse)


def two_state_vllm(o_a, lse_a, o_b, lse_b, out, out_lse=None) -> torch.Tensor:
    """vLLM's design; LSE in natural log, +inf an empty state. Returns ``out``."""
    at = _layout(o_a, lse_a, out)
    if o_b.stride() != o_a.stride() or lse_b.stride() != lse_a.stride():
        raise ValueError("both states share one layout")
    _check(library().peer_two_state_vllm(
        o_a.data_ptr(), lse_a.data_ptr(), o_b.data_ptr(), lse_b.data_ptr(), out.data_ptr(),
        _out_lse(out_lse, at.tokens, at.heads), at, int(o_a.dtype == torch.bfloat16),
        torch.cuda.current_stream().cuda_stream), "peer_two_state_vllm")
    return out


def two_state_flashinfer(v_a, s_a, v_b, s_b, out, out_lse=None) -> torch.Tensor:
    """FlashInfer's two-state design; base-2 LSE. Returns ``out``."""
    at = _layout(v_a, s_a, out)
    if v_b.stride() != v_a.stride() or s_b.stride() != s_a.stride():
        raise ValueError("both states share one layout")
    _check(library().peer_two_state_flashinfer(
        v_a.data_ptr(), s_a.data_ptr(), v_b.data_ptr(), s_b.data_ptr(), out.data_ptr(),
        _out_lse(out_lse, at.tokens, at.heads), at, int(v_a.dtype == torch.bfloat16),
        torch.cuda.current_stream().cuda_stream), "peer_two_state_flashinfer")
    return out


def states_flashinfer(v, s, out, out_lse=None) -> torch.Tensor:
    """FlashInfer's N-state design: ``v`` (N, tokens, heads, head_dim), ``s`` (N, tokens,
    heads) base-2 LSE, any strides but unit on head_dim. Returns ``out``."""
    at = _layout(v[0], s[0], out)
    _check(library().peer_states_flashinfer(
        v.data_ptr(), s.data_ptr(), v.shape[0], v.stride(0), s.stride(0), out.data_ptr(),
        _out_lse(out_lse, at.tokens, at.heads), at, int(v.dtype == torch.bfloat16),
        torch.cuda.current_stream().cuda_stream), "peer_states_flashinfer")
    return out
