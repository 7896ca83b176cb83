"""The uneven `split` head on one device's classes, against the dense head of plain JAX.

What it measures
    One device (CPU, or a GPU where JAX sees one), the gradient (input, kernel, bias) of the softmax
    cross-entropy head over `--rows` rows of `--features` features, for each class count in `--classes`:

    * plain:   ``optax.softmax_cross_entropy_with_integer_labels(x @ w + b, y).mean()`` under
               ``jax.jit(jax.grad(...))``: the head as a user writes it.
    * whalex:  whalex's uneven head (``whalex.columns.uneven_head``) on a one-device
               model axis: the branch a device of a split runs at its own class count (one matmul
               per direction), its kernel and logits padded to the split's width (the largest
               count in `--classes`), the statistics masked.

    * switch:  whalex's branch inside a ``lax.switch`` on an index held on the device (two branches,
               the device's count and the split's width), as the SPMD program picks a device's
               count from its axis index: what the conditional itself costs (on XLA:GPU it reads
               the index back to the host before it launches the branch).

    Interleaved rounds, medians; the table prints each layout's time, its time per class and its
    ratio to plain: what the head of a split pays over the dense head on the device that runs the
    most classes and on the one that runs the fewest.

Run from the repo root: ``python bench/split_head.py`` (about a minute). Writes
bench/results/split_head.json (`--out` for another file).
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

import harness
from whalex.columns import UnevenColumns, uneven_head


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--features", type=int, default=512)
    ap.add_argument("--classes", default="1408,640", help="class counts, comma-separated (one device's share)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=None, help="the results file (default bench/results/split_head.json)")
    return ap.parse_args(argv)


def gradients(args, n: int, width: int) -> dict:
    """{layout: a zero-argument call of the head's jitted gradient at `n` classes}; whalex's kernel
    padded to `width` columns."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(args.rows, args.features)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(args.features, n)) * 0.01, jnp.float32)
    b = jnp.zeros((n,), jnp.float32)
    y = jnp.asarray(rng.integers(0, n, args.rows), jnp.int32)
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))

    def plain(x, w, b):
        return optax.softmax_cross_entropy_with_integer_labels(x @ w + b, y).mean()

    layout = UnevenColumns((n,), width, n)
    head = uneven_head(mesh, "model", (), layout, args.rows)
    padded = (x, layout.pad(w, 1), layout.pad(b, 0))
    plain_grad = jax.jit(jax.grad(plain, argnums=(0, 1, 2)))
    whalex_grad = jax.jit(jax.grad(lambda x, w, b: head(x, w, b, y), argnums=(0, 1, 2)))
    wide = uneven_head(mesh, "model", (), UnevenColumns((width,), width, width), args.rows)
    branches = [lambda x, w, b: head(x, w, b, y), lambda x, w, b: wide(x, w, b, y)]
    switch_grad = jax.jit(jax.grad(lambda k, x, w, b: jax.lax.switch(k, branches, x, w, b), argnums=(1, 2, 3)))
    k = jnp.asarray(0, jnp.int32)
    calls = {"plain": lambda: plain_grad(x, w, b), "whalex": lambda: whalex_grad(*padded),
             "switch": lambda: switch_grad(k, *padded)}
    dx, dw, db = calls["whalex"]()              # the same gradient as the dense head
    sx, sw, sb = calls["switch"]()
    tol = dict(rtol=2e-4, atol=1e-6) if jax.default_backend() == "cpu" else dict(rtol=2e-2, atol=1e-4)  # TF32 dots
    for a, r in zip((dx, layout.unpad(dw, 1), layout.unpad(db, 0), sx, layout.unpad(sw, 1), layout.unpad(sb, 0)),
                    2 * tuple(calls["plain"]())):
        np.testing.assert_allclose(a, r, **tol)
    return calls


def main(argv=None):
    args = parse(argv)
    rows = []
    classes = [int(c) for c in args.classes.split(",")]
    for n in classes:
        t = harness.interleaved(gradients(args, n, max(classes)), args.rounds, warmup=1)
        plain = t.median("plain")
        for name in t.wall:
            m = t.median(name)
            rows.append({"classes": n, "layout": name, "median_ms": m * 1e3, "us_per_class": m / n * 1e6,
                         "vs_plain": m / plain})
            print(f"{n:6d} classes  {name:7s} {m * 1e3:8.1f} ms  {m / n * 1e6:6.1f} us/class  "
                  f"x{m / plain:.3f} plain", flush=True)
    record = {"config": vars(args), "jax": jax.__version__, "device": jax.devices()[0].device_kind, "rows": rows}
    path = harness.write_result("split_head", record, out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
