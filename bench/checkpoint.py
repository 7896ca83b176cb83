"""The step-time cost of asynchronous checkpoints: `wh.CheckpointManager(save_interval_steps=k)`.

What it measures
    One training process, one model (a Flax MLP, 2.6M parameters, Adam: a 30 MiB checkpoint of
    params + mu + nu), one whalex step (pure data parallelism over 8 simulated CPU devices), trained
    in interleaved blocks of ``--block`` steps under four conditions:

        none      ``state, metrics = step(state, batch)``, no checkpointing (the baseline)
        k = 1     the same, then ``manager.save(step, state)`` after every step, with a manager made
        k = 5     as ``wh.CheckpointManager(dir, max_to_keep=3, save_interval_steps=k)``: orbax skips
        k = 20    the saves at steps that are not multiples of k; the others start an async save

    Every step is timed on its own, from the call of the step to ``jax.block_until_ready`` of the new
    state and loss, with ``manager.save`` inside the timed region (its synchronous part: reading
    the step counter, orbax copying the arrays to host memory, waiting for the previous save if it is
    still being written, starting the background write). At the end of every block the manager's
    ``wait_until_finished()`` is timed separately (the write still in flight), so a pending write
    never spills into the next block's timings. Blocks rotate through the conditions (round r
    starts at condition r mod 4), so machine noise hits all of them alike.

Reported per condition
    median ms/step and its ratio to the baseline's median (the median step of k = 5 and k = 20 is a
    step that does not save); mean ms/step over all timed steps (the amortised cost, saving steps
    included) and its ratio; the median of the saving steps alone; the median wall time of
    ``wait_until_finished`` at the end of a block; the number of saves started.
    Files go to a temporary directory on the local disk (removed afterwards).

Run from the repo root: ``python bench/checkpoint.py`` (under 2 minutes on 2 CPU cores).
Writes bench/results/checkpoint.json.
"""
from __future__ import annotations

import os

import harness

harness.simulate_devices(8)

import argparse
import contextlib
import pathlib
import platform
import shutil
import statistics
import tempfile
import time

import jax
import numpy as np
import optax

import whalex as wh
from models import MLP  # bench/models.py: a stock Flax MLP

N_DEV = 8


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--features", type=int, default=256)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--classes", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64, help="global batch (a power of two, over 8 devices)")
    ap.add_argument("--intervals", type=str, default="1,5,20", help="save_interval_steps values")
    ap.add_argument("--block", type=int, default=20, help="steps per block (a multiple of every interval)")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds (one block per condition each)")
    ap.add_argument("--num-batches", type=int, default=4, help="distinct batches, cycled through")
    ap.add_argument("--out", default=None, help="the results file (default bench/results/checkpoint.json)")
    args = ap.parse_args()
    assert len(jax.devices()) == N_DEV, jax.devices()
    args.intervals = [int(k) for k in args.intervals.split(",")]
    assert all(args.block % k == 0 for k in args.intervals), "block must be a multiple of every interval"
    return args


def build(args) -> dict:
    """The model, its whalex step and state, the batches on the devices, the checkpoint's size."""
    model = MLP(args.width, args.depth, args.classes)
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((args.features, args.classes)).astype(np.float32)
    host_batches = []
    for _ in range(args.num_batches):
        x = rng.standard_normal((args.batch, args.features), dtype=np.float32)
        host_batches.append({"x": x, "y": np.argmax(x @ teacher, axis=1).astype(np.int32)})
    params = model.init(jax.random.key(0), host_batches[0]["x"][:1])["params"]

    def loss_fn(p, batch):
        logits = model.apply({"params": p}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    step = wh.parallelize(loss_fn, optax.adam(1e-3))
    state = step.init(params, host_batches[0])
    tree = step.plan.caller_state(state)
    return {"step": step, "state": state, "params": params, "host_batches": host_batches,
            "batches": [jax.device_put(b, step.plan.storage.batch_shardings) for b in host_batches],
            "n_params": sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params)),
            "ckpt_bytes": sum(x.nbytes for x in jax.tree.leaves(tree))}


