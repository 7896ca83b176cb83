"""How often does the refinement keep a split within 3% of the fastest, at the emulated cluster's noise?
A Monte Carlo study of `whalex.balance.refine.search`, which runs the Refiner's own sweep (the same
generator) over a timing callback.

A sweep on the emulated cluster takes minutes per setting, and its own timings are as noisy as the
refinement's, so a change to the search cannot be judged there from a few runs. Here both halves of a
refinement's problem come from measurements:

* the step's true time is a V in the slow devices' speed scale, `1 + a max(s - v, 0) + b max(v - s, 0)`,
  its vertex `v` (the fastest split, relative to the prediction) and slopes drawn from the V's fitted to
  the splits of every sweep recorded in bench/results/hetero_sweep.json;
* each timed step is that time times a run of consecutive steps' noise from bench/results/step_noise.json
  (`bench/step_noise.py`: one split's steps timed one by one on the emulated cluster, as log ratios to
  their median), drawn in segments of `SEGMENT` steps at random offsets so that slow periods and drift
  hold as they did; one study per emulation and slowdown.

A refinement "lands" where its kept split's true time is within 3% (and 5%) of the vertex's. The table
gives the prediction alone (the calibrated plan, where the calibration put the vertex), the sweep as it
runs (a short step's rounds), and the sweep held to its first bracket (no widening sweep: what the
widening costs in steps and buys in landings).

    python bench/refine_noise.py [--trials 1000] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Callable

import numpy as np

from whalex.balance import refine

RESULTS = pathlib.Path(__file__).parent / "results"
PER_POINT = 10                      # a short step's timed steps per split (the MLP at 1024)
SEGMENT = 50                        # consecutive measured steps drawn together


class NoisyStep:
    """A synthetic step: its true time a V at scale s, each call one step timed with the next measured
    noise; `calls` counts its steps."""

    def __init__(self, v: float, a: float, b: float, noise: np.ndarray):
        self.v, self.a, self.b, self.noise = v, a, b, noise
        self.calls = 0

    def true(self, s: float) -> float:
        return 1.0 + self.a * max(s - self.v, 0.0) + self.b * max(self.v - s, 0.0)

    def __call__(self, s: float) -> float:
        t = self.true(s) * float(np.exp(self.noise[self.calls % len(self.noise)]))
        self.calls += 1
        return t


def key(s: float) -> int:
    """A placement: the slow device's rows, about 250 at the prediction."""
    return round(250 * s)


def searched(**options) -> Callable[[NoisyStep], float]:
    """The scale `refine.search` keeps, a short step's rounds (`PER_POINT`), `options` passed on."""
    def run(cost):
        return refine.search(cost, key=key, rounds=refine.sweep_rounds(PER_POINT), **options)[0].kept
    return run


def prediction(cost: NoisyStep) -> float:
    return 1.0


VARIANTS: dict[str, Callable[[NoisyStep], float]] = {
    "calibrated (no refinement)": prediction,
    "refined (sweep)": searched(),
    "refined, sweep not widened": searched(reach=(refine.LO, refine.HI)),
}


def runs_of(record: dict) -> list[dict]:
    runs = record.get("runs", [])
    return runs if isinstance(runs, list) else [runs]


def sweep_vs(path: pathlib.Path = RESULTS / "hetero_sweep.json") -> np.ndarray:
    """(vertex, slope above it, slope below it) of a V fitted to each recorded sweep's split medians,
    relative to its least time."""
    record = json.loads(path.read_text())
    out = []
    for run in runs_of(record) + [r for v in record.get("variants", {}).values() for r in runs_of(v)]:
        xs = [(float(q["name"][1:]), q["median_s"]) for q in run.get("variants", []) or []
              if isinstance(q, dict) and q.get("name", "").startswith("x")]
        if len(xs) < 5:
            continue
        s, t = (np.asarray(c, np.float64) for c in zip(*xs))
        fit = refine.fit_v(list(zip(s, t)))
        if fit is not None:
            out.append((fit.at, fit.a / fit.h, fit.b / fit.h))
    return np.asarray(out)


