"""What running a device's rows in parts costs: the uneven data-parallel program's loop on one device.

An uneven plan runs each device's rows as a `fori_loop` over full chunks, then its remainder under a
`lax.cond` (`whalex.lowering.uneven`). Each trip adds its gradient's accumulation and its launches.
This bench times value_and_grad of Whale's Example 2 model (the stock Flax MLP backbone, a Dense head
over 2048 classes) at a slow device's row counts of a 1024-row batch, run three ways, against the
plain-JAX way (one `jax.jit(jax.value_and_grad(loss))` call over the same rows), interleaved rounds:

- `binary/64`: 64-row chunks, then one chunk per binary digit of the remainder (whalex before);
- `exact/64`: 64-row chunks, then the remainder as one chunk;
- `whalex`: the chunk whalex picks (`cost.chunk_rows` for a split of the batch with this share) and
  the remainder as one chunk, as the uneven program runs it.

    python bench/uneven_parts.py [--rows 163,191,192,200,824,833] [--rounds 15]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="163,191,192,200,824,833", help="a device's rows, comma-separated")
    ap.add_argument("--batch", type=int, default=1024, help="the global batch the rows are a share of")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds of 3 calls each")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "uneven_parts.json"))
    return ap.parse_args(argv)


def model(n: int):
    """Example 2's model on one device, `n` rows: (grad, params, x, y), grad = value_and_grad of a summed loss."""
    import flax.linen as nn
    import jax
    import numpy as np
    import optax

    from models import MLP
    backbone, head = MLP(512, 3, 512), nn.Dense(2048)
    rng = np.random.default_rng(0)
    x = jax.numpy.asarray(rng.standard_normal((n, 512)).astype(np.float32))
    y = jax.numpy.asarray(rng.integers(0, 2048, n).astype(np.int32))
    params = {"b": backbone.init(jax.random.key(0), x[:1])["params"],
              "h": head.init(jax.random.key(1), x[:1])["params"]}

    def loss(p, x, y):
        logits = head.apply({"params": p["h"]}, backbone.apply({"params": p["b"]}, x))
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()
    return jax.value_and_grad(loss), params, x, y


def in_parts(grad, rows: int, chunk: int, binary: bool):
    """value_and_grad over `rows` rows as the uneven program runs one device's: full chunks in a
    fori_loop with a traced trip count, then the remainder (one chunk, or one per binary digit) under
    lax.cond."""
    import jax
    import jax.numpy as jnp

    def run(p, x, y):
        full, rem = divmod(rows, chunk)

        def body(i, acc):
            part = [jax.lax.dynamic_slice_in_dim(v, i * chunk, chunk) for v in (x, y)]
            return jax.tree.map(jnp.add, acc, grad(p, *part))
        acc = jax.lax.fori_loop(0, jnp.asarray(full), body, (jnp.zeros(()), jax.tree.map(jnp.zeros_like, p)))
        sizes = [s for s in (1 << k for k in reversed(range(chunk.bit_length()))) if rem & s] if binary else \
            [rem] if rem else []
        off = full * chunk
        for s in sizes:
            acc = jax.lax.cond(jnp.asarray(True), lambda a, o=off, s=s: jax.tree.map(
                jnp.add, a, grad(p, x[o:o + s], y[o:o + s])), lambda a: a, acc)
            off += s
        return acc
    return jax.jit(run)


def variants(grad, rows: int, batch: int) -> dict:
    import jax

    from whalex.balance.cost import chunk_rows, speed_grain
    shares = (batch - rows, rows)
    chunk = chunk_rows(shares, speed_grain(batch, shares))
    return {"plain jax.jit": jax.jit(lambda p, x, y: grad(p, x[:rows], y[:rows])),
            "binary/64": in_parts(grad, rows, 64, True), "exact/64": in_parts(grad, rows, 64, False),
            f"whalex (chunk {chunk})": in_parts(grad, rows, chunk, False)}


def timed(fns: dict, args, rounds: int) -> dict:
    """Median seconds per call of each function, over interleaved rounds of 3 calls (order alternating)."""
    import jax
    for f in fns.values():
        jax.block_until_ready(f(*args))
        jax.block_until_ready(f(*args))
    times = {n: [] for n in fns}
    for r in range(rounds):
        for n in (list(fns) if r % 2 else list(fns)[::-1]):
            t = time.perf_counter()
            for _ in range(3):
                out = fns[n](*args)
            jax.block_until_ready(out)
            times[n].append((time.perf_counter() - t) / 3)
    return {n: statistics.median(t) for n, t in times.items()}


def main(argv=None):
    args = parse(argv)
    counts = [int(r) for r in args.rows.split(",")]
    grad, params, x, y = model(max(counts))
    results = []
    for rows in counts:
        med = timed(variants(grad, rows, args.batch), (params, x, y), args.rounds)
        plain = med["plain jax.jit"]
        results.append({"rows": rows, "median_s": med, "vs_plain": {n: t / plain for n, t in med.items()}})
        print(f"{rows:5d} rows  " + "  ".join(f"{n} {1e3 * t:.2f} ms ({t / plain:.3f})" for n, t in med.items()),
              flush=True)
    pathlib.Path(args.out).write_text(json.dumps({"batch": args.batch, "rounds": args.rounds, "runs": results},
                                                 indent=1) + "\n")


if __name__ == "__main__":
    main()
