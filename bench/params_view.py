"""The cost of reading `state.params` as the caller's pytree when a pipeline stores stage buffers.

What it measures
    A Flax MLP (stock ``nn.Dense`` layers, Adam) trained by a whalex pipeline (auto_parallel into 2
    stages, 4 micro-batches, nested data parallelism over 8 simulated CPU devices). The pipeline
    stores its parameters packed, one ``[stages, width]`` buffer; ``state.params`` unpacks them into
    the caller's pytree with one jitted call, each leaf spread over the 8 devices. Every repeat runs
    one pipeline step (fresh arrays: jax caches an array's host copy once fetched), then times, each
    to ``jax.block_until_ready``, in rotating order on that step's state:

        view             ``state.params``: the unpack, arrays left on the devices
        view+host        ``jax.device_get(state.params)`` (what logging or evaluation on the host does)
        by hand          the plain-JAX way without the view: ``jax.device_get(state.stored_params)``
                         and numpy slices of the host buffer by the plan's parameter offsets

    and the step itself for scale. Reported: median ms of each; ratios view/step and
    view+host / by hand.

Run from the repo root: ``python bench/params_view.py`` (about a minute on 2 CPU cores).
Writes bench/results/params_view.json.
"""
from __future__ import annotations

import os

import harness

harness.simulate_devices(8)

import argparse
import dataclasses
import platform
import time

import flax.linen as nn
import jax
import numpy as np
import optax

import whalex as wh
from models import MLP          # bench/models.py: a stock Flax MLP


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--features", type=int, default=256)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--classes", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None, help="the results file (default bench/results/params_view.json)")
    args = ap.parse_args()
    t_start = time.perf_counter()

    model = MLP(args.width, args.depth, args.classes)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.features), dtype=np.float32)
    batch = {"x": x, "y": rng.integers(0, args.classes, args.batch).astype(np.int32)}
    params = model.init(jax.random.key(0), x[:1])["params"]
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))

    def loss_fn(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, b["x"]), b["y"]).mean()

    pipe = wh.parallelize(loss_fn, optax.adam(1e-3),
                          config=wh.Config(num_micro_batch=4, auto_parallel=True, num_task_graph=2))
    pstate = pipe.init(params, batch)
    if pstate.view is None:
        raise SystemExit("pipelines store the caller's pytree since issue 13 (no stage buffers to unpack): "
                         "nothing to measure; bench/results/params_view.json keeps the figures of the packed storage.")
    placed = pipe.plan.place_batch(batch)
    prog = pipe.plan.program

    def by_hand(state):           # what a user would write against the packed buffer
        buf = jax.device_get(state.stored_params)["stages"]
        leaves = [None] * len(jax.tree.leaves(params))
        for s, (ps, slots) in enumerate(zip(prog.cut.params, prog.param_slots)):
            for p, slot in zip(ps, slots):
                leaves[p] = buf[s, slot.offset:slot.offset + slot.size].reshape(slot.shape)
        return jax.tree.unflatten(jax.tree.structure(params), leaves)

    reads = {"view": lambda st: st.params, "view+host": lambda st: jax.device_get(st.params), "by hand": by_hand}
    run = {"state": pstate}

    def one_step():
        run["state"], m = pipe(run["state"], placed)
        return run["state"], m["loss"]

    def fresh():                  # untimed: this step's state on fresh arrays (no host copy cached yet)
        stored = jax.block_until_ready(jax.tree.map(lambda x: x + 0, run["state"].stored_params))
        return (dataclasses.replace(run["state"], stored_params=stored),)

    # each repeat: one step, then the reads in rotating order; 3 warm-up calls each compile the step and the unpack
    timings = harness.interleaved({"step": one_step, **reads}, args.repeats, warmup=3, setup=dict.fromkeys(reads, fresh),
                                  order_by=lambda names, r: ["step"] + harness.order(names[1:], r, "rotate"))
    times = {c: timings.times(c) for c in ["step", *reads]}
    state = run["state"]
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), by_hand(state))
    med = {c: harness.median(t) * 1e3 for c, t in times.items()}
    ratios = {"view / step": med["view"] / med["step"], "view+host / by hand": med["view+host"] / med["by hand"]}

    print(f"state.params view benchmark: 8 simulated CPU devices ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores), jax {jax.__version__}")
    print(f"model: Flax MLP {args.features} -> {args.depth} x Dense({args.width}) -> {args.classes}, {n_params:,} "
          f"params ({n_params * 4 / 2**20:.1f} MiB), Adam; pipeline {pipe.plan.layout.axis_sizes} "
          f"(stages x replicas), 4 micro-batches; global batch {args.batch}; {args.repeats} interleaved repeats")
    print()
    print(f"  {'what':<12} {'median ms':>9}")
    for c in times:
        print(f"  {c:<12} {med[c]:>9.3f}")
    print()
    for k, v in ratios.items():
        print(f"  {k:<24} {v:6.3f}")
    print(f"\ntotal {time.perf_counter() - t_start:.1f}s")
    path = harness.write_result("params_view", {
        "args": {k: v for k, v in vars(args).items() if k != "out"}, "n_params": n_params, "median_ms": med,
        "ratios": ratios, "jax": jax.__version__, "cpu_count": os.cpu_count()}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
