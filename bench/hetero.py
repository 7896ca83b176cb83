"""Hardware-aware balance on a real 2-process run with one slowed process (issues 4 and 12).

What it measures
    Two processes on this machine, started by ``python -m whalex.launch -n 2`` (one CPU device
    each, process i pinned to core i), form one jax.distributed group (gloo collectives). Process
    1's core also runs competing busy loops (``while True: pass`` pinned to that core, started
    before the workers and killed by PID at the end, also on failure): one busy loop leaves process
    1 about half a core (near 2:1), two leave it about a third (near 3:1); ``--slow-by quota`` caps
    process 1 at that share of its core by a CPU cgroup quota instead (`harness.add_emulation_args`).
    A heterogeneous cluster made of identical hardware.

    The model is what users write: a stock Flax MLP (``nn.Dense`` layers with their biases, ReLU,
    a Dense head), MSE, Adam, under ``wh.replicate()``. It is trained three ways in the same run,
    from the same initial parameters on the same global batch:

    * plain:    a hand-written ``jax.jit`` data-parallel step over the 2-process mesh (params
                replicated, batch ``P('data')``): the plain-JAX reference, an even split.
    * even:     whalex with ``Config(hardware_aware=False)``: the even plan.
    * balanced: whalex on the calibrated cluster: ``calibrate(cluster, loss_fn, params,
                batch, optimizer=optimizer)`` times the user's step (loss, gradient, Adam
                update) on each process's device at a quarter, half and all of the global batch's
                rows (all-gathered): the fitted line's time per row gives each speed, its intercept
                each device's fixed time per step, and Algorithm 1 equalises fixed time + rows x
                time per row.
    * same-even: the balanced program at a near-even split (the cluster declared 1 : 1.01 with
                ``Cluster.with_speeds``): the baseline that isolates the balance (see Collectives).

    Steps are timed one by one on process 0 (each ends on the replicated loss, which needs the
    cross-process all-reduce, so process 0's clock sees the slowest process), in interleaved blocks
    (plain, even, balanced, plain, ...) so that drift hits all three alike; medians are reported.
    Every (slowdown, batch) configuration is a separate 2-process run; one table at the end. Both
    processes' glibc keeps freed memory (``--allocator cached``, ``harness.CACHED_MALLOC``), as a GPU
    runtime pools it, instead of faulting in fresh pages for a step's large temporaries depending on
    what was freed before (``--allocator default`` measures without).

Definitions (s0, s1: calibrated speeds of the two processes, W: work of one global step)
    ideal even time      (W/2) / min(s0, s1)      half the batch each, the slow one bounds the step
    ideal balanced time  W / (s0 + s1)            work in proportion to speed, no overheads
    ideal speedup        even / balanced = (s0 + s1) / (2 min(s0, s1))
    actual speedup       median even step / median balanced step
    efficiency           actual speedup / ideal speedup        (target >= 0.95)
    split-limited ideal  the ideal speedup with the batch split the planner actually chose.
    The speeds are the mean of a calibration before and one after the timed steps.

    Collectives: gloo runs the operands of an all-reduce one after the other, each at a fixed cost
    of a few ms when a busy loop shares the core. The even plan (GSPMD, like plain jax.jit)
    all-reduces every gradient leaf (two per Dense layer); the balanced program psums one fused
    gradient buffer after its chunk loop (`whalex.lowering.fused_collectives.fused_psum`). The table prints
    even/plain and balanced/plain so that this difference is visible next to the speedup.

Whale's Example 2 (``--model hybrid``)
    The same MLP (its last nn.Dense(width) giving the features) under ``wh.replicate()``, then a
    classification head over ``--classes`` under ``wh.split()``: ``wh.ops.softmax_cross_entropy_head``
    with the nn.Dense head's kernel and bias (``--head ops``: the classes split in proportion to
    speed) or nn.Dense + optax's cross-entropy (``--head optax``: an even GSPMD head). Balanced, the
    backbone runs speed-proportional rows and a gather bridges them to the head
    (``whalex.lowering.uneven_hybrid``). plain is the hand-written GSPMD hybrid: backbone
    replicated, head kernel and bias sharded over the classes, batch ``P('data')``. The table adds
    the planner's predictions (plan.balance for the rows, plan.head_balance for the classes), and
    the split-limited ideal weighs each split by its share of the step's FLOPs.

Run from the repo root: ``python bench/hetero.py`` (about 10 minutes on 2 CPU cores for the six
configurations; needs >= 2 cores and an otherwise idle machine). Writes bench/results/hetero.json;
``python bench/hetero.py --model hybrid`` (batch 4096, one busy loop) writes
bench/results/hetero_hybrid.json. ``--repeats 3`` runs every configuration three times, interleaved,
and ends with a table of each configuration's medians over its runs (the figures to quote).
Prints PASS/FAIL per configuration against the 0.95 efficiency target but never fails the process
on FAIL. ``--slowdowns 0`` runs without a busy loop (a control: the planner should keep the even plan).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import harness

TARGET = 0.95


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_emulation_args(ap, "hetero", batches="", slowdowns="", slow_by="busy", timeout=400,
                               notes={"batches": " (default: mlp 4096,2048,4116; hybrid 4096)",
                                      "slowdowns": " (0: a control; default: mlp 1,2; hybrid 1)",
                                      "out": "; hetero_hybrid.json with --model hybrid"})
    ap.add_argument("--model", choices=("mlp", "hybrid"), default="mlp",
                    help="mlp: a replicate MLP (MSE); hybrid: Whale's Example 2, the MLP as a replicate backbone "
                         "and a split classification head")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=3, help="hidden Dense layers")
    ap.add_argument("--classes", type=int, default=2048, help="hybrid: classes of the split head")
    ap.add_argument("--head", choices=("ops", "optax"), default="ops",
                    help="hybrid: wh.ops.softmax_cross_entropy_head (uneven class shards) or nn.Dense + optax's "
                         "cross-entropy (an even GSPMD head)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (one block of each variant)")
    ap.add_argument("--block", type=int, default=5, help="timed steps per block")
    ap.add_argument("--calib-rows", type=int, default=None,
                    help="rows of the calibration batch (default: the whole global batch, as a user passes it)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="2-process runs per configuration, interleaved (all configurations, then again): the "
                         "final table gives each configuration's median over its runs")
    harness.add_allocator_arg(ap)
    args = ap.parse_args(argv)
    hybrid = args.model == "hybrid"
    args.batches = args.batches or ("4096" if hybrid else "4096,2048,4116")       # the default per model
    args.slowdowns = args.slowdowns or ("1" if hybrid else "1,2")
    return args


# ----------------------------------------------------------------------------------- the model

OUT = 8


def with_model_defaults(args):
    """`args` (a sibling bench's) completed with this bench's model options at their defaults."""
    for k, v in vars(parse([])).items():
        if not hasattr(args, k):
            setattr(args, k, v)
    return args


def make_model(args):
    """The model of `args.model`: (loss_fn, params, batch)."""
    return make_hybrid(args) if args.model == "hybrid" else make_mlp(args)


def make_mlp(args):
    """A stock Flax MLP (bench/models.py): `depth` x (nn.Dense(width) + ReLU) and an nn.Dense(OUT) head."""
    from models import mlp_regression

    model, params, batch = mlp_regression(args.width, args.depth, OUT, args.batch)

    def loss_fn(p, b):
        import jax.numpy as jnp

        import whalex as wh
        with wh.replicate():                   # data parallel over every device of every process
            return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    return loss_fn, params, batch


def make_hybrid(args):
    """Whale's Example 2 as users write it: the stock Flax MLP (its last nn.Dense(width) gives the
    features) under `wh.replicate()`, a classification head over `classes` under `wh.split()`."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from models import MLP

    backbone, head = MLP(args.width, args.depth, args.width), nn.Dense(args.classes)
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((args.batch, args.width)).astype(np.float32),
             "y": rng.integers(0, args.classes, args.batch).astype(np.int32)}
    params = jax.device_get({"backbone": backbone.init(jax.random.key(0), batch["x"][:1])["params"],
                             "head": head.init(jax.random.key(1), jnp.zeros((1, args.width)))["params"]})

    def loss_fn(p, b):
        import whalex as wh
        with wh.replicate():                   # data parallel over every device of every process
            h = backbone.apply({"params": p["backbone"]}, b["x"])
        with wh.split():                       # the classes sharded over every device
            if args.head == "ops":
                return wh.ops.softmax_cross_entropy_head(h, p["head"]["kernel"], p["head"]["bias"], b["y"])
            return optax.softmax_cross_entropy_with_integer_labels(head.apply({"params": p["head"]}, h), b["y"]).mean()

    return loss_fn, params, batch


