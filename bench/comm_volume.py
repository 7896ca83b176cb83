"""Collective bytes per training step: pure data parallelism vs. Whale's hybrid (paper Example 2).

What it measures
    The paper's "100K classes" model (Whale, USENIX ATC'22, section 3.1 / Figure 5): a backbone
    with about ResNet-50's parameter count (here a stack of Dense layers, 1024 -> 6 x Dense(2048):
    23.1M params, 92 MB; feature dim 2048) and a 2048 x 100000 fully connected head (205M params,
    819 MB = 782 MiB) with softmax cross-entropy. Two annotations of the same model:

    * DP:     backbone and head+loss both under ``wh.replicate(N)`` (pure data parallelism).
    * hybrid: backbone under ``wh.replicate(N)``, FC head + softmax cross-entropy under
              ``wh.split(N)`` (the paper reports 89.7% less gradient synchronisation for this).

    For N = 8, 16 and 32 simulated CPU devices, one SGD training step of each is planned with
    ``wh.plan`` (params and batch are ``jax.ShapeDtypeStruct``s: nothing is allocated), lowered,
    and COMPILED by XLA; nothing is executed. The compiled HLO text (``Compiled.as_text()``,
    i.e. after the SPMD partitioner, so what each device really runs) is parsed for every
    all-reduce / all-gather / reduce-scatter / all-to-all / collective-permute (sync forms, and
    async ``-start``/``-done`` pairs, counted once, by the ``-done`` result, which is the
    collective's output).

The numbers (all per training step, all per device, since the SPMD program is per device)
    * "HLO bytes": the sum over collectives of the bytes of their RESULT shape(s), as written in
      the compiled HLO. For an all-reduce that is the size of the reduced buffer, e.g. the whole
      gradient for DP. This is the headline number (DP bytes, hybrid bytes, reduction %).
    * "grad-sync bytes": the part of "HLO bytes" in collective results whose shape is the global
      shape of a parameter (up to a transpose), i.e. the gradient synchronisation the paper talks
      about (activation and loss collectives excluded). Any collective kind counts, because XLA may
      turn a gradient all-reduce into a sharded gradient plus an all-gather. The paper's 89.7%
      compares this kind of number.
    * "ring bytes": an estimate of the bytes each device SENDS with ring algorithms, from the
      result size S and group size n read from replica_groups: all-reduce 2(n-1)/n*S, all-gather
      (n-1)/n*S, reduce-scatter (n-1)*S, all-to-all (n-1)/n*S, collective-permute S.
    * "whalex predicted": whalex's own per-device traffic estimate (``plan.predicted_comm_bytes``),
      for comparison with the ring numbers.

    The global batch defaults to 4*N (4 rows per device) so the compile stays cheap; the hybrid's
    activation collectives grow with the batch, gradients do not (see ``--per-device-batch``).

Gradient accumulation (``--micro-batches``, default 1 4 16)
    Each mode is also planned with ``num_micro_batch = M`` (the hybrid with
    ``Config(share_devices=True)``: collocated, gradient accumulation, no pipeline) at a global batch
    of max(M) * N rows, and its gradient collectives are counted PER STEP: a collective inside a
    ``while`` body (the micro-batch loop) counts once per trip (its known trip count). "grad bytes
    per step" are the parameter-shaped results (a leading per-shard dimension of 1 dropped); reduced
    once a step, they are the same for every M. The hybrid's mesh is data=1 x model=N: its backbone
    accumulates per model shard (whalex/lowering/groups.py); plan.summary()'s "gradients:" line, kept
    in "plan_note", says how each plan sums them.

How to run (from the repo root)
    ``python bench/comm_volume.py``                      N = 8, 16, 32 with 100000 classes
    ``python bench/comm_volume.py --small``              N = 8, 10000 classes, 2 backbone layers: quick;
                                                         writes bench/results/comm_volume_small.json
    Each N runs in its own subprocess (``--worker N``), because the simulated device count
    (``XLA_FLAGS=--xla_force_host_platform_device_count=N``) must be set before JAX is imported.
    Writes bench/results/comm_volume.json (``--small``: comm_volume_small.json).
"""
from __future__ import annotations

import os
import sys

import harness

