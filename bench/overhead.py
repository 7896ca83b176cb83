"""whalex overhead vs. hand-written `jax.jit` data parallelism (8 simulated CPU devices).

What it measures
    1. Step time (Acceptance 5 of issue 12). One training step of the same stock Flax MLP (no whalex
       annotation: the default strategy replicates it over the 8 devices), same optimizer (Adam),
       same data, global batch 256 (a power of two, 32 per device), done two ways in the same process:

       * whalex: ``step = wh.parallelize(loss_fn, optax.adam(...))``, ``state, metrics = step(state, batch)``.
       * plain:  a hand-written ``jax.jit`` step (``value_and_grad`` + optax update) on a 1-D mesh
         ``jax.make_mesh((8,), ('data',), axis_types=(AxisType.Auto,))`` with replicated params
         (``NamedSharding(mesh, P())``), the batch sharded ``P('data')`` via ``in_shardings`` and the
         state donated, called as ``state, loss = train_step(state, batch)``: nothing else per step.

       Target: whalex/plain median step time <= 1.02 with a placed batch.

    2. Host-side cost of one call: the same two steps on a tiny MLP (8 -> 16 -> 4,
       batch 16), where the computation is negligible and the time until the call returns (JAX
       dispatches asynchronously) is Python and dispatch work: whalex's ``Step.__call__`` (its
       bookkeeping, batch placement, then the jitted call) vs the plain jitted call alone. The
       difference is whalex's host overhead per step, in microseconds: wall time, and the calling
       thread's CPU time (``time.thread_time``), which other processes disturb less.

How
    Both sides are compiled and warmed up, then timed in interleaved blocks (whalex block, plain
    block, plain block, whalex block, ...) so machine noise hits both alike. Step times end with
    ``jax.block_until_ready`` on the new state and loss (Python dispatch plus computation);
    host-side times stop when the call returns, and the block happens outside the timed region.
    Two batch modes: "placed" (the batch given to both is already on the devices, sharded
    P('data')) and "host" (a numpy batch, copied to the devices every step by both: whalex in
    ``Step.__call__``, plain by ``jit``'s in_shardings). The verdict uses "placed". Reported per
    mode: medians over all steps, their ratio, the spread of the per-round ratios (quartiles) and a
    bootstrap 95% interval of the ratio of medians, and the load average (other processes share the
    2 cores: a ratio whose interval contains 1.00 is within this machine's noise). After the timed
    steps both sides have done the same updates from the same initial params: their losses and
    params are compared.

Run from the repo root: ``python bench/overhead.py`` (about a minute on 2 CPU cores).
Writes bench/results/overhead.json. Never fails the process on a FAIL verdict.
"""
from __future__ import annotations

import os

import harness

harness.simulate_devices(8)

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import whalex as wh
from models import MLP  # bench/models.py: a stock Flax MLP
from whalex.jaxpr.hlo import KINDS

N_DEV = 8
TARGET = 1.02


