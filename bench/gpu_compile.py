"""Plans compiled with XLA's GPU compiler for 8 to 512 GPUs, on a machine without a GPU.

    JAX_PLATFORMS=cpu python bench/gpu_compile.py            # every plan shape, 8 x H100 (+ 64 and 512)
    JAX_PLATFORMS=cpu python bench/gpu_compile.py --small    # a tiny model, seconds per case
    JAX_PLATFORMS=cpu python bench/gpu_compile.py --cases dp remat_full --devices 8 64 512
    JAX_PLATFORMS=cpu python bench/gpu_compile.py --size 1b --cases 3d_4x4x4 --devices 64   # 1.1B GPT, 3D

Needs JAX's CUDA plugin (`pip install -e '.[cuda]'`), no GPU and no driver. Each case plans a GPT-style
stock Flax model on `wh.Cluster.gpu_topology(kinds=[KIND] * N)`, compiles the step as `wh.parallelize`
runs it and prints, per device: whalex's predicted memory (`plan.predicted_memory()`) beside XLA:GPU's
(`plan.step_memory()`), the predicted collective bytes beside the compiled HLO's
(`plan.compiled_collectives()`), the asynchronous collectives and those with compute scheduled between
start and done, the compile time and whether the step fits the device. The plain-JAX reference is the
hand-written data-parallel `jax.jit` step of the same model on the same topology, with and without
`nn.remat(Block)`. Writes bench/results/gpu_compile_<size>.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import (
    NamedSharding,  # noqa: E402
    PartitionSpec as P,
)

import harness  # noqa: E402
import whalex as wh  # noqa: E402
from models import GPT  # noqa: E402
from whalex.jaxpr import hlo  # noqa: E402

SIZES = {
    "small": dict(vocab=512, d=128, heads=4, layers=4, seq=128, batch=4),
    "medium": dict(vocab=8192, d=512, heads=8, layers=4, seq=512, batch=8),
    "full": dict(vocab=32768, d=1024, heads=16, layers=8, seq=1024, batch=16),
    "1b": dict(vocab=32768, d=2560, heads=16, layers=12, seq=1024, batch=2),      # 1.11B parameters
}


class AnnotatedBlock(nn.Module):
    """`models.Block` with its MLP under `wh.split(mlp_split)` (Megatron's tensor-parallel MLP) or
    replaced by a `wh.moe.MoE` layer over `experts` experts, expert parallel."""

    heads: int
    mlp_split: int = 0
    experts: int = 0

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        y = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(y, y, mask=mask)
        y = nn.LayerNorm()(x)
        if self.experts:
            return x + wh.moe.MoE(num_experts=self.experts, hidden=4 * d, k=2, capacity_factor=1.0,
                                  expert_parallel=self.experts)(y)
        if self.mlp_split:
            with wh.split(self.mlp_split):
                return x + nn.Dense(d)(nn.gelu(nn.Dense(4 * d)(y)))
        return x + nn.Dense(d)(nn.gelu(nn.Dense(4 * d)(y)))


class AnnotatedGPT(nn.Module):
    """`models.GPT` of `AnnotatedBlock`s, returning the loss; with `head_split`, the vocabulary head
    and its loss under `wh.split(head_split)` (Whale's Example 2: the rest is replicated)."""

    vocab: int
    d: int
    heads: int
    layers: int
    mlp_split: int = 0
    head_split: int = 0
    experts: int = 0

    @nn.compact
    def __call__(self, tokens, targets):
        x = nn.Embed(self.vocab, self.d)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.d)).astype(x.dtype)
        for _ in range(self.layers):
            x = AnnotatedBlock(self.heads, self.mlp_split, self.experts)(x)
        x = nn.LayerNorm()(x)

        def head(x):
            logits = nn.Dense(self.vocab)(x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        if self.head_split:
            with wh.split(self.head_split):
                return head(x)
        return head(x)


# case: (model annotations, Config keywords)
CASES = {
    "dp": ({}, {}),
    "amp_bf16": ({}, {"amp": "bf16"}),
    "split": ({"mlp_split": 8}, {}),
    "hybrid": ({"head_split": 8}, {}),
    "pipeline_1f1b": ({}, {"auto_parallel": True, "num_task_graph": 2, "num_micro_batch": 4, "schedule": "1f1b"}),
    "pipeline_gpipe": ({}, {"auto_parallel": True, "num_task_graph": 2, "num_micro_batch": 4, "schedule": "gpipe"}),
    "pipeline_zb": ({}, {"auto_parallel": True, "num_task_graph": 2, "num_micro_batch": 4, "schedule": "zb-h1"}),
    "pipeline4_1f1b": ({}, {"auto_parallel": True, "num_task_graph": 4, "num_micro_batch": 8, "schedule": "1f1b"}),
    "pipeline4_zb": ({}, {"auto_parallel": True, "num_task_graph": 4, "num_micro_batch": 8, "schedule": "zb-h1"}),
    "pipeline4_zb2": ({}, {"auto_parallel": True, "num_task_graph": 4, "num_micro_batch": 8, "schedule": "zb-h2"}),
    "3d": ({"mlp_split": 2}, {"auto_parallel": True, "num_task_graph": 2, "num_micro_batch": 2}),
    "3d_remat": ({"mlp_split": 2}, {"auto_parallel": True, "num_task_graph": 2, "num_micro_batch": 2, "remat": "full",
                                    "amp": "bf16"}),
    "3d_4x4x4": ({"mlp_split": 4}, {"auto_parallel": True, "num_task_graph": 4, "num_micro_batch": 8}),  # 64 GPUs
    "zero1": ({}, {"zero_level": 1}),
    "zero2": ({}, {"zero_level": 2}),
    "zero3": ({}, {"zero_level": 3}),
    "moe": ({"experts": 8}, {}),
    "remat_full": ({}, {"remat": "full", "amp": "bf16"}),
    "remat_auto": ({}, {"remat": "auto", "amp": "bf16"}),
    "offload_opt_state": ({}, {"offload": "opt_state"}),
    "offload_params": ({}, {"offload": "params"}),
}


def problem(size: dict, n: int, annotations: dict):
    """(loss_fn, abstract params, abstract batch) at `size["batch"]` rows per device: the stock GPT of
    bench/gpu.py without annotations, else the annotated one."""
    tokens = jax.ShapeDtypeStruct((size["batch"] * n, size["seq"]), jnp.int32)
    batch = {"x": tokens, "y": tokens}
    if not annotations:
        stock = GPT(size["vocab"], size["d"], size["heads"], size["layers"])
        params = jax.eval_shape(lambda: stock.init(jax.random.key(0), jnp.zeros((1, size["seq"]), jnp.int32))["params"])

        def stock_loss(p, b):
            logits = stock.apply({"params": p}, b["x"]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

        return stock_loss, params, batch
    model = AnnotatedGPT(size["vocab"], size["d"], size["heads"], size["layers"], **annotations)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, size["seq"]), jnp.int32),
                                               jnp.zeros((1, size["seq"]), jnp.int32))["params"])

    def loss_fn(p, b):
        return model.apply({"params": p}, b["x"], b["y"])

    return loss_fn, params, batch