def measured_noise(path: pathlib.Path = RESULTS / "step_noise.json") -> dict[str, np.ndarray]:
    """{setting: log(step / median step)} of every run in step_noise.json."""
    out = {}
    for model, record in json.loads(path.read_text()).get("variants", {}).items():
        for run in runs_of(record):
            if "times" in run:
                t = np.asarray(run["times"], np.float64)
                out[f"{model} {run['slow_by']} 1/{1 + run['hogs']} {run['batch']}"] = np.log(t / np.median(t))
    return out


def draw_noise(rng, trace: np.ndarray, steps: int) -> np.ndarray:
    """`steps` of noise: segments of `SEGMENT` consecutive steps of `trace` at random offsets."""
    starts = rng.integers(0, len(trace) - SEGMENT, -(-steps // SEGMENT))
    return np.concatenate([trace[s:s + SEGMENT] for s in starts])[:steps]


def study(trace: np.ndarray, vs: np.ndarray, trials: int, seed: int, variants: list[str]) -> dict[str, dict]:
    """Each variant over the same `trials` (a V drawn from `vs`, a noise drawn from `trace`): the fraction
    landing within 3% and 5%, the median and 90th percentile excess, the median steps timed."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(vs), trials)
    seeds = rng.integers(0, 1 << 31, trials)
    out = {}
    for name in variants:
        excess, steps = [], []
        for pick, s in zip(picks, seeds):
            v, a, b = vs[pick]
            cost = NoisyStep(v, a, b, draw_noise(np.random.default_rng(s), trace, 4000))
            kept = VARIANTS[name](cost)
            excess.append(cost.true(kept) / cost.true(v) - 1)
            steps.append(cost.calls)
        e = np.asarray(excess)
        out[name] = {"within_3": float(np.mean(e <= 0.03)), "within_5": float(np.mean(e <= 0.05)),
                     "median": float(np.median(e)), "p90": float(np.percentile(e, 90)),
                     "steps": int(np.median(steps))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default=None, help="names of VARIANTS, separated by ';' (default: all)")
    ap.add_argument("--noise", default=str(RESULTS / "step_noise.json"), help="bench/step_noise.py's results")
    ap.add_argument("--quiet", type=float, default=0.01, help="also a synthetic setting: normal noise of this sd")
    ap.add_argument("--settings", default=None, help="comma-separated substrings of the settings to study")
    ap.add_argument("--out", default=None, help="write the table as JSON here too")
    args = ap.parse_args()

    vs = sweep_vs()
    q = np.percentile(vs, [25, 50, 75], axis=0)
    print(f"{len(vs)} sweeps' V's: vertex {q[1, 0]:.2f} [{q[0, 0]:.2f}-{q[2, 0]:.2f}], slope above "
          f"{q[1, 1]:.2f} [{q[0, 1]:.2f}-{q[2, 1]:.2f}], below {q[1, 2]:.2f} [{q[0, 2]:.2f}-{q[2, 2]:.2f}] "
          "(median [IQR])")
    names = args.variants.split(";") if args.variants else list(VARIANTS)
    results = {}
    traces = measured_noise(pathlib.Path(args.noise))
    if args.quiet:
        traces[f"synthetic normal sd {args.quiet}"] = np.random.default_rng(args.seed).normal(0.0, args.quiet, 4000)
    if args.settings:
        traces = {k: v for k, v in traces.items() if any(x in k for x in args.settings.split(","))}
    for setting, trace in traces.items():
        sd = 1.4826 * np.median(np.abs(trace))
        print(f"\n{setting}: {len(trace)} steps measured, robust sd {sd:.3f}, 95th percentile "
              f"{np.percentile(trace, 95):+.3f}; {args.trials} trials")
        print(f"  {'':<28} {'within 3%':>9} {'within 5%':>9} {'median':>7} {'90th':>7} {'steps':>6}")
        results[setting] = study(trace, vs, args.trials, args.seed, names)
        for name, r in results[setting].items():
            print(f"  {name:<28} {r['within_3']:>9.3f} {r['within_5']:>9.3f} {r['median']:>7.4f} {r['p90']:>7.4f} "
                  f"{r['steps']:>6}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