class Pair:
    """A whalex step and the equivalent hand-written jitted step on the same model, batches and
    initial params; each side walks the batch list in the same order."""

    def __init__(self, features, width, depth, classes, batch, num_batches, seed=0):
        self.model = model = MLP(width, depth, classes)
        rng = np.random.default_rng(seed)
        # random inputs, labels from a fixed random linear teacher, so the loss stays meaningful
        teacher = rng.standard_normal((features, classes)).astype(np.float32)
        host = []
        for _ in range(num_batches):
            x = rng.standard_normal((batch, features), dtype=np.float32)
            host.append({"x": x, "y": np.argmax(x @ teacher, axis=1).astype(np.int32)})
        params0 = model.init(jax.random.key(0), host[0]["x"][:1])["params"]
        self.n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params0))

        def loss_fn(params, b):
            logits = model.apply({"params": params}, b["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

        opt = optax.adam(1e-3)
        t0 = time.perf_counter()
        self.wstep = wh.parallelize(loss_fn, opt)
        self.wstate = self.wstep.init(params0, host[0])
        self.wh_setup = time.perf_counter() - t0

        t0 = time.perf_counter()
        mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        self.batch_sh = {"x": data, "y": data}

        def plain_train(state, b):
            params, opt_state = state
            loss, grads = jax.value_and_grad(loss_fn)(params, b)
            updates, opt_state = opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        pparams = jax.device_put(jax.tree.map(lambda a: jnp.array(a, copy=True), params0), rep)
        self.pstate = (pparams, jax.jit(opt.init, out_shardings=rep)(pparams))
        state_sh = jax.tree.map(lambda _: rep, self.pstate)
        self.plain_jit = jax.jit(plain_train, in_shardings=(state_sh, self.batch_sh), out_shardings=(state_sh, rep),
                                 donate_argnums=(0,))
        self.plain_setup = time.perf_counter() - t0

        self.batches = {"placed": [jax.device_put(b, self.batch_sh) for b in host], "host": host}
        self.counter = {"whalex": 0, "plain": 0}
        self.loss = {"whalex": None, "plain": None}
        # the whalex plan must be the same placement as the hand-written one
        self.same_specs = (all(a.sharding.spec == P() for a in jax.tree.leaves(self.wstate.params))
                           and all(s.spec == P("data")
                                   for s in jax.tree.leaves(self.wstep.plan.storage.batch_shardings)))

    def call(self, side, mode):
        """One step of `side` on the next batch of `mode`; returns what to block on."""
        bs = self.batches[mode]
        b = bs[self.counter[side] % len(bs)]
        self.counter[side] += 1
        if side == "whalex":
            self.wstate, m = self.wstep(self.wstate, b)
            self.loss[side] = m["loss"]
            return self.wstate, self.loss[side]
        self.pstate, self.loss[side] = self.plain_jit(self.pstate, b)
        return self.pstate, self.loss[side]

    def collectives(self):
        """Collectives in both compiled programs (sanity: the same communication)."""
        def count(txt):
            kinds = harness.by_kind(harness.collectives(txt, N_DEV))
            return {k: kinds[k]["count"] if k in kinds else 0 for k in KINDS}

        return {"whalex": count(self.wstep.plan.lowered().compile().as_text()),
                "plain": count(self.plain_jit.lower(self.pstate, self.batches["placed"][0]).compile().as_text())}

    def agreement(self):
        """(|loss difference|, max relative param error) after the same updates on both sides."""
        wl, pl = float(self.loss["whalex"]), float(self.loss["plain"])
        err = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
                  for a, b in zip(jax.tree.leaves(self.wstate.params), jax.tree.leaves(self.pstate[0])))
        return abs(wl - pl), err, wl, pl


def timed(pair, mode, rounds, block, host_only):
    """Per-step seconds of both sides in interleaved blocks, the order alternating: ({side: [block of
    wall times per round]}, the same for the calling thread's CPU time, which other processes on the
    machine disturb less). `host_only`: each call timed until it returns, blocked on afterwards."""
    t = harness.interleaved({side: (lambda side=side: pair.call(side, mode)) for side in ("whalex", "plain")},
                            rounds, block=block, sync_timed=not host_only, cpu_clock=time.thread_time)
    return t.wall, t.cpu


def summarise(times, rng, n_boot=2000):
    """Medians (us), their ratio, per-round ratio quartiles and a bootstrap 95% interval of the ratio."""
    w, p = np.asarray(times["whalex"]), np.asarray(times["plain"])     # (rounds, block)
    per_round = np.median(w, axis=1) / np.median(p, axis=1)
    ci = harness.bootstrap_ratio(w, p, rng, n_boot)                    # resample whole rounds
    wm, pm = float(np.median(w)), float(np.median(p))
    return {"whalex_median_us": wm * 1e6, "plain_median_us": pm * 1e6, "ratio": wm / pm,
            "difference_us": (wm - pm) * 1e6,
            "whalex_min_us": float(w.min()) * 1e6, "plain_min_us": float(p.min()) * 1e6,
            "per_round_ratio_quartiles": [float(q) for q in np.percentile(per_round, [25, 50, 75])],
            "per_round_ratio_range": [float(per_round.min()), float(per_round.max())],
            "ratio_ci95": ci, "steps_timed_each": int(w.size)}


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--features", type=int, default=256)
    ap.add_argument("--classes", type=int, default=256)
    ap.add_argument("--batch", type=int, default=256, help="global batch (divided over 8 devices)")
    ap.add_argument("--num-batches", type=int, default=8, help="distinct batches, cycled through in order")
    ap.add_argument("--rounds", type=int, default=40, help="interleaved rounds per batch mode")
    ap.add_argument("--block", type=int, default=10, help="steps per block")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--tiny-rounds", type=int, default=40, help="interleaved rounds of the host-side timing")
    ap.add_argument("--out", default=None, help="the results file (default bench/results/overhead.json)")
    args = ap.parse_args()
    assert len(jax.devices()) == N_DEV, jax.devices()
    return args


def warm_up(args, pair, tiny) -> float:
    """`--warmup` steps of each side in each batch mode, for both pairs; the seconds it took."""
    t0 = time.perf_counter()
    for pr in (pair, tiny):
        for mode in pr.batches:
            for side in ("whalex", "plain"):
                for _ in range(args.warmup):
                    jax.block_until_ready(pr.call(side, mode))
    return time.perf_counter() - t0


def measure(args, pair, tiny, rng) -> dict:
    """The step times in each batch mode, the host side of a tiny call, and the two sides' agreement."""
    t0 = time.perf_counter()
    step_res = {mode: summarise(timed(pair, mode, args.rounds, args.block, host_only=False)[0], rng)
                for mode in pair.batches}
    host_wall, host_cpu = timed(tiny, "placed", args.tiny_rounds, args.block, host_only=True)
    host_res = {"placed": summarise(host_wall, rng), "placed_thread_cpu": summarise(host_cpu, rng)}
    timed_time = time.perf_counter() - t0
    load_end = os.getloadavg()
    loss_diff, param_err, wl, pl = pair.agreement()
    ratio = step_res["placed"]["ratio"]
    return {"step_res": step_res, "host_res": host_res, "timed_time": timed_time, "load_end": load_end,
            "loss_diff": loss_diff, "param_err": param_err, "wl": wl, "pl": pl, "steps_each": int(pair.wstate.step),
            "ratio": ratio, "verdict": "PASS" if ratio <= TARGET else "FAIL"}


def report_setting(args, pair, coll, load_start, load_end) -> None:
    print(f"whalex overhead benchmark: {N_DEV} simulated CPU devices ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores), jax {jax.__version__}; load average {load_start[0]:.2f} at start, "
          f"{load_end[0]:.2f} at end")
    print(f"model: stock Flax MLP {args.features} -> {args.depth} x Dense({args.width}) -> {args.classes}, "
          f"{pair.n_params:,} params, Adam; global batch {args.batch} ({args.batch // N_DEV}/device), "
          f"{args.num_batches} distinct batches cycled")
    print(f"whalex plan: {pair.wstep.plan.task_graphs[0].strategy}, same shardings as plain: {pair.same_specs}")
    print(f"collectives in compiled HLO: whalex {coll['whalex']}  plain {coll['plain']}")
    print(f"timing: {args.rounds} interleaved rounds x {args.block} steps per side per mode, each step "
          "synchronised with jax.block_until_ready")
    print()
    hdr = f"  {'':<40} {'whalex':>9} {'plain':>9} {'ratio':>7} {'round ratios p25-p75':>21} {'ratio 95% CI':>15}"
    print(hdr)
    print("  " + "-" * (len(hdr) - 2))


def report(args, pair, tiny, m, warm_time) -> None:
    """The timing table, the host overhead per call, the agreement and the verdict."""
    step_res, host_res, ratio = m["step_res"], m["host_res"], m["ratio"]

    def row(label, r, unit, scale):
        q, ci = r["per_round_ratio_quartiles"], r["ratio_ci95"]
        print(f"  {label:<40} {r['whalex_median_us'] * scale:>7.3f}{unit} {r['plain_median_us'] * scale:>7.3f}{unit} "
              f"{r['ratio']:>7.3f} {f'{q[0]:.3f}-{q[2]:.3f}':>21} {f'[{ci[0]:.3f},{ci[1]:.3f}]':>15}")

    row("step, placed batch (pre-sharded)", step_res["placed"], "ms", 1e-3)
    row("step, host batch (numpy, copied)", step_res["host"], "ms", 1e-3)
    row("host side of a call, tiny MLP: wall", host_res["placed"], "us", 1.0)
    row("  calling thread's CPU time", host_res["placed_thread_cpu"], "us", 1.0)
    print()
    print(f"whalex host overhead per call (tiny MLP, {tiny.n_params} params, placed batch): "
          f"{host_res['placed']['difference_us']:+.1f} us wall over the plain jitted call "
          f"({host_res['placed']['plain_median_us']:.1f} us), "
          f"{host_res['placed_thread_cpu']['difference_us']:+.1f} us of the calling thread's CPU time "
          f"({host_res['placed_thread_cpu']['plain_median_us']:.1f} us)")
    print(f"after {m['steps_each']} steps each: |loss_whalex - loss_plain| = {m['loss_diff']:.3e} "
          f"(losses {m['wl']:.6f} / {m['pl']:.6f}); max relative param error {m['param_err']:.2e}")
    print(f"{m['verdict']}: whalex/plain median step time ratio {ratio:.3f} (placed batch; 95% CI "
          f"[{step_res['placed']['ratio_ci95'][0]:.3f}, {step_res['placed']['ratio_ci95'][1]:.3f}]) "
          f"vs target <= {TARGET}")
    print(f"(setup: whalex plan+init {pair.wh_setup:.2f}s, plain {pair.plain_setup:.2f}s; warm-up {warm_time:.1f}s, "
          f"timed {m['timed_time']:.1f}s)")


def record(args, pair, tiny, coll, m, load_start) -> dict:
    step_res, host_res = m["step_res"], m["host_res"]
    return {
        "benchmark": "overhead", "devices": N_DEV, "device_kind": "simulated CPU", "cpu_cores": os.cpu_count(),
        "jax": jax.__version__, "load_average_start": list(load_start), "load_average_end": list(m["load_end"]),
        "model": {"kind": "stock Flax MLP", "features": args.features, "width": args.width, "depth": args.depth,
                  "classes": args.classes, "params": pair.n_params, "optimizer": "adam(1e-3)"},
        "global_batch": args.batch, "num_batches": args.num_batches,
        "method": "interleaved blocks (rotating order), per-step wall time with block_until_ready; medians; "
                  "per-round ratio quartiles; bootstrap 95% CI over rounds; plain = the bare jitted call",
        "same_shardings": bool(pair.same_specs), "collectives": coll,
        "modes": step_res, "ratio": m["ratio"], "target": TARGET, "verdict": m["verdict"], "verdict_mode": "placed",
        "host_side_per_call": {"model": {"features": 8, "width": 16, "depth": 1, "classes": 4,
                                         "params": tiny.n_params, "global_batch": 16},
                               "method": "time until the call returns (asynchronous dispatch), block outside "
                                         "the timed region; placed batch",
                               "wall": host_res["placed"], "thread_cpu": host_res["placed_thread_cpu"]},
        "steps_each": m["steps_each"], "final_loss_whalex": m["wl"], "final_loss_plain": m["pl"],
        "loss_abs_diff": m["loss_diff"], "max_rel_param_err": m["param_err"],
    }


def main():
    args = parse()
    rng = np.random.default_rng(0)
    load_start = os.getloadavg()
    pair = Pair(args.features, args.width, args.depth, args.classes, args.batch, args.num_batches)
    tiny = Pair(8, 16, 1, 4, 16, 2)
    warm_time = warm_up(args, pair, tiny)
    coll = pair.collectives()
    m = measure(args, pair, tiny, rng)
    report_setting(args, pair, coll, load_start, m["load_end"])
    report(args, pair, tiny, m, warm_time)
    print(f"wrote {harness.write_result('overhead', record(args, pair, tiny, coll, m, load_start), args.out)}")


if __name__ == "__main__":
    main()