def compile_case(name: str, size: dict, cluster, budget_fraction: float = 0.5) -> dict:
    """Plan one case on `cluster`, compile it for XLA:GPU and compare with the prediction."""
    annotations, config = CASES[name]
    n = cluster.size
    loss_fn, params, batch = problem(size, n, annotations)
    if config.get("remat") == "auto":
        config = dict(config, memory_budget=None)
    t0 = time.perf_counter()
    plan = wh.plan(loss_fn, params, batch, optax.adamw(1e-4), config=wh.Config(**{k: v for k, v in config.items()
                                                                                   if v is not None}), cluster=cluster)
    predicted = plan.predicted_memory()
    t1 = time.perf_counter()
    compiled = plan.step_memory()
    coll = plan.compiled_collectives()
    copies = plan.compiled_host_copies()
    t2 = time.perf_counter()
    return {"case": name, "devices": n, "kind": cluster.target, "config": config, "program": plan.program_kind,
            "predicted_bytes": predicted.total, "xla_gpu_bytes": compiled.total,
            "memory_ratio": predicted.total / compiled.total,
            "predicted_comm_bytes": plan.predicted_comm_bytes, "compiled_comm_bytes": coll.ring_bytes,
            "comm_ratio": plan.predicted_comm_bytes / coll.ring_bytes if coll.ring_bytes else None,
            "collectives": coll.count, "asynchronous": coll.asynchronous, "overlapped": coll.overlapped,
            "host_copies": copies.count, "host_copy_bytes": copies.bytes, "host_copies_overlapped": copies.overlapped,
            "host_copies_overlapping_matmuls": copies.overlapping_matmuls,
            "fits": compiled.total <= cluster.specs[0].memory_bytes, "plan_s": t1 - t0, "compile_s": t2 - t1}


