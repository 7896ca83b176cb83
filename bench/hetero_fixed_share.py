"""Where would a calibrated split have landed with less of the slow device's fixed time counted? Read from
recorded sweeps.

What it reads
    `bench/results/hetero_sweep.json`'s MLP variants (``--variants``, name prefixes): per run and per
    calibration (a quarter of the batch, all of it), the calibrated speeds and fixed times and the split
    they gave, and the sweep's medians at x0.7-x1.3 of the slow device's speed.

What it computes
    The balance equalises ``fixed_i + rows_i x work_per_row / speed_i``; the work per row is read back
    from the split each calibration gave. With the fixed times' difference scaled by ``share`` (0: none of
    it, 1: as calibrated), the slow device's rows, and the sweep's time there (linear between the sweep's
    points, as a ratio to its fastest point). It prints each calibration's rows and ratios and, per share,
    the median ratio and how many land within 5% and 3%. It re-reads timings; it times nothing, so the
    ratios carry the sweeps' own noise, the same for every share.

    python bench/hetero_fixed_share.py [--variants mlp_twin,mlp_robust,mlp_rounds]
"""
from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

RESULTS = pathlib.Path(__file__).parent / "results" / "hetero_sweep.json"
SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)


def rows_at(run: dict, which: str, shares) -> list[float] | None:
    """The slow device's rows with each of `shares` of the calibrated fixed times' difference, None where
    the calibration's fixed times were equal (the work per row cannot be read back)."""
    n = run["batch"]
    fast, slow = run["speeds"][which]
    f_fast, f_slow = run["overheads"][which]
    rows = next(v for v in run["variants"] if v["name"] == f"whalex ({which})")["rows"][1]
    den = rows * (1 / fast + 1 / slow) - n / fast
    if abs(f_fast - f_slow) < 1e-6 or abs(den) < 1e-12:
        return None
    work = (f_fast - f_slow) / den
    return [(share * (f_fast - f_slow) + n * work / fast) / (work / fast + work / slow) for share in shares]


def sweep_ratio(run: dict, rows: float) -> float:
    """The sweep's median at `rows` (linear between its points) over its fastest point's."""
    points = sorted((v for v in run["variants"] if v["name"].startswith("x")), key=lambda v: v["rows"][1])
    r = np.asarray([v["rows"][1] for v in points], np.float64)
    t = np.asarray([v["median_s"] for v in points], np.float64)
    return float(np.interp(rows, r, t) / t.min())


def main(argv=None):
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--variants", default="mlp_twin,mlp_robust,mlp_rounds",
                    help="comma-separated name prefixes of the variants to read")
    args = ap.parse_args(argv)
    prefixes = tuple(args.variants.split(","))
    data = json.loads(RESULTS.read_text())["variants"]
    ratios: dict[float, list[float]] = {s: [] for s in SHARES}
    for name, variant in data.items():
        if not name.startswith(prefixes):
            continue
        for run in variant.get("runs", []):
            for which in ("quarter", "whole"):
                at = rows_at(run, which, SHARES)
                if at is None:
                    continue
                cells = []
                for s, r in zip(SHARES, at):
                    ratios[s].append(sweep_ratio(run, r))
                    cells.append(f"{r:6.0f}:{ratios[s][-1]:.3f}")
                print(f"{name:24} {run['slow_by']:5} {run['hogs']} {run['batch']:5} {which:7} " + "  ".join(cells))
    print("share  median  within 5%  within 3%")
    for s in SHARES:
        v = np.asarray(ratios[s])
        print(f"{s:5.2f}  {np.median(v):.3f}   {(v <= 1.05).sum():3d}/{len(v)}     {(v <= 1.03).sum():3d}/{len(v)}")


if __name__ == "__main__":
    main()
