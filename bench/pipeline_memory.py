"""Per-device memory of whalex's 1F1B vs GPipe pipelines as the number of micro-batches grows.

What it measures
    One training step (forward, backward, Adam update) of the same model, planned with
    ``wh.plan`` on 8 simulated CPU devices = 4 pipeline stages x 2 data-parallel replicas, with
    ``wh.Config(num_micro_batch=M, schedule="1f1b" | "gpipe")`` for M = 8, 16, 32. Each plan is
    lowered and COMPILED by XLA, never run: params and batch are ``jax.ShapeDtypeStruct``s.
    The figures are XLA's per-device ``Compiled.memory_analysis()`` of the SPMD program.

    The model: 4 stages, each ``wh.replicate(1)`` around ``L`` Dense(H)+tanh layers (the last stage
    also has a Dense(C) head and an MSE loss). The micro-batch size ``b`` is FIXED, so the global
    batch is b * M * dp and grows with M: this is the regime in which GPipe's stash grows with M.
    Defaults (H=256, L=2, b=1024) make one micro-batch's stage input (b*H floats = 1 MiB) larger
    than one stage's parameters (~0.5 MiB), so activation memory is what differs.

What to expect (whalex's pipeline runtime, ``whalex/lowering/pipeline``)
    Per device, the runtime stashes only stage inputs in ``schedule.slots`` buffers of
    ``message_bytes`` each (float32 here; a 16-bit float where every boundary value is one), plus
    incoming gradients in ``schedule.grad_slots`` = 1 buffer, and recomputes the stage forward in the
    backward. slots = S (=4) for 1F1B and M for GPipe, so the stash is predicted at
    (slots + grad_slots) * message_bytes: flat in M for 1F1B,
    linear in M for GPipe. Everything
    else (one micro-batch's recomputed stage activations, gradient accumulator, Adam update) does
    not depend on M.

The XLA numbers (per device, bytes)
    argument  buffers of the program's inputs: this device's row of the packed stage parameters,
              its Adam moments, and its share of its replica's batch (M*b rows: so this grows with
              M for BOTH schedules). Since issue 13 (Build 6) a stage device receives only the
              batch leaves its stage reads (`whalex/lowering/stage_batch.py`): x on stage 0, y on
              stage 3, packed per dtype into one [stages, rows, width] buffer sharded over
              (stage, data), so every device holds the widest stage's row (here x's 64 floats per
              row) instead of the whole batch (x and y, 80 floats per row). The "Batch per stage
              device" table shows each stage's share; "before" is the whole replica batch.
    output    buffers of the outputs: new params, new Adam state, loss.
    temp      XLA's preallocated scratch ("preallocated-temp" allocation): everything live inside
              the program that is neither an input nor an output, after XLA's buffer reuse. This
              is the "activation" figure: the stashes, the scan carry, recomputed activations.
    alias     output bytes that reuse (donated) input buffers.
    peak      argument + output + temp - alias: what the device must hold at once.
    Two compiles per config: ``plan.compiled_memory()`` (public API; ``plan.lowered()`` does NOT
    donate the state, so alias = 0) and the step as ``wh.parallelize`` runs it (state donated).
    Caveat, found while writing this: XLA's buffer assignment may place a temporary inside an
    output buffer that is not yet live (a "maybe-live-out" allocation); such a temporary is then
    counted in "output", not in "temp". With activations small next to the state this happens to
    the stash (seen with ``--micro 256 --hidden 512``: the 1F1B forward stash sat in an output
    buffer, and the "residual" column, temp - predicted stash, then differs between schedules) and
    to the plain reference's temporaries; with the defaults the residual is the same everywhere.

Plain-JAX reference, in the same run (one device, no whalex, the same loss function: outside a
whalex transformation the annotations only name scopes)
    micro  ``jax.jit(jax.value_and_grad(loss))`` on one micro-batch (b rows)
    full   the same on one pipeline replica's M micro-batches at once (M*b rows): what a user who
           neither pipelines nor accumulates pays for the same batch; grows linearly with M
    accum  plain gradient accumulation: ``lax.scan`` over the M micro-batches of value_and_grad
           (the plain-JAX way to keep activation memory flat; it holds the whole model)
    (no optimizer update in the references; their arguments are the full model and the batch)

Checks (printed PASS/FAIL, never fail the process)
    1F1B temp at M=32 within 10% of M=8; GPipe temp linear in M (the increments 8->16 and
    16->32 are in ratio 1:2 within 10%, and the slope matches the predicted stash per
    micro-batch within 10%); GPipe temp > 1F1B temp at every M.

Run from the repo root: ``python bench/pipeline_memory.py`` (about 15 s on 2 CPU cores).
Writes bench/results/pipeline_memory.json.
"""
from __future__ import annotations

