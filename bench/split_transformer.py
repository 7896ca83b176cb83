"""Collective bytes of `split` transformer blocks against Megatron's analytic minimum (issue 14).

What it measures
    Stock Flax pre-LN transformer blocks (LayerNorm, MultiHeadDotProductAttention, LayerNorm, a
    4x MLP with gelu, residuals), trained with SGD on a mean-squared loss, on 8 simulated CPU devices:

    * whalex:   the model and its loss under ``wh.split(8)``; whalex picks the sharding patterns.
    * plain:    the plain-JAX way: ``jax.jit`` with Megatron's shardings written by hand
                (q/k/v and MLP-up kernels and biases split on heads / hidden units, the output and
                MLP-down kernels on their contracting dimension), the batch replicated.

    Two attentions: stock ``nn.MultiHeadDotProductAttention`` (separate q, k, v kernels) and a
    fused (width, 3, heads, head_dim) qkv kernel, as Megatron-LM writes it.

    Both steps are compiled; collectives are read from the compiled HLO (what each device runs) and
    counted as per-device ring bytes (all-reduce 2(n-1)/n of the array, all-gather and
    reduce-scatter (n-1)/n). Megatron's minimum for L blocks: two all-reduces of the
    [batch, seq, width] activations per block forward (attention output, MLP down) and two per
    block backward (the input gradients of the attention and of the MLP, which the LayerNorms'
    parameters need): 4L all-reduces. With separate q, k, v kernels XLA's CPU pipeline all-reduces
    the three input gradients apart (the hand-written plain-JAX step alike); a fused kernel has one.
    Step times are medians of ``--steps`` interleaved rounds (the order alternating), printed as a
    ratio; on simulated CPU devices they say little about a GPU.

Run: ``python bench/split_transformer.py`` (about a minute). Writes bench/results/split_transformer.json.
"""
from __future__ import annotations

import harness

harness.simulate_devices(8)

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import whalex as wh


