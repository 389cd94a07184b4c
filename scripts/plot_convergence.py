#!/usr/bin/env python3
"""Draws the validation-loss curves of `lowbit train --json` reports into one SVG.

    scripts/plot_convergence.py [--tokens-per-step N] OUT.svg REPORT.json...

Each report's `evals` (step, loss) becomes one polyline, named after its file; the x axis is
tokens (step x batch x seq from the report, or --tokens-per-step for reports without them). Standard library only, so it runs anywhere
the reports are.
"""

import json
import os
import sys

W, H, PAD_L, PAD_R, PAD_T, PAD_B = 760, 440, 70, 200, 30, 50
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]
DASH = {"adamw": "", "muon": "6,3"}


def tokens_per_step(report, default):
    model = report.get("model") or {}
    if "seq" in model and "batch" in report:
        return report["batch"] * model["seq"]
    return default


def main():
    args = sys.argv[1:]
    default = 1
    if args[0] == "--tokens-per-step":
        default, args = int(args[1]), args[2:]
    out, files = args[0], args[1:]
    curves = []
    for f in files:
        with open(f) as fh:
            r = json.load(fh)
        name = os.path.splitext(os.path.basename(f))[0]
        tps = tokens_per_step(r, default)
        pts = [(e["step"] * tps, e["loss"]) for e in r["evals"]]
        curves.append((name, pts))
    xs = [x for _, p in curves for x, _ in p]
    ys = [y for _, p in curves for _, y in p]
    x0, x1 = 0, max(xs)
    y0, y1 = min(ys) * 0.97, max(ys) * 1.02
    sx = lambda x: PAD_L + (x - x0) / (x1 - x0) * (W - PAD_L - PAD_R)
    sy = lambda y: PAD_T + (y1 - y) / (y1 - y0) * (H - PAD_T - PAD_B)
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
         f'font-family="sans-serif" font-size="12">',
         f'<rect width="{W}" height="{H}" fill="white"/>']
    for i in range(6):
        y = y0 + (y1 - y0) * i / 5
        o.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" '
                 f'stroke="#ddd"/><text x="{PAD_L - 8}" y="{sy(y) + 4:.1f}" '
                 f'text-anchor="end">{y:.2f}</text>')
        x = x0 + (x1 - x0) * i / 5
        o.append(f'<text x="{sx(x):.1f}" y="{H - PAD_B + 18}" text-anchor="middle">'
                 f'{x / 1e6:.2f}M</text>')
    o.append(f'<text x="{(PAD_L + W - PAD_R) / 2}" y="{H - 8}" text-anchor="middle">'
             f'training tokens</text>')
    o.append(f'<text x="16" y="{(PAD_T + H - PAD_B) / 2}" text-anchor="middle" '
             f'transform="rotate(-90 16 {(PAD_T + H - PAD_B) / 2})">validation loss (nats/token)'
             f'</text>')
    for k, (name, pts) in enumerate(curves):
        color = COLORS[k % len(COLORS)]
        dash = DASH.get(name.split("-")[-1], "")
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        o.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" '
                 f'stroke-dasharray="{dash}" points="{path}"/>')
        ly = PAD_T + 18 * k + 10
        o.append(f'<line x1="{W - PAD_R + 12}" x2="{W - PAD_R + 40}" y1="{ly}" y2="{ly}" '
                 f'stroke="{color}" stroke-width="2" stroke-dasharray="{dash}"/>'
                 f'<text x="{W - PAD_R + 46}" y="{ly + 4}">{name} {pts[-1][1]:.4f}</text>')
    o.append("</svg>")
    with open(out, "w") as fh:
        fh.write("\n".join(o) + "\n")


if __name__ == "__main__":
    main()