import os

import harness

harness.simulate_devices(8)

import argparse
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import whalex as wh

N_DEV = 8
STAGES = 4
KEYS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")


def make_model(hidden: int, layers: int, features: int, classes: int):
    """loss_fn(params, batch) with 4 annotated stages, and its parameter shapes."""

    def loss_fn(p, batch):
        h = batch["x"]
        for s in range(STAGES):
            with wh.replicate(1):
                for l in range(layers):
                    h = jnp.tanh(h @ p[f"s{s}"][f"w{l}"] + p[f"s{s}"][f"b{l}"])
                if s == STAGES - 1:
                    out = h @ p["head"]["w"] + p["head"]["b"]
                    return jnp.mean((out - batch["y"]) ** 2)

    f32 = jnp.float32
    params = {f"s{s}": {} for s in range(STAGES)}
    for s in range(STAGES):
        for l in range(layers):
            fan_in = features if (s == 0 and l == 0) else hidden
            params[f"s{s}"][f"w{l}"] = jax.ShapeDtypeStruct((fan_in, hidden), f32)
            params[f"s{s}"][f"b{l}"] = jax.ShapeDtypeStruct((hidden,), f32)
    params["head"] = {"w": jax.ShapeDtypeStruct((hidden, classes), f32),
                      "b": jax.ShapeDtypeStruct((classes,), f32)}
    return loss_fn, params


def batch_shapes(rows: int, features: int, classes: int):
    return {"x": jax.ShapeDtypeStruct((rows, features), jnp.float32),
            "y": jax.ShapeDtypeStruct((rows, classes), jnp.float32)}


def mem_dict(compiled) -> dict:
    m = compiled.memory_analysis()
    d = {k: int(getattr(m, k)) for k in KEYS}
    return with_peak(d)


def with_peak(d: dict) -> dict:
    d = dict(d)
    d["peak_bytes"] = (d["argument_size_in_bytes"] + d["output_size_in_bytes"] + d["temp_size_in_bytes"]
                       - d.get("alias_size_in_bytes", 0))
    return d


def mib(n: float) -> str:
    return f"{n / 2**20:8.2f}"


def pipeline_row(loss_fn, params, args, M: int, schedule: str, optimizer, cluster) -> dict:
    dp = N_DEV // STAGES
    batch = batch_shapes(args.micro * M * dp, args.features, args.classes)
    t0 = time.perf_counter()
    plan = wh.plan(loss_fn, params, batch, optimizer,
                   config=wh.Config(num_micro_batch=M, schedule=schedule), cluster=cluster)
    assert plan.schedule is not None and plan.layout.axis_sizes == (dp, STAGES), plan.layout
    public = with_peak({k: int(v) for k, v in plan.compiled_memory().items() if k in KEYS})
    # the step as wh.parallelize runs it: the TrainState is donated (outputs may alias inputs)
    donated = mem_dict(plan.lowered(donate=True).compile())
    sched = plan.schedule
    buffers = plan.report.stage_buffers()
    stash = (sched.slots + sched.grad_slots) * buffers.message_bytes   # forward + gradient stash
    batch_bytes = buffers.batch_bytes                      # what each device holds (padded stage row)
    return {
        "schedule": schedule, "M": M, "micro_batch": args.micro, "data_parallel": dp,
        "global_batch": plan.global_batch, "slots": sched.slots, "ticks": sched.num_ticks,
        "bubble_fraction": sched.bubble_fraction,
        "max_in_flight": [sched.max_in_flight(s) for s in range(STAGES)],
        "max_grads_waiting": grads_waiting(sched),
        "batch_bytes_per_device": batch_bytes,
        "batch_bytes_per_device_before": buffers.whole_batch_bytes,    # the replica's whole batch (before Build 6)
        "batch_bytes_read_per_stage": list(buffers.stage_batch_bytes),
        "batch_leaves_per_stage": [list(leaves) for leaves in buffers.stage_batch_leaves],
        "message_width_floats": buffers.message_width, "message_bytes": buffers.message_bytes,
        "param_width_floats": buffers.param_width,
        "predicted_stash_bytes": stash,
        "memory": public, "memory_donated": donated,
        "activation_bytes": public["temp_size_in_bytes"],
        "residual_bytes": public["temp_size_in_bytes"] - stash,
        "seconds": time.perf_counter() - t0,
    }


