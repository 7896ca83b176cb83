"""Uneven `split` shards (MLP hidden units, attention heads), measured on the emulated heterogeneous
cluster (issue 14, Build 4; stock Flax layers: issue 28, Build 4).

What it measures
    The 2-process cluster of `bench/hetero.py` (one CPU device per process, process i pinned to core
    i, process 1's core shared with busy loops: near 2:1 with one, near 3:1 with two). One layer under
    ``wh.split(2)``, its model axis across the two processes, MSE, Adam:

    * mlp:              ``wh.ops.mlp(x, w1, b1, w2, b2)``, the Megatron MLP (hidden units split).
    * attention:        ``wh.ops.attention(x, ...)``, multi-head self-attention (heads split).
    * mlp_stock:        the same MLP written with two stock ``nn.Dense`` and ``nn.gelu``.
    * attention_stock:  a stock ``nn.MultiHeadDotProductAttention`` (the planner finds both in the
                        captured program and runs them as the ops).

    Two plans of the same step on the calibrated cluster (``calibrate(..., optimizer=)``):

    * even:      ``hardware_aware=False``: each process holds half of the units (GSPMD shardings).
    * balanced:  hidden units / heads in proportion to the calibrated speeds, per-device chunk loops.

    Both are timed in interleaved blocks of steps on process 0, each block up to both processes being
    done with it, both processes idle between blocks; medians over blocks of the mean step time in a
    block. Both processes' glibc keeps freed memory (``--allocator cached``, ``harness.CACHED_MALLOC``),
    as a GPU runtime pools it: with glibc's own thresholds, whether a step's large temporaries fault
    in fresh pages depended on what was freed before, and the stock MLP's even step took 89 to 171 ms
    from run to run at the same quota. The table prints the measured speedup (median even step /
    median balanced step) beside the planner's prediction (``plan.balance.predicted_speedup``: the
    slowest device's time under the even shards over the same under the balanced ones). The
    prediction counts what the lowering does (``whalex/planner/split_cost.py``): the units' FLOPs,
    the forward that the units beyond those every device runs compute again in the backward pass (on
    CPU, where the lowering recomputes them rather than zero-fill buffers for them), the rest of the
    step, the all-reduces and the calibrated fixed time that both plans pay, and the memory traffic
    only the balanced plan pays (the optimizer update of the stored padding, the zero-filled
    gradients of the padded width).

Run from the repo root: ``python bench/hetero_split.py`` (several minutes; needs >= 2 cores and an
otherwise idle machine). Writes bench/results/hetero_split.json, whose "variants" keep the other
runs (settings in each one's "config"). ``--quick``: small shapes, one round, every layer, near 2:1
only, on a declared V100 + T4 pair instead of calibrated speeds (so the balanced plan is uneven
whatever the noise), into that file's variants.quick: checks that the bench runs end to end (its
timings mean nothing on a busy machine).
"""
from __future__ import annotations

import argparse
import platform
import sys
import time