def plain_param_specs(args, params):
    """Parameter layouts of the hand-written jax.jit step: replicated, and for the hybrid the head's
    classes sharded over 'data' (GSPMD's Example 2)."""
    import jax
    from jax.sharding import PartitionSpec as P

    specs = jax.tree.map(lambda _: P(), params)
    if args.model == "hybrid":
        specs["head"] = {"kernel": P(None, "data"), "bias": P("data")}
    return specs


def flops_per_step(args) -> float:
    """Forward + backward FLOPs of one global step (6 per multiply-add), the dense layers only."""
    if args.model == "hybrid":
        return 6.0 * args.batch * ((args.depth + 1) * args.width ** 2 + args.width * args.classes)
    return 6.0 * args.batch * (args.depth * args.width ** 2 + args.width * OUT)


def head_classes(plan):
    """The classes of each process's head shard when the plan splits them unevenly, else None."""
    r = plan.head_balance
    return [d.rows for d in r.devices] if r is not None and r.applied else None


def phases(args, rows, classes) -> list:
    """(fraction of the step's FLOPs, per-process loads) of each part the plan splits on its own: the
    rows of the batch, and for the hybrid's head the class shards (`classes` None: an even head)."""
    if args.model != "hybrid":
        return [(1.0, rows)]
    total = flops_per_step(args)
    head = 6.0 * args.batch * args.width * args.classes / total
    return [(1.0 - head, rows), (head, classes or [args.classes // 2] * 2)]


# ------------------------------------------------------------------------------------- worker

def worker(args):
    """One 2-process run: calibrate, build the four programs, time them interleaved, calibrate again."""
    import optax

    pid, log = harness.worker_start("the driver: python bench/hetero.py")
    loss_fn, params, batch = make_model(args)
    optimizer = optax.adam(1e-3)
    small = {k: v[: args.calib_rows] for k, v in batch.items()} if args.calib_rows else batch
    cluster = _calibrate(loss_fn, params, small, optimizer, log)
    progs = _programs(args, loss_fn, optimizer, cluster, params, batch)
    times, losses = _time_programs(args, progs, batch, log)
    # speeds again at the end: did the slowdown stay put while we measured?
    again = _calibrate(loss_fn, params, small, optimizer)
    harness.write_worker_result(args.worker_out, _worker_record(args, cluster, again, progs, times, losses), pid)


def _calibrate(loss_fn, params, small, optimizer, log=None):
    """The cluster with both processes' calibrated speeds (logged, with the time it took, given `log`)."""
    import whalex as wh
    from whalex.balance.calibrate import calibrate

    t0 = time.perf_counter()
    cluster = calibrate(wh.Cluster.detect(), loss_fn, params, small, optimizer=optimizer, repeats=9)
    if log is not None:
        log(f"calibrated speeds (GFLOP/s): {[round(float(s) / 1e9, 2) for s in cluster.speeds]}, fixed ms per step "
            f"{[round(1e3 * o, 2) for o in cluster.overhead or ()]}, in {time.perf_counter() - t0:.1f} s")
    return cluster


def _plain_step(args, loss_fn, optimizer, params, batch):
    """Plain JAX: the hand-written data-parallel step on the same 2-process mesh, its state and the
    batch's sharding."""
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices())
    rep, dat = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    p_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), plain_param_specs(args, params))

    def plain_step(state, b):
        p, o = state
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        u, o = optimizer.update(g, o, p)
        return (optax.apply_updates(p, u), o), loss

    o_sh = optax.tree_map_params(optimizer, lambda _, sh: sh, jax.eval_shape(optimizer.init, params), p_sh,
                                 transform_non_params=lambda _: rep)      # Adam's moments as their params
    plain_jit = jax.jit(plain_step, out_shardings=((p_sh, o_sh), rep), donate_argnums=(0,))
    pp = jax.device_put(params, p_sh)
    return plain_jit, (pp, jax.jit(optimizer.init, out_shardings=o_sh)(pp)), jax.tree.map(lambda _: dat, batch)