def old_peak(row: dict) -> int:
    """The peak with the replica's whole batch on every device (before Build 6)."""
    return row["memory"]["peak_bytes"] + row["batch_bytes_per_device_before"] - row["batch_bytes_per_device"]


def grads_waiting(sched) -> list[int]:
    """Per stage s < S-1, the most gradients that have arrived from stage s+1 but whose backward
    B(s, m) has not run yet, over all ticks: what the gradient stash really has to hold."""
    from whalex.records.schedules import Task
    when = sched.when()
    out = []
    for s in range(sched.num_stages - 1):
        most = 0
        for t in range(sched.num_ticks):
            most = max(most, sum(1 for m in range(sched.num_micro_batch)
                                 if when[Task(s + 1, m, "B")] + 1 <= t <= when[Task(s, m, "B")]))
        out.append(most)
    return out


def plain_refs(loss_fn, params, args, Ms) -> dict:
    """Single-device plain-JAX value_and_grad: one micro-batch, all M at once, and scan-accumulated."""
    vg = jax.jit(jax.value_and_grad(loss_fn))
    out = {"micro": mem_dict(vg.lower(params, batch_shapes(args.micro, args.features, args.classes)).compile()),
           "full": {}, "accum": {}}

    def accum_fn(p, batch, M):
        mb = jax.tree.map(lambda x: x.reshape((M, x.shape[0] // M) + x.shape[1:]), batch)

        def body(carry, b):
            loss, g = jax.value_and_grad(loss_fn)(p, b)
            return jax.tree.map(jnp.add, carry, (loss, g)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), p))
        (loss, g), _ = jax.lax.scan(body, zero, mb)
        return loss / M, jax.tree.map(lambda x: x / M, g)

    for M in Ms:
        full = batch_shapes(args.micro * M, args.features, args.classes)     # one replica's batch
        out["full"][M] = mem_dict(vg.lower(params, full).compile())
        acc = jax.jit(accum_fn, static_argnums=2)
        out["accum"][M] = mem_dict(acc.lower(params, full, M).compile())
    return out


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256, help="H: width of every hidden layer")
    ap.add_argument("--layers", type=int, default=2, help="L: Dense+tanh layers per stage")
    ap.add_argument("--micro", type=int, default=1024, help="b: rows per micro-batch (fixed as M grows)")
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--classes", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--out", default=None, help="the results file (default bench/results/pipeline_memory.json)")
    args = ap.parse_args()
    assert len(jax.devices()) == N_DEV, jax.devices()
    Ms = sorted(set(args.micro_batches))
    if len(Ms) < 3:
        ap.error("--micro-batches needs at least three values (the linearity check uses three)")
    args.Ms = Ms
    return args


def compile_all(args):
    """Both schedules' pipeline plans at every M, compiled, and plain JAX's references:
    (rows, plain, parameter count)."""
    loss_fn, params = make_model(args.hidden, args.layers, args.features, args.classes)
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    cluster = wh.Cluster.detect()
    optimizer = optax.adam(1e-3)
    rows = [pipeline_row(loss_fn, params, args, M, sch, optimizer, cluster)
            for M in args.Ms for sch in ("1f1b", "gpipe")]
    return rows, plain_refs(loss_fn, params, args, args.Ms), n_params