class FusedAttention(nn.Module):
    """Attention with one (width, 3, heads, head_dim) qkv kernel, as Megatron-LM fuses it."""
    heads: int

    @nn.compact
    def __call__(self, x):
        width = x.shape[-1]
        qkv = nn.DenseGeneral((3, self.heads, width // self.heads), name="qkv")(x)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(width // self.heads), axis=-1)
        return nn.DenseGeneral(width, axis=(-2, -1), name="out")(jnp.einsum("bhqk,bkhd->bqhd", w, v))


def make_loss(width: int, heads: int, blocks: int, fused: bool, n: int | None):
    """(model, loss_fn): pre-LN blocks and a mean-squared loss, all under ``wh.split(n)`` when n is set."""
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm()(x)
            attn = FusedAttention(heads, name="attn") if fused else \
                nn.MultiHeadDotProductAttention(num_heads=heads, name="attn")
            x = x + (attn(h) if fused else attn(h, h))
            h = nn.LayerNorm()(x)
            return x + nn.Dense(width, name="down")(nn.gelu(nn.Dense(4 * width, name="up")(h)))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(blocks):
                x = Block(name=f"block_{i}")(x)
            return x

    model = Model()

    def loss_fn(p, bt):
        if n:
            with wh.split(n):
                return jnp.mean((model.apply({"params": p}, bt["x"]) - bt["t"]) ** 2)
        return jnp.mean((model.apply({"params": p}, bt["x"]) - bt["t"]) ** 2)
    return model, loss_fn


def megatron_spec(path: str, ndim: int) -> P:
    """Megatron's layout, by hand: column-split q/k/v/up (kernels and biases, on the heads and the
    hidden units), row-split out/down kernels."""
    if "'qkv'" in path:
        return P(None, None, "model") if "kernel" in path else P(None, "model")
    if any(k in path for k in ("query", "key", "value")):
        return P(None, "model") if "kernel" in path else P("model")
    if "'up'" in path:
        return P(None, "model") if "kernel" in path else P("model")
    if ("'out'" in path or "'down'" in path) and "kernel" in path:
        return P("model")
    return P()


def ring_bytes(text: str) -> tuple[float, dict]:
    found = harness.collectives(text, 8)
    return sum(c["ring_bytes"] for c in found), {k: v["count"] for k, v in harness.by_kind(found).items()}


def run_variant(args, fused: bool) -> dict:
    n = 8
    b, s, w, L = args.batch, args.seq, args.width, args.blocks
    k = jax.random.split(jax.random.key(0), 3)
    batch = {"x": jax.random.normal(k[0], (b, s, w)), "t": jax.random.normal(k[1], (b, s, w))}
    model, plain_loss = make_loss(w, args.heads, L, fused, None)
    params = model.init(k[2], batch["x"])["params"]
    opt = optax.sgd(1e-3)

    # whalex
    step = wh.parallelize(make_loss(w, args.heads, L, fused, n)[1], opt)
    state = step.init(params, batch)
    whalex_text = step.plan.lowered().compile().as_text()
    holder = {"state": state}

    def whalex_step():
        holder["state"], m = step(holder["state"], batch)
        return m["loss"]

    # plain JAX: Megatron's shardings by hand
    mesh = jax.make_mesh((n,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    specs = jax.tree_util.tree_map_with_path(lambda path, x: megatron_spec(jax.tree_util.keystr(path), x.ndim), params)
    pshard = jax.tree.map(lambda sp: NamedSharding(mesh, sp), specs, is_leaf=lambda x: isinstance(x, P))
    repl = NamedSharding(mesh, P())

    def plain_update(p, o, bt):
        loss, g = jax.value_and_grad(plain_loss)(p, bt)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    pp = jax.device_put(params, pshard)
    po = opt.init(pp)
    pb = jax.device_put(batch, repl)
    plain_jit = jax.jit(plain_update, in_shardings=(pshard, None, repl), out_shardings=(pshard, None, repl),
                        donate_argnums=(0, 1))
    plain_text = plain_jit.lower(pp, po, pb).compile().as_text()
    pholder = {"p": pp, "o": po}

    def plain_step():
        pholder["p"], pholder["o"], loss = plain_jit(pholder["p"], pholder["o"], pb)
        return loss

    # compile and warm up, then interleaved rounds (the order alternating), so load hits both alike
    times = harness.interleaved({"whalex": whalex_step, "plain": plain_step}, args.steps, warmup=1)
    t_whalex, t_plain = harness.median(times.times("whalex")), harness.median(times.times("plain"))
    act = b * s * w * 4
    minimum = 4 * L * 2 * (n - 1) / n * act
    wb, wk = ring_bytes(whalex_text)
    pb_, pk = ring_bytes(plain_text)
    return {"attention": "fused qkv" if fused else "flax MultiHeadDotProductAttention",
            "megatron_minimum_bytes": minimum, "all_reduces": 4 * L, "activation_bytes": act,
            "whalex": {"bytes": wb, "collectives": wk, "ratio_to_minimum": wb / minimum, "step_s": t_whalex},
            "plain": {"bytes": pb_, "collectives": pk, "ratio_to_minimum": pb_ / minimum, "step_s": t_plain},
            "bytes_ratio": wb / pb_, "time_ratio": t_whalex / t_plain}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default=None, help="the results file (default bench/results/split_transformer.json)")
    args = p.parse_args()
    results = [run_variant(args, fused) for fused in (False, True)]
    print(f"{args.blocks} pre-LN blocks, batch {args.batch} x seq {args.seq} x width {args.width}, {args.heads} heads, "
          "split(8) over 8 simulated CPU devices, SGD")
    r0 = results[0]
    print(f"Megatron minimum: {r0['all_reduces']} all-reduces of {r0['activation_bytes'] / 2**20:.2f} MiB = "
          f"{r0['megatron_minimum_bytes'] / 2**20:.3f} MiB per device and step")
    print(f"{'attention':<36} {'plan':<8} {'collective MiB':>15} {'vs minimum':>11} {'step ms':>8}  collectives")
    for r in results:
        for key, name in (("whalex", "whalex"), ("plain", "plain")):
            x = r[key]
            print(f"{r['attention']:<36} {name:<8} {x['bytes'] / 2**20:>15.3f} {x['ratio_to_minimum']:>11.4f} "
                  f"{x['step_s'] * 1e3:>8.1f}  {x['collectives']}")
        print(f"{'':<36} whalex / plain: bytes {r['bytes_ratio']:.4f}, step time (median) {r['time_ratio']:.3f}")
    config = {k: v for k, v in vars(args).items() if k != "out"}
    print(f"wrote {harness.write_result('split_transformer', {'config': config, 'results': results}, args.out)}")


if __name__ == "__main__":
    main()