def _programs(args, loss_fn, optimizer, cluster, params, batch) -> dict:
    """The compared programs: plain JAX, whalex even, whalex balanced, and the balanced program itself
    at a near-even split (declared speeds 1 : 1.01): the same chunk loop and fused gradient psum as
    "balanced", so balanced vs this isolates the balance from the collectives."""
    import whalex as wh

    even = wh.parallelize(loss_fn, optimizer, config=wh.Config(hardware_aware=False), cluster=cluster)
    bal = wh.parallelize(loss_fn, optimizer, cluster=cluster)
    same = wh.parallelize(loss_fn, optimizer, cluster=cluster.with_speeds([1.0, 1.01]))
    plain_jit, plain_state, batch_sh = _plain_step(args, loss_fn, optimizer, params, batch)
    return {"steps": {"even": even, "balanced": bal, "same-even": same},
            "states": {"even": even.init(params, batch), "balanced": bal.init(params, batch),
                       "same-even": same.init(params, batch), "plain": plain_state},
            "plain": plain_jit, "batch_sh": batch_sh}


def _time_programs(args, progs, batch, log):
    """Each program's step times (compiled and warmed up, then interleaved blocks in a fixed order:
    plain, even, same-even, balanced, ...) and its last loss."""
    from whalex.distributed import place_global

    states, losses = progs["states"], {}

    def run(name):
        if name == "plain":
            states[name], loss = progs["plain"](states[name], place_global(batch, progs["batch_sh"]))
        else:
            states[name], m = progs["steps"][name](states[name], batch)
            loss = m["loss"]
        losses[name] = float(loss)             # waits for the step, incl. the cross-process all-reduce
        return losses[name]

    names = ("plain", "even", "same-even", "balanced")
    progress = harness.progress(log, args.rounds)

    def on_round(r, t):
        if r == 0:
            log(f"compiled and warmed up in {t.warmup_s:.1f} s")
        progress(r, t)

    timings = harness.interleaved({n: (lambda n=n: run(n)) for n in names}, args.rounds, block=args.block,
                                  warmup=2, order_by="fixed", sync=None, on_round=on_round)
    return {n: timings.times(n) for n in names}, losses


