"""PNG of the winner map and the speed-up over kv_split=1 (``kvsplit db plot``).

Uses matplotlib's object API with the Agg canvas, never pyplot, so that the
caller's backend and global state are untouched.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from .schemas import TuningRecord

#: Beyond this many (device, build, head dim, dtypes, stats) groups the plot gets unreadable.
MAX_GROUPS = 24


def _group_title(record: TuningRecord) -> str:
    k = record.key
    return (
        f"{k.device.label}  build {k.build_hash[:10]}\n"
        f"D={k.head_dim}  {k.partial_dtype}->{k.out_dtype}  {k.stats_format}"
    )


def plot_records(records: list[TuningRecord], out: Path, *, dpi: int = 100) -> int:
    """Draw one row of two heat maps per group of keys and save a PNG.

    Each group shares everything but ``num_splits`` (y axis) and ``rows``
    (x axis).  Left: the winner's kv_split (log2 colour scale).  Right: the
    winner's speed-up over kv_split=1 (blank where kv_split=1 was not measured).

    Returns
    -------
    int
        Number of groups drawn (at most :data:`MAX_GROUPS`).

    Raises
    ------
    ValueError
        ``records`` is empty.
    """
    if not records:
        raise ValueError("no tuning results to plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups: dict[tuple, list[TuningRecord]] = defaultdict(list)
    for record in records:
        k = record.key
        groups[(k.device.label, k.build_hash, k.head_dim, k.partial_dtype, k.out_dtype, k.stats_format)].append(record)
    keys = sorted(groups)[:MAX_GROUPS]

    fig = Figure(figsize=(13, 4.2 * len(keys)), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(keys), 2, squeeze=False)
    for row_axes, group_key in zip(axes, keys, strict=True):
        recs = groups[group_key]
        splits = sorted({r.key.num_splits for r in recs})
        rows = sorted({r.key.rows for r in recs})
        winner = [[math.nan] * len(rows) for _ in splits]
        speedup = [[math.nan] * len(rows) for _ in splits]
        for r in recs:
            i, j = splits.index(r.key.num_splits), rows.index(r.key.rows)
            k = r.winner.kv_split
            winner[i][j] = math.log2(k) if k else math.nan
            speedup[i][j] = r.speedup if r.speedup is not None else math.nan
        panels = (
            (row_axes[0], winner, "winner kv_split", "viridis", lambda v: f"{2 ** round(v)}", (0, 4)),
            (row_axes[1], speedup, "speed-up over kv_split=1", "magma", lambda v: f"{v:.2f}", (None, None)),
        )
        for ax, grid, title, cmap, fmt, (vmin, vmax) in panels:
            image = ax.imshow(grid, origin="lower", aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax)
            ax.set_xticks(range(len(rows)), [str(v) for v in rows], rotation=45, fontsize=7)
            ax.set_yticks(range(len(splits)), [str(v) for v in splits], fontsize=7)
            ax.set_xlabel("rows")
            ax.set_ylabel("num_splits")
            ax.set_title(f"{title}\n{_group_title(recs[0])}", fontsize=8)
            if len(rows) * len(splits) <= 400:  # labels stay legible
                for i, line in enumerate(grid):
                    for j, value in enumerate(line):
                        if not math.isnan(value):
                            r, g, b, _ = image.cmap(image.norm(value))
                            light = 0.299 * r + 0.587 * g + 0.114 * b > 0.5  # dark text on light cells
                            ax.text(
                                j,
                                i,
                                fmt(value),
                                ha="center",
                                va="center",
                                fontsize=6,
                                color="black" if light else "white",
                            )
            bar = fig.colorbar(image, ax=ax, shrink=0.8)
            if ax is row_axes[0]:
                bar.set_ticks(range(5), labels=["1", "2", "4", "8", "16"])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return len(keys)