import harness


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", default="mlp,mlp_stock,attention,attention_stock",
                    help="layers to measure, comma-separated")
    ap.add_argument("--quick", action="store_true", help="small shapes and one round: checks the bench runs")
    ap.add_argument("--declared", default=None,
                    help="device kinds, comma-separated, instead of calibrating (the quick run: V100-32GB,T4-16GB)")
    harness.add_emulation_args(ap, "hetero_split", batches="1024", slow_by="quota", timeout=500)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=4096, help="MLP hidden units")
    ap.add_argument("--heads", type=int, default=32, help="attention heads (head_dim 32)")
    ap.add_argument("--seq", type=int, default=16, help="attention sequence length")
    ap.add_argument("--repeats", type=int, default=1,
                    help="2-process runs per configuration, interleaved (all configurations, then again): the "
                         "final table gives each configuration's median over its runs")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--block", type=int, default=3)
    ap.add_argument("--calib-rows", type=int, default=None,
                    help="rows of the batch calibrate() times (default: all of them, as its docstring asks)")
    harness.add_allocator_arg(ap)
    ap.add_argument("--op", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


QUICK = {"declared": "V100-32GB,T4-16GB", "batches": "64", "slowdowns": "1", "width": 64, "hidden": 512, "heads": 8,
         "seq": 8, "rounds": 1, "block": 1, "calib_rows": 32}


class _Stock:
    """The stock Flax layers (built lazily: flax is imported in the worker)."""

    @staticmethod
    def mlp(d, hidden):
        import flax.linen as nn

        class MLP(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Dense(d)(nn.gelu(nn.Dense(hidden)(x)))
        return MLP()

    @staticmethod
    def attention(heads):
        import flax.linen as nn
        return nn.MultiHeadDotProductAttention(num_heads=heads, qkv_features=heads * 32)


def make_stock(args, k):
    """(layer(p, x), params, batch) of a stock Flax layer."""
    import jax

    d = args.width
    if args.op == "mlp_stock":
        module, shape = _Stock.mlp(d, args.hidden), (args.batch, d)
    else:
        module, shape = _Stock.attention(args.heads), (args.batch, args.seq, d)
    batch = {"x": jax.random.normal(k[5], shape), "y": jax.random.normal(k[6], shape)}
    params = module.init(k[7], batch["x"][:2])["params"]
    return (lambda p, x: module.apply({"params": p}, x)), params, batch


def make_model(args):
    import jax
    import jax.numpy as jnp

    import whalex as wh

    k = jax.random.split(jax.random.key(0), 10)
    d = args.width
    if args.op.endswith("_stock"):
        layer, params, batch = make_stock(args, k)
    elif args.op == "mlp":
        h = args.hidden
        params = {"w1": jax.random.normal(k[0], (d, h)) / d ** 0.5, "b1": jnp.zeros(h),
                  "w2": jax.random.normal(k[1], (h, d)) / h ** 0.5, "b2": jnp.zeros(d)}
        batch = {"x": jax.random.normal(k[2], (args.batch, d)), "y": jax.random.normal(k[3], (args.batch, d))}

        def layer(p, x):
            return wh.ops.mlp(x, p["w1"], p["b1"], p["w2"], p["b2"], "gelu")
    else:
        heads, hd = args.heads, 32
        params = {n: jax.random.normal(k[i], (d, heads, hd)) / d ** 0.5 for i, n in enumerate(("wq", "wk", "wv"))}
        params.update({f"b{n}": jnp.zeros((heads, hd)) for n in "qkv"})
        params["wo"] = jax.random.normal(k[4], (heads, hd, d)) / (heads * hd) ** 0.5
        params["bo"] = jnp.zeros(d)
        batch = {"x": jax.random.normal(k[5], (args.batch, args.seq, d)),
                 "y": jax.random.normal(k[6], (args.batch, args.seq, d))}

        def layer(p, x):
            return wh.ops.attention(x, p["wq"], p["bq"], p["wk"], p["bk"], p["wv"], p["bv"], p["wo"], p["bo"])

    def loss_fn(p, b):
        with wh.split(2):
            return jnp.mean((layer(p, b["x"]) - b["y"]) ** 2)

    return loss_fn, params, batch


def worker(args):
    import jax
    import optax
    from jax.experimental import multihost_utils

    import whalex as wh
    from whalex.balance.calibrate import calibrate

    pid, log = harness.worker_start("the driver")
    loss_fn, params, batch = make_model(args)
    optimizer = optax.adam(1e-3)
    small = {k: v[: args.calib_rows or args.batch] for k, v in batch.items()}
    cluster = wh.Cluster(kinds=args.declared.split(",")) if args.declared else \
        calibrate(wh.Cluster.detect(), loss_fn, params, small, optimizer=optimizer, repeats=9)
    log(f"calibrated speeds: {[round(s / 1e9, 2) for s in cluster.speeds]}")
    steps = {"even": wh.parallelize(loss_fn, optimizer, config=wh.Config(hardware_aware=False), cluster=cluster),
             "balanced": wh.parallelize(loss_fn, optimizer, cluster=cluster)}
    states = {n: s.init(params, batch) for n, s in steps.items()}

    losses = {}
    run = harness.step_runner(steps, states, batch, losses)

    def block(name):
        """`args.block` steps, then both processes done with them. A block is timed whole: a step ends
        on process 0 when its loss is ready, which can be before the other process has finished the
        step (the even plan's slow process runs its backward pass after the last collective), so the
        first step after an idle times short and the others long; the block's time over its steps
        counts every step of both processes once. Both processes idle between blocks: otherwise the
        process a plan leaves idle starts the other plan's block early."""
        for _ in range(args.block):
            run(name)
        jax.block_until_ready(states[name])
        multihost_utils.sync_global_devices(f"hetero_split {name}")

    timings = harness.interleaved({n: (lambda n=n: block(n)) for n in steps}, args.rounds, warmup=1,
                                  order_by="fixed", sync=None, on_round=harness.progress(log, args.rounds))
    times = {n: [t / args.block for t in timings.times(n)] for n in steps}
    report = steps["balanced"].plan.balance
    out = {"speeds": list(cluster.speeds), "times": times, "final_loss": losses,
           "counts": [d.rows for d in report.devices] if report is not None else None,
           "predicted_speedup": report.predicted_speedup if report is not None and report.applied else 1.0,
           "predicted_ms": {"even": 1e3 * report.even_time, "balanced": 1e3 * report.balanced_time}
           if report is not None else None,
           "devices": [{"rows": d.rows, "even_rows": d.even_rows, "speed": d.speed, "time_ms": 1e3 * d.time,
                        "even_time_ms": 1e3 * d.even_time, "shared_ms": 1e3 * d.overhead}
                       for d in report.devices] if report is not None else None,
           "fixed_ms": None if cluster.overhead is None else [1e3 * t for t in cluster.overhead],
           "basis": report.basis if report is not None else "",
           "kind": report.kind if report is not None else "even (speeds merged)"}
    harness.write_worker_result(args.worker_out, out, pid)


def summarise(res: dict) -> dict:
    if "failed" in res:
        return res
    med = {n: harness.median(v) for n, v in res["times"].items()}
    return {**res, "median_step_s": med, "speedup_actual": med["even"] / med["balanced"]}


def over_runs(runs) -> list[dict]:
    """Per (layer, loops, batch): the medians over its repeated runs, printed as the final table. One
    run's speeds move by several percent with the calibration (a quota's share of a core is not the same
    in every run), and its speedup with them; the median over interleaved runs is the figure to quote."""
    out = []
    print("\nmedians over the repeated runs of each configuration\n")
    head = f"{'layer':>15} {'loops':>5} {'batch':>6} {'runs':>4} {'s0/s1':>6} {'speedup':>8} {'pred':>6} " \
           f"{'vs pred':>8}  speedup (pred) of each run"
    print(head)
    print("-" * len(head))
    for (op, hogs, batch), ok in harness.by_config(runs, ("op", "hogs", "batch")):
        if not ok:
            print(f"{op:>15} {hogs:>5} {batch:>6}  every run failed")
            continue
        m = {"op": op, "hogs": hogs, "batch": batch, "runs": len(ok),
             "speed_ratio": harness.median([r["speeds"][0] / r["speeds"][1] for r in ok]),
             "speedup_actual": harness.median([r["speedup_actual"] for r in ok]),
             "predicted_speedup": harness.median([r["predicted_speedup"] for r in ok]),
             "vs_pred": harness.median([r["speedup_actual"] / r["predicted_speedup"] - 1 for r in ok])}
        each = ", ".join(f"{r['speedup_actual']:.2f} ({r['predicted_speedup']:.2f})" for r in ok)
        print(f"{op:>15} {hogs:>5} {batch:>6} {len(ok):>4} {m['speed_ratio']:>6.2f} {m['speedup_actual']:>8.3f} "
              f"{m['predicted_speedup']:>6.3f} {m['vs_pred']:>+8.1%}  {each}")
        out.append(m)
    return out


def parse_quick(argv):
    """The options, with `QUICK`'s settings under --quick."""
    args = parse(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def main(argv):
    return harness.two_process_main(argv, parse_quick, worker, driver)


def driver(args, argv, cores, env, load_before):
    env = harness.allocator_env(env, args.allocator)
    t0 = time.perf_counter()
    runs = []
    for _ in range(args.repeats):
        for op in args.ops.split(","):
            runs += [{"op": op, **summarise(res)}
                     for res in harness.run_emulations(args, argv + ["--op", op], cores, env, __file__)]
    print(f"\n2 processes x 1 CPU device, one split(2) layer across them (width {args.width}; MLP hidden "
          f"{args.hidden}; attention {args.heads} heads x 32, seq {args.seq}), Adam, MSE; medians\n")
    head = f"{'layer':>15} {'loops':>5} {'batch':>6} {'s0/s1':>6} {'units':>11} {'even ms':>8} {'bal ms':>8} " \
           f"{'speedup':>8} {'pred':>6} {'vs pred':>8}"
    print(head)
    print("-" * len(head))
    for r in runs:
        if "failed" in r:
            print(f"{r['op']:>15} {r['hogs']:>5} {r['batch']:>6}  FAILED: {r['failed']}")
            continue
        s, med = r["speeds"], r["median_step_s"]
        units = "/".join(map(str, r["counts"])) if r["counts"] else "even"
        print(f"{r['op']:>15} {r['hogs']:>5} {r['batch']:>6} {s[0] / s[1]:>6.2f} {units:>11} {1e3 * med['even']:>8.1f} "
              f"{1e3 * med['balanced']:>8.1f} {r['speedup_actual']:>8.3f} {r['predicted_speedup']:>6.3f} "
              f"{r['speedup_actual'] / r['predicted_speedup'] - 1:>+8.1%}")
    print(f"\nunits: hidden units / heads per process in the balanced plan; vs pred: measured speedup over the "
          f"predicted one, minus 1; total wall time {time.perf_counter() - t0:.0f} s; load before {load_before:.2f}")
    medians = over_runs(runs) if args.repeats > 1 else []
    path = harness.write_result(
        "hetero_split", {"config": {k: v for k, v in vars(args).items()
                                    if k not in ("worker_out", "batch", "op", "out")},
                         "machine": {"platform": platform.platform(), "load_before": load_before},
                         "runs": runs, "medians": medians}, args.out,
        variant="quick" if args.quick and not args.out else None)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
