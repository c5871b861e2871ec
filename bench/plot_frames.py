#!/usr/bin/env python3
"""fps over frames, from the renderer's `--frame-log` files (one JSON line per frame).

usage: python3 bench/plot_frames.py [LABEL=]FILE... [--out renderer-frames.png] [--window 20]

Each FILE is one run (e.g. legacy, vmm, pool, staged at 3840x2160, 2,000 frames); its label is
LABEL, or the file's name without its extension. One chart, a line per run: the fps of a
rolling window of frames (frames / their summed wall time, so one slow frame weighs what it
cost), and where the log has GPU times (CUDA), the same from the GPU's side as a dotted line
of the same colour. Printed per run: the fps of the whole run, and the flatness figure of
issue 24, the fps of the last 200 frames / the fps of frames 200-400 (the last frame's wait
for the GPU to finish is in its time, so a host that ran ahead pays at the end).
Needs matplotlib (pip install matplotlib).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot import load as load_records  # noqa: E402  (also selects matplotlib's Agg backend)

import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    frames = [r for r in load_records(path) if "frame" in r]
    frames.sort(key=lambda r: r["frame"])
    return frames


def fps_of(times_us):
    total = sum(times_us)
    return len(times_us) * 1e6 / total if total > 0 else float("nan")


def rolling_fps(times_us, window):
    out = []
    acc = 0.0
    for i, t in enumerate(times_us):
        acc += t
        if i >= window:
            acc -= times_us[i - window]
        n = min(i + 1, window)
        out.append(n * 1e6 / acc if acc > 0 else float("nan"))
    return out


def flatness(times_us):
    """fps of the last 200 frames / fps of frames 200-400 (None under 600 frames)."""
    if len(times_us) < 600:
        return None
    return fps_of(times_us[-200:]) / fps_of(times_us[200:400])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="[LABEL=]FILE")
    ap.add_argument("--out", default="renderer-frames.png")
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--title", default=None)
    a = ap.parse_args()

    fig, ax = plt.subplots(figsize=(10, 5))
    for i, spec in enumerate(a.runs):
        label, _, path = spec.rpartition("=")
        if not label:
            label = os.path.splitext(os.path.basename(path))[0]
        frames = load(path)
        if not frames:
            print(f"{label}: no frames in {path}")
            continue
        wall = [r["us"] for r in frames]
        x = [r["frame"] for r in frames]
        colour = f"C{i % 10}"
        ax.plot(x, rolling_fps(wall, a.window), color=colour, label=f"{label} (wall)")
        gpu = [r.get("gpu_us") for r in frames]
        gpu_line = ""
        if any(g is not None for g in gpu[1:]):
            g = [v for v in gpu[1:] if v is not None]
            ax.plot(x[1:], rolling_fps(g, a.window), color=colour, linestyle=":", label=f"{label} (GPU)")
            gf = flatness(g)
            gpu_line = f", GPU side {fps_of(g):.1f} fps" + (f", flatness {gf:.3f}" if gf is not None else "")
        flat = flatness(wall)
        drain = frames[-1].get("drain_us")
        queued = [r.get("gpu_frames_queued") for r in frames if r.get("gpu_frames_queued") is not None]
        extra = ""
        if queued:
            extra += f"; frames queued on the GPU: max {max(queued)}, last {queued[-1]}"
        if drain is not None:
            extra += f"; final GPU drain {drain / 1000:.1f} ms"
        print(
            f"{label}: {len(frames)} frames, {fps_of(wall):.1f} fps; "
            + (
                f"flatness (last 200 / frames 200-400) {flat:.3f}"
                f" ({fps_of(wall[-200:]):.1f} / {fps_of(wall[200:400]):.1f} fps)"
                if flat is not None
                else "flatness n/a (under 600 frames)"
            )
            + gpu_line
            + extra
        )
    ax.set_xlabel("frame")
    ax.set_ylabel(f"fps (rolling, {a.window} frames)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(a.title or "renderer: fps over frames")
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