def plain_step(size: dict, cluster, remat_block: bool) -> dict:
    """The hand-written data-parallel `jax.jit` step (donated, bf16 compute on fp32 parameters) of the
    stock GPT on the same topology: XLA:GPU's per-device memory and its gradient all-reduces."""
    n = cluster.size
    mesh = jax.sharding.Mesh(cluster.devices, ("data",))
    model = GPT(size["vocab"], size["d"], size["heads"], size["layers"], remat_block=remat_block)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, size["seq"]), jnp.int32))["params"])
    opt = optax.adamw(1e-4)

    def loss_fn(p, b):
        p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
        logits = model.apply({"params": p}, b["x"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    def train(state, b):
        p, o = state
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        u, o = opt.update(g, o, p)
        return (optax.apply_updates(p, u), o), loss

    def placed(tree, spec):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec)), tree)

    tokens = jax.ShapeDtypeStruct((size["batch"] * n, size["seq"]), jnp.int32)
    t0 = time.perf_counter()
    compiled = jax.jit(train, donate_argnums=0).lower(placed((params, jax.eval_shape(opt.init, params)), P()),
                                                      placed({"x": tokens, "y": tokens}, P("data"))).compile()
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    coll = hlo.step_collectives(compiled.as_text(), n)
    return {"case": "plain_remat_block" if remat_block else "plain", "devices": n, "kind": cluster.target,
            "xla_gpu_bytes": float(total), "compiled_comm_bytes": coll.ring_bytes, "collectives": coll.count,
            "asynchronous": coll.asynchronous, "overlapped": coll.overlapped, "compile_s": time.perf_counter() - t0}


def row_text(r: dict) -> str:
    gb = 1e9
    pred = f"{r['predicted_bytes'] / gb:7.2f}" if "predicted_bytes" in r else "      -"
    ratio = f"{r['memory_ratio']:.3f}" if "memory_ratio" in r else "    -"
    comm = f"{r['comm_ratio']:.3f}" if r.get("comm_ratio") else "    -"
    return (f"{r['case']:18s} {r['devices']:4d}  {pred} {r['xla_gpu_bytes'] / gb:7.2f} {ratio}   "
            f"{r['compiled_comm_bytes'] / 1e6:9.1f} {comm}  {r['asynchronous']:3d}/{r['overlapped']:3d}  "
            f"{r['compile_s']:6.1f}" + (f"  host copies {r['host_copies']} ({r['host_copy_bytes'] / 1e6:.0f} MB), "
                                       f"{r['host_copies_overlapped']} overlapped" if r.get("host_copies") else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--small", action="store_true", help="the small model (the suite runs this)")
    ap.add_argument("--cases", nargs="*", default=[c for c in CASES if c != "3d_4x4x4"],
                    choices=list(CASES) + ["plain"])
    ap.add_argument("--devices", type=int, nargs="*", default=[8])
    ap.add_argument("--kind", default="H100-80GB")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    size_name = "small" if args.small else args.size
    size = SIZES[size_name]
    rows = []
    print(f"{'case':18s} {'GPUs':>4s}  {'pred GB':>7s} {'XLA GB':>7s} {'ratio':>5s}   {'comm MB':>9s} {'ratio':>5s}"
          f"  async/ovl  compile s")
    for n in args.devices:
        cluster = wh.Cluster.gpu_topology(kinds=[args.kind] * n)
        for name in args.cases:
            try:
                made = [plain_step(size, cluster, r) for r in (False, True)] if name == "plain" else \
                    [compile_case(name, size, cluster)]
            except Exception as e:      # noqa: BLE001 (a case whalex refuses is recorded, not fatal)
                rows.append({"case": name, "devices": n, "error": f"{type(e).__name__}: {e}"[:400]})
                print(f"{name:18s} {n:4d}  refused: {rows[-1]['error'][:120]}")
                continue
            for r in made:
                rows.append(r)
                print(row_text(r), flush=True)
    harness.write_result(f"gpu_compile_{size_name}", {"size": size, "kind": args.kind, "jax": jax.__version__,
                                                      "rows": rows,
                             "method": "predicted: plan.predicted_memory(); XLA:GPU: plan.step_memory() on "
                                       "Cluster.gpu_topology (arguments + outputs + temp - aliased, per device); "
                                       "collectives: plan.compiled_collectives() (ring bytes per device); "
                                       "host copies: plan.compiled_host_copies() (offload plans lower over an "
                                       "abstract mesh and compile for the topology's devices)"}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