def measure(args, m: dict) -> dict:
    """Train under every condition in interleaved blocks, each with its own manager in a temporary
    directory; the per-step times, which steps saved, the end-of-block waits and a restore's check."""
    step, batches, conditions = m["step"], m["batches"], ["none"] + [f"k={k}" for k in args.intervals]
    root = pathlib.Path(tempfile.mkdtemp(prefix="whalex-bench-ckpt-"))
    saving = {c: [] for c in conditions}          # per timed step: did this step start a save
    waits = {c: [] for c in conditions}
    last_saved = {}                                # condition -> the step of its last save
    run = {"state": m["state"], "metrics": None, "calls": 0, "step": int(m["state"].step), "record": False}

    def one_step(cond):
        """One step of `cond`, then its manager's save (timed with the step, to block_until_ready)."""
        b = batches[run["calls"] % len(batches)]
        run["calls"] += 1
        run["state"], run["metrics"] = step(run["state"], b)
        run["step"] += 1
        saved = managers[cond].save(step, run["state"]) if managers[cond] is not None else False
        if saved:
            last_saved[cond] = run["step"]
        if run["record"]:
            saving[cond].append(bool(saved))
        return run["state"], run["metrics"]["loss"]

    def wait(cond, r):               # the write still in flight, timed apart at the end of the block
        if managers[cond] is not None:
            waits[cond].append(harness.time_call(managers[cond].wait_until_finished, sync=None)[0])

    with contextlib.ExitStack() as stack:
        managers = {"none": None}
        for k in args.intervals:
            managers[f"k={k}"] = stack.enter_context(
                wh.CheckpointManager(root / f"k{k}", max_to_keep=3, save_interval_steps=k))
        warm_time = _warm_up(args, step, one_step, managers, conditions, run)
        run["record"] = True
        timings = harness.interleaved({c: (lambda c=c: one_step(c)) for c in conditions}, args.rounds,
                                      block=args.block, order_by="rotate", after_block=wait)
        kept = {c: managers[c].all_steps() for c in conditions if managers[c] is not None}
        # sanity: the latest checkpoint of the first interval restores, at the step it was saved at
        restored_step = int(managers[conditions[1]].restore(step, m["params"], m["host_batches"][0]).step)
        restored_ok = restored_step == last_saved[conditions[1]] == managers[conditions[1]].latest_step()
    shutil.rmtree(root, ignore_errors=True)
    return {"conditions": conditions, "times": {c: timings.times(c) for c in conditions}, "saving": saving,
            "waits": waits, "kept": kept, "restored_step": restored_step, "restored_ok": restored_ok,
            "last_saved": last_saved, "final_step": int(run["state"].step),
            "final_loss": float(run["metrics"]["loss"]), "warm_time": warm_time, "timed_time": timings.timed_s}


def _warm_up(args, step, one_step, managers, conditions, run) -> float:
    """Compile and a few steps, then one forced save per manager (orbax's first save sets up); its seconds."""
    t0 = time.perf_counter()
    harness.interleaved({"none": lambda: one_step("none")}, 0, warmup=args.block)
    for cond in conditions[1:]:
        managers[cond].save(step, run["state"], force=True)
        managers[cond].wait_until_finished()
    return time.perf_counter() - t0


def summarise(t: dict) -> dict:
    """Per condition: median and mean ms/step and their ratios to the baseline's, the saving steps'
    median, the end-of-block waits, the saves started."""
    times, saving, waits = t["times"], t["saving"], t["waits"]
    base = harness.median(times["none"])
    base_mean = statistics.fmean(times["none"])
    res = {}
    for c in t["conditions"]:
        ts = times[c]
        save_steps = [x for x, sv in zip(ts, saving[c]) if sv]
        res[c] = {"median_ms": harness.median(ts) * 1e3, "ratio_median": harness.median(ts) / base,
                  "mean_ms": statistics.fmean(ts) * 1e3, "ratio_mean": statistics.fmean(ts) / base_mean,
                  "saving_step_median_ms": harness.median(save_steps) * 1e3 if save_steps else None,
                  "wait_until_finished_median_ms": harness.median(waits[c]) * 1e3 if waits[c] else None,
                  "wait_until_finished_max_ms": max(waits[c]) * 1e3 if waits[c] else None,
                  "saves_started": sum(saving[c]), "steps_timed": len(ts)}
    return res


