"""Is whalex's balanced split the fastest split? A sweep of the real step around it, on the emulated cluster.

What it measures
    The 2-process cluster of `bench/hetero.py`, process 1 slowed by a CPU quota (``--slow-by quota``,
    1/2 or 1/3 of its core) or by busy loops sharing its core (``--slow-by busy``), and one of three
    models (``--model``), Adam:

    * mlp:      the stock Flax MLP of `bench/hetero.py` under `replicate` (the split: rows per device);
    * hybrid:   Whale's Example 2 (`bench/hetero.py --model hybrid`): the MLP a replicate backbone, a
                split classification head (the split: rows and head classes per device together);
    * pipeline: the stock 12-layer MLP of `bench/hetero_pipeline.py` cut into 2 stages by
                ``auto_parallel`` with 8 micro-batches (the split: Dense layers per stage), run with its
                flags (one library call per dot, glibc keeping freed memory).

    In each run:

    * calibrate: ``calibrate(Cluster.detect(), loss_fn, params, batch, optimizer=adam)`` twice, on
      a quarter of the global batch (with ``global_batch=``, as the summary advises: its rows repeated
      up to the step's) and on all of it (the user's two likely choices); the pipeline with
      ``num_micro_batch=`` (a stage runs the step's rows one micro-batch at a time: calibrate times
      them so);
    * whalex:  the balanced plan on each calibration (``wh.parallelize(..., cluster=calibrated)``);
    * refined: ``Config(hardware_aware="refine")`` on each calibration: its first steps time the real
      step at splits around the prediction and keep the fastest (the steps it took are reported; a
      hybrid sweeps its rows, then its head's classes at the rows kept, then its rows again at the
      classes kept where those moved);
    * sweep:   the same step with the slow process's calibrated speed (whole batch) scaled by
      ``--factors`` (default 9 points over x0.7-x1.3), fixed times kept (`Cluster.with_speeds`):
      the fastest of these is "the fastest split found". For the hybrid the scale moves the rows and the
      classes together, one family of splits; the slow process's speed on the classes alone is also
      scaled by ``--head-factors`` (x0.5, x0.75, x1.5, x2) at the calibrated rows (``x1 head x...``,
      `Cluster.with_head_scale`), points of the sweep like the others, so that the fastest found is not
      held to that family (a refinement sweeps the classes alone and can land off it).

    All variants are timed in interleaved blocks on process 0 (each step ends on the replicated
    loss, so process 0's clock sees the slower process); per variant the median step and its spread
    (interquartile range / 2 / median). The table gives each variant's rows (fast/slow) and its median
    over the fastest found (acceptance: whalex within 1.05, refined within 1.03). The least of nine
    noisy medians favours a lucky draw, so the sweep's two fastest splits and whalex's variants are
    then timed again in fresh interleaved rounds (``confirmed_s``, ``--confirm-rounds``, each round's
    order the last one's reversed): the table compares those, round by round. Each split is timed once
    there, whichever variants chose it (one split is one program; ``timed_as`` names the variant timed),
    beside an A/A twin: the sweep's fastest split built and run as a second step, whose ratio to that
    split (in the table's A/A row) is the run's noise floor. A variant's ratio to the
    fastest found is the median over rounds of its block's median over the fastest's in the same round
    (drift over the run falls on both), with a 90% bootstrap interval over the rounds beside it: a
    ratio whose interval straddles a bar is not decided by the run.

Run from the repo root on an otherwise idle machine with >= 2 cores: ``python bench/hetero_sweep.py``
(every combination of ``--slow-by``, ``--slowdowns`` and ``--batches``; several minutes each).
Writes bench/results/hetero_sweep.json (``--model hybrid`` and ``pipeline``: its ``variants``).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

import harness
import hetero  # bench/hetero.py: its model and defaults

FACTORS = tuple(round(0.7 + 0.075 * i, 3) for i in range(9))      # x0.7 ... x1.3 of the slow speed
CONFIRM_SWEEP = 2                                                   # the sweep's fastest splits timed again


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_emulation_args(ap, "hetero_sweep", batches="1024,4096", slow_by="quota,busy", timeout=3600)
    ap.add_argument("--factors", default=",".join(map(str, FACTORS)),
                    help="the slow process's speed relative to its calibrated one, per sweep point")
    ap.add_argument("--model", choices=("mlp", "hybrid", "pipeline"), default="mlp")
    ap.add_argument("--head-factors", default="0.5,0.75,1.5,2",
                    help="hybrid: the slow process's speed on the classes relative to its calibrated one, at "
                         "the calibrated rows, per further sweep point ('' for none)")
    ap.add_argument("--micro", type=int, default=8, help="pipeline: micro-batches per step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--confirm-rounds", type=int, default=10, help="rounds of the confirmation (each --block calls)")
    args = ap.parse_args(argv)
    pipeline = args.model == "pipeline"
    args.model = "mlp" if pipeline else args.model
    hetero.with_model_defaults(args)                   # the model of bench/hetero.py, its defaults
    args.model, args.depth = ("pipeline", 12) if pipeline else (args.model, args.depth)
    args.factors = [float(f) for f in args.factors.split(",")]
    args.head_factors = [float(f) for f in args.head_factors.split(",") if f.strip()]
    return args


def spread(xs) -> float:
    q1, med, q3 = np.percentile(np.asarray(xs, np.float64), [25, 50, 75])
    return float((q3 - q1) / 2 / med) if med > 0 else 0.0


def make(args):
    """The model and the plan's Config of `args.model`: (loss_fn, params, batch, config kwargs)."""
    if args.model == "pipeline":
        import hetero_pipeline
        return (*hetero_pipeline.make_model(args),
                {"auto_parallel": True, "num_task_graph": 2, "num_micro_batch": args.micro})
    return (*hetero.make_model(args), {})


