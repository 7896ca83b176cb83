"""Median step time of whalex pipelines on the tests' models, beside plain-JAX single-device training.

What it measures
    The pipeline models of tests/test_pipeline.py (`_two_stage`: 2 stages x 4 replicas, 4 micro-batches;
    `FourStages`: 4 stages x 2 replicas, 8 micro-batches) and tests/test_pipeline_optim.py's untied
    decoder-only LM (4 stages x 2 replicas, 4 micro-batches), Adam, on 8 simulated CPU devices; each
    step timed to `jax.block_until_ready`, after 3 warm-up steps. Baseline in the same run: the same
    loss and optimizer as one plain `jax.jit` step on one device. Reported: median ms and the ratio
    pipeline / plain.

    Run it under two versions of whalex to compare them (e.g. before and after a change of the
    pipeline's state layout): `PYTHONPATH=<checkout> python bench/pipeline_step.py --label after`.
    Writes bench/results/pipeline_step_<label>.json.
"""
from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import argparse
import json
import pathlib
import statistics
import time

import jax
import optax

import whalex as wh
import test_pipeline as tp
import test_pipeline_optim as tl

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def models():
    params, batch = tp._plain()
    yield "two_stage 2x4 M=4", tp._two_stage, params, batch, 4
    model = tp.FourStages()
    k = jax.random.split(jax.random.key(1), 3)
    b = {"x": jax.random.normal(k[0], (32, 12)), "y": jax.random.normal(k[1], (32, 4))}
    p = model.init(k[2], b["x"], b["y"])["params"]
    yield "four_stages 4x2 M=8", (lambda p, b: model.apply({"params": p}, b["x"], b["y"])), p, b, 8
    yield "lm (untied) 4x2 M=4", tl.lm_loss, tl.lm_params(tied=False), tl.lm_batch(), 4


def median_ms(fn, state, batch, repeats):
    times = []
    for r in range(repeats + 3):
        s = time.perf_counter()
        state = fn(state, batch)
        jax.block_until_ready(state)
        if r >= 3:
            times.append(time.perf_counter() - s)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="now")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    opt = optax.adam(1e-2, eps=1e-4)
    rows = []
    for name, loss_fn, params, batch, m in models():
        step = wh.parallelize(loss_fn, opt, config=wh.Config(num_micro_batch=m))
        state = step.init(params, batch)
        placed = step.plan.place_batch(batch)
        pipe = median_ms(lambda s, b: step(s, b)[0], state, placed, args.repeats)

        @jax.jit
        def plain(carry, b):
            p, o = carry
            g = jax.grad(loss_fn)(p, b)
            u, o = opt.update(g, o, p)
            return optax.apply_updates(p, u), o

        dev = jax.devices()[0]
        ref = median_ms(plain, jax.device_put((params, opt.init(params)), dev), jax.device_put(batch, dev),
                        args.repeats)
        rows.append({"model": name, "pipeline_ms": pipe, "plain_ms": ref, "ratio": pipe / ref})
    print(f"pipeline step time ({args.label}): 8 simulated CPU devices, {os.cpu_count()} cores, jax {jax.__version__}, "
          f"Adam, {args.repeats} steps after 3 warm-up")
    print(f"  {'model':<22} {'pipeline ms':>11} {'plain ms':>9} {'ratio':>6}")
    for r in rows:
        print(f"  {r['model']:<22} {r['pipeline_ms']:>11.2f} {r['plain_ms']:>9.2f} {r['ratio']:>6.2f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"pipeline_step_{args.label}.json").write_text(json.dumps(
        {"label": args.label, "rows": rows, "jax": jax.__version__, "cpu_count": os.cpu_count()}, indent=2))


if __name__ == "__main__":
    main()