def print_memory(args, rows, by, n_params) -> None:
    """The setting, then per schedule and M: slots, bubble, the device's bytes and the predicted stash."""
    Ms = args.Ms
    print(f"whalex pipeline memory: {STAGES} stages x {N_DEV // STAGES} data-parallel replicas on {N_DEV} "
          f"simulated CPU devices (jax {jax.__version__}); compiled, not run")
    print(f"model: {STAGES} stages x {args.layers} x Dense({args.hidden})+tanh, input {args.features}, head "
          f"{args.classes}, {n_params:,} params ({n_params * 4 / 2**20:.2f} MiB); Adam; micro-batch "
          f"b={args.micro} rows fixed, global batch = b*M*2")
    print(f"one stage input per micro-batch: {args.micro}x{args.hidden} f32 = "
          f"{args.micro * args.hidden * 4 / 2**20:.2f} MiB; one stage's params: "
          f"{rows[0]['param_width_floats'] * 4 / 2**20:.2f} MiB")
    print()
    print("Per device, MiB (plan.compiled_memory(): state not donated, alias 0). activation = temp.")
    print("predicted stash = (slots + grad_slots) x stage-input (forward + gradient stash); residual = temp - stash")
    head = (f"{'sched':<6}{'M':>4}{'slots':>6}{'bubble':>8}{'argument':>10}{'output':>9}{'temp=act':>10}"
            f"{'peak':>9}{'stash':>9}{'residual':>9}{'peak(don.)':>11}")
    print(head)
    print("-" * len(head))
    for M in Ms:
        for sch in ("1f1b", "gpipe"):
            r = by[(sch, M)]
            m, d = r["memory"], r["memory_donated"]
            print(f"{sch:<6}{M:>4}{r['slots']:>6}{r['bubble_fraction']:>8.3f}{mib(m['argument_size_in_bytes']):>10}"
                  f"{mib(m['output_size_in_bytes']):>9}{mib(m['temp_size_in_bytes']):>10}{mib(m['peak_bytes']):>9}"
                  f"{mib(r['predicted_stash_bytes']):>9}{mib(r['residual_bytes']):>9}{mib(d['peak_bytes']):>11}")
    print()


def print_batch(Ms, by) -> None:
    """The batch each stage device holds, against what it held when every device had the replica's whole batch."""
    print("Batch per stage device, MiB (Build 6: each stage device receives only the leaves its stage reads;")
    print("every device holds the widest stage's row of each dtype buffer; 'before' = the replica's whole batch;")
    print(" old = the peak with the whole batch: peak + before - held)")
    bhead = (f"{'sched':<6}{'M':>4}{'before':>9}{'held':>9}"
             + "".join(f"{'s' + str(s) + ' reads':>10}" for s in range(STAGES))
             + f"{'held/peak':>11}{'before/old':>13}")
    print(bhead)
    print("-" * len(bhead))
    for M in Ms:
        for sch in ("1f1b", "gpipe"):
            r = by[(sch, M)]
            peak = r["memory"]["peak_bytes"]
            print(f"{sch:<6}{M:>4}{mib(r['batch_bytes_per_device_before']):>9}{mib(r['batch_bytes_per_device']):>9}"
                  + "".join(f"{mib(b):>10}" for b in r["batch_bytes_read_per_stage"])
                  + f"{100 * r['batch_bytes_per_device'] / peak:>10.0f}%"
                  + f"{100 * r['batch_bytes_per_device_before'] / old_peak(r):>12.0f}%")
    print()


def gpipe_over_1f1b(Ms, by) -> dict:
    """GPipe's temp and peak over 1F1B's, per M, printed."""
    print("GPipe / 1F1B per M:")
    ratios = {}
    for M in Ms:
        a, g = by[("1f1b", M)], by[("gpipe", M)]
        ratios[M] = {"temp": g["memory"]["temp_size_in_bytes"] / a["memory"]["temp_size_in_bytes"],
                     "peak": g["memory"]["peak_bytes"] / a["memory"]["peak_bytes"],
                     "peak_donated": g["memory_donated"]["peak_bytes"] / a["memory_donated"]["peak_bytes"]}
        print(f"  M={M:<3} temp {ratios[M]['temp']:5.2f}x   peak {ratios[M]['peak']:5.2f}x   "
              f"peak (donated) {ratios[M]['peak_donated']:5.2f}x")
    print()
    return ratios


