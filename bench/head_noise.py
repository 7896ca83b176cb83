"""Which class split a calibration's head timing picks, time after time, and which the step runs fastest.

The 2-process cluster of `bench/hetero_sweep.py` (process 1 slowed by a CPU quota or by busy loops on its
core), Whale's Example 2 (bench/hetero.py's hybrid) with Adam, calibrated on the whole batch without the
head. Then, on the same cluster: ``--trials`` times, the head's program timed as a calibration times it
(`whalex.balance.head_timing.head_rounds` at the step's rows: a calibration on fewer rows repeats them
up to ``global_batch``), each trial's split kept from its first 9 and 18 rounds and from all of them
(`head_timing.MAX_ROUNDS` within ``--head-seconds``, by default a calibration's `head_timing.SECONDS`);
and the real step, its rows at the calibrated split, at every class split those timings can pick, in
interleaved rounds (``--rounds``, blocks of ``--block`` steps, the first untimed). Writes every round's
seconds to bench/results/head_noise.json, and prints each class split's step time over the fastest's
and how often each rule kept it.

    python bench/head_noise.py [--slow-by quota,busy] [--slowdowns 2] [--batches 1024] [--trials 6]
"""
from __future__ import annotations

import argparse
import functools
import sys

import numpy as np

import harness
import hetero  # bench/hetero.py: its model and defaults


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_emulation_args(ap, "head_noise", batches="1024", slowdowns="2", slow_by="busy", timeout=1500)
    ap.add_argument("--trials", type=int, default=6, help="head timings per row count")
    ap.add_argument("--rounds", type=int, default=20,
                    help="interleaved rounds of the step at each class split (0: the head timings only)")
    ap.add_argument("--block", type=int, default=3, help="steps per block, the first untimed")
    ap.add_argument("--head-seconds", type=float, default=None,
                    help="how long each trial times the head (default: head_timing.SECONDS, as a calibration)")
    args = ap.parse_args(argv)
    args.model = "hybrid"
    hetero.with_model_defaults(args)
    return args


def worker(args):
    import optax
    from jax.experimental import multihost_utils

    import whalex as wh
    from whalex.balance.calibrate import calibrate
    from whalex.balance.head_timing import SECONDS, counts_at, head_rounds, kept_scale, split_heads

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
        every = np.asarray(multihost_utils.process_allgather(times))      # [processes, rounds, scales]
        trials.append({"scales": list(scales), "times": every.tolist(), "kept": kept,
                       "counts": list(counts_at(head.classes, cluster.speeds, kept))})
        log(f"trial {t}: {len(times)} rounds, kept x{kept:.3f} -> classes {trials[-1]['counts']}; medians "
            + ", ".join(f"x{s:g} {1e3 * m:.2f}" for s, m in timed))
    record = {"speeds": list(cluster.speeds), "overheads": list(cluster.overhead or ()), "trials": trials}
    if args.rounds > 0:
        record.update(_step_at_each_split(args, cluster, loss_fn, optimizer, params, batch, head, log))
    harness.write_worker_result(args.worker_out, record, pid)


def _step_at_each_split(args, cluster, loss_fn, optimizer, params, batch, head, log) -> dict:
    """The real step, its rows at the calibrated split, at every class split a head timing can pick, in
    interleaved rounds: {"rows": {split: rows}, "step": {split: {"scale", "blocks"}}}."""
    import whalex as wh
    from whalex.balance.head_timing import distinct_splits

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
    return {"rows": rows,
            "step": {n: {"scale": splits[tuple(map(int, n.split("/")))], "blocks": b} for n, b in step.items()}}


def picks(trial: dict, classes: int, speeds) -> dict[str, tuple[int, ...]]:
    """The class split a trial's head timings give by each rule: the calibration's (`decided` over the
    drift-free medians averaged over processes, as `kept_scale` decides) from its first 9 and 18 rounds
    and from all of them, the V through every round's points (the refinement's, `decide`, snapped to
    neighbouring splits; the processes' seconds averaged per round), and the least drift-free median.
    A record of one process's times (the bench's first runs) is that process's alone."""
    from whalex.balance.head_timing import counts_at, decided, drift_free_medians
    from whalex.balance.refine import decide

    counts = functools.partial(counts_at, classes, speeds)
    scales, every = trial["scales"], np.asarray(trial["times"])
    every = every[None] if every.ndim == 2 else every                       # [processes, rounds, scales]

    def medians(rounds):
        return np.mean([drift_free_medians(t[:rounds]) for t in every], axis=0)
    table = {r: {s: [float(t)] for s, t in zip(scales, row)} for r, row in enumerate(every.mean(axis=0))}
    out = {f"{n} rounds": counts(decided(scales, medians(n))[0]) for n in (9, 18) if n < every.shape[1]}
    whole = medians(None)
    return {**out, "all rounds": counts(decided(scales, whole)[0]),
            "rounds V": counts(decide(table, counts)[0]),
            "least median": counts(scales[int(np.argmin(whole))])}


def tally(run: dict, classes: int) -> dict[str, list[str]]:
    """{rule: the class split each trial's timings give by it} (`picks`; the first runs kept their trials
    by the rows they timed)."""
    out: dict[str, list[str]] = {}
    trials = run["trials"]
    for t in [t for v in trials.values() for t in v] if isinstance(trials, dict) else trials:
        for rule, counts in picks(t, classes, run["speeds"]).items():
            out.setdefault(rule, []).append("/".join(map(str, counts)))
    return out


def report(run: dict, classes: int) -> list[str]:
    """Each class split's step time over the fastest's (paired by round), and how often each rule picks it;
    without the step timed, each rule's picks."""
    picked = tally(run, classes)
    head = f"{harness.slowed(run)} batch {run['batch']}"
    if "step" not in run:
        return [head] + [f"  {rule}: {', '.join(v)}" for rule, v in picked.items()]
    names = list(run["step"])
    per_round = np.array([[np.median(b) for b in run["step"][n]["blocks"]] for n in names])    # [split, round]
    ratio = np.median(per_round / per_round.min(axis=0, keepdims=True).clip(1e-12), axis=1)
    paired = np.median(per_round / per_round[int(np.argmin(np.median(per_round, axis=1)))], axis=1)
    lines = [f"{head}, rows {next(iter(run['rows'].values()))}"]
    for i, n in enumerate(names):
        chosen = ", ".join(f"{rule} x{v.count(n)}" for rule, v in picked.items() if n in v)
        lines.append(f"  classes {n:>10}: step {1e3 * np.median(per_round[i]):.1f} ms, over the fastest "
                     f"{paired[i]:.3f} (per round {ratio[i]:.3f}); picked by {chosen or '-'}")
    return lines


def driver(args, argv, cores, env, load_before):
    runs = harness.run_emulations(args, argv, cores, env, __file__)
    for run in runs:
        if "trials" in run:
            print("\n".join(report(run, args.classes)), flush=True)
    path = harness.write_result("head_noise", {"load_before": load_before, "runs": runs}, args.out)
    print(f"wrote {path}")


def main(argv):
    return harness.two_process_main(argv, parse, worker, driver)


if __name__ == "__main__":
    main(sys.argv[1:])
