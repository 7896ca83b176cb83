"""What one split's step times look like, step by step, on the emulated cluster: the noise a refinement
times through.

The 2-process cluster of `bench/hetero_sweep.py` (process 1 slowed by a CPU quota or by busy loops on its
core), its stock Flax MLP (or Whale's Example 2, ``--model hybrid``) with Adam, calibrated on the whole
batch and run at whalex's balanced split for ``--steps`` steps, each timed on its own (process 0's clock;
the step ends on the replicated loss, so it sees the slower process). Writes every step's seconds per
setting to bench/results/step_noise.json; `bench/refine_noise.py` draws its measured noise from them.

    python bench/step_noise.py [--slow-by quota,busy] [--slowdowns 1,2] [--batches 1024] [--steps 400]
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import harness
import hetero  # bench/hetero.py: its model and defaults


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_emulation_args(ap, "step_noise", batches="1024", slow_by="quota,busy", timeout=900)
    ap.add_argument("--model", choices=("mlp", "hybrid"), default="mlp")
    ap.add_argument("--steps", type=int, default=400, help="steps timed, each on its own")
    args = ap.parse_args(argv)
    hetero.with_model_defaults(args)
    return args


def worker(args):
    import optax

    import whalex as wh
    from whalex.balance.calibrate import calibrate

    pid, log = harness.worker_start("the driver")
    loss_fn, params, batch = hetero.make_model(args)
    optimizer = optax.adam(1e-3)
    cluster = calibrate(wh.Cluster.detect(), loss_fn, params, batch, optimizer=optimizer, repeats=9)
    step = wh.parallelize(loss_fn, optimizer, cluster=cluster)
    run = harness.step_runner({"s": step}, {"s": step.init(params, batch)}, batch)
    for _ in range(5):                                 # its compile and first steps, untimed
        run("s")
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        run("s")
        times.append(time.perf_counter() - t0)
    log(f"rows {step.plan.batch_sizes}: median {np.median(times) * 1e3:.1f} ms")
    harness.write_worker_result(args.worker_out, {"model": args.model, "rows": list(step.plan.batch_sizes),
                                                  "times": times}, pid)


def describe(times) -> str:
    e = np.log(np.asarray(times) / np.median(times))
    q = np.percentile(e, [5, 25, 75, 95])
    return (f"median {np.median(times) * 1e3:.1f} ms, log residuals 5/25/75/95%: "
            + "/".join(f"{x:+.3f}" for x in q) + f", lag-1 autocorrelation {np.corrcoef(e[:-1], e[1:])[0, 1]:.2f}")


def driver(args, argv, cores, env, load_before):
    def report(run):
        if "times" in run:
            print(f"{harness.slowed(run)} batch {run['batch']} rows {run['rows']}: "
                  f"{describe(run['times'])}", flush=True)

    runs = harness.run_emulations(args, argv, cores, env, __file__, on_run=report)
    path = harness.write_result("step_noise", {"load_before": load_before, "runs": runs}, args.out,
                                variant=args.model)
    print(f"wrote {path}")


def main(argv):
    return harness.two_process_main(argv, parse, worker, driver)


if __name__ == "__main__":
    main(sys.argv[1:])