def split_of(plan) -> str:
    """What a variant's plan splits, as text: rows per device, a split head's classes, stage layers."""
    from whalex.refining import placement
    rows, head, layers = placement(plan)
    if plan.schedule is not None:
        return "layers " + "/".join(str(len(x)) for x in layers)
    return "/".join(map(str, rows)) + (f" head {'/'.join(map(str, head))}" if head else "")


def worker(args):
    import optax

    import whalex as wh
    from whalex.balance.calibrate import calibrate
    from whalex.mesh.cluster import scaled_speeds

    pid, log = harness.worker_start("the driver")
    loss_fn, params, batch, config = make(args)
    optimizer = optax.adam(1e-3)
    quarter = {k: v[: args.batch // 4] for k, v in batch.items()}
    micro = {"num_micro_batch": args.micro} if args.model == "pipeline" else {}
    clusters = {c: calibrate(wh.Cluster.detect(), loss_fn, params, b, optimizer=optimizer, repeats=9, **kw, **micro)
                for c, b, kw in (("quarter", quarter, {"global_batch": args.batch}), ("whole", batch, {}))}
    base = clusters["whole"]
    steps, states = {}, {}

    def add(name, cluster, **more):
        s = wh.parallelize(loss_fn, optimizer, cluster=cluster, config=wh.Config(**config, **more))
        steps[name], states[name] = s, s.init(params, batch)

    refine_steps = {}
    for c, cluster in clusters.items():
        add(f"whalex ({c})", cluster)
        add(f"refined ({c})", cluster, hardware_aware="refine")
        refine_steps[f"refined ({c})"] = refine(steps, states, f"refined ({c})", batch, log)
    sweep = {f"x{f:g}": base.with_speeds(scaled_speeds(base.speeds, f)[0], overhead=base.overhead)
             for f in args.factors}                    # the twin below reuses its split's cluster
    if args.model == "hybrid":                         # the classes alone: the joint scale moves both together
        slow = scaled_speeds(base.speeds, 1.0)[1]
        at = base.with_speeds(base.speeds, overhead=base.overhead)
        sweep |= {f"x1 head x{h:g}": at.with_head_scale(base.head_scale * h, slow) for h in args.head_factors}
    for name, cluster in sweep.items():
        add(name, cluster)
    splits = {name: split_of(s.plan) for name, s in steps.items()}
    log(f"splits: {splits}")

    run = harness.step_runner(steps, states, batch)     # the loss as a float: waits for the step on both processes
    timings = harness.interleaved({n: (lambda n=n: run(n)) for n in steps}, args.rounds, block=args.block,
                                  warmup=2, order_by="fixed", sync=None)
    ranked = ranked_sweep(timings, splits)
    twin = f"A/A {ranked[0]}"                          # the fastest split built again: the run's noise floor
    add(twin, sweep[ranked[0]])
    splits[twin] = split_of(steps[twin].plan)
    for _ in range(3):                                 # its compile and first steps, untimed
        run(twin)
    timed_as = {**timed_splits(splits, ranked[:CONFIRM_SWEEP]), twin: twin}
    confirmed = confirm(run, list(dict.fromkeys(timed_as.values())), args, log)
    out = {"model": args.model, "speeds": {c: list(cl.speeds) for c, cl in clusters.items()},
           "overheads": {c: list(cl.overhead or ()) for c, cl in clusters.items()},
           "calibrated_rows": {c: cl.calibrated_rows for c, cl in clusters.items()},
           "refine_steps": refine_steps, "confirm_block": args.block,
           "refinements": {n: refinement_record(s.plan) for n, s in steps.items() if n.startswith("refined")},
           "variants": [variant_record(n, s.plan, splits[n], timings, confirmed, timed_as) for n, s in steps.items()]}
    harness.write_worker_result(args.worker_out, out, pid)


def variant_record(name, plan, split, timings, confirmed, timed_as) -> dict:
    """One variant's results: its rows and split, the sweep's median and spread (the A/A twin, built after
    the sweep: its confirmation's), and the confirmation of the name its split was timed under."""
    sweep = timings if name in timings.wall else confirmed
    out = {"name": name, "rows": list(plan.batch_sizes), "split": split,
           "median_s": harness.median(sweep.times(name)), "spread": spread(sweep.times(name))}
    if name not in timed_as:
        return out
    again = timed_as[name]
    return {**out, "confirmed_s": harness.median(confirmed.times(again)),
            "confirmed_rounds": [harness.median(b) for b in confirmed.wall[again]],
            **({"timed_as": again} if again != name else {})}


def ranked_sweep(timings, splits) -> list[str]:
    """The sweep's points, fastest first by their medians, one per split (neighbouring speeds can give the
    same rows)."""
    from whalex.refining import slowest
    sweep = [n for n in splits if n.startswith("x")]
    medians = slowest([harness.median(timings.times(n)) for n in sweep])   # alike on every process: one program
    ranked = [sweep[i] for i in np.argsort(medians, kind="stable")]
    return [n for i, n in enumerate(ranked) if splits[n] not in {splits[m] for m in ranked[:i]}]


def timed_splits(splits, fastest) -> dict:
    """{variant: the name its split is timed under} for the sweep's `fastest` points and every whalex
    variant: one timing per split, since a split is one program whichever variant chose it (variants
    that share a split would otherwise differ by the run's noise alone, which the A/A twin measures)."""
    by_split = {splits[n]: n for n in fastest}
    return {**{n: n for n in fastest},
            **{n: by_split.setdefault(splits[n], n) for n in splits if not n.startswith(("x", "A/A"))}}


def confirm(run, names, args, log):
    """`names` timed again in fresh interleaved rounds: the least of nine noisy medians is a lucky draw as
    often as a fast split, so the fastest found is compared with whalex's plans on timings that did not
    choose it."""
    log(f"confirming {names}")
    return harness.interleaved({n: (lambda n=n: run(n)) for n in names}, args.confirm_rounds, block=args.block,
                               warmup=1, order_by="alternate", sync=None)


def refine(steps, states, name, batch, log):
    """Runs a refining step's first calls until its refinement settles: the steps it took (None: the
    plan has nothing to refine)."""
    from whalex.balance.refine import max_steps
    from whalex.refining import refinable

    for _ in range(max_steps(head=True) if refinable(steps[name].plan) else 0):    # then it runs the split kept
        states[name], _ = steps[name](states[name], batch)
        if steps[name].plan.refinement is not None:
            break
    ref = steps[name].plan.refinement
    head = "" if ref is None or ref.head is None else f", its head's classes x{ref.head.kept:.3g}"
    head += "" if ref is None or ref.again is None else f", its rows again x{ref.again.kept:.3g}"
    log(f"{name}: " + (f"kept x{ref.kept:.3g}{head} ({split_of(steps[name].plan)}) after {ref.steps} steps"
                       if ref else "nothing refined"))
    return None if ref is None else ref.steps


def refinement_record(plan) -> dict | None:
    """What a refinement timed and kept, for the results file: (scale, rows, seconds, paired ratio to the
    prediction, timed steps, head units) per split, and the split kept (a fitted vertex or the least
    median), its rows and head units, the gain the sweep saw and the rounds of the sweep that decided;
    a hybrid's head sweep (`head`) and its rows' sweep at the classes kept (`again`) likewise."""
    return sweep_record(plan.refinement)


def sweep_record(ref) -> dict | None:
    """`refinement_record`'s record of one sweep (a `whalex.balance.refine.Refinement`), None for None."""
    if ref is None:
        return None
    row = lambda p: [p.scale, list(p.rows), p.seconds, p.paired, p.steps, list(p.units)]      # noqa: E731
    return {"kept": ref.kept, "kept_rows": list(ref.kept_rows), "kept_units": list(ref.kept_units),
            "fitted": ref.fitted, "gain": ref.gain, "rounds": ref.rounds, "steps": ref.steps,
            "points": [row(p) for p in ref.points], "head": sweep_record(ref.head), "again": sweep_record(ref.again)}


def _versus(v, best, key) -> str:
    if "confirmed_rounds" in v and "confirmed_rounds" in best:
        mid, lo, hi = harness.paired_ratio(v["confirmed_rounds"], best["confirmed_rounds"])
        return f"{mid:.3f} [{lo:.3f}-{hi:.3f}]"
    return f"{v[key] / best[key]:.3f}"


def emulation(run) -> str:
    """How a run slowed its second process, as the table names it: "quota 1/2", "busy 1/3"."""
    hogs = run["hogs"]
    return f"{run['slow_by']} {'1/2' if hogs == 1 else '1/3' if hogs == 2 else hogs}"


def table(runs) -> list[str]:
    head = ("emulation", "batch", "variant", "split (fast/slow)", "median", "spread", "/ fastest [90%]")
    body = []
    for r in runs:
        what = emulation(r)
        if "failed" in r:
            body.append((what, str(r["batch"]), "FAILED", r["failed"], "", "", ""))
            continue
        sweep = [v for v in r["variants"] if v["name"].startswith("x")]
        key = "confirmed_s" if all("confirmed_s" in v for v in r["variants"] if not v["name"].startswith("x")) \
            else "median_s"                          # runs before the confirmation: the sweep's own medians
        best = min((v for v in sweep if key in v), key=lambda v: v[key])
        named = {v["name"]: v for v in r["variants"]}
        for v in [v for v in r["variants"] if not v["name"].startswith("x")] + [best]:
            name = v["name"] if v is not best else f"fastest found ({v['name']})"
            where = v.get("split") or "/".join(map(str, v["rows"]))
            versus = named[v["name"][4:]] if v["name"].startswith("A/A ") else best   # the twin: its own split
            body.append((what, str(r["batch"]), name, where, f"{1e3 * v[key]:.1f} ms",
                         f"±{100 * v['spread']:.1f}%", _versus(v, versus, key)))
    return _table(head, body)


def _table(head, rows) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]


def main(argv):
    return harness.two_process_main(argv, parse, worker, driver)


def driver(args, argv, cores, env, load_before):
    if args.model == "pipeline":                       # bench/hetero_pipeline.py's flags for its model
        import hetero_pipeline
        env = harness.allocator_env({**env, "XLA_FLAGS": " ".join([env["XLA_FLAGS"], hetero_pipeline.YNN])}, "cached")
    runs = harness.run_emulations(args, argv, cores, env, __file__)
    print(f"\n{args.model}: stock Flax MLP {args.depth} x Dense({args.width}), Adam; load before {load_before:.2f}")
    print("\n".join(table(runs)))
    variant = None if args.model == "mlp" else args.model       # the other models' runs: the file's variants
    path = harness.write_result("hetero_sweep", {"load_before": load_before, "runs": runs}, args.out, variant=variant)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
