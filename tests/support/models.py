"""Small models annotated with whalex in every style: context manager, function decorator, class decorator.

Each builder returns (loss_fn, params, batch). The strategies:
  dp       everything replicated (data parallel)
  split    everything split (tensor parallel)
  hybrid   Whale's Example 2: backbone replicate(8), wide head + softmax cross-entropy split(8)
  default  set_default_strategy(replicate(8)) for the backbone, head split(8)
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import whalex as wh

B, D_IN, D_HID, CLASSES = 32, 12, 24, 320


def data(seed=0, batch=B):
    kx, ky = jax.random.split(jax.random.key(seed))
    return {"x": jax.random.normal(kx, (batch, D_IN)), "y": jax.random.randint(ky, (batch,), 0, CLASSES)}


def _ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# ---------------------------------------------------------------- Flax linen models

class Backbone(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(D_HID)(x))
        return nn.tanh(nn.Dense(D_HID)(x))


class Head(nn.Module):
    @nn.compact
    def __call__(self, h, y):
        return _ce(nn.Dense(CLASSES)(h), y)


def flax_model(strategy: str, style: str):
    """A Flax model whose annotations are written in `style`: ctx | fn | class."""
    bb_prim = wh.replicate(8) if strategy in ("dp", "hybrid") else wh.split(8) if strategy == "split" else None
    head_prim = wh.replicate(8) if strategy == "dp" else wh.split(8)

    if style == "class":
        BB = bb_prim(type("BB", (Backbone,), {})) if bb_prim else Backbone
        HD = head_prim(type("HD", (Head,), {}))

        class Model(nn.Module):
            @nn.compact
            def __call__(self, x, y):
                if strategy == "default":
                    wh.set_default_strategy(wh.replicate(8))
                return HD()(BB()(x), y)
    elif style == "fn":
        class Model(nn.Module):
            @nn.compact
            def __call__(self, x, y):
                if strategy == "default":
                    wh.set_default_strategy(wh.replicate(8))
                bb, hd = Backbone(), Head()
                h = bb_prim(bb)(x) if bb_prim else bb(x)
                return head_prim(hd)(h, y)
    else:
        class Model(nn.Module):
            @nn.compact
            def __call__(self, x, y):
                if strategy == "default":
                    wh.set_default_strategy(wh.replicate(8))
                if bb_prim:
                    with bb_prim:
                        h = Backbone()(x)
                else:
                    h = Backbone()(x)
                with head_prim:
                    return Head()(h, y)

    model = Model()
    batch = data()
    params = model.init(jax.random.key(0), batch["x"], batch["y"])["params"]

    def loss_fn(p, b):
        return model.apply({"params": p}, b["x"], b["y"])

    return loss_fn, params, batch


# ---------------------------------------------------------------- plain-function models

def plain_params(seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return {
        "w1": jax.random.normal(ks[0], (D_IN, D_HID)) / D_IN ** 0.5, "b1": jnp.zeros(D_HID),
        "w2": jax.random.normal(ks[1], (D_HID, D_HID)) / D_HID ** 0.5, "b2": jnp.zeros(D_HID),
        "wh": jax.random.normal(ks[2], (D_HID, CLASSES)) / D_HID ** 0.5, "bh": jnp.zeros(CLASSES),
    }


def _backbone(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.tanh(h @ p["w2"] + p["b2"])


def _head(p, h, y):
    return _ce(h @ p["wh"] + p["bh"], y)


def plain_model(strategy: str, style: str):
    """A plain-function model (params dict) annotated in `style`: ctx | fn."""
    bb_prim = wh.replicate(8) if strategy in ("dp", "hybrid") else wh.split(8) if strategy == "split" else None
    head_prim = wh.replicate(8) if strategy == "dp" else wh.split(8)

    if style == "fn":
        bb = bb_prim(_backbone) if bb_prim else _backbone
        hd = head_prim(_head)

        def loss_fn(p, b):
            if strategy == "default":
                wh.set_default_strategy(wh.replicate(8))
            return hd(p, bb(p, b["x"]), b["y"])
    else:
        def loss_fn(p, b):
            if strategy == "default":
                wh.set_default_strategy(wh.replicate(8))
            if bb_prim:
                with bb_prim:
                    h = _backbone(p, b["x"])
            else:
                h = _backbone(p, b["x"])
            with head_prim:
                return _head(p, h, b["y"])

    return loss_fn, plain_params(), data()


def masked_mlp(b, seed=0):
    """A stock Flax MLP (nn.Dense with biases) and a masked mean on a batch with padded rows."""
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(5)(nn.relu(nn.Dense(16)(x)))

    rng = np.random.default_rng(seed)
    batch = {"x": jnp.asarray(rng.standard_normal((b, 12), np.float32)),
             "y": jnp.asarray(rng.integers(0, 5, b).astype(np.int32)),
             "mask": jnp.asarray((rng.random(b) > 0.2).astype(np.float32))}
    params = MLP().init(jax.random.key(seed), batch["x"][:1])["params"]

    def loss_fn(p, bt):
        ce = optax.softmax_cross_entropy_with_integer_labels(MLP().apply({"params": p}, bt["x"]), bt["y"])
        return (ce * bt["mask"]).sum() / bt["mask"].sum()

    return loss_fn, params, batch