if "--worker" in sys.argv:   # the device count must be fixed before jax is imported
    harness.simulate_devices(int(sys.argv[sys.argv.index("--worker") + 1]))

import argparse
import json
import time

import numpy as np

PAPER_REDUCTION = 89.7


# ------------------------------------------------------------------------------------------
# worker: one device count, both annotations
# ------------------------------------------------------------------------------------------
def grad_bytes_per_step(text: str, param_dims: set) -> dict:
    """Parameter-shaped collective results per step (a leading dimension of 1 dropped, dims sorted):
    count, bytes, and the part of them inside loops."""
    from whalex.jaxpr.hlo import looped_collectives, nbytes

    out = {"count": 0, "bytes": 0.0, "in_loops_bytes": 0.0}
    for c, trips in looped_collectives(text):
        for dt, shape in c.arrays:
            s = shape[1:] if len(shape) > 1 and shape[0] == 1 else shape
            if len(s) and tuple(sorted(s)) in param_dims:
                out["count"] += trips
                out["bytes"] += trips * nbytes([(dt, shape)])
                out["in_loops_bytes"] += (trips > 1) * trips * nbytes([(dt, shape)])
    return out


def micro_batch_rows(wh, jax, jnp, loss_fn, params, param_dims, n, feat, micro) -> list:
    """Gradient collective bytes per step at each num_micro_batch in `micro` (global batch max(micro) * n)."""
    rows = []
    batch = max(micro) * n
    shapes = {"x": jax.ShapeDtypeStruct((batch, feat), jnp.float32), "y": jax.ShapeDtypeStruct((batch,), jnp.int32)}
    import optax
    for m in micro:
        t0 = time.perf_counter()
        plan = wh.plan(loss_fn, params, shapes, optimizer=optax.sgd(0.1),
                       config=wh.Config(num_micro_batch=m, share_devices=True))
        text = plan.lowered().compile().as_text()
        note = [c for c in plan.couplings if c.startswith("gradients:")]
        rows.append({"num_micro_batch": m, "global_batch": batch, **grad_bytes_per_step(text, param_dims),
                     "plan_note": note[0] if note else "", "compile_s": time.perf_counter() - t0})
    return rows


# ------------------------------------------------------------------------------------------
def make_model_factory(n: int, classes: int, width: int, depth: int):
    """`make_model(head_strategy)`: the backbone under wh.replicate(n), the FC head + softmax
    cross-entropy under `head_strategy(n)`."""
    import flax.linen as nn
    import optax

    import whalex as wh

    class Backbone(nn.Module):
        @nn.compact
        def __call__(self, x):
            with wh.replicate(n):
                for _ in range(depth):
                    x = nn.relu(nn.Dense(width)(x))
            return x

    class Head(nn.Module):   # FC + softmax cross-entropy, annotated by the caller
        @nn.compact
        def __call__(self, x, y):
            logits = nn.Dense(classes)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def make_model(head_strategy):
        class Model(nn.Module):
            @nn.compact
            def __call__(self, x, y):
                h = Backbone()(x)
                with head_strategy(n):
                    return Head()(h, y)
        return Model()

    return make_model


def worker(args) -> dict:
    """One device count: compile the DP and the hybrid program and read their collectives."""
    import jax
    import jax.numpy as jnp

    import whalex as wh

    n = args.worker
    assert len(jax.devices()) == n, (len(jax.devices()), n)
    classes, feat = args.classes, args.features
    make_model = make_model_factory(n, classes, 2048, args.depth)
    batch = args.per_device_batch * n
    batch_shapes = {"x": jax.ShapeDtypeStruct((batch, feat), jnp.float32),
                    "y": jax.ShapeDtypeStruct((batch,), jnp.int32)}
    out = {"n": n, "global_batch": batch, "classes": classes, "modes": {}}
    for mode, strategy in (("dp", wh.replicate), ("hybrid", wh.split)):
        model = make_model(strategy)
        params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, feat)),  # noqa: B023 (called at once)
                                                   jnp.zeros((1,), jnp.int32))["params"])

        def loss_fn(p, b, model=model):
            return model.apply({"params": p}, b["x"], b["y"])

        out["modes"][mode] = mode_record(args, n, batch, loss_fn, params, batch_shapes, mode)
    return out


