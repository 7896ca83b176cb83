"""What the emulated heterogeneous cluster's slow process costs, beyond one speed (issue 12).

What it measures
    The 2-process cluster and the stock Flax MLP of `bench/hetero.py` (process 1's core shared with
    busy loops), two things per slowdown:

    * curve: each process times the user's local step (loss, gradient, Adam update; calibrate's
      `time_rounds`, interleaved rounds) at 512 ... 4096 rows and prints milliseconds and
      microseconds per row. A GPU's time per row is flat past small batches; a process that shares
      its core with a busy loop gets more than its share for short bursts (the scheduler credits a
      task that slept), so its time per row grows with the step's length.
    * sweep: the balanced data-parallel step of whalex with the split moved around the calibrated one
      (`Cluster.with_speeds` at declared ratios; the calibrated cluster's own split is one of them),
      timed in interleaved blocks on process 0: which split is fastest in the real step.

Run from the repo root: ``python bench/hetero_probe.py`` (about 5 minutes on an otherwise idle
machine with >= 2 cores). Writes bench/results/hetero_probe.json.
"""
from __future__ import annotations

import argparse
import sys

import harness
import hetero  # bench/hetero.py: its model and defaults

SIZES = (512, 1024, 2048, 3072, 4096)
FACTORS = (0.85, 0.92, 1.0, 1.1, 1.2)     # the slow process's declared slowdown, relative to the calibrated one


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_emulation_args(ap, "hetero_probe", batches="4096", slow_by="busy", timeout=600)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=4)
    args = ap.parse_args(argv)
    hetero.with_model_defaults(args)                   # the model of bench/hetero.py, its defaults
    return args


def worker(args):
    import jax
    import numpy as np
    import optax
    from jax.experimental import multihost_utils

    import whalex as wh
    from whalex.balance.calibrate import calibrate, time_rounds
    from whalex.balance.timed_work import loss_work

    pid, log = harness.worker_start("the driver")
    loss_fn, params, batch = hetero.make_model(args)
    optimizer = optax.adam(1e-3)

    fn, lead, _ = loss_work(loss_fn, params, optimizer)
    sets = [(*lead, {k: v[:n] for k, v in batch.items()}) for n in SIZES if n <= args.batch]
    t = time_rounds(jax.local_devices(), fn, sets, 9)                 # (round, this device, size)
    mine = np.median(t[:, 0, :], axis=0)
    curve = np.asarray(multihost_utils.process_allgather(mine)).reshape(2, -1)
    log("curve ms: " + "; ".join(f"p{p} " + " ".join(f"{n}:{1e3 * c:.1f}" for n, c in zip(SIZES, curve[p]))
                                 for p in range(2)))

    cluster = calibrate(wh.Cluster.detect(), loss_fn, params, batch, optimizer=optimizer, repeats=9)
    ratio = cluster.speeds[0] / cluster.speeds[1]
    steps, states, rows = {}, {}, {}
    for f in FACTORS:
        s = wh.parallelize(loss_fn, optimizer, cluster=cluster if f == 1.0 else cluster.with_speeds([ratio * f, 1.0]))
        steps[f], states[f], rows[f] = s, s.init(params, batch), list(s.plan.batch_sizes)

    def run(f):
        states[f], m = steps[f](states[f], batch)
        return float(m["loss"])                # waits for the step on both processes

    timings = harness.interleaved({f: (lambda f=f: run(f)) for f in FACTORS}, args.rounds, block=args.block,
                                  warmup=2, order_by="fixed", sync=None)
    times = {f: timings.times(f) for f in FACTORS}
    out = {"sizes": [n for n in SIZES if n <= args.batch], "curve_s": curve.tolist(), "speed_ratio": ratio,
           "overhead": list(cluster.overhead or ()),
           "sweep": [{"factor": f, "rows": rows[f], "median_s": harness.median(times[f])} for f in FACTORS]}
    harness.write_worker_result(args.worker_out, out, pid)


def main(argv):
    return harness.two_process_main(argv, parse, worker, driver)


def driver(args, argv, cores, env, load_before):
    runs = harness.run_emulations(args, argv, cores, env, __file__)
    print(f"\nstock Flax MLP {args.depth} x Dense({args.width}), Adam; load before {load_before:.2f}")
    for r in runs:
        if "failed" in r:
            print(f"{r['slow_by']} {r['hogs']}, batch {r['batch']}: FAILED {r['failed']}")
            continue
        c = r["curve_s"]
        print(f"\nprocess 1 at 1/{1 + r['hogs']} ({r['slow_by']}), batch {r['batch']}: local step, ms (us per row)")
        for p in range(2):
            print(f"  process {p}: " + "  ".join(f"{n}: {1e3 * t:.1f} ({1e6 * t / n:.0f})"
                                                 for n, t in zip(r["sizes"], c[p])))
        print("  slow/fast per size: " + "  ".join(f"{n}: {b / a:.2f}" for n, a, b in zip(r["sizes"], c[0], c[1])))
        best = min(r["sweep"], key=lambda s: s["median_s"])
        cal = next(s for s in r["sweep"] if s["factor"] == 1.0)
        print(f"  calibrated ratio {r['speed_ratio']:.2f}, "
              f"fixed ms per step {[round(1e3 * o, 1) for o in r['overhead']]}")
        for s in r["sweep"]:
            mark = " <- calibrated" if s["factor"] == 1.0 else ""
            mark += " <- fastest" if s is best else ""
            print(f"  rows {s['rows'][0]:>5}/{s['rows'][1]:<5} step {1e3 * s['median_s']:7.1f} ms{mark}")
        print(f"  the calibrated split is {cal['median_s'] / best['median_s'] - 1:+.1%} slower than the fastest")
    print(f"wrote {harness.write_result('hetero_probe', {'load_before': load_before, 'runs': runs}, args.out)}")


if __name__ == "__main__":
    main(sys.argv[1:])
