"""Why a first-use tuning and bench_dispatch disagree on a shape (a diagnostic).

    python -P benchmarks/lab/tie.py [--out DIR] [--shape D ROWS N ...] [--pair MODE MODE]

For each shape (default: D = 128, 1000 rows, N = 48 and 100; bf16, maxsum):
the tuner's own timings of a pair of configs (default KvSplit K4 and DSplit
P2xK4d8, spelled as KVSPLIT_MODE spells a fixed config: 4 and dsplit:2:4:8)
over five fresh tunings, and the same two configs timed as bench_dispatch
times them (every valid config replayed in turns, 32 launches a graph) and
with the tuner's batch; then three more tunings with those buffers alive, in the order
bench_dispatch's first use comes.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

from kvsplit import _kernel, merge
from kvsplit.autotune import timing, tuner
from kvsplit.db import DeviceInfo, TuningKey
from kvsplit.config import KernelConfig
from kvsplit.dispatch.constraints import configs_for_key, valid_configs
from kvsplit.dispatch.dispatcher import _fixed_config


def config(mode: str) -> KernelConfig:
    """The config a fixed KVSPLIT_MODE names (the dispatcher's own parser)."""
    fixed = _fixed_config(mode)
    if fixed is None:
        raise SystemExit(f"tie.py: --pair takes KVSPLIT_MODE configs (4, dsplit:2:4:8), "
                         f"not {mode!r}")
    return fixed


def tuned(key, device, pair, name: str) -> str:
    """One fresh tuning of ``key``: its winner and its timings of ``pair``."""
    record = tuner.tune(key, device, configs_for_key(key, is_cuda=True))
    got = {c.config: c.median_us for c in record.candidates}
    return (f"{name}: winner {record.winner.label}; "
            + ", ".join(f"{c.label} {got.get(c, float('nan')):.2f}" for c in pair)
            + f"; best timed {min(got.values()):.2f} of {len(got)}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp"))
    parser.add_argument("--shape", type=int, nargs=3, action="append", metavar=("D", "ROWS", "N"))
    parser.add_argument("--pair", nargs=2, default=["4", "dsplit:2:4:8"])
    args = parser.parse_args()
    pair = tuple(map(config, args.pair))
    timing.spin_up_gpu()
    lines = []
    for head_dim, rows, num_splits in args.shape or [(128, 1000, 48), (128, 1000, 100)]:
        key = TuningKey(device=DeviceInfo(name="NVIDIA H200", cc_major=9, cc_minor=0,
                                          sm_count=132),
                        build_hash="b", head_dim=head_dim, partial_dtype="bfloat16",
                        out_dtype="bfloat16", stats_format="maxsum", num_splits=num_splits,
                        rows=rows)
        device = torch.device("cuda", 0)
        for attempt in range(5):
            lines.append(f"{head_dim}/{rows}/{num_splits} " + tuned(key, device, pair,
                                                                   f"tune {attempt}"))
            print(lines[-1], flush=True)
        g = torch.Generator().manual_seed(1)
        m = torch.randn(num_splits, rows, generator=g) * 2
        l = 1 + 64 * torch.rand(num_splits, rows, generator=g)
        o = (torch.randn(num_splits, rows, head_dim, generator=g)
             * l.unsqueeze(-1)).cuda().bfloat16()
        stats = torch.stack([m, l], -1).cuda()
        out = torch.empty(rows, head_dim, dtype=torch.bfloat16, device="cuda")
        configs = valid_configs(head_dim=head_dim, elem_bytes=2, rows=rows,
                                num_splits=num_splits, sm_count=132)
        for label, chosen, batch in (("all configs, batch 32", configs, 32),
                                     ("the pair, batch 32", list(pair), 32),
                                     ("the pair, batch 8", list(pair), 8)):
            times = timing.time_cuda_graphs({c: (lambda i, c=c: _kernel.launch(
                c, merge.MAXSUM, o, stats, out, 0.1, merge._LN2)) for c in chosen},
                batch=batch, replays=15)
            lines.append(f"{head_dim}/{rows}/{num_splits} {label}: " + ", ".join(
                f"{c.label} {times[c].median_us:.2f}" for c in pair))
            print(lines[-1], flush=True)
        # As bench_dispatch's first use runs: after every config was timed, its buffers alive.
        for attempt in range(3):
            lines.append(f"{head_dim}/{rows}/{num_splits} after all configs, "
                         + tuned(key, device, pair, f"tune {attempt}"))
            print(lines[-1], flush=True)
    (args.out / "tie.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
