"""What a pipeline stage's tasks cost on one device, against the unit costs whalex's schedules plan with.

What it measures
    One stage of a GPT (`--layers` stock Flax pre-LN blocks of bench/models.py, `--d` wide, bf16
    compute on fp32 parameters, `--batch` x `--seq` tokens of one micro-batch), on one device (a GPU
    where JAX sees one), each task as its own jitted call, medians of interleaved rounds:

    * F:        the stage's forward;
    * backward: its input and weight gradients from the forward's residuals (`jax.vjp`'s pullback,
                jitted on its own: no recompute);
    * B:        the input gradient alone (the pullback of a vjp taken with respect to the input);
    * W:        the weight gradient's own work, backward - B (a pullback with respect to the parameters
                alone still carries the cotangent through every layer: it is B's chain and more);
    * recompute + backward: the forward recomputed from the stage's input, then both gradients,
                as whalex's backward task runs it.

    Reported in units of F beside the schedules' costs (`whalex.records.schedules`: a backward 2, with
    recompute 3; a split backward's W 1 and its B the rest). On a GPU the numbers are the ones the
    lockstep model's tick lengths stand for; on CPU they run in seconds (`--small`).

Run from the repo root: ``python bench/stage_tasks.py`` (a GPU: about a minute) or ``--small``.
Writes bench/results/stage_tasks.json (`--out` for another file).
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import harness
from models import Block
from whalex.records.schedules import RECOMPUTE_COSTS, UNIT_COSTS

SIZES = {"full": dict(d=2048, heads=16, layers=4, seq=2048, batch=8),
         "small": dict(d=64, heads=2, layers=2, seq=32, batch=4)}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="a tiny stage: runs on CPU in seconds")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None, help="the results file (default bench/results/stage_tasks.json)")
    return ap.parse_args(argv)


def stage(size: dict):
    """(apply(params, x) in bf16 on fp32 parameters, params, x, a cotangent like the output)."""
    import flax.linen as nn

    class Stage(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(size["layers"]):
                x = Block(size["heads"])(x)
            return x

    model = Stage()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(size["batch"], size["seq"], size["d"])), jnp.bfloat16)
    params = jax.device_put(model.init(jax.random.key(0), x[:1])["params"])

    def apply(p, x):
        return model.apply({"params": jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)}, x)
    return apply, params, x, jnp.ones_like(x)


def tasks(size: dict) -> dict:
    """{task: a zero-argument call of its jitted computation}."""
    apply, params, x, g = stage(size)
    forward = jax.jit(apply)
    pull = jax.jit(lambda pb, g: pb(g))                 # a pullback alone, from its residuals
    both = jax.vjp(apply, params, x)[1]
    b_only = jax.vjp(lambda x: apply(params, x), x)[1]
    recompute = jax.jit(lambda p, x, g: jax.vjp(apply, p, x)[1](g))
    return {"F": lambda: forward(params, x), "backward": lambda: pull(both, g), "B": lambda: pull(b_only, g),
            "recompute + backward": lambda: recompute(params, x, g)}


def main(argv=None):
    args = parse(argv)
    size = SIZES["small" if args.small else "full"]
    t = harness.interleaved(tasks(size), args.rounds, warmup=2)
    f = t.median("F")
    planned = {"F": UNIT_COSTS[0], "backward": UNIT_COSTS[1], "B": UNIT_COSTS[1] - UNIT_COSTS[0],
               "W": UNIT_COSTS[0], "recompute + backward": RECOMPUTE_COSTS[1]}
    medians = {name: t.median(name) for name in t.wall}
    medians["W"] = medians["backward"] - medians["B"]
    rows = []
    for name, m in medians.items():
        rows.append({"task": name, "median_ms": m * 1e3, "in_forwards": m / f, "planned": planned[name]})
        print(f"{name:22s} {m * 1e3:8.2f} ms  {m / f:5.2f} F  (planned {planned[name]:g})", flush=True)
    record = {"config": {**vars(args), **size}, "jax": jax.__version__, "device": jax.devices()[0].device_kind,
              "rows": rows}
    print(f"wrote {harness.write_result('stage_tasks', record, out=args.out)}")


if __name__ == "__main__":
    main(sys.argv[1:])
