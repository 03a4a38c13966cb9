"""PNG of the winner map and the speed-up over kv_split=1 (``kvsplit db plot``).

Uses matplotlib's object API with the Agg canvas, never pyplot, so that the
caller's backend and global state are untouched.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from pathlib import Path

from ..terminal import printable
from ..db.schemas import TuningRecord

#: What ``kvsplit db plot`` says when matplotlib (the ``plot`` extra) is not installed.
MISSING = "kvsplit db plot needs matplotlib, which is not installed; pip install 'kvsplit[plot]'"


def matplotlib() -> tuple[type, type]:
    """matplotlib's Agg canvas and Figure; ``ImportError`` with :data:`MISSING` when it is absent."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(MISSING) from exc
    return FigureCanvasAgg, Figure


#: Beyond this many (device, build, head dim, dtypes, stats) groups the plot gets unreadable.
MAX_GROUPS = 24


def _group_title(record: TuningRecord) -> str:
    """The stored names as data: control characters escaped (drawn with ``parse_math=False``, so
    that ``$...$`` in a device name is not mathtext)."""
    k = record.key
    return (
        f"{printable(k.device.label)}  build {printable(k.build_hash[:10])}\n"
        f"D={k.head_dim}  {k.partial_dtype}->{k.out_dtype}  {k.stats_format}"
    )


def _short(config) -> str:
    """kvsplit(kv_split=8) -> K8; dsplit(kv_split=16, slices=4) -> P4xK16; few(vectors=2)
    -> F2."""
    params = config.params
    if "vectors" in params:
        return f"F{params['vectors']}"
    k = params.get("kv_split", "?")
    return f"P{params['slices']}xK{k}" if "slices" in params else f"K{k}"


#: File suffix -> the format written (the file is what its name says).
FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}


def _groups_per_row(config) -> int:
    return config.params.get("kv_split", 1) * config.params.get("slices", 1)


def plot_records(records: list[TuningRecord], out: Path, *, dpi: int = 100) -> int:
    """Draw one row of two heat maps per group of keys and save them (PNG, SVG or PDF, by the
    suffix of ``out``; its directory must exist).

    Each group shares everything but ``num_splits`` (y axis) and ``rows``
    (x axis).  Left: the winner config, coloured by its groups per row
    (kv_split x slices, log2 scale) and labelled ``K8`` (KvSplit) or
    ``P4xK16`` (DSplit: slices x kv_split).  Right: the winner's speed-up over
    kv_split=1 (blank where kv_split=1 was not measured). Each panel's colour scale is
    shared by every group drawn.

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
    FigureCanvasAgg, Figure = matplotlib()

    groups: dict[tuple, list[TuningRecord]] = defaultdict(list)
    for record in records:
        k = record.key
        groups[(k.device.label, k.build_hash, k.head_dim, k.partial_dtype, k.out_dtype, k.stats_format)].append(record)
    keys = sorted(groups)[:MAX_GROUPS]
    # One colour scale for every group of a panel: the same colour means the same value.
    drawn = [r for k in keys for r in groups[k]]
    top = max(1, max(_groups_per_row(r.winner) for r in drawn))
    winner_range = (0, max(1.0, math.log2(top)))
    speedups = [r.speedup for r in drawn if r.speedup is not None]
    speedup_range = (min(speedups), max(speedups)) if speedups else (None, None)

    fig = Figure(figsize=(13, 4.2 * len(keys)), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(keys), 2, squeeze=False)
    for row_axes, group_key in zip(axes, keys, strict=True):
        recs = groups[group_key]
        splits = sorted({r.key.num_splits for r in recs})
        rows = sorted({r.key.rows for r in recs})
        winner = [[math.nan] * len(rows) for _ in splits]
        names = [[""] * len(rows) for _ in splits]
        speedup = [[math.nan] * len(rows) for _ in splits]
        for r in recs:
            i, j = splits.index(r.key.num_splits), rows.index(r.key.rows)
            winner[i][j] = math.log2(_groups_per_row(r.winner))
            names[i][j] = _short(r.winner)
            speedup[i][j] = r.speedup if r.speedup is not None else math.nan
        panels = (
            (row_axes[0], winner, "winner config (colour: groups per row)", "viridis",
             lambda v, i, j: names[i][j], winner_range),
            (row_axes[1], speedup, "speed-up over kv_split=1", "magma",
             lambda v, i, j: f"{v:.2f}", speedup_range),
        )
        for ax, grid, title, cmap, fmt, (vmin, vmax) in panels:
            image = ax.imshow(grid, origin="lower", aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax)
            ax.set_xticks(range(len(rows)), [str(v) for v in rows], rotation=45, fontsize=7)
            ax.set_yticks(range(len(splits)), [str(v) for v in splits], fontsize=7)
            ax.set_xlabel("rows")
            ax.set_ylabel("num_splits")
            ax.set_title(f"{title}\n{_group_title(recs[0])}", fontsize=8, parse_math=False)
            if len(rows) * len(splits) <= 400:  # labels stay legible
                for i, line in enumerate(grid):
                    for j, value in enumerate(line):
                        if not math.isnan(value):
                            r, g, b, _ = image.cmap(image.norm(value))
                            light = 0.299 * r + 0.587 * g + 0.114 * b > 0.5  # dark text on light cells
                            ax.text(
                                j,
                                i,
                                fmt(value, i, j),
                                ha="center",
                                va="center",
                                fontsize=6,
                                color="black" if light else "white",
                            )
            bar = fig.colorbar(image, ax=ax, shrink=0.8)
            if ax is row_axes[0]:
                ticks = range(0, int(winner_range[1]) + 1)
                bar.set_ticks(ticks, labels=[str(2 ** t) for t in ticks])
    out = Path(out)
    with warnings.catch_warnings():  # a name in a script the font lacks: boxes, not a warning per glyph
        warnings.filterwarnings("ignore", message="Glyph .* missing from")
        fig.savefig(out, format=FORMATS[out.suffix.lower()])
    return len(keys)