def _worker_record(args, cluster, again, progs, times, losses) -> dict:
    """What a worker hands the driver: speeds before and after, each program's rows, the balance's
    report and prediction, the times and losses."""
    even, bal, same = (progs["steps"][n] for n in ("even", "balanced", "same-even"))
    rep_bal, head_bal = bal.plan.balance, bal.plan.head_balance
    return {
        "speeds": [float(s) for s in cluster.speeds], "speeds_after": [float(s) for s in again.speeds],
        "overheads": list(cluster.overhead or ()), "overheads_after": list(again.overhead or ()),
        "rows_even": list(even.plan.batch_sizes), "rows_balanced": list(bal.plan.batch_sizes),
        "rows_same_even": list(same.plan.batch_sizes),
        "local_rows_balanced": [bal.plan.local_rows(i) for i in range(2)],
        "balance_applied": bool(rep_bal is not None and rep_bal.applied),
        "balance_unit": rep_bal.unit if rep_bal is not None else None,
        "predicted_speedup": rep_bal.predicted_speedup if rep_bal is not None else 1.0,
        "predicted_speedup_head": head_bal.predicted_speedup if head_bal is not None and head_bal.applied else None,
        "phases_balanced": phases(args, list(bal.plan.batch_sizes), head_classes(bal.plan)),
        "phases_same_even": phases(args, list(same.plan.batch_sizes), head_classes(same.plan)),
        "balance_kind": rep_bal.kind if rep_bal is not None else None,
        "times": times, "final_loss": losses, "flops_per_step": flops_per_step(args),
    }


# ------------------------------------------------------------------------------------- driver

def driver(args, argv, cores, env, load_before):
    env = harness.allocator_env(env, args.allocator)
    t0 = time.perf_counter()
    runs = [run for _ in range(args.repeats) for run in harness.run_emulations(args, argv, cores, env, __file__)]
    report(args, runs, time.perf_counter() - t0, load_before)


