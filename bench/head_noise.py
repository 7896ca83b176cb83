"""Which class split a calibration's head timing picks, time after time, and which the step runs fastest.

The 2-process cluster of `bench/hetero_sweep.py` (process 1 slowed by a CPU quota or by busy loops on its
core), Whale's Example 2 (bench/hetero.py's hybrid) with Adam, calibrated on the whole batch without the
head. Then, on the same cluster: ``--trials`` times, the head's program timed as a calibration times it
(`whalex.balance.head_timing.head_rounds` at the step's rows: a calibration on fewer rows repeats them
up to ``global_batch``), each trial's split kept from its first 9 rounds (a fixed count) and from all
of them (rounds for `head_timing.SECONDS`); and the real step, its rows at the calibrated split, at
every class split those timings can pick, in interleaved rounds (``--rounds``, blocks of ``--block``
steps, the first untimed). Writes every round's seconds to bench/results/head_noise.json, and prints
each class split's step time over the fastest's and how often each rule kept it.

    python bench/head_noise.py [--slow-by quota,busy] [--slowdowns 2] [--batches 1024] [--trials 6]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

import harness
import hetero  # bench/hetero.py: its model and defaults


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_emulation_args(ap, "head_noise", batches="1024", slowdowns="2", slow_by="busy", timeout=1500)
    ap.add_argument("--trials", type=int, default=6, help="head timings per row count")
    ap.add_argument("--rounds", type=int, default=20, help="interleaved rounds of the step at each class split")
    ap.add_argument("--block", type=int, default=3, help="steps per block, the first untimed")
    ap.add_argument("--head-seconds", type=float, default=None,
                    help="how long each trial times the head (default: head_timing.SECONDS, as a calibration)")
    args = ap.parse_args(argv)
    args.model = "hybrid"
    hetero.with_model_defaults(args)
    return args


def worker(args):
    import optax

    import whalex as wh
    from whalex.balance.calibrate import calibrate
    from whalex.balance.head_timing import SECONDS, class_counts, distinct_splits, head_rounds, kept_scale, split_heads
    from whalex.balance.refine import scaled_speeds

    pid, log = harness.worker_start("the driver")
    loss_fn, params, batch = hetero.make_model(args)
    optimizer = optax.adam(1e-3)
    cluster = calibrate(wh.Cluster.detect(), loss_fn, params, batch, optimizer=optimizer, repeats=9, head=False)
    head = split_heads(loss_fn, params, batch)[0]
    trials = []
    for t in range(args.trials):
        scales, times = head_rounds(cluster.devices, head, cluster.speeds, 9,
                                    seconds=SECONDS if args.head_seconds is None else args.head_seconds)
        kept, timed = kept_scale(scales, times)
        counts = class_counts(head.classes, scaled_speeds(cluster.speeds, kept)[0])
        trials.append({"scales": list(scales), "times": times.tolist(), "kept": kept, "counts": list(counts)})
        log(f"trial {t}: {len(times)} rounds, kept x{kept:.3f} -> classes {counts}; medians "
            + ", ".join(f"x{s:g} {1e3 * m:.2f}" for s, m in timed))

    grid = np.round(np.arange(0.40, 1.20, 0.05), 2)  # every class split a timing can pick, the step at each
    splits = {c: s for s, c in distinct_splits(head.classes, cluster.speeds, grid).items()}
    steps, states = {}, {}
    for counts, s in splits.items():
        name = "/".join(map(str, counts))
        steps[name] = wh.parallelize(loss_fn, optimizer, cluster=cluster.with_head_scale(s))
        states[name] = steps[name].init(params, batch)
    rows = {n: list(st.plan.batch_sizes) for n, st in steps.items()}
    log(f"rows {rows}")
    run = harness.step_runner(steps, states, batch)
    timings = harness.interleaved({n: (lambda n=n: run(n)) for n in steps}, args.rounds, block=args.block,
                                  warmup=2, order_by="alternate", sync=None)
    step = {n: [blk[1:] for blk in timings.wall[n]] for n in steps}
    for n in steps:
        log(f"step at classes {n}: median {1e3 * np.median(step[n]):.1f} ms")
    record = {"speeds": list(cluster.speeds), "overheads": list(cluster.overhead or ()), "rows": rows,
              "trials": trials,
              "step": {n: {"scale": splits[tuple(map(int, n.split("/")))], "blocks": b} for n, b in step.items()}}
    harness.write_worker_result(args.worker_out, record, pid)


def picks(trial: dict, classes: int, speeds) -> dict[str, tuple[int, ...]]:
    """The class split a trial's head timings give by each rule: the V through the drift-free medians
    (the calibration's, `kept_scale`) of its first 9 rounds and of all of them, the V through every
    round's points (the refinement's, `decide`, snapped to neighbouring splits), and the least
    drift-free median."""
    from whalex.balance.head_timing import class_counts, drift_free_medians, kept_scale
    from whalex.balance.refine import decide, scaled_speeds

    def counts(s):
        return class_counts(classes, scaled_speeds(speeds, s)[0])
    def median_v(times):
        return counts(kept_scale(scales, times)[0])
    scales, times = trial["scales"], np.asarray(trial["times"])
    table = {r: {s: [float(t)] for s, t in zip(scales, row)} for r, row in enumerate(times)}
    return {"9 rounds": median_v(times[:9]), "all rounds": median_v(times),
            "rounds V": counts(decide(table, counts)[0]),
            "least median": counts(scales[int(np.argmin(drift_free_medians(times)))])}


def report(run: dict, classes: int) -> list[str]:
    """Each class split's step time over the fastest's (paired by round), and how often each rule picks it."""
    names = list(run["step"])
    per_round = np.array([[np.median(b) for b in run["step"][n]["blocks"]] for n in names])    # [split, round]
    ratio = np.median(per_round / per_round.min(axis=0, keepdims=True).clip(1e-12), axis=1)
    paired = np.median(per_round / per_round[int(np.argmin(np.median(per_round, axis=1)))], axis=1)
    lines = [f"{run['slow_by']} 1/{1 + run['hogs']} batch {run['batch']}, rows {next(iter(run['rows'].values()))}"]
    tally = {}
    for t in run["trials"]:
        for rule, counts in picks(t, classes, run["speeds"]).items():
            tally.setdefault(rule, []).append("/".join(map(str, counts)))
    for i, n in enumerate(names):
        chosen = ", ".join(f"{rule} x{v.count(n)}" for rule, v in tally.items() if n in v)
        lines.append(f"  classes {n:>10}: step {1e3 * np.median(per_round[i]):.1f} ms, over the fastest "
                     f"{paired[i]:.3f} (per round {ratio[i]:.3f}); picked by {chosen or '-'}")
    return lines


def driver(args, argv, cores, env, load_before):
    runs = harness.run_emulations(args, argv, cores, env, __file__)
    for run in runs:
        if "step" in run:
            print("\n".join(report(run, args.classes)), flush=True)
    path = harness.write_result("head_noise", {"load_before": load_before, "runs": runs}, args.out)
    print(f"wrote {path}")


def main(argv):
    return harness.two_process_main(argv, parse, worker, driver)


if __name__ == "__main__":
    main(sys.argv[1:])
