#!/usr/bin/env python3
"""Plots of a handoff benchmark run, from its JSON lines.

usage: python3 bench/plot.py bench.jsonl [--out docs] [--prefix bench-gpu]

Writes PREFIX-roundtrip.png, PREFIX-cold.png, PREFIX-throughput.png and, when the run had
them, PREFIX-bandwidth.png and PREFIX-renderer.png. Several files may be given (e.g. a full
run and a run of the items that failed in it); each chart takes every matching record.
Needs matplotlib (pip install matplotlib).
"""

import argparse
import json
import lzma
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    """The JSON records of a log, plain or xz-compressed (`.xz`, as large logs are kept)."""
    records = []
    opener = lzma.open if str(path).endswith(".xz") else open
    with opener(path, "rt") as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    records.append(json.loads(line))
                except ValueError:
                    pass
    return records


def machine_title(records):
    for r in records:
        if r.get("name") == "machine":
            m = r["machine"]
            gpu = m.get("gpu") or "no GPU"
            return f"{m['cpu']} ({m['cores']} cores), {gpu}"
    return ""


def pick(records, name, **kw):
    return [r for r in records if r.get("name") == name
            and all(r.get(k) == v for k, v in kw.items())]


def roundtrip(records, title, path):
    bars = []
    for r in pick(records, "floor"):
        bars.append(("socket floor", r["p50_us"], r["p99_us"], "#888888"))
    for r in pick(records, "cached_roundtrip"):
        name = f"baton {r['backend']}" + (" +event" if r["variant"] != "share" else "")
        bars.append((name, r["p50_us"], r["p99_us"], "#1f77b4"))
    for r in pick(records, "torch_roundtrip"):
        if "p50_us" in r:
            bars.append((f"torch mp {r['variant']}", r["p50_us"], r["p99_us"], "#d62728"))
    if not bars:
        return False
    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = range(len(bars))
    ax.bar([x - 0.2 for x in xs], [b[1] for b in bars], 0.4, color=[b[3] for b in bars], label="p50")
    ax.bar([x + 0.2 for x in xs], [b[2] for b in bars], 0.4, color=[b[3] for b in bars], alpha=0.45, label="p99")
    for x, b in zip(xs, bars):
        ax.text(x - 0.2, b[1], f"{b[1]:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([b[0] for b in bars], rotation=20, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("round trip, µs (log)")
    ax.set_title(f"Handoff round trip (items 1, 2, 7)\n{title}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def cold(records, title, path):
    rows = pick(records, "cold_handoff")
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [f"{r['backend']}\n{r['variant']}" for r in rows]
    make = [r["make_p50_us"] for r in rows]
    hand = [r["handoff_p50_us"] for r in rows]
    free = [r["free_p50_us"] for r in rows]
    xs = range(len(rows))
    ax.bar(xs, make, label="make (alloc/carve)", color="#2ca02c")
    ax.bar(xs, hand, bottom=make, label="offer → open → close → release", color="#1f77b4")
    ax.bar(xs, free, bottom=[a + b for a, b in zip(make, hand)], label="free", color="#ff7f0e")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("µs per handoff, p50 of each part (log)")
    ax.set_title(f"Cold handoff, a new buffer each time (item 3)\n{title}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def throughput(records, title, path):
    bars = [(f"baton {r['backend']}", r["per_s"], "#1f77b4") for r in pick(records, "pipelined")]
    bars += [("torch mp", r["per_s"], "#d62728") for r in pick(records, "torch_pipelined")]
    if not bars:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(bars))
    ax.bar(xs, [b[1] for b in bars], color=[b[2] for b in bars])
    for x, b in zip(xs, bars):
        ax.text(x, b[1], f"{b[1]:,.0f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(200_000, color="k", ls="--", lw=1, label="target 200,000/s")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([b[0] for b in bars], fontsize=8)
    ax.set_ylabel("handoffs per second")
    ax.set_title(f"Pipelined handoffs, 256 in flight (item 4)\n{title}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def bandwidth(records, title, path):
    rows = pick(records, "bandwidth")
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['backend']}\n{r['variant']}" for r in rows]
    xs = range(len(rows))
    ax.bar(xs, [r["gbps"] for r in rows], color="#9467bd")
    for x, r in zip(xs, rows):
        ax.text(x, r["gbps"], f"{r['gbps']:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("GB/s (read + written)")
    ax.set_title(f"1 GiB device copy, imported vs local (item 5)\n{title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def renderer(records, title, path):
    rows = [r for r in pick(records, "renderer") if "fps" in r]
    if not rows:
        return False
    sizes = sorted({r["size"] for r in rows}, key=lambda s: int(s.split("x")[0]))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for k, (variant, color) in enumerate([("zero-copy", "#1f77b4"), ("staged", "#ff7f0e")]):
        vals = [next((r["fps"] for r in rows if r["size"] == s and r["variant"] == variant), 0)
                for s in sizes]
        xs = [i + (k - 0.5) * width for i in range(len(sizes))]
        ax.bar(xs, vals, width, label=variant, color=color)
        for x, v in zip(xs, vals):
            ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(range(len(sizes))))
    ax.set_xticklabels(sizes)
    ax.set_ylabel("frames per second")
    ax.set_title(f"Renderer example, zero-copy vs host-staged (item 6)\n{title}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("jsonl", nargs="+")
    ap.add_argument("--out", default="docs")
    ap.add_argument("--prefix", default="bench")
    args = ap.parse_args()
    records = [r for path in args.jsonl for r in load(path)]
    title = machine_title(records)
    os.makedirs(args.out, exist_ok=True)
    for kind, fn in [("roundtrip", roundtrip), ("cold", cold), ("throughput", throughput),
                     ("bandwidth", bandwidth), ("renderer", renderer)]:
        path = os.path.join(args.out, f"{args.prefix}-{kind}.png")
        if fn(records, title, path):
            print(path)


if __name__ == "__main__":
    main()
