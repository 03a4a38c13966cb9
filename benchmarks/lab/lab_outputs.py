"""What an output dtype costs the product: the same merge (bf16 partials, base-e LSE,
split-major rows) writing bf16, fp16, float32 and FP8 e4m3fn (with a per-tensor scale and
without), each with the auto choice and with one fixed Few config, beside the read probe.
fp16 writes the bytes bf16 does, so fp16 - bf16 is what the output's code costs apart
from bytes (each output dtype has its own instance of the lean Few kernel).

    python -P benchmarks/lab/lab_outputs.py [--out DIR]

us per launch, graph replay in turns, L2-warm; every output checked against float64 first.
Needs an installed kvsplit with CUDA kernels.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import tempfile

SHAPES = [(8, 2, 128), (512, 2, 128), (4096, 2, 128), (4096, 2, 512), (32768, 2, 128),
          (512, 16, 64), (512, 16, 128), (512, 16, 512), (4096, 8, 128)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp"))
    args = parser.parse_args()
    os.environ["KVSPLIT_DB"] = f"sqlite:///{tempfile.mkdtemp()}/outputs.sqlite"
    os.environ["KVSPLIT_MODE"] = "auto"
    import torch

    import kvsplit
    from kvsplit import _kernel, _native, merge as merge_module
    from kvsplit.autotune.timing import spin_up_gpu, time_cuda_graphs
    from kvsplit.dispatch.constraints import valid_configs

    probe = _native.bench().launch_read_probe
    spin_up_gpu()
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    fp8 = torch.float8_e4m3fn
    scale = torch.tensor([0.5], device="cuda")
    outs = {"bf16": (torch.bfloat16, None), "fp16": (torch.float16, None),
            "fp32": (torch.float32, None), "fp8s": (fp8, scale), "fp8": (fp8, None)}
    g = torch.Generator(device="cuda").manual_seed(0)
    names = ["read"] + [f"{n}" for n in outs] + [f"{n} v1" for n in outs]
    lines = ["| rows x N x D | auto config (bf16) | " + " | ".join(names)
             + " | fp16 - bf16 | fp32 - bf16 | fp8s - bf16 |", "|---" * (len(names) + 5) + "|"]
    for rows, num_splits, head_dim in SHAPES:
        o = torch.randn(num_splits, rows, head_dim, device="cuda", generator=g).bfloat16()
        lse = torch.randn(num_splits, rows, device="cuda", generator=g)
        weights = torch.softmax(lse.double(), 0)
        reference = (weights.unsqueeze(-1) * o.double()).sum(0)
        few1 = next(c for c in valid_configs(head_dim=head_dim, elem_bytes=2, rows=rows,
                                             num_splits=num_splits, sm_count=sm_count)
                    if c.family == "few" and c.params.get("vectors") == 1)
        runs, config_label = {}, ""
        for name, (dtype, out_scale) in outs.items():
            out = torch.empty(rows, head_dim, dtype=dtype, device="cuda")
            extra = {"out_scale": out_scale} if out_scale is not None else {}

            def merge(i, out=out, extra=extra):
                kvsplit.merge_lse(o, lse, base=math.e, out=out, **extra)

            merge(0)
            torch.cuda.synchronize()
            got = out.double() * (out_scale.item() if out_scale is not None else 1.0)
            tolerance = 0.1 if dtype == fp8 else 2e-2
            assert (got - reference).abs().max().item() < tolerance * max(1.0, reference.abs().max().item()), name
            if name == "bf16":
                config_label = merge_module._layout_launch(
                    merge_module.LSE, o, lse, math.e, None, None, out, False, None).kernel.config.label
            runs[name] = merge
            if out_scale is None:
                plan = _kernel.Launch(few1, 1, o, lse, out, None, 1.0)
                runs[f"{name} v1"] = (lambda i, plan=plan, out=out:
                                      _kernel.run(plan, o, lse, out, 1.0 / math.log(2)))
        out = torch.empty(rows, head_dim, dtype=torch.bfloat16, device="cuda")
        runs["read"] = lambda i: probe(o.data_ptr(), o.numel() * 2, lse.data_ptr(), lse.numel() * 4,
                                       out.data_ptr(), out.numel() * 2,
                                       torch.cuda.current_stream().cuda_stream)
        batch = max(4, min(64, round(2000 / ((o.numel() * 2) / 3e6 + 2.0))))
        times = {k: t.median_us for k, t in time_cuda_graphs(runs, batch=batch, replays=15).items()}
        cells = [f"{times[n]:.2f}" if n in times else "-" for n in names]
        lines.append(f"| {rows} x {num_splits} x {head_dim} | {config_label} | " + " | ".join(cells)
                     + f" | {times['fp16'] - times['bf16']:+.2f} | {times['fp32'] - times['bf16']:+.2f}"
                     f" | {times['fp8s'] - times['bf16']:+.2f} |")
        print(lines[-1], flush=True)
    text = "us per launch, bf16 partials, graph replay in turns, L2-warm\n" + "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lab_outputs.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