def mode_record(args, n, batch, loss_fn, params, batch_shapes, mode) -> dict:
    """One annotation's plan, compiled: its collectives, their bytes, whalex's prediction."""
    import jax
    import jax.numpy as jnp
    import optax

    import whalex as wh
    from whalex.jaxpr.hlo import nbytes

    leaves = jax.tree.leaves(params)
    backbone_n = sum(int(np.prod(l.shape)) for l in jax.tree.leaves(params["Backbone_0"]))
    head_n = sum(int(np.prod(l.shape)) for l in leaves) - backbone_n
    param_shapes = {tuple(l.shape) for l in leaves}
    t0 = time.perf_counter()
    plan = wh.plan(loss_fn, params, batch_shapes, optimizer=optax.sgd(0.1))
    lowered = plan.lowered()
    t1 = time.perf_counter()
    hlo = lowered.compile().as_text()
    t2 = time.perf_counter()
    colls = harness.collectives(hlo, n)
    param_dims = {tuple(sorted(s)) for s in param_shapes}
    # a gradient leaves as a parameter-shaped result (XLA may transpose it, and may turn
    # an all-reduce into a locally sharded gradient + all-gather, so any kind counts)
    grad_sync = sum(nbytes([a for a in c["arrays"] if tuple(sorted(a[1])) in param_dims]) for c in colls)
    rec = {
        "strategies": [t.strategy for t in plan.task_graphs],
        "param_specs": {k: str(v) for k, v in plan.param_specs.items()},
        "backbone_params": backbone_n, "head_params": head_n,
        "param_bytes": 4.0 * (backbone_n + head_n),
        "hlo_bytes": sum(c["bytes"] for c in colls),
        "grad_sync_bytes": grad_sync,
        # activations are [global batch, ...]: if the batch equals a parameter dimension, an
        # activation collective can look parameter-shaped and grad-sync may be overcounted
        "grad_sync_ambiguous": any(batch in s for s in param_shapes),
        "ring_bytes": sum(c["ring_bytes"] for c in colls),
        "whalex_predicted_bytes": float(plan.predicted_comm_bytes),
        "by_kind": harness.by_kind(colls),
        "collectives": [{"kind": c["kind"], "async": c["async"], "group": c["group"],
                         "result": " ".join(f"{dt}{list(s)}" for dt, s in c["arrays"]),
                         "bytes": c["bytes"]} for c in colls],
        "plan_lower_s": t1 - t0, "compile_s": t2 - t1,
    }
    if args.micro_batches:
        rec["micro_batches"] = micro_batch_rows(wh, jax, jnp, loss_fn, params, param_dims, n,
                                                args.features, args.micro_batches)
    if args.dump_hlo:
        harness.RESULTS.mkdir(parents=True, exist_ok=True)
        (harness.RESULTS / f"comm_volume_{mode}_n{n}.hlo.txt").write_text(hlo)
    return rec


# ------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------
def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f} MB"


def _red(dp: float, hy: float) -> float:
    return 100.0 * (1.0 - hy / dp) if dp else float("nan")


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ns", type=int, nargs="+", default=[8, 16, 32], help="device counts")
    ap.add_argument("--classes", type=int, default=100_000, help="FC head classes (paper: 100000)")
    ap.add_argument("--features", type=int, default=1024, help="backbone input features")
    ap.add_argument("--depth", type=int, default=6, help="Dense(2048) layers in the backbone")
    ap.add_argument("--per-device-batch", type=int, default=4, help="global batch = this * N")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per N")
    ap.add_argument("--dump-hlo", action="store_true", help="also write the compiled HLO texts")
    ap.add_argument("--micro-batches", type=int, nargs="*", default=[1, 4, 16],
                    help="num_micro_batch values for the gradient-bytes-per-step table (none: skip it)")
    ap.add_argument("--small", action="store_true", help="N=8, 10000 classes, 2 layers: a quick run")
    ap.add_argument("--out", default=None, help="the results file (default bench/results/comm_volume.json)")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.small:
        args.ns, args.classes, args.depth = [8], 10_000, 2
        args.out = args.out or str(harness.RESULTS / "comm_volume_small.json")
    return args


