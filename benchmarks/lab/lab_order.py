"""What a head-major LSE costs a two-state merge: vLLM's calls (partials [tokens, heads, D],
LSE [heads, tokens]) through ``kvsplit.compat.vllm`` beside the same merge with token-major
LSE through ``kvsplit.merge_lse`` (the same bytes, the stats of adjacent rows side by side),
each with and without the merged LSE; vLLM's design (``benchmarks/peers_cuda.py``) on the
head-major LSE, and the read probe over the bytes of the call that exports nothing.

    python -P benchmarks/lab/lab_order.py [--out DIR]

us per launch, bf16, graph replay in turns, L2-warm; every output checked against float64
first. Needs torch and an installed kvsplit with CUDA kernels.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import labkit  # noqa: E402
import peers_cuda  # noqa: E402

import kvsplit  # noqa: E402
from kvsplit.compat import vllm  # noqa: E402

timing = labkit.load("lab_timing", "autotune/timing.py")

# (tokens, heads, head_dim): the two-state decode and prefill shapes engines run.
SHAPES = [(1, 32, 128), (16, 32, 128), (128, 32, 128), (1024, 32, 128), (4096, 32, 128),
          (1, 16, 512), (64, 16, 512), (1024, 16, 512), (256, 8, 256), (256, 32, 64)]
NAMES = ["read", "vllm", "token-major", "vllm +lse", "token-major +lse", "vllm peer"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp"))
    args = parser.parse_args()
    lib = ctypes.CDLL(str(labkit.build("probe", "", [])))
    timing.spin_up_gpu()
    g = torch.Generator(device="cuda").manual_seed(0)
    lines = ["| tokens x heads x D | MB | " + " | ".join(NAMES)
             + " | vllm / token-major | vllm +lse / token-major +lse |", "|---" * (len(NAMES) + 4) + "|"]
    for tokens, heads, head_dim in SHAPES:
        dev = {"device": "cuda"}
        a, b = (torch.randn(tokens, heads, head_dim, generator=g, **dev).bfloat16() for _ in range(2))
        sa, sb = (torch.randn(tokens, heads, generator=g, **dev) for _ in range(2))
        hm_a, hm_b = sa.t().contiguous(), sb.t().contiguous()  # vLLM's [heads, tokens]
        weights = torch.softmax(torch.stack([sa, sb]).double(), 0)
        reference = weights[0, ..., None] * a.double() + weights[1, ..., None] * b.double()
        out = torch.empty(tokens, heads, head_dim, dtype=torch.bfloat16, **dev)
        lse_hm = torch.empty(heads, tokens, **dev)
        runs = {
            "vllm": lambda i: vllm.merge_attn_states(out, a, hm_a, b, hm_b),
            "token-major": lambda i: kvsplit.merge_lse([a, b], [sa, sb], base=math.e, out=out),
            "vllm +lse": lambda i: vllm.merge_attn_states(out, a, hm_a, b, hm_b, lse_hm),
            "token-major +lse": lambda i: kvsplit.merge_lse([a, b], [sa, sb], base=math.e, out=out,
                                                            return_lse=True),
            "vllm peer": lambda i: peers_cuda.two_state_vllm(a, hm_a.t(), b, hm_b.t(), out),
        }
        for name, run in runs.items():
            out.fill_(float("nan"))
            run(0)
            torch.cuda.synchronize()
            error = (out.double() - reference).abs().max().item()
            assert error < 2e-2, (name, tokens, heads, head_dim, error)
        o = torch.stack([a, b])
        stats = torch.stack([sa, sb])
        runs["read"] = lambda i: labkit.read_probe(lib, o, stats, out)
        megabytes = (o.numel() * 2 + stats.numel() * 4 + out.numel() * 2) / 1e6
        times = labkit.median_us(timing, runs, megabytes / 3 + 2.0)
        cells = [f"{times[n]:.2f}" for n in NAMES]
        lines.append(f"| {tokens} x {heads} x {head_dim} | {megabytes:.1f} | " + " | ".join(cells)
                     + f" | {times['vllm'] / times['token-major']:.3f}"
                     f" | {times['vllm +lse'] / times['token-major +lse']:.3f} |")
        print(lines[-1], flush=True)
    text = "us per launch, two bf16 states, graph replay in turns, L2-warm\n" + "\n".join(lines)
    labkit.report(args.out, "lab_order.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
