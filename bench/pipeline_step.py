"""Median step time of whalex pipelines on the tests' models, beside plain-JAX single-device training.

What it measures
    The pipeline models of tests/lowering/test_pipeline.py (`two_stage`: 2 stages x 4 replicas, 4 micro-batches;
    `FourStages`: 4 stages x 2 replicas, 8 micro-batches) and tests/lowering/test_pipeline_optim.py's untied
    decoder-only LM (4 stages x 2 replicas, 4 micro-batches), written out again below (a bench imports
    nothing from tests/), Adam, on 8 simulated CPU devices; each step timed to `jax.block_until_ready`,
    after 3 warm-up steps. Baseline in the same run: the same loss and optimizer as one plain `jax.jit`
    step on one device, the two interleaved (rounds alternating their order). Reported: median ms and
    the ratio pipeline / plain.

    Run it under two versions of whalex to compare them (e.g. before and after a change of the
    pipeline's state layout): `PYTHONPATH=<checkout> python bench/pipeline_step.py --label after`.
    Writes bench/results/pipeline_step_<label>.json.
"""
from __future__ import annotations

import os

import harness

harness.simulate_devices(8)

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import whalex as wh

# ---- the models of tests/lowering/test_pipeline.py ---------------------------------------------------

BIAS = nn.initializers.normal(0.5)


def two_stage_params(seed=0):
    k = jax.random.split(jax.random.key(seed), 6)
    params = {"w1": jax.random.normal(k[0], (16, 32)) / 4, "b1": jax.random.normal(k[3], (32,)),
              "w2": jax.random.normal(k[1], (32, 24)) / 6, "w3": jax.random.normal(k[2], (24, 8)) / 5}
    batch = {"x": jax.random.normal(k[4], (64, 16)), "y": jax.random.normal(k[5], (64, 8))}
    return params, batch


def two_stage(p, b):
    with wh.replicate(1):
        h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    with wh.replicate(1):
        g = jnp.tanh(h @ p["w2"])
        return jnp.mean((g @ p["w3"] - b["y"]) ** 2)


class Embed(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(48, bias_init=BIAS)(x)


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.tanh(nn.Dense(self.width, bias_init=BIAS)(x))


class Head(nn.Module):
    @nn.compact
    def __call__(self, x, skip, y):
        out = nn.Dense(4, bias_init=BIAS)(x) + skip[:, :4]
        return jnp.mean((out - y) ** 2)


class FourStages(nn.Module):
    """Four stages with different functions, widths and layer counts (1, 3, 1, 1+head), and a skip
    connection from stage 0 to stage 3."""

    @nn.compact
    def __call__(self, x, y):
        with wh.replicate(1):
            e = Embed()(x)
        with wh.replicate(1):
            h = Block(32)(e)
            h = Block(32)(h)
            h = Block(24)(h)
        with wh.replicate(1):
            h = Block(40)(h)
        with wh.replicate(1):
            h = Block(16)(h)
            return Head()(h, e, y)


# ---- the LM of tests/lowering/test_pipeline_optim.py -------------------------------------------------

V, D, T, B = 32, 16, 8, 16          # vocabulary, width, sequence length, global batch


def _ln(x, g):
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean((x - m) ** 2, -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * g


def _attention(p, x):
    h = _ln(x, p["g1"])
    q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
    a = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(D)
    a = jnp.where(jnp.tril(jnp.ones((T, T), bool)), a, -1e9)
    return x + jnp.einsum("bts,bsd->btd", jax.nn.softmax(a, -1), v) @ p["wo"]


def _mlp(p, x):
    return x + jnp.tanh(_ln(x, p["g2"]) @ p["w1"]) @ p["w2"]


def lm_params(seed=0):
    """The untied LM's parameters."""
    ks = iter(jax.random.split(jax.random.key(seed), 32))
    n = lambda shape, s: s * jax.random.normal(next(ks), shape)  # noqa: E731

    def block(attention):
        p = {"g2": 1 + n((D,), 0.1), "w1": n((D, 2 * D), 0.3), "w2": n((2 * D, D), 0.3)}
        if attention:
            p.update(g1=1 + n((D,), 0.1), wq=n((D, D), 0.3), wk=n((D, D), 0.3), wv=n((D, D), 0.3),
                     wo=n((D, D), 0.3))
        return p

    p = {"emb": n((V, D), 1.0), "pos": n((T, D), 0.3), "b0": block(True), "b1": block(False), "b2": block(False),
         "lnf": 1 + n((D,), 0.1)}
    p["out"] = n((D, V), 1.0)
    return p


def lm_batch(seed=1):
    tok = jax.random.randint(jax.random.key(seed), (B, T + 1), 0, V)
    return {"tok": tok[:, :-1], "y": tok[:, 1:]}


def lm_loss(p, b):
    """A decoder-only LM in 4 stages."""
    with wh.replicate(1):
        x = _mlp(p["b0"], _attention(p["b0"], p["emb"][b["tok"]] + p["pos"]))
    with wh.replicate(1):
        x = _mlp(p["b1"], x)
    with wh.replicate(1):
        x = _mlp(p["b2"], x)
    with wh.replicate(1):
        logits = _ln(x, p["lnf"]) @ p["out"]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])
        return jnp.mean(jnp.sum(ce, axis=1))


