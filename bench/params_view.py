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

Since issue 13 pipelines store the caller's pytree (no stage buffers to unpack): the script checks
that and exits with a note. bench/results/params_view.json keeps the figures of the packed storage;
the timing code (which read the packed buffer by the pipeline's parameter offsets) is in this file's
git history.

Run from the repo root: ``python bench/params_view.py``.
"""
from __future__ import annotations

import harness

harness.simulate_devices(8)

import argparse

import jax
import numpy as np
import optax

import whalex as wh
from models import MLP  # bench/models.py: a stock Flax MLP


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

    model = MLP(args.width, args.depth, args.classes)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.features), dtype=np.float32)
    batch = {"x": x, "y": rng.integers(0, args.classes, args.batch).astype(np.int32)}
    params = model.init(jax.random.key(0), x[:1])["params"]

    def loss_fn(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, b["x"]), b["y"]).mean()

    pipe = wh.parallelize(loss_fn, optax.adam(1e-3),
                          config=wh.Config(num_micro_batch=4, auto_parallel=True, num_task_graph=2))
    pstate = pipe.init(params, batch)
    if pstate.view is None:
        raise SystemExit("pipelines store the caller's pytree since issue 13 (no stage buffers to unpack): "
                         "nothing to measure; bench/results/params_view.json keeps the figures of the packed storage.")
    raise SystemExit(f"this pipeline stores its parameters as {pstate.view.layout}: the packed stage buffers this "
                     "bench timed by hand are gone (see its docstring).")

if __name__ == "__main__":
    main()
