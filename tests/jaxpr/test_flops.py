"""Training FLOPs counted from the jaxpr (whalex.jaxpr.flops), checked against XLA
CPU's cost analysis of the same forward + vjp, and counted without lowering anything."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from whalex.balance.profile import group_flops, taskgraph_flops
from whalex.jaxpr.capture import capture
from whalex.jaxpr.flops import equation_flops, training_flops

VOCAB, WIDTH, HEADS, LENGTH, BLOCKS, BATCH = 256, 128, 4, 32, 2, 4


def xla_flops(loss_fn, params, batch) -> float:
    """XLA CPU's count for the loss and its vjp w.r.t. the parameters (the cotangent an argument, so
    that nothing is folded as a constant)."""
    def fwd_bwd(p, b, ct):
        loss, vjp = jax.vjp(lambda q: loss_fn(q, b), p)
        return loss, vjp(ct)
    cost = jax.jit(fwd_bwd).lower(params, batch, jnp.float32(1.0)).cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def counted(loss_fn, params, batch) -> float:
    """whalex's count for the whole model, as the planners ask for it."""
    cap = capture(loss_fn, params, batch)
    return sum(taskgraph_flops(cap.jaxpr, cap.assign, len(cap.taskgraphs), cap.num_params))


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(10)(x)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(h, h, mask=mask)
        return x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(4 * WIDTH)(nn.LayerNorm()(x))))


class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        return Block()(x, mask), None


class Gpt(nn.Module):
    """A GPT-style stack of stock Flax layers; `layers`: "unrolled", "remat" or "scan"."""

    layers: str = "unrolled"

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH)(tokens) + self.param("pos", nn.initializers.normal(0.02), (LENGTH, WIDTH))
        mask = nn.make_causal_mask(tokens)
        if self.layers == "scan":
            stack = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                            in_axes=nn.broadcast, length=BLOCKS)
            x, _ = stack()(x, mask)
        else:
            block = nn.remat(Block) if self.layers == "remat" else Block
            for _ in range(BLOCKS):
                x = block()(x, mask)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def mlp():
    model = Mlp()
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((64, 128)).astype(np.float32),
             "y": rng.standard_normal((64, 10)).astype(np.float32)}
    params = model.init(jax.random.key(0), batch["x"][:1])["params"]
    return (lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)), params, batch


def gpt(layers="unrolled"):
    model = Gpt(layers)
    tokens = jax.random.randint(jax.random.key(0), (BATCH, LENGTH + 1), 0, VOCAB)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = model.init(jax.random.key(1), batch["inputs"])["params"]

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    return loss_fn, params, batch


@pytest.mark.parametrize("build", [mlp, gpt, lambda: gpt("remat")], ids=["mlp", "gpt", "gpt-remat"])
def test_the_count_agrees_with_xla_on_matmul_dominated_models(build):
    loss_fn, params, batch = build()
    ours, xla = counted(loss_fn, params, batch), xla_flops(loss_fn, params, batch)
    assert abs(ours / xla - 1) < 0.02, (ours, xla)


def test_a_scan_over_layers_is_counted_per_iteration():
    """XLA counts a loop body once; the count is the unrolled model's (whose XLA count it matches)."""
    scanned, unrolled = counted(*gpt("scan")), counted(*gpt())
    assert scanned == pytest.approx(unrolled, rel=1e-4)
    assert abs(scanned / xla_flops(*gpt()) - 1) < 0.02
    body_once = xla_flops(*gpt("scan"))                              # what XLA says of the scanned model
    assert scanned > body_once * 1.3


def _one(fn, *args, differentiated=None):
    """equation_flops of fn's jaxpr, the first argument differentiated, the first output seeded."""
    closed = jax.make_jaxpr(fn)(*args)
    n = len(closed.jaxpr.invars)
    diff = differentiated if differentiated is not None else [k == 0 for k in range(n)]
    return training_flops(closed, diff, [k == 0 for k in range(len(closed.jaxpr.outvars))])