def run_workers(args):
    """Each device count in its own worker process: (the results, the failures by N)."""
    results, failures = [], {}
    for n in args.ns:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(n), "--classes", str(args.classes),
               "--features", str(args.features), "--depth", str(args.depth),
               "--per-device-batch", str(args.per_device_batch), "--micro-batches", *map(str, args.micro_batches)] \
            + (["--dump-hlo"] if args.dump_hlo else [])
        t0 = time.perf_counter()
        p = harness.run_worker(cmd, args.timeout)
        if p is None:
            failures[n] = f"timed out after {args.timeout}s"
            print(f"N={n}: timed out after {args.timeout}s", flush=True)
            continue
        lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        if p.returncode or not lines:
            failures[n] = (p.stderr or p.stdout)[-2000:]
            print(f"N={n}: worker failed (rc {p.returncode}):\n{failures[n]}", flush=True)
            continue
        r = json.loads(lines[-1][len("RESULT "):])
        r["wall_s"] = time.perf_counter() - t0
        results.append(r)
        d, h = r["modes"]["dp"], r["modes"]["hybrid"]
        print(f"N={n}: done in {r['wall_s']:.0f}s (compile dp {d['compile_s']:.0f}s, hybrid {h['compile_s']:.0f}s)",
              flush=True)
    return results, failures


def report_bytes(args, results) -> None:
    """The model, then HLO bytes and grad-sync bytes per N, DP against hybrid."""
    m0 = results[0]["modes"]
    print()
    print("Collective bytes per training step and device, from compiled HLO (SGD; nothing executed).")
    print(f"Model: backbone {args.features} -> {args.depth} x Dense(2048), {m0['dp']['backbone_params']:,} params "
          f"({_mb(4 * m0['dp']['backbone_params'])}); FC head 2048 x {args.classes:,} + softmax CE, "
          f"{m0['dp']['head_params']:,} params ({_mb(4 * m0['dp']['head_params'])}); "
          f"global batch {args.per_device_batch} x N.")
    print("DP = everything wh.replicate(N); hybrid = backbone wh.replicate(N), head + loss wh.split(N).")
    print()
    hdr = (f"  {'N':>3}  {'DP HLO bytes':>14}  {'hybrid HLO bytes':>16}  {'reduction':>9}  "
           f"{'DP grad-sync':>13}  {'hyb grad-sync':>13}  {'reduction':>9}")
    print("HLO bytes = sum of collective result sizes; grad-sync = the part with parameter-shaped results "
          "(gradients)")
    print(hdr)
    print("  " + "  ".join("-" * w for w in (3, 14, 16, 9, 13, 13, 9)))
    for r in results:
        d, h = r["modes"]["dp"], r["modes"]["hybrid"]
        print(f"  {r['n']:>3}  {_mb(d['hlo_bytes']):>14}  {_mb(h['hlo_bytes']):>16}  "
              f"{_red(d['hlo_bytes'], h['hlo_bytes']):>8.1f}%  {_mb(d['grad_sync_bytes']):>13}  "
              f"{_mb(h['grad_sync_bytes']):>13}  {_red(d['grad_sync_bytes'], h['grad_sync_bytes']):>8.1f}%")
    amb = [r["n"] for r in results if any(m["grad_sync_ambiguous"] for m in r["modes"].values())]
    if amb:
        print(f"  WARNING N={amb}: the global batch equals a parameter dimension, so activation collectives "
              "may be counted as grad-sync there; change --per-device-batch or --features.")


def report_ring(results) -> None:
    """The ring estimate of bytes sent against whalex's prediction, then the collectives by kind."""
    print()
    print("Ring-algorithm estimate of bytes SENT per device (from HLO result size and group size), "
          "and whalex's own prediction:")
    print(f"  {'N':>3}  {'DP ring':>12}  {'hybrid ring':>12}  {'reduction':>9}  "
          f"{'DP whalex-pred':>14}  {'hyb whalex-pred':>15}")
    print("  " + "  ".join("-" * w for w in (3, 12, 12, 9, 14, 15)))
    for r in results:
        d, h = r["modes"]["dp"], r["modes"]["hybrid"]
        print(f"  {r['n']:>3}  {_mb(d['ring_bytes']):>12}  {_mb(h['ring_bytes']):>12}  "
              f"{_red(d['ring_bytes'], h['ring_bytes']):>8.1f}%  {_mb(d['whalex_predicted_bytes']):>14}  "
              f"{_mb(h['whalex_predicted_bytes']):>15}")
    print()
    print("Collectives in the compiled HLO (count, HLO bytes):")
    for r in results:
        for mode in ("dp", "hybrid"):
            bk = r["modes"][mode]["by_kind"]
            desc = ", ".join(f"{k} x{v['count']} {_mb(v['bytes'])}" for k, v in bk.items()) or "none"
            print(f"  N={r['n']:<3} {mode:<7} {desc}")