def plain_ratios_of(args, plain, by) -> dict:
    """Plain JAX's temp, the whole batch at once and scan-accumulated, against one micro-batch's and
    a 1F1B device's, per M, printed."""
    Ms = args.Ms
    print("Plain JAX, one device, jax.jit(jax.value_and_grad(loss)) on the whole model, MiB:")
    pm = plain["micro"]
    print(f"  one micro-batch ({args.micro} rows): temp {mib(pm['temp_size_in_bytes']).strip()}, "
          f"peak {mib(pm['peak_bytes']).strip()}")
    plain_ratios = {}
    for M in Ms:
        pf, pa = plain["full"][M], plain["accum"][M]
        one = by[("1f1b", M)]["memory"]
        plain_ratios[M] = {"full_over_micro_temp": pf["temp_size_in_bytes"] / pm["temp_size_in_bytes"],
                           "accum_over_micro_temp": pa["temp_size_in_bytes"] / pm["temp_size_in_bytes"],
                           "full_over_1f1b_temp": pf["temp_size_in_bytes"] / one["temp_size_in_bytes"],
                           "full_over_1f1b_peak": pf["peak_bytes"] / one["peak_bytes"]}
        print(f"  M={M:<3} all {M * args.micro} rows at once: temp {mib(pf['temp_size_in_bytes']).strip()} "
              f"({plain_ratios[M]['full_over_micro_temp']:.1f}x one micro-batch, "
              f"{plain_ratios[M]['full_over_1f1b_temp']:.1f}x a 1F1B device's temp); "
              f"scan-accumulated: temp {mib(pa['temp_size_in_bytes']).strip()} "
              f"({plain_ratios[M]['accum_over_micro_temp']:.2f}x)")
    return plain_ratios