def report(args, m, t, res, loads, t_start) -> None:
    print(f"checkpoint cost benchmark: {N_DEV} simulated CPU devices ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores), jax {jax.__version__}, whalex from {os.path.dirname(wh.__file__)}")
    print(f"model: Flax MLP {args.features} -> {args.depth} x Dense({args.width}) -> {args.classes}, "
          f"{m['n_params']:,} params, Adam; checkpoint {m['ckpt_bytes'] / 2**20:.1f} MiB (params + mu + nu); "
          f"global batch {args.batch} ({args.batch // N_DEV}/device); plan {m['step'].plan.task_graphs[0].strategy}")
    print(f"timing: {args.rounds} interleaved rounds x {args.block} steps per condition, each step timed to "
          f"block_until_ready with manager.save inside; wait_until_finished timed at the end of each block")
    print()
    print(f"  {'condition':<9} {'median ms':>9} {'ratio':>6} {'mean ms':>8} {'ratio':>6} {'save-step ms':>12} "
          f"{'wait ms':>8} {'saves':>5}")
    print(f"  {'-' * 9} {'-' * 9} {'-' * 6} {'-' * 8} {'-' * 6} {'-' * 12} {'-' * 8} {'-' * 5}")
    fmt = lambda v: f"{v:.1f}" if v is not None else "-"  # noqa: E731
    for c, r in res.items():
        print(f"  {c:<9} {r['median_ms']:>9.2f} {r['ratio_median']:>6.3f} {r['mean_ms']:>8.2f} "
              f"{r['ratio_mean']:>6.3f} {fmt(r['saving_step_median_ms']):>12} "
              f"{fmt(r['wait_until_finished_median_ms']):>8} {r['saves_started']:>5}")
    print()
    print(f"kept steps: {t['kept']}; restore of k={args.intervals[0]}'s latest at step {t['restored_step']} "
          f"(its last save: {t['last_saved'][t['conditions'][1]]}): {'ok' if t['restored_ok'] else 'MISMATCH'}")
    print(f"load average (1 min) {loads[0]:.2f} -> {loads[1]:.2f}; warm-up {t['warm_time']:.1f}s, "
          f"timed {t['timed_time']:.1f}s, total {time.perf_counter() - t_start:.1f}s")


def record(args, m, t, res, loads, t_start) -> dict:
    return {
        "benchmark": "checkpoint", "devices": N_DEV, "device_kind": "simulated CPU", "cpu_cores": os.cpu_count(),
        "load_average_1min": {"start": loads[0], "end": loads[1]}, "jax": jax.__version__,
        "model": {"kind": "flax.linen MLP", "features": args.features, "width": args.width, "depth": args.depth,
                  "classes": args.classes, "params": m["n_params"], "optimizer": "adam(1e-3)"},
        "checkpoint_bytes": m["ckpt_bytes"], "global_batch": args.batch,
        "plan": str(m["step"].plan.task_graphs[0].strategy),
        "manager": "wh.CheckpointManager(dir, max_to_keep=3, save_interval_steps=k), async (orbax)",
        "method": "interleaved blocks (rotating order), per-step wall time to block_until_ready with "
                  "manager.save inside; wait_until_finished timed separately at the end of each block; medians",
        "block": args.block, "rounds": args.rounds, "conditions": res,
        "restored_step_matches": t["restored_ok"], "final_step": t["final_step"], "final_loss": t["final_loss"],
        "seconds": {"warm_up": t["warm_time"], "timed": t["timed_time"], "total": time.perf_counter() - t_start},
    }


def main():
    args = parse()
    load_start = os.getloadavg()[0]
    t_start = time.perf_counter()
    m = build(args)
    t = measure(args, m)
    loads = (load_start, os.getloadavg()[0])
    res = summarise(t)
    report(args, m, t, res, loads, t_start)
    print(f"wrote {harness.write_result('checkpoint', record(args, m, t, res, loads, t_start), args.out)}")


if __name__ == "__main__":
    main()