def ideal(speeds, parts=None):
    """Ideal speedup of the balanced split over the even one from per-process speeds (W = 1):
    even (1/2) / min(s) over balanced 1 / sum(s); with `parts` (the worker's `phases`), the balanced
    time of those splits."""
    even = 0.5 / min(speeds)
    bal = 1.0 / sum(speeds) if parts is None else parts_time(speeds, parts)
    return even / bal


def parts_time(speeds, parts):
    """Ideal time (W = 1) of a step whose parts run one after the other, part k a fraction f_k of the
    work split as loads_k: sum_k f_k max_i (loads_k,i / sum loads_k) / s_i."""
    return sum(f * max((r / sum(loads)) / si for r, si in zip(loads, speeds)) for f, loads in parts)


def split_time(speeds, parts):
    """The ideal speedup of the proportional split over the splits `parts`."""
    return parts_time(speeds, parts) * sum(speeds)


def summarise(res: dict) -> dict:
    """The figures of one configuration (speeds: mean of the calibrations before and after)."""
    if "failed" in res:
        return res
    s = [(a + b) / 2 for a, b in zip(res["speeds"], res["speeds_after"])]
    med = {n: harness.median(v) for n, v in res["times"].items()}
    actual = med["even"] / med["balanced"]
    out = {"slow_by": res.get("slow_by", "busy")}                  # the first runs had busy loops alone
    out |= {k: res[k] for k in ("hogs", "batch", "speeds", "speeds_after", "overheads", "overheads_after",
                               "rows_even", "rows_balanced", "local_rows_balanced", "balance_applied", "balance_unit",
                               "predicted_speedup", "predicted_speedup_head", "balance_kind", "phases_balanced",
                               "final_loss", "times")}
    same = med["same-even"] / med["balanced"]
    out.update(speeds_mean=s, speed_ratio=s[0] / s[1], median_step_s=med, speedup_actual=actual,
               speedup_ideal=ideal(s), speedup_split_limited=ideal(s, res["phases_balanced"]),
               efficiency=actual / ideal(s), even_vs_plain=med["even"] / med["plain"],
               balanced_vs_plain=med["balanced"] / med["plain"], rows_same_even=res["rows_same_even"],
               speedup_same_program=same, efficiency_same_program=same / split_time(s, res["phases_same_even"]))
    out["verdict"] = "PASS" if out["efficiency"] >= TARGET else "FAIL"
    return out