def checks_of(Ms, by) -> dict:
    """1F1B's temp flat in M, GPipe's linear in M at the predicted slope, GPipe above 1F1B; printed."""
    lo, mid, hi = Ms[0], Ms[len(Ms) // 2], Ms[-1]
    t = {(s, M): by[(s, M)]["memory"]["temp_size_in_bytes"] for s in ("1f1b", "gpipe") for M in Ms}
    # predicted GPipe bytes per micro-batch (one stashed input)
    per_mb = by[("gpipe", lo)]["message_bytes"]
    slope = (t[("gpipe", hi)] - t[("gpipe", lo)]) / (hi - lo)
    inc1 = t[("gpipe", mid)] - t[("gpipe", lo)]
    inc2 = t[("gpipe", hi)] - t[("gpipe", mid)]
    expect_inc = (hi - mid) / (mid - lo) if mid != lo else float("nan")
    checks = {
        f"1F1B temp at M={hi} within 10% of M={lo}":
            abs(t[("1f1b", hi)] / t[("1f1b", lo)] - 1) <= 0.10,
        f"GPipe temp increments {lo}->{mid} : {mid}->{hi} in ratio 1:{expect_inc:g} (+-10%)":
            inc1 > 0 and abs((inc2 / inc1) / expect_inc - 1) <= 0.10,
        f"GPipe temp slope {slope / 2**20:.3f} MiB/micro-batch within 10% of predicted {per_mb / 2**20:.3f}":
            abs(slope / per_mb - 1) <= 0.10,
        "GPipe temp > 1F1B temp at every M": all(t[("gpipe", M)] > t[("1f1b", M)] for M in Ms),
    }
    print()
    for name, ok in checks.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    if not all(checks.values()):
        print("  (a FAIL is reported as measured; see the residual column and the module docstring's caveat)")
    return checks


def where_the_bytes_go(Ms, rows, by) -> None:
    """The residual, the gradient stash, the batch and donation, computed from this run (not asserted)."""
    print()
    print("Where the bytes go (computed from this run):")
    A4 = rows[0]["message_bytes"]
    resid = sorted({r["residual_bytes"] for r in rows})
    print(f"  * temp - predicted stash = {', '.join(mib(x).strip() for x in resid)} MiB in every config: the "
          f"per-tick buffers (activation/gradient messages of {A4 / 2**20:.2f} MiB each, in the scan carry, the "
          "switch outputs and the ppermutes) plus one micro-batch's recomputed stage forward/backward.")
    waiting = max(max(r["max_grads_waiting"]) for r in rows)
    print(f"  * gradient stash: at most {waiting} gradient(s) wait at a stage, and the runtime allocates "
          f"schedule.grad_slots = {waiting} buffer(s) for them.")
    b_lo, b_hi = by[("1f1b", Ms[0])], by[("1f1b", Ms[-1])]
    print(f"  * argument grows with M for both schedules: {mib(b_lo['batch_bytes_per_device']).strip()} -> "
          f"{mib(b_hi['batch_bytes_per_device']).strip()} MiB of it is the batch. Each stage device holds only "
          f"the leaves its stage reads (x on stage 0, y on stage {STAGES - 1}), padded to the widest stage: at "
          f"M={Ms[-1]} the batch is {100 * b_hi['batch_bytes_per_device'] / b_hi['memory']['peak_bytes']:.0f}% of "
          f"a 1F1B device's peak; the replica's whole batch ({mib(b_hi['batch_bytes_per_device_before']).strip()}"
          f" MiB, what every device held before) was "
          f"{100 * b_hi['batch_bytes_per_device_before'] / old_peak(b_hi):.0f}%"
          f" of the peak it made.")
    d = by[("1f1b", Ms[0])]
    print(f"  * donation (the step wh.parallelize runs): alias = "
          f"{mib(d['memory_donated']['alias_size_in_bytes']).strip()} MiB (the whole state), but temp grows by "
          f"{mib(d['memory_donated']['temp_size_in_bytes'] - d['memory']['temp_size_in_bytes']).strip()} MiB "
          f"(presumably XLA can no longer borrow not-yet-live output buffers for temporaries), so the peak drops by "
          f"only {mib(d['memory']['peak_bytes'] - d['memory_donated']['peak_bytes']).strip()} MiB.")


def main():
    args = parse()
    Ms = args.Ms
    t_start = time.perf_counter()
    rows, plain, n_params = compile_all(args)
    by = {(r["schedule"], r["M"]): r for r in rows}
    print_memory(args, rows, by, n_params)
    print_batch(Ms, by)
    ratios = gpipe_over_1f1b(Ms, by)
    plain_ratios = plain_ratios_of(args, plain, by)
    checks = checks_of(Ms, by)
    where_the_bytes_go(Ms, rows, by)
    elapsed = time.perf_counter() - t_start
    print(f"\n{len(rows)} pipeline plans x 2 compiles + {1 + 2 * len(Ms)} plain compiles in {elapsed:.1f} s")
    out = record(args, rows, plain, n_params, ratios, plain_ratios, checks, elapsed)
    path = harness.write_result("pipeline_memory", out, args.out, newline=True)
    print(f"wrote {path.relative_to(pathlib.Path.cwd()) if path.is_relative_to(pathlib.Path.cwd()) else path}")


def record(args, rows, plain, n_params, ratios, plain_ratios, checks, elapsed) -> dict:
    return {
        "benchmark": "pipeline_memory",
        "devices": N_DEV, "device_kind": "simulated CPU", "stages": STAGES, "data_parallel": N_DEV // STAGES,
        "cpu_cores": os.cpu_count(), "jax": jax.__version__, "python": platform.python_version(),
        "model": {"hidden": args.hidden, "layers_per_stage": args.layers, "features": args.features,
                  "classes": args.classes, "params": n_params, "optimizer": "adam(1e-3)"},
        "micro_batch": args.micro,
        "method": "wh.plan on ShapeDtypeStructs, compiled (not run); Compiled.memory_analysis() per device; "
                  "'memory' from plan.compiled_memory() (state not donated), 'memory_donated' from the step "
                  "as wh.parallelize runs it; peak = argument + output + temp - alias; activation = temp",
        "rows": rows,
        "gpipe_over_1f1b": {str(M): v for M, v in ratios.items()},
        "plain": {"micro": plain["micro"], "full": {str(M): v for M, v in plain["full"].items()},
                  "accum": {str(M): v for M, v in plain["accum"].items()},
                  "ratios": {str(M): v for M, v in plain_ratios.items()}},
        "checks": checks,
        "seconds": elapsed,
    }


if __name__ == "__main__":
    main()
