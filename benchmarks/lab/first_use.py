"""What a first-use tuning costs, phase by phase (a diagnostic for the 50 ms first-use budget).

    python -P benchmarks/lab/first_use.py [--out DIR]

For unseen shapes (fresh database): the wall time of the first ``merge_maxsum``
call, and inside it the tuner's phases (scratch buffers, the plan and check
run of every candidate, the timing of all of them in CUDA graphs, the store),
measured by wrapping the tuner's functions. Each shape is run twice: after
timing every valid config in graphs first (as benchmarks/bench_dispatch.py
does before its first call) and without.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import pathlib
import sys
import tempfile
import time

import torch

os.environ["KVSPLIT_DB"] = "sqlite:///" + tempfile.mkdtemp() + "/first-use.sqlite"

import kvsplit  # noqa: E402
from kvsplit import _kernel, merge  # noqa: E402
from kvsplit.autotune import timing, tuner  # noqa: E402
from kvsplit.dispatch.constraints import valid_configs  # noqa: E402

SHAPES = [(d, r, n) for d in (512, 128) for r in (40, 300) for n in (20, 100)]
PHASES = collections.defaultdict(float)


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.synchronize()
            PHASES[name] += (time.perf_counter() - begin) * 1e3
    return wrapper


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp"))
    args = parser.parse_args()
    tuner._Scratch.__init__ = timed("scratch", tuner._Scratch.__init__)
    tuner._Scratch.plan = timed("plans", tuner._Scratch.plan)
    tuner._measure = timed("measure (graphs)", tuner._measure)
    tuner.tune = timed("tune (all)", tuner.tune)
    timing.spin_up_gpu()
    g = torch.Generator().manual_seed(0)
    lines = ["| D / rows / N | sweep first | candidates | first call ms | "
             "tune ms | scratch | plans | measure | rest of tune | outside tune |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    record = []
    for sweep in (False, True):
        for head_dim, rows, num_splits in SHAPES:
            rows_here = rows + (1 if sweep else 0)  # another key: not tuned yet
            o = torch.randn(num_splits, rows_here, head_dim, generator=g).cuda().bfloat16()
            stats = torch.stack([torch.randn(num_splits, rows_here, generator=g),
                                 1 + torch.rand(num_splits, rows_here, generator=g)], -1).cuda()
            out = torch.empty(rows_here, head_dim, dtype=torch.bfloat16, device="cuda")
            if sweep:
                configs = valid_configs(head_dim=head_dim, elem_bytes=2, rows=rows_here,
                                        num_splits=num_splits, sm_count=132)
                timing.time_cuda_graphs({c: (lambda i, c=c: _kernel.launch(
                    c, merge.MAXSUM, o, stats, out, 0.1, merge._LN2)) for c in configs},
                    batch=32, replays=15)
            PHASES.clear()
            torch.cuda.synchronize()
            begin = time.perf_counter()
            kvsplit.merge_maxsum(o, stats, 0.1, out=out)
            torch.cuda.synchronize()
            first = (time.perf_counter() - begin) * 1e3
            phases = dict(PHASES)
            plans = phases.get("plans", 0.0)
            rest = phases.get("tune (all)", 0.0) - sum(
                phases.get(k, 0.0) for k in ("scratch", "plans", "measure (graphs)"))
            count = len(tuner.prune(valid_configs(head_dim=head_dim, elem_bytes=2, rows=rows_here,
                                                  num_splits=num_splits, sm_count=132),
                                    _key(head_dim, rows_here, num_splits)))
            line = (f"| {head_dim} / {rows_here} / {num_splits} | {'yes' if sweep else 'no'} | "
                    f"{count} | {first:.1f} | {phases.get('tune (all)', 0):.1f} | "
                    f"{phases.get('scratch', 0):.1f} | {plans:.1f} | "
                    f"{phases.get('measure (graphs)', 0):.1f} | {rest:.1f} | "
                    f"{first - phases.get('tune (all)', 0):.1f} |")
            print(line, flush=True)
            lines.append(line)
            record.append({"shape": [head_dim, rows_here, num_splits], "sweep": sweep,
                           "first_ms": first, **phases})
    (args.out / "first_use.md").write_text("\n".join(lines) + "\n")
    (args.out / "first_use.json").write_text(json.dumps(record, indent=1))
    return 0


def _key(head_dim, rows, num_splits):
    from kvsplit.db import DeviceInfo, TuningKey
    return TuningKey(device=DeviceInfo(name="GPU", cc_major=9, cc_minor=0, sm_count=132),
                     build_hash="b", head_dim=head_dim, partial_dtype="bfloat16",
                     out_dtype="bfloat16", stats_format="maxsum", num_splits=num_splits,
                     rows=rows)


if __name__ == "__main__":
    sys.exit(main())
