"""Turns the JSON of the GPU benchmarks into the markdown of docs/benchmarks.md.

    python benchmarks/report.py DIR     (DIR holds any of bench_merge.json,
                                         bench_dispatch.json, bench_chain.json,
                                         bench_peers.json and bench_host_*.json)
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics
import sys

# The seed design's figures on an H200, (K=1, best K).
REFERENCE = {(512, 64, 132): (20.4, 5.3), (512, 64, 16): (3.7, 2.5),
             (128, 32, 264): (38.8, 5.8), (512, 2048, 132): (65.6, 65.6)}
# (seed design best K, read probe, a widely used peer) as first measured, us.
PEERS = {(512, 64, 16): (2.47, 1.40, 2.32), (512, 64, 132): (5.29, 2.32, 7.27),
         (512, 64, 264): (8.37, 3.31, 12.79), (128, 32, 16): (2.38, 1.31, 1.99),
         (128, 32, 264): (5.22, 1.49, 6.21), (128, 256, 132): (4.66, 2.38, 4.82),
         (512, 512, 132): (19.55, 17.41, 20.29)}
K1 = "kvsplit(kv_split=1)"


def short(label: str) -> str:
    """kvsplit(kv_split=8) -> K8; dsplit(depth=8, kv_split=16, slices=4) -> P4xK16d8;
    few(vectors=2) -> F2."""
    params = dict(part.split("=") for part in label[label.index("(") + 1:-1].split(", "))
    if "vectors" in params:
        return f"F{params['vectors']}"
    if "slices" not in params:
        return f"K{params['kv_split']}"
    return f"P{params['slices']}xK{params['kv_split']}d{params['depth']}"


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def merge_table(data: dict) -> str:
    lines = [
        "| D | rows | N | K=1 | KvSplit best | DSplit best | best | read | best / read | "
        "best, PDL | cold read | cold K=1 | cold best | torch | eager |",
        "|" + "---|" * 15,
    ]
    for r in data["results"]:
        warm, ks, ds, best = r["warm"], r["best_kvsplit"], r["best_dsplit"], r["best"]
        dsplit = f"{warm[ds]:.2f} ({short(ds)})" if ds else "-"
        lines.append(
            f"| {r['head_dim']} | {r['rows']} | {r['num_splits']} | {warm[K1]:.2f} "
            f"| {warm[ks]:.2f} ({short(ks)}) | {dsplit} | **{warm[best]:.2f}** "
            f"| {r['read_us']:.2f} | {warm[best] / r['read_us']:.2f} | {r['best_pdl_us']:.2f} "
            f"| {r['cold_read_us']:.2f} | {r['cold'][K1]:.2f} | {r['cold'][best]:.2f} "
            f"| {r['torch_us']:.2f} | {r['eager_us']:.2f} |")
    ratios = [r["warm"][r["best"]] / r["read_us"] for r in data["results"]]
    lines += ["", f"best / read over the {len(ratios)} shapes: geomean {geomean(ratios):.2f}, "
              f"min {min(ratios):.2f}, max {max(ratios):.2f}; "
              f"{sum(x <= 1.2 for x in ratios)} shapes within 1.2x."]
    return "\n".join(lines)


def peer_table(data: dict) -> str:
    by_shape = {(r["head_dim"], r["rows"], r["num_splits"]): r for r in data["results"]}
    lines = ["| D / rows / N | best (config) | read | best / read | best, PDL | issue: seed best K "
             "/ read / peer | best vs peer |", "|---|---|---|---|---|---|---|"]
    for shape, (seed, read, peer) in PEERS.items():
        r = by_shape[shape]
        best = r["warm"][r["best"]]
        lines.append(f"| {shape[0]} / {shape[1]} / {shape[2]} | {best:.2f} ({short(r['best'])}) "
                     f"| {r['read_us']:.2f} | {best / r['read_us']:.2f} | {r['best_pdl_us']:.2f} "
                     f"| {seed} / {read} / {peer} | {best / peer:.2f} |")
    return "\n".join(lines)


def reference_table(data: dict) -> str:
    by_shape = {(r["head_dim"], r["rows"], r["num_splits"]): r for r in data["results"]}
    lines = ["| D / rows / N | K=1 measured / reference | KvSplit best measured / reference | "
             "K=1 ratio | best ratio |", "|---|---|---|---|---|"]
    for shape, (k1, best) in REFERENCE.items():
        r = by_shape[shape]
        got_k1, got_best = r["warm"][K1], r["warm"][r["best_kvsplit"]]
        lines.append(f"| {shape[0]} / {shape[1]} / {shape[2]} | {got_k1:.2f} / {k1} | "
                     f"{got_best:.2f} ({short(r['best_kvsplit'])}) / {best} | "
                     f"{got_k1 / k1:.2f} | {got_best / best:.2f} |")
    return "\n".join(lines)


def dispatch_section(data: dict) -> str:
    lines = []
    for name, part in data["regret"].items():
        rows = part["rows"]
        tuned = part["first_use_ms"]
        lines += [
            f"**{name}** ({len(rows)} shapes): geomean regret "
            f"{100 * part['geomean_regret']:.2f} %, worst {100 * part['worst_regret']:.2f} %; "
            f"sources: " + ", ".join(f"{s} {sum(r['source'] == s for r in rows)}"
                                     for s in sorted({r['source'] for r in rows})) + ".",
        ]
        if tuned:
            lines += [f"First-use tuning (wall clock of the first call, scratch tensors "
                      f"included): median {tuned[len(tuned) // 2]:.1f} ms, "
                      f"{sum(t <= 50 for t in tuned)} of {len(tuned)} keys within 50 ms, max "
                      f"{tuned[-1]:.1f} ms."]
        lines += ["", "| D | rows | N | best (all configs) | us | auto | us | source | regret "
                  "| first call ms |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['head_dim']} | {r['rows']} | {r['num_splits']} | {short(r['best'])} "
                         f"| {r['best_us']:.2f} | {short(r['auto'])} | {r['auto_us']:.2f} "
                         f"| {r['source']} | {100 * r['regret']:.1f} % "
                         f"| {r['first_call_ms']:.1f} |")
        lines.append("")
    return "\n".join(lines)


def host_table(data: dict) -> str:
    lines = [f"Host time per call on {data['device']} ({data['shape']}, no sync, a cache hit, "
             "out given):", "", "| call | us |", "|---|---|"]
    lines += [f"| {name} | {us:.2f} |" for name, us in data["host_us"].items()]
    lines += ["", f"Merge - raw binding: {data['over_raw_us']:.2f} us; merge / add_: "
              f"{data['over_add']:.2f}x."]
    return "\n".join(lines)


def chain_table(data: dict) -> str:
    lines = ["| D | rows | N | config | merge alone | producer alone | pair, PDL off "
             "| pair, PDL on | saved |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        for label, c in r["configs"].items():
            lines.append(
                f"| {r['head_dim']} | {r['rows']} | {r['num_splits']} | {short(label)} "
                f"| {c['merge_us']:.2f} | {r['producer_us']:.2f} | {c['pair_off_us']:.2f} "
                f"| {c['pair_on_us']:.2f} | {c['pair_off_us'] - c['pair_on_us']:+.2f} |")
    return "\n".join(lines)


PEER_COLUMNS = (("triton", "serial Triton"), ("compile", "torch.compile"))


def _ratio_summary(name: str, ratios: list, over: float) -> str:
    if not ratios:
        return f"{name}: -"
    worst = max(ratios, key=lambda x: x[0])
    return (f"{name}: geomean {geomean(x for x, _ in ratios):.2f}, worst {worst[0]:.2f} "
            f"({worst[1]}), over {over:g} at {sum(x > over for x, _ in ratios)} of {len(ratios)}")


def peers_section(data: dict) -> str:
    """The peers table: kvsplit auto and best next to the read probe and the peers."""
    results = data["results"]
    lines = [f"{data['gpu']}, {data['date']}: copy {data['copy_bytes_per_us'] / 1e6:.2f} TB/s, "
             f"empty launch {data['noop_us']:.2f} us; torch.compile mode "
             f"{data.get('compile_mode', 'default')}; {data.get('versions', {})}"
             + ("" if data.get("complete", True) else f"; INCOMPLETE ({len(results)} shapes)")]
    for name, why in data.get("failures", {}).items():
        lines.append(f"{name} failed: {why.strip().splitlines()[-1]}")
    for regime in ("warm", "cold"):
        lines += ["", f"**L2-{regime}** (us per launch; ratios > 1: kvsplit auto is slower)", "",
                  "| D / rows / N | read | kvsplit auto | best | serial Triton | torch.compile "
                  "| auto / read | best / read | auto / Triton | auto / compile | auto / best |",
                  "|" + "---|" * 11]
        ratios = {"read": [], "best_read": [], "triton": [], "compile": [], "best": []}
        for r in results:
            t = r[regime]
            shape = f"{r['head_dim']} / {r['rows']} / {r['num_splits']}"
            auto = t.get("auto")

            def us(name):
                return f"{t[name]:.2f}" if name in t else "-"

            def ratio(key, num, den):
                if num not in t or den not in t:
                    return "-"
                ratios[key].append((t[num] / t[den], shape))
                return f"{t[num] / t[den]:.2f}"

            triton = us("triton") + (f" (w{r['triton_warps']})" if "triton_warps" in r else "")
            lines.append(
                f"| {shape} | {us('read')} | {us('auto')} ({short(r['auto'])}) "
                f"| {us('best')} ({short(r['best'])}) | {triton} | {us('compile')} "
                f"| {ratio('read', 'auto', 'read')} | {ratio('best_read', 'best', 'read')} "
                f"| {ratio('triton', 'auto', 'triton')} | {ratio('compile', 'auto', 'compile')} "
                f"| {ratio('best', 'auto', 'best')} |" if auto is not None else f"| {shape} | - |")
        lines += ["", "- " + _ratio_summary("auto / read", ratios["read"], 1.2),
                  "- " + _ratio_summary("best / read", ratios["best_read"], 1.2),
                  "- " + _ratio_summary("auto / serial Triton", ratios["triton"], 1.0),
                  "- " + _ratio_summary("auto / torch.compile", ratios["compile"], 1.0),
                  "- " + _ratio_summary("auto / best", ratios["best"], 1.05)]
    diffs = [max(r["max_diff_vs_auto"].values()) for r in results if r["max_diff_vs_auto"]]
    if diffs:
        lines += ["", f"Largest |peer - kvsplit auto| over all shapes: {max(diffs):.1e} "
                  "(bf16 outputs of order 1)."]
    sources = sorted({r["auto_source"] for r in results})
    lines.append("Auto choices from: " + ", ".join(
        f"{s} {sum(r['auto_source'] == s for r in results)}" for s in sources) + ".")
    return "\n".join(lines)


FEW_PEERS = {"vllm": "vLLM", "fi2": "FI 2-state", "fiN": "FI N-state", "triton": "serial Triton"}


def few_section(data: dict) -> str:
    """The few-states table: kvsplit auto next to the read probe and each peer."""
    results = data["results"]
    lines = [f"{data['gpu']}, {data['date']}: copy {data['copy_bytes_per_us'] / 1e6:.2f} TB/s, "
             f"empty launch {data['noop_us']:.2f} us; torch {data.get('torch')}"
             + ("" if data.get("complete", True) else f"; INCOMPLETE ({len(results)} shapes)")]
    for name, why in data.get("failures", {}).items():
        lines.append(f"{name} failed: {why.strip().splitlines()[-1]}")
    lines += ["", "**L2-warm, graph replay** (us per launch; ratios > 1: kvsplit auto is slower)",
              "", "| tokens x heads x D | N | MB | read | kvsplit auto | auto / read | before Few "
              "| " + " | ".join(FEW_PEERS.values()) + " | auto / fastest peer | tuning ms |",
              "|" + "---|" * (9 + len(FEW_PEERS))]
    floor_misses, peer_ratios, read_ratios, tune_ms = [], [], [], []
    for r in results:
        t = r["warm"]
        shape = f"{r['tokens']} x {r['heads']} x {r['head_dim']}"
        label = f"{shape} N={r['num_splits']}"
        auto, read = t["auto"], t["read"]
        read_ratios.append((auto / read, label))
        # The few-states floor: 1.1 x read above 4 MB, read + 0.4 us below.
        if auto > (1.1 * read if r["bytes"] > 4e6 else read + 0.4):
            floor_misses.append(label)
        peers_here = {k: t[k] for k in FEW_PEERS if k in t}
        fastest = min(peers_here.values()) if peers_here else None
        if fastest:
            peer_ratios.append((auto / fastest, label))
        tune_ms.append(r["tune_ms"])
        before = (f"{t['pre-few']:.2f} ({short(r['pre_few'])})" if "pre-few" in t else "-")
        peer_cells = " | ".join(f"{t[k]:.2f}" if k in t else "-" for k in FEW_PEERS)
        versus = f"{auto / fastest:.2f}" if fastest else "-"
        lines.append(f"| {shape} | {r['num_splits']} | {r['bytes'] / 1e6:.1f} | {read:.2f} "
                     f"| {auto:.2f} ({short(r['auto'])}) | {auto / read:.2f} | {before} "
                     f"| {peer_cells} | {versus} | {r['tune_ms']:.0f} |")
    lines += ["", "- " + _ratio_summary("auto / read", read_ratios, 1.1),
              "- " + _ratio_summary("auto / fastest peer", peer_ratios, 1.0),
              f"- over the floor (1.1 x read above 4 MB, read + 0.4 us below): "
              f"{len(floor_misses)} of {len(results)}"
              + (f" ({', '.join(floor_misses)})" if floor_misses else ""),
              f"- first-use tuning: median {statistics.median(tune_ms):.0f} ms, max "
              f"{max(tune_ms):.0f} ms over {len(tune_ms)} keys" if tune_ms else "- no tuning"]
    diffs = [max(r["max_diff"].values()) for r in results if r["max_diff"]]
    if diffs:
        lines.append(f"- largest |other - kvsplit auto| over all shapes: {max(diffs):.1e} "
                     "(bf16 outputs of order 1)")
    return "\n".join(lines)


def main() -> int:
    folder = pathlib.Path(sys.argv[1])
    if (folder / "bench_merge.json").exists():
        merge = json.loads((folder / "bench_merge.json").read_text())
        print(f"{merge['gpu']}, {merge['date']}: copy {merge['copy_bytes_per_us'] / 1e6:.2f} "
              f"TB/s, empty launch {merge['noop_us']:.2f} us\n")
        print(merge_table(merge), "\n")
        print(peer_table(merge), "\n")
        print(reference_table(merge), "\n")
    for name, render in (("bench_dispatch.json", dispatch_section),
                         ("bench_chain.json", chain_table), ("bench_peers.json", peers_section),
                         ("bench_host_cuda.json", host_table),
                         ("bench_host_cpu.json", host_table),
                         ("bench_few.json", few_section)):
        path = folder / name
        if path.exists():
            print(render(json.loads(path.read_text())), "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
