"""Quick GPU check against the float64 reference, for a first look at a new build."""

from __future__ import annotations

import argparse
import math
import sys

import torch

import kvsplit
from kvsplit.reference import merge_lse_reference, merge_maxsum_reference, random_partials


def main() -> int:
    argparse.ArgumentParser(description=__doc__).add_argument("--out")
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for fmt in ("maxsum", "lse"):
        for head_dim in (64, 128, 256, 512):
            for k in (1, 2, 4, 8, 16):
                for dtype in (torch.bfloat16, torch.float16, torch.float32):
                    o, st = random_partials(37, 50, head_dim, stats_format=fmt, generator=g,
                                            empty_fraction=0.2)
                    counts = torch.randint(0, 40, (50,), generator=g, dtype=torch.int32)
                    sinks = torch.randn(5, generator=g)
                    o = o.to(dtype)
                    cuda = [t.cuda() for t in (o, st, counts, sinks)]
                    if fmt == "maxsum":
                        out, stats = kvsplit.merge_maxsum(cuda[0], cuda[1], 0.9, sinks=cuda[3],
                                                          split_counts=cuda[2], return_stats=True,
                                                          kv_split=k)
                        ref, ref_stats = merge_maxsum_reference(o, st, 0.9, sinks=sinks,
                                                                split_counts=counts)
                    else:
                        out, stats = kvsplit.merge_lse(cuda[0], cuda[1], base=math.e, sinks=cuda[3],
                                                       split_counts=cuda[2], return_lse=True,
                                                       kv_split=k)
                        ref, ref_stats = merge_lse_reference(o, st, base=math.e, sinks=sinks,
                                                             split_counts=counts)
                    err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
                    same_inf = torch.equal(torch.isinf(stats.cpu()), torch.isinf(ref_stats))
                    stat_err = (stats.cpu().double() - ref_stats).nan_to_num(0, 0, 0).abs().max().item()
                    worst = max(worst, err)
                    if not (err < 5e-3 and same_inf and stat_err < 1e-3 and not out.isnan().any()):
                        print(f"FAIL {fmt} D={head_dim} K={k} {dtype}: err {err:.2e} "
                              f"stats {stat_err:.2e} inf-match {same_inf}")
                        return 1
    print(f"smoke: all configurations match the float64 reference (worst rel err {worst:.2e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