def models():
    params, batch = two_stage_params()
    yield "two_stage 2x4 M=4", two_stage, params, batch, 4
    model = FourStages()
    k = jax.random.split(jax.random.key(1), 3)
    b = {"x": jax.random.normal(k[0], (32, 12)), "y": jax.random.normal(k[1], (32, 4))}
    p = model.init(k[2], b["x"], b["y"])["params"]
    yield "four_stages 4x2 M=8", (lambda p, b: model.apply({"params": p}, b["x"], b["y"])), p, b, 8
    yield "lm (untied) 4x2 M=4", lm_loss, lm_params(), lm_batch(), 4


# ---- measuring --------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="now")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None, help="the results file (default bench/results/pipeline_step_<label>.json)")
    args = ap.parse_args()
    opt = optax.adam(1e-2, eps=1e-4)
    rows = []
    for name, loss_fn, params, batch, m in models():
        step = wh.parallelize(loss_fn, opt, config=wh.Config(num_micro_batch=m))
        pstate = step.init(params, batch)
        placed = step.plan.place_batch(batch)

        @jax.jit
        def plain(carry, b):
            p, o = carry
            g = jax.grad(loss_fn)(p, b)  # noqa: B023  (timed in this iteration)
            u, o = opt.update(g, o, p)
            return optax.apply_updates(p, u), o

        dev = jax.devices()[0]
        plain_batch = jax.device_put(batch, dev)
        states = {"pipeline": pstate, "plain": jax.device_put((params, opt.init(params)), dev)}

        def run(which, step=step, states=states, placed=placed, plain_batch=plain_batch):  # this model's
            if which == "pipeline":
                states[which] = step(states[which], placed)[0]
            else:
                states[which] = plain(states[which], plain_batch)
            return states[which]

        times = harness.interleaved({w: (lambda w=w: run(w)) for w in states}, args.repeats, warmup=3)
        pipe, ref = times.median("pipeline") * 1e3, times.median("plain") * 1e3
        rows.append({"model": name, "pipeline_ms": pipe, "plain_ms": ref, "ratio": pipe / ref})
    print(f"pipeline step time ({args.label}): 8 simulated CPU devices, {os.cpu_count()} cores, jax {jax.__version__}, "
          f"Adam, {args.repeats} interleaved steps each after 3 warm-up")
    print(f"  {'model':<22} {'pipeline ms':>11} {'plain ms':>9} {'ratio':>6}")
    for r in rows:
        print(f"  {r['model']:<22} {r['pipeline_ms']:>11.2f} {r['plain_ms']:>9.2f} {r['ratio']:>6.2f}")
    path = harness.write_result(f"pipeline_step_{args.label}", {"label": args.label, "rows": rows,
                                                                "jax": jax.__version__, "cpu_count": os.cpu_count()},
                                args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