def report_micro_batches(args, results) -> None:
    """Gradient collective bytes per step at each num_micro_batch."""
    print()
    print(f"Gradient collectives per step with gradient accumulation "
          f"(global batch {max(args.micro_batches)} x N; "
          "a collective in the micro-batch loop counted once per trip):")
    print(f"  {'N':>3}  {'mode':<7} {'M':>3}  {'count':>6}  {'grad bytes/step':>15}  {'in loops':>12}  "
          "plan says")
    for r in results:
        for mode in ("dp", "hybrid"):
            for row in r["modes"][mode].get("micro_batches", []):
                print(f"  {r['n']:>3}  {mode:<7} {row['num_micro_batch']:>3}  {row['count']:>6}  "
                      f"{_mb(row['bytes']):>15}  {_mb(row['in_loops_bytes']):>12}  {row['plan_note'][:90]}")


def record(args, results, failures, t_all) -> dict:
    return {"benchmark": "comm_volume", "what": "bytes of collective results per training step per device, parsed "
           "from compiled HLO (Compiled.as_text()); ring_bytes = ring-algorithm estimate of bytes sent per "
           "device; grad_sync_bytes = collective results whose shape is a parameter's (possibly transposed) "
           "shape, i.e. gradient synchronisation",
           "classes": args.classes, "features": args.features, "depth": args.depth,
           "per_device_batch": args.per_device_batch, "optimizer": "sgd(0.1)",
           "paper_reduction_pct": PAPER_REDUCTION,
           "rows": [{"n": r["n"], "dp_bytes": r["modes"]["dp"]["hlo_bytes"],
                     "hybrid_bytes": r["modes"]["hybrid"]["hlo_bytes"],
                     "reduction_pct": _red(r["modes"]["dp"]["hlo_bytes"], r["modes"]["hybrid"]["hlo_bytes"]),
                     "dp_grad_sync_bytes": r["modes"]["dp"]["grad_sync_bytes"],
                     "hybrid_grad_sync_bytes": r["modes"]["hybrid"]["grad_sync_bytes"],
                     "grad_sync_reduction_pct": _red(r["modes"]["dp"]["grad_sync_bytes"],
                                                     r["modes"]["hybrid"]["grad_sync_bytes"]),
                     "dp_ring_bytes": r["modes"]["dp"]["ring_bytes"],
                     "hybrid_ring_bytes": r["modes"]["hybrid"]["ring_bytes"],
                     "ring_reduction_pct": _red(r["modes"]["dp"]["ring_bytes"], r["modes"]["hybrid"]["ring_bytes"]),
                     "grad_bytes_per_step_by_micro_batches": {
                         mode: {str(row["num_micro_batch"]): row["bytes"]
                                for row in r["modes"][mode].get("micro_batches", [])}
                         for mode in ("dp", "hybrid")}}
                    for r in results],
           "details": results, "failures": {str(k): v for k, v in failures.items()},
           "total_wall_s": time.perf_counter() - t_all}


def main():
    args = parse()
    if args.worker is not None:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    t_all = time.perf_counter()
    results, failures = run_workers(args)
    if results:
        report_bytes(args, results)
        report_ring(results)
        if args.micro_batches:
            report_micro_batches(args, results)
        print()
        print(f"Paper (Whale, 100K classes): hybrid needs {PAPER_REDUCTION}% less gradient synchronisation than DP.")
    if args.classes != 100_000:
        print(f"NOTE: run with --classes {args.classes}, not the paper's 100000.")
    out = record(args, results, failures, t_all)
    path = harness.write_result("comm_volume", out, args.out)
    print(f"wrote {path} (total {out['total_wall_s']:.0f}s)")


if __name__ == "__main__":
    main()