def test_a_dot_with_the_data_has_one_backward_product_with_two_activations_two():
    w, x = jnp.ones((64, 32)), jnp.ones((16, 64))
    fwd = 2 * 16 * 64 * 32
    assert _one(lambda w, x: x @ w, w, x) == fwd * 2                                 # dW only
    assert _one(lambda w, x: x @ w, w, x, differentiated=[True, True]) == fwd * 3    # dW and dx
    assert _one(lambda w, x: x @ w, w, x, differentiated=[False, False]) == fwd      # nothing trained
    assert _one(lambda w, i: i.astype(jnp.float32) @ w, w, jnp.ones((16, 64), jnp.int32),
                differentiated=[True, True]) == fwd * 2 + 16 * 64                  # an integer operand: + its convert


def test_each_group_sums_to_the_whole_and_the_loss_alone_is_seeded():
    loss_fn, params, batch = gpt()
    cap = capture(loss_fn, params, batch)
    n = len(cap.jaxpr.jaxpr.eqns)
    halves = group_flops(cap.jaxpr, [list(range(n // 2)), list(range(n // 2, n))], num_params=cap.num_params)
    whole = group_flops(cap.jaxpr, [list(range(n))], num_params=cap.num_params)[0]
    assert sum(halves) == pytest.approx(whole) and min(halves) > 0
    aux = jax.make_jaxpr(lambda w, x: (jnp.sum(x @ w), jnp.tanh(x @ w)))(jnp.ones((8, 8)), jnp.ones((4, 8)))
    both = training_flops(aux, [True, False], [True, True])
    assert training_flops(aux, [True, False], [True, False]) < both    # an aux output gets no backward


def test_control_flow_and_convolutions():
    x = jnp.ones((8, 8))

    def cond(w):
        return lax.cond(w[0, 0] > 0, lambda: (w @ w).sum(), lambda: w.sum())
    assert _one(cond, x) == _one(lambda w: (w @ w).sum(), x) + 2        # the costliest branch; + compare, convert

    def fori(w):
        return lax.fori_loop(0, 5, lambda i, c: c @ w, jnp.eye(8)).sum()
    step = 2 * 8 ** 3
    assert 5 * 3 * step <= _one(fori, x) < 5 * 3 * step * 1.05          # a static fori_loop: a scan of 5

    def while_(w):
        return lax.while_loop(lambda c: c[0] < 7, lambda c: (c[0] + 1, c[1] @ w), (0, jnp.eye(8)))[1].sum()
    fwd_only = equation_flops(jax.make_jaxpr(while_)(x), [False], [True])
    assert 7 * step <= fwd_only.forward < 7 * step * 1.05               # a literal trip count

    def conv(k, img):
        y = lax.conv_general_dilated(img, k, (2, 2), "SAME", rhs_dilation=(1, 1))
        return jnp.sum(y * y)
    k, img = jnp.ones((6, 3, 3, 3)), jnp.ones((2, 3, 17, 17))
    ours = _one(conv, k, img)
    assert abs(ours / xla_flops(lambda p, b: conv(p, b), k, img) - 1) < 0.02


def test_shard_map_counts_its_body_once_per_shard():
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    w = jnp.ones((16, 16))

    def sharded(w, x):
        body = jax.shard_map(lambda w, x: x @ w, mesh=mesh, in_specs=(P(), P("a")), out_specs=P("a"),
                             axis_names={"a"})
        return jnp.sum(body(w, x))
    x = jnp.ones((32, 16))
    plain = _one(lambda w, x: jnp.sum(x @ w), w, x)
    assert _one(sharded, w, x) == pytest.approx(plain, rel=0.01)


def test_counting_never_lowers(monkeypatch):
    loss_fn, params, batch = gpt()
    cap = capture(loss_fn, params, batch)

    def refuse(*args, **kwargs):
        raise AssertionError("FLOPs must be counted, not lowered")
    monkeypatch.setattr(jax, "jit", refuse)
    monkeypatch.setattr(jax.stages.Traced, "lower", refuse)
    assert sum(taskgraph_flops(cap.jaxpr, cap.assign, len(cap.taskgraphs), cap.num_params)) > 0
