"""Host time of one eager merge call, beside the raw binding launch and one aten op.

Run:  python -P benchmarks/bench_host.py [--out DIR] [--device cpu|cuda]

Microseconds per call, no synchronisation, cache hit (the layout's launch and
the dispatcher's choice are made by the warm-up), ``out`` given:
  merge_*(kv_split=None)   the public call;
  merge_*(kv_split=K)      the same with a forced K;
  merge_*, Python path     the call without the binding's per-call path
                           (kvsplit.merge._merge: key, launch lookup, checks, launch);
  of which: binding's ...  csrc/fast_call.cpp's call_fast called directly;
  raw binding              the launcher of the binding with a prepared
                           parameter object and the addresses (the floor of
                           any Python caller of these kernels);
  empty kernel binding     (GPU) an empty kernel through the binding;
  aten out.add_(0)         one aten op on the same ``out``;
  of which: ...            pieces of the Python path's own work, timed alone;
  merge_lse, out allocated the public call without ``out`` (one torch.empty);
  <engine> <op>            each kvsplit.compat adapter on a two-state merge of
                           tokens=1, heads=8, D=64 (bf16; FA3 float32) with the
                           engine's layouts (TensorRT-LLM's MLA merge: one
                           request of every token, merged), and
                           "<engine> <op> plain": the
                           public kvsplit call on the same tensors (the same
                           views, outputs given where the adapter takes them,
                           allocated where it allocates), so that the
                           difference is what the adapter's layer costs.
  <engine> <op>, engine's  (GPU, with the engines' suites folder: --engine-suites,
  Triton op                default $KVSPLIT_ENGINE_SUITES or .suites, assembled by
                           ../shared/engine-suites; nothing of it is in this repository)
                           the engine's own Triton op on the adapter's tensors:
                           vLLM's merge_attn_states, SGLang's Triton merge_state,
                           FlashInfer's Triton merge_state and merge_states;
  <style> CUDA merge       (GPU, nvcc on the machine) benchmarks/peer_kernels.cu's
  (ctypes)                 vLLM-style and FlashInfer-style two-state kernels through
                           ctypes, as a C++ op without the Python checks would cost.
All variants are timed in turns, eight rounds (each a warm-up and five samples
of 1000 calls), the lowest round median kept: neighbours in the table run
within microseconds of each other, so that a drifting host touches them alike.
GPU shape: D=512 rows=64 N=16 bf16 maxsum; CPU shape (the CPU implementation):
D=64 rows=1 N=1 bf16 lse.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import torch

import kvsplit
from kvsplit import _kernel, _native, merge
from kvsplit.dispatch.dispatcher import dispatcher


ROOT = pathlib.Path(__file__).resolve().parents[1]


def variants(device: str, suites: pathlib.Path | None = None):
    g = torch.Generator().manual_seed(3)
    ext = _native.ext()
    if device == "cuda":
        num_splits, rows, head_dim = 16, 64, 512
        o = torch.randn(num_splits, rows, head_dim, generator=g).cuda().bfloat16()
        stats = torch.stack([torch.randn(num_splits, rows, generator=g),
                             1 + torch.rand(num_splits, rows, generator=g)], -1).cuda()
        out = torch.empty(rows, head_dim, dtype=torch.bfloat16, device="cuda")
        call = lambda **kw: kvsplit.merge_maxsum(o, stats, 0.1, out=out, **kw)  # noqa: E731
        name = "merge_maxsum"
    else:
        num_splits, rows, head_dim = 1, 1, 64
        o = torch.randn(num_splits, rows, head_dim, generator=g).bfloat16()
        stats = torch.randn(num_splits, rows, generator=g)
        out = torch.empty(rows, head_dim, dtype=torch.bfloat16)
        call = lambda **kw: kvsplit.merge_lse(o, stats, out=out, **kw)  # noqa: E731
        name = "merge_lse"
    call()
    call(kv_split=1)
    layout = next(p for p in dispatcher.launches.values() if p.kernel is not None)
    launch = layout.kernel.native
    addresses = (o.data_ptr(), stats.data_ptr(), 0, 0, out.data_ptr(), 0)
    scale = layout.log2_scale or 0.1
    fmt = merge.MAXSUM if device == "cuda" else merge.LSE
    scalar = 0.1 if device == "cuda" else 2.0
    table = {
        f"{name}(kv_split=None)": lambda: call(),
        f"{name}(kv_split=1)": lambda: call(kv_split=1),
        f"{name}, Python path": lambda: merge._merge(fmt, o, stats, scalar, None, None, out,
                                                      False, None),
        "  of which: binding's per-call path": lambda: merge._call_fast(
            merge._FORMS[fmt], o, stats, scalar, None, None, out, None, None),
    }
    if device == "cuda":
        raw_stream = torch._C._cuda_getCurrentRawStream
        table["raw binding"] = lambda: ext.merge_cuda(launch, *addresses, scale, raw_stream(0))
        noop = _native.bench().launch_noop
        table["empty kernel binding"] = lambda: noop(1, raw_stream(0))
    else:
        table["raw binding"] = lambda: ext.merge_cpu(launch, *addresses, scale)
    table["aten out.add_(0)"] = lambda: out.add_(0)
    table.update(adapter_calls(device, suites))
    # What the Python path adds to the raw binding, piece by piece:
    table["  Python path, of which: layout key + launch lookup"] = lambda: merge._layout_launch(
        fmt, o, stats, scalar, None, None, out, False, None)
    table["  of which: torch.compiler.is_compiling"] = torch.compiler.is_compiling
    table["  of which: 3 x data_ptr()"] = lambda: (o.data_ptr(), stats.data_ptr(), out.data_ptr())
    if device == "cuda":
        table["  of which: current stream lookup"] = lambda: raw_stream(0)
    return table, f"D={head_dim} rows={rows} N={num_splits}"


def adapter_calls(device: str, suites: pathlib.Path | None = None) -> dict:
    """{name: call} of each adapter at a two-state decode merge, outputs as its engine has them,
    and on a GPU the engines' own ops on the same tensors (:func:`engine_calls`)."""
    from kvsplit.compat import flash_attn, flashinfer, sglang, trtllm, vllm, xformers

    g = torch.Generator().manual_seed(5)
    tokens, heads, head_dim = 1, 8, 64

    def t(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    po, so = t(tokens, heads, head_dim), t(tokens, heads, head_dim)
    pl, sl = t(heads, tokens, dtype=torch.float32), t(heads, tokens, dtype=torch.float32)
    out = torch.empty_like(po)
    s_a, s_b = pl.t().contiguous(), sl.t().contiguous()
    v_m, s_m = torch.empty_like(po), torch.empty_like(s_a)
    stacked_o, stacked_s = torch.stack([po, so]), torch.stack([s_a, s_b])
    fi_v, fi_s = stacked_o.transpose(0, 1).contiguous(), stacked_s.transpose(0, 1).contiguous()
    fa_o = t(2, 1, tokens, heads, head_dim, dtype=torch.float32)
    fa_s = t(2, 1, tokens, heads, dtype=torch.float32)
    x_o = t(2, 1, tokens, heads, head_dim)
    x_s = t(2, 1, heads, tokens, dtype=torch.float32)
    plain_o = stacked_o.view(2, tokens * heads, head_dim)
    plain_s = stacked_s.view(2, tokens * heads)
    plain_out = torch.empty(tokens * heads, head_dim, dtype=torch.bfloat16, device=device)
    po_list, pl_list, s_ab = [po, so], [pl.t(), sl.t()], [s_a, s_b]
    fa_parts, fa_lse = fa_o[:, 0], fa_s[:, 0]
    fi_vt, fi_st = fi_v.transpose(0, 1), fi_s.transpose(0, 1)
    x_parts, x_lse = x_o[:, 0], x_s[:, 0].transpose(-1, -2)
    e = math.e
    # TensorRT-LLM: one request of every token, merged in place ((max, sum) stats).
    trt_attn, trt_temp = po.clone(), so.clone()
    trt_stats = torch.stack([s_a, 1 + s_b.abs()], -1).contiguous()
    trt_temp_stats = trt_stats.clone()
    trt_bounds = torch.tensor([0, tokens], device=device)
    trt_ops = torch.ones(1, dtype=torch.int64, device=device)
    calls = {
        "trtllm merge_chunked_attention_for_mla": lambda: trtllm.merge_chunked_attention_for_mla(
            trt_attn, trt_temp, trt_stats, trt_temp_stats, 1, trt_bounds, tokens, trt_ops, heads,
            head_dim),
        "merge_lse, 2 states, out given": lambda: kvsplit.merge_lse(plain_o, plain_s,
                                                                    out=plain_out),
        "merge_lse, 2 states, out allocated": lambda: kvsplit.merge_lse(plain_o, plain_s),
        "vllm merge_attn_states": lambda: vllm.merge_attn_states(out, po, pl, so, sl),
        "vllm merge_attn_states plain": lambda: kvsplit.merge_lse(po_list, pl_list, base=e,
                                                                  out=out),
        "sglang merge_state_v2, outs given": lambda: sglang.merge_state_v2(po, s_a, so, s_b,
                                                                           v_m, s_m),
        "sglang merge_state_v2, outs given plain": lambda: kvsplit.merge_lse(
            po_list, s_ab, base=e, out=v_m),
        "flashinfer merge_state_in_place": lambda: flashinfer.merge_state_in_place(
            v_m, s_m, so, s_b),
        "flashinfer merge_state (allocates)": lambda: flashinfer.merge_state(po, s_a, so, s_b),
        "flashinfer merge_state (allocates) plain": lambda: kvsplit.merge_lse(
            po_list, s_ab, base=2.0, return_lse=True),
        "flashinfer merge_states (allocates)": lambda: flashinfer.merge_states(fi_v, fi_s),
        "flashinfer merge_states (allocates) plain": lambda: kvsplit.merge_lse(
            fi_vt, fi_st, base=2.0, return_lse=True),
        "fa3 flash_attn_combine (allocates)": lambda: flash_attn.flash_attn_combine(fa_o, fa_s),
        "fa3 flash_attn_combine (allocates) plain": lambda: kvsplit.merge_lse(
            fa_parts, fa_lse, base=e, out_dtype=torch.float32, return_lse=True),
        "xformers merge_attentions (allocates)": lambda: xformers.merge_attentions(x_o, x_s),
        "xformers merge_attentions (allocates) plain": lambda: kvsplit.merge_lse(
            x_parts, x_lse, base=e, return_lse=True),
    }
    if device == "cuda":
        calls.update(engine_calls(suites, po, pl, so, sl, s_a, s_b, out, v_m, s_m, fi_v, fi_s))
    return calls


# The adapter each CUDA peer is compared with (the engines' Triton ops: the name before ", ").
ENGINE_ADAPTER = {"vLLM-style CUDA merge (ctypes)": "vllm merge_attn_states",
                  "FlashInfer-style CUDA merge (ctypes)": "sglang merge_state_v2, outs given"}


def engine_calls(suites: pathlib.Path | None, po, pl, so, sl, s_a, s_b, out, v_m, s_m, fi_v,
                 fi_s) -> dict:
    """{name: call} of the engines' own ops (and the CUDA peers) on the adapters' tensors
    (:func:`adapter_calls`'s: the states, head-major and token-major LSEs, outputs)."""
    calls = {}
    if suites is not None and suites.is_dir():
        sys.path[:0] = [str(suites / "vllm"), str(suites / "fi"), str(suites / "sglang")]
        try:
            from vllm.v1.attention.ops.triton_merge_attn_states import merge_attn_states
            calls["vllm merge_attn_states, vLLM's Triton op"] = lambda: merge_attn_states(
                out, po, pl, so, sl)
        except ImportError as error:
            print(f"  (no vLLM Triton op: {error})")
        try:
            from flashinfer.triton import cascade
            calls["flashinfer merge_state (allocates), FlashInfer's Triton op"] = (
                lambda: cascade.merge_state(po, s_a, so, s_b))
            calls["flashinfer merge_states (allocates), FlashInfer's Triton op"] = (
                lambda: cascade.merge_states(fi_v, fi_s))
        except ImportError as error:
            print(f"  (no FlashInfer Triton ops: {error})")
        try:
            sys.path.insert(0, str(suites / "sglang" / "tests"))
            from test_merge_state_v2 import merge_state_triton
            calls["sglang merge_state_v2, outs given, SGLang's Triton op"] = (
                lambda: merge_state_triton(po, s_a, so, s_b, v_m, s_m))
        except ImportError as error:
            print(f"  (no SGLang Triton op: {error})")
    try:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        import peers_cuda
        peers_cuda.library()
        calls["vLLM-style CUDA merge (ctypes)"] = lambda: peers_cuda.two_state_vllm(
            po, pl.t(), so, sl.t(), out)
        calls["FlashInfer-style CUDA merge (ctypes)"] = lambda: peers_cuda.two_state_flashinfer(
            po, s_a, so, s_b, v_m, s_m)
    except (ImportError, RuntimeError, OSError, subprocess.CalledProcessError) as error:
        print(f"  (no CUDA peers: {error})")
    for name, call in list(calls.items()):  # compile (Triton) and check each once
        try:
            call()
        except Exception as error:  # noqa: BLE001 - an engine's op that cannot run here is left out
            print(f"  ({name} left out: {type(error).__name__}: {error})")
            del calls[name]
    return calls


def measure(table: dict, device: str, rounds: int = 8, calls: int = 1000) -> dict[str, float]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    result: dict[str, float] = {}
    for _ in range(rounds):  # in turns: no variant pays the warm-up or a slow spell alone
        for name, fn in table.items():
            for _ in range(200):
                fn()
            sync()
            samples = []
            for _ in range(5):
                begin = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples.append((time.perf_counter() - begin) * 1e6 / calls)
                sync()
            result[name] = min(result.get(name, math.inf), sorted(samples)[2])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--engine-suites", type=pathlib.Path,
                        default=os.environ.get("KVSPLIT_ENGINE_SUITES") or ROOT / ".suites",
                        help="the engines' suites folder, whose Triton ops are timed beside "
                             "the adapters (GPU)")
    args = parser.parse_args()
    table, shape = variants(args.device, args.engine_suites)
    result = measure(table, args.device)
    merge_name = next(iter(result))
    print(f"host time per call ({args.device}, {shape}, no sync, cache hit, out given):")
    for name, us in result.items():
        print(f"  {name:34s} {us:6.2f} us")
    over_raw = result[merge_name] - result["raw binding"]
    over_add = result[merge_name] / result["aten out.add_(0)"]
    print(f"  {merge_name} - raw binding = {over_raw:.2f} us; "
          f"{merge_name} / add_ = {over_add:.2f}x")
    print("  adapters against the public call on the same tensors (same process, in turns):")
    for name, us in result.items():
        if f"{name} plain" in result:
            plain = result[f"{name} plain"]
            print(f"    {name:38s} {us:6.2f} us, plain {plain:6.2f} us: {us - plain:+5.2f} us")
    engine_ops = {name: us for name, us in result.items()
                  if name.endswith(("Triton op", "(ctypes)"))}
    if engine_ops:
        print("  the engines' own ops on the adapters' tensors (same process, in turns):")
        for name, us in engine_ops.items():
            adapter = ENGINE_ADAPTER.get(name, name.rsplit(", ", 1)[0])
            if adapter in result:
                print(f"    {name:60s} {us:6.2f} us; adapter {result[adapter]:6.2f} us: "
                      f"{result[adapter] - us:+6.2f} us")
            else:
                print(f"    {name:60s} {us:6.2f} us")
    print(f"  fast path served {_kernel.fast_info()['hits']} calls (enabled: {_kernel.FAST_CALL})")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"bench_host_{args.device}.json").write_text(json.dumps(
            {"device": args.device, "shape": shape, "host_us": result,
             "over_raw_us": over_raw, "over_add": over_add}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