def report(args, runs, wall, load_before):
    rows = [summarise(r) for r in runs]
    print()
    print(f"2 processes x 1 CPU device; process 1 slowed ({args.slow_by}: a CPU quota or busy loops on its core); "
          f"{describe(args)}; "
          f"{args.rounds} rounds x {args.block} steps per variant, medians; allocator {args.allocator}")
    print()
    head = (f"{'slowed':>10} {'batch':>6} {'s0/s1':>6} {'rows balanced':>14} {'grain':>5} {'even ms':>8} "
            f"{'bal ms':>8} {'speedup':>8} {'pred':>6} {'ideal':>6} {'split-lim':>9} {'eff':>6} {'same ms':>8} "
            f"{'eff same':>8} {'even/plain':>10} {'bal/plain':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "failed" in r:
            print(f"{harness.slowed(r):>10} {r['batch']:>6}  FAILED: {r['failed']}")
            continue
        med = r["median_step_s"]
        rb = "/".join(str(x) for x in r["rows_balanced"])
        print(f"{harness.slowed(r):>10} {r['batch']:>6} {r['speed_ratio']:>6.2f} {rb:>14} "
              f"{str(r['balance_unit']):>5} "
              f"{1e3 * med['even']:>8.1f} {1e3 * med['balanced']:>8.1f} {r['speedup_actual']:>8.3f} "
              f"{r['predicted_speedup']:>6.3f} {r['speedup_ideal']:>6.3f} {r['speedup_split_limited']:>9.3f} "
              f"{r['efficiency']:>6.3f} "
              f"{1e3 * med['same-even']:>8.1f} {r['efficiency_same_program']:>8.3f} "
              f"{r['even_vs_plain']:>10.3f} {r['balanced_vs_plain']:>9.3f}  {r['verdict']}")
        if args.model == "hybrid":
            pred = r["predicted_speedup_head"]
            print(f"{'':>17} head classes {'/'.join(str(c) for c in r['phases_balanced'][1][1])}, the planner's "
                  f"predicted speedup of the head {'(even head)' if pred is None else f'{pred:.3f}'}")
    print()
    print("pred = the planner's predicted speedup (plan.balance: the batch rows"
          + (" of the replicate backbone; the head's prediction is plan.head_balance" if args.model == "hybrid"
             else "") + "); split-lim = the ideal speedup with the splits the planner chose"
          + (" (rows for the backbone's FLOPs, classes for the head's)" if args.model == "hybrid" else ""))
    print(f"eff = (median even step / median balanced step) / ((s0 + s1) / (2 min(s0, s1))); target >= {TARGET}")
    print("eff same = the same with the balanced program itself at a near-even split ('same', declared speeds "
          "1:1.01) as the baseline, its ideal from its own rows: the balance alone, without the collectives' "
          "difference between the GSPMD even plan (one all-reduce operand per gradient leaf) and the balanced "
          "program (one fused buffer)")
    print(f"total wall time {wall:.0f} s; 1-min load average before the run {load_before:.2f}")
    medians = over_runs(rows) if args.repeats > 1 else []
    out = {
        "config": {k: v for k, v in vars(args).items() if k not in ("worker_out", "timeout", "batch", "out")},
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cores": sorted(os.sched_getaffinity(0)), "loadavg_before": load_before},
        "target": TARGET, "runs": rows, "medians": medians, "wall_s": wall,
    }
    path = harness.write_result("hetero" if args.model == "mlp" else f"hetero_{args.model}", out, args.out)
    print(f"wrote {path}")


def over_runs(rows) -> list[dict]:
    """Per (emulation, slowdown, batch): the medians over its repeated runs, printed as the final table.
    One run's efficiency moves by several percent with the machine's drift between its calibrations and
    its timed steps; the median over interleaved runs is the figure to quote."""
    out = []
    print()
    print("medians over the repeated runs of each configuration")
    head = f"{'slowed':>10} {'batch':>6} {'runs':>4} {'s0/s1':>6} {'speedup':>8} {'ideal':>6} {'eff':>6}  " \
           "efficiency of each run"
    print(head)
    print("-" * len(head))
    for (slow_by, hogs, batch), ok in harness.by_config(rows, ("slow_by", "hogs", "batch")):
        slowed = harness.slowed({"slow_by": slow_by, "hogs": hogs})
        if not ok:
            print(f"{slowed:>10} {batch:>6}  every run failed")
            continue
        m = {k: harness.median([r[k] for r in ok]) for k in ("speed_ratio", "speedup_actual", "speedup_ideal",
                                                               "efficiency")}
        verdict = "PASS" if m["efficiency"] >= TARGET else "FAIL"
        each = " ".join(f"{r['efficiency']:.3f}" for r in ok)
        print(f"{slowed:>10} {batch:>6} {len(ok):>4} {m['speed_ratio']:>6.2f} {m['speedup_actual']:>8.3f} "
              f"{m['speedup_ideal']:>6.3f} {m['efficiency']:>6.3f}  {each}  {verdict}")
        out.append({"slow_by": slow_by, "hogs": hogs, "batch": batch, "runs": len(ok), **m,
                    "efficiencies": [r["efficiency"] for r in ok], "verdict": verdict})
    return out


def describe(args) -> str:
    if args.model == "hybrid":
        head = "wh.ops.softmax_cross_entropy_head" if args.head == "ops" else "nn.Dense + optax cross-entropy"
        return (f"Whale Example 2: stock Flax MLP {args.depth} x Dense({args.width}) + Dense({args.width}) with biases "
                f"under wh.replicate(), {head} over {args.classes} classes under wh.split(), Adam")
    return f"stock Flax MLP {args.depth} x Dense({args.width}) + Dense({OUT}) with biases, Adam, MSE"


if __name__ == "__main__":
    harness.two_process_main(sys.argv[1:], parse, worker, driver)
