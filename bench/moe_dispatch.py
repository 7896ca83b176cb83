"""MoE dispatch: whalex expert parallelism (explicit all-to-all) vs. plain GSPMD annotations (8 CPU devices).

What it measures
    One training step (loss + grads + Adam update, jitted, state donated) of the same small MoE
    model, same parameters, same data, same optimizer, done two ways in the same process:

    * A, whalex: ``wh.parallelize(loss_fn, adam)`` with the default strategy (replicate) and every
      MoE layer ``wh.moe.MoE(..., expert_parallel=8)`` (Whale's Example 5: the experts under
      ``wh.split(8)``). The planner replaces the experts call with a ``shard_map`` that exchanges
      the dispatched buffer with two explicit ``lax.all_to_all`` (forward; two more in backward).
    * B, plain GSPMD (the GShard way): the same model with an MoE layer written in this file from
      the functional pieces (``top_k_gating``, ``dispatch``, ``feed_forward``, ``combine``; same
      parameter names, shapes and values), jitted by hand with ``jax.jit(in_shardings=...,
      out_shardings=..., donate_argnums=0)`` on ``jax.make_mesh((8,), ('x',))``: the batch sharded
      ``P('x')``, the expert weights (leading E dim of w_in, b_in, w_out, b_out) and their Adam
      moments ``P('x')``, everything else replicated, and ``with_sharding_constraint`` on the
      dispatched buffer [G, E, C, d]: ``P(None, 'x')`` (experts sharded) before the experts and
      ``P('x')`` (groups sharded) after. No shard_map, no explicit collective: XLA's SPMD
      partitioner chooses how to reshard (all-to-all, or all-gather + slicing, ...).

    The model: x [batch, seq, features] -> Dense(d) -> ``--layers`` x (x + MoE(LayerNorm(x))) ->
    Dense(features); loss = MSE to a fixed random teacher's targets + 0.01 aux + 0.001 z-loss.
    Routing groups are one sequence (so they never span devices).

The numbers (per training step, per device: the SPMD program is per device)
    * collectives: every all-reduce / all-gather / reduce-scatter / all-to-all / collective-permute
      in the COMPILED HLO (``Compiled.as_text()``, after the SPMD partitioner), counted by kind;
      parsed by ``whalex.jaxpr.hlo`` through ``bench/harness.py`` (async start/done counted once).
    * HLO bytes: the sum of the collectives' RESULT shapes (product(shape) * itemsize), the
      headline number; ring bytes: a ring-algorithm estimate of the bytes each device sends.
    * step time: the median of ``--steps`` individually timed steps per variant, each ended with
      ``jax.block_until_ready``, after ``--warmup`` untimed steps; the two variants alternate
      step by step (A B, B A, A B, ...) so background load hits both alike. Each side receives a
      batch already placed ``P('x')`` and calls ``jax.device_put`` on it (whalex's Step does too).
    * ratios B/A (GSPMD / whalex) for bytes and for time.

Correctness (asserted)
    From identical parameters and batch, one step of A and of B give the same loss (relative
    difference < 1e-5) and the same parameters (max|a-b| / max|b| per leaf < 1e-5). Adam uses
    eps=1e-4 (as the tests do): with eps=1e-8 an element whose true gradient is ~0 moves by ~lr on
    float reassociation noise alone, which would measure the optimizer, not the two programs.

Run from the repo root: ``python bench/moe_dispatch.py`` (about a minute on 2 CPU cores).
Writes bench/results/moe_dispatch.json (``--dump-hlo`` also writes both compiled HLO texts).
"""
from __future__ import annotations

import os

import harness

harness.simulate_devices(8)

import argparse
import math
import platform
import re
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import whalex as wh
from whalex.moe.dispatch import feed_forward
from whalex.moe.layer import COLLECTION

N_DEV = 8
EXPERT_PARAMS = ("w_in", "b_in", "w_out", "b_out")
AUX_WEIGHT, Z_WEIGHT = 1e-2, 1e-3
TOL = 1e-5


# ------------------------------------------------------------------------------------------
# the model: A uses wh.moe.MoE(expert_parallel=8); B uses GSPMDMoE below (same params)
# ------------------------------------------------------------------------------------------
class GSPMDMoE(nn.Module):
    """wh.moe.MoE's computation from the functional pieces, with GShard-style sharding
    constraints on the dispatched buffer instead of expert parallelism under split."""

    num_experts: int
    hidden: int
    k: int
    capacity_factor: float
    mesh: Any
    axis: str = "x"
    activation: str = "gelu"

    @nn.compact
    def __call__(self, x):
        d, e, h = x.shape[-1], self.num_experts, self.hidden
        gs = math.prod(x.shape[1:-1])                      # one routing group per sequence
        xg = x.reshape(-1, gs, d)
        # same names, shapes and initialisers as wh.moe.MoE (params come from its init anyway)
        router = self.param("router", nn.initializers.lecun_normal(), (d, e))
        w_in = self.param("w_in", wh.moe.layer._expert_init, (e, d, h))
        b_in = self.param("b_in", nn.initializers.zeros, (e, h))
        w_out = self.param("w_out", wh.moe.layer._expert_init, (e, h, d))
        b_out = self.param("b_out", nn.initializers.zeros, (e, d))
        cap = wh.moe.capacity(gs, e, self.k, self.capacity_factor)
        routing = wh.moe.top_k_gating(xg @ router, self.k, cap)
        buf = wh.moe.dispatch(xg, routing, e, cap)                              # [G, E, C, d]
        buf = jax.lax.with_sharding_constraint(buf, NamedSharding(self.mesh, P(None, self.axis)))
        out = feed_forward(buf, w_in, b_in, w_out, b_out, self.activation)
        out = jax.lax.with_sharding_constraint(out, NamedSharding(self.mesh, P(self.axis)))
        self.sow(COLLECTION, "aux_loss", routing.aux_loss)
        self.sow(COLLECTION, "z_loss", routing.z_loss)
        return wh.moe.combine(out, routing).reshape(x.shape)


class Net(nn.Module):
    """Dense in -> layers x (residual MoE on LayerNorm) -> Dense out."""

    d: int
    features: int
    layers: int
    experts: int
    hidden: int
    k: int
    capacity_factor: float
    variant: str            # "whalex" | "gspmd" | "plain" (plain: wh.moe.MoE without split, for init)
    mesh: Any = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.d, name="embed")(x)
        for i in range(self.layers):
            if self.variant == "gspmd":
                moe = GSPMDMoE(self.experts, self.hidden, self.k, self.capacity_factor, self.mesh, name=f"moe_{i}")
            else:
                moe = wh.moe.MoE(self.experts, self.hidden, k=self.k, capacity_factor=self.capacity_factor,
                                 expert_parallel=N_DEV if self.variant == "whalex" else None, name=f"moe_{i}")
            x = x + moe(nn.LayerNorm(name=f"ln_{i}")(x))
        return nn.Dense(self.features, name="out")(x)


def make_loss(model: Net):
    def loss_fn(params, batch):
        y, upd = model.apply({"params": params}, batch["x"], mutable=[COLLECTION])
        losses = wh.moe.moe_losses(upd)
        return jnp.mean((y - batch["y"]) ** 2) + AUX_WEIGHT * losses["aux_loss"] + Z_WEIGHT * losses["z_loss"]
    return loss_fn


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------
def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = float(np.max(np.abs(b)))
    return float(np.max(np.abs(a - b)) / (scale if scale > 0 else 1.0))


def is_expert_path(path) -> bool:
    return any(getattr(k, "key", None) in EXPERT_PARAMS for k in path)


def _source(op_name: str, kind: str) -> str:
    """The jax op a collective was partitioned from (HLO metadata op_name)."""
    name = op_name or "?"
    if ":" in name:             # XLA combined several collectives into one (a tuple result)
        name = f"{name.count(':') + 1} combined ops ({kind} combiner)"
    return re.sub(r"^jit\([^)]*\)/", "", name)


def summarise(hlo: str, param_shapes: set) -> dict:
    colls = harness.collectives(hlo, N_DEV)
    by_kind = harness.by_kind(colls)
    grad_sync = sum(DTYPE_BYTES_F32 * int(np.prod(s)) for c in colls for _, s in c["arrays"]
                    if tuple(sorted(s)) in param_shapes)
    return {
        "hlo_bytes": sum(c["bytes"] for c in colls),
        "ring_bytes": sum(c["ring_bytes"] for c in colls),
        "param_shaped_bytes": grad_sync,
        "count": len(colls),
        "by_kind": by_kind,
        "has_all_to_all": "all-to-all" in by_kind,
        "collectives": [{"kind": c["kind"], "async": c["async"], "group": c["group"],
                         "source": _source(c["op_name"], c["kind"]),
                         "result": " ".join(f"{dt}{list(s)}" for dt, s in c["arrays"]), "bytes": c["bytes"]}
                        for c in colls],
    }


DTYPE_BYTES_F32 = 4      # every parameter is float32


def _kb(x: float) -> str:
    return f"{x / 1e3:,.1f} KB" if x < 1e6 else f"{x / 1e6:,.2f} MB"


def _by_source(s: dict) -> dict:
    """(kind, op_name without layer prefix) -> (count, bytes), largest first."""
    agg: dict = {}
    for c in s["collectives"]:
        key = (c["kind"], re.sub(r"/moe_\d+/", "/moe_*/", c["source"]))
        n, b = agg.get(key, (0, 0.0))
        agg[key] = (n + 1, b + c["bytes"])
    return dict(sorted(agg.items(), key=lambda kv: -kv[1][1]))


def _kinds(s: dict) -> str:
    return ", ".join(f"{k} x{v['count']}" for k, v in s["by_kind"].items()) or "none"


# ------------------------------------------------------------------------------------------
def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32, help="global batch (sequences), a multiple of 8")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence (= one routing group)")
    ap.add_argument("--features", type=int, default=64, help="input and output features")
    ap.add_argument("--d", type=int, default=128, help="model width")
    ap.add_argument("--experts", type=int, default=16, help="experts per MoE layer (a multiple of 8)")
    ap.add_argument("--hidden", type=int, default=256, help="each expert's hidden width")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--capacity", type=float, default=1.25, help="capacity factor")
    ap.add_argument("--layers", type=int, default=2, help="MoE layers")
    ap.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (eps=1e-4)")
    ap.add_argument("--num-batches", type=int, default=4, help="distinct batches, cycled through in order")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant before timing")
    ap.add_argument("--dump-hlo", action="store_true", help="also write both compiled HLO texts")
    ap.add_argument("--out", default=None, help="the results file (default bench/results/moe_dispatch.json)")
    args = ap.parse_args()
    assert len(jax.devices()) == N_DEV, jax.devices()
    if args.batch % N_DEV or args.experts % N_DEV:
        ap.error("--batch and --experts must be multiples of 8")
    return args


def build(args) -> dict:
    """Both models (B's layer declares exactly the parameters of wh.moe.MoE), their losses, the
    batches placed on the mesh, the parameters, the optimizer."""
    mesh = jax.make_mesh((N_DEV,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    kw = dict(d=args.d, features=args.features, layers=args.layers, experts=args.experts, hidden=args.hidden,
              k=args.top_k, capacity_factor=args.capacity)
    model_b = Net(**kw, variant="gspmd", mesh=mesh)
    rng = np.random.default_rng(0)
    teacher = (rng.standard_normal((args.features, args.features)) / np.sqrt(args.features)).astype(np.float32)
    host_batches = []
    for _ in range(args.num_batches):
        x = rng.standard_normal((args.batch, args.seq, args.features), dtype=np.float32)
        host_batches.append({"x": x, "y": np.tanh(x @ teacher).astype(np.float32)})
    params0 = Net(**kw, variant="plain").init(jax.random.key(0), host_batches[0]["x"][:1])["params"]
    shapes_b = jax.eval_shape(lambda: model_b.init(jax.random.key(0), host_batches[0]["x"][:1])["params"])
    assert jax.tree.structure(shapes_b) == jax.tree.structure(params0)
    assert [s.shape for s in jax.tree.leaves(shapes_b)] == [p.shape for p in jax.tree.leaves(params0)]
    data = NamedSharding(mesh, P("x"))
    batch_sh = {"x": data, "y": data}
    return {"mesh": mesh, "kw": kw, "loss_a": make_loss(Net(**kw, variant="whalex")), "loss_b": make_loss(model_b),
            "host_batches": host_batches, "params0": params0,
            "n_params": sum(int(p.size) for p in jax.tree.leaves(params0)),
            "n_expert": sum(int(p.size) for path, p in jax.tree_util.tree_leaves_with_path(params0)
                            if is_expert_path(path)),
            "param_shapes": {tuple(sorted(p.shape)) for p in jax.tree.leaves(params0)},
            "cap": wh.moe.capacity(args.seq, args.experts, args.top_k, args.capacity),
            "opt": optax.adam(args.lr, eps=1e-4), "batch_sh": batch_sh,
            "placed": [jax.device_put(b, batch_sh) for b in host_batches]}


def _copy(t):
    """A copy of every array of `t` (the steps donate their states)."""
    return jax.tree.map(lambda a: jnp.array(a, copy=True), t)


def build_whalex(c: dict) -> None:
    """A: whalex's step, its state and compiled HLO, into `c`."""
    t0 = time.perf_counter()
    wstep = wh.parallelize(c["loss_a"], c["opt"])
    c["wstate"] = wstep.init(_copy(c["params0"]), c["host_batches"][0])
    c["wstep"], c["plan"] = wstep, wstep.plan
    c["a_hlo"] = wstep.plan.lowered().compile().as_text()
    c["a_setup"] = time.perf_counter() - t0

    def w_step(state, batch):
        state, m = wstep(state, batch)
        return state, m["loss"]

    c["w_step"] = w_step


def build_gspmd(c: dict) -> None:
    """B: the plain GSPMD step (experts sharded, the rest replicated), its state and compiled HLO, into `c`."""
    t0 = time.perf_counter()
    mesh, opt, loss_b, batch_sh = c["mesh"], c["opt"], c["loss_b"], c["batch_sh"]

    def spec_for(path, _):
        return NamedSharding(mesh, P("x") if is_expert_path(path) else P())

    def b_train(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_b)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    state_shapes = jax.eval_shape(lambda p: (p, opt.init(p)), c["params0"])
    state_sh = jax.tree_util.tree_map_with_path(spec_for, state_shapes)
    rep = NamedSharding(mesh, P())
    b_jit = jax.jit(b_train, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, rep), donate_argnums=0)
    init_b = jax.jit(lambda p: (p, opt.init(p)), out_shardings=state_sh)
    c["bstate"] = init_b(_copy(c["params0"]))
    c["b_hlo"] = b_jit.lower(c["bstate"], c["placed"][0]).compile().as_text()

    def b_step(state, batch):
        return b_jit(state, jax.device_put(batch, batch_sh))      # mirror whalex's Step.__call__

    c["b_step"], c["b_setup"] = b_step, time.perf_counter() - t0


def check(c: dict) -> None:
    """The same placement of the expert weights on both sides, and one step from the same params and
    batch giving the same loss and parameters; into `c`."""
    c["a_specs"] = {k: str(v) for k, v in c["plan"].param_specs.items()}
    c["a_shard_rows"], c["b_shard_rows"] = (
        sorted({sh.data.shape[0] for path, s in jax.tree_util.tree_leaves_with_path(tree)
                if is_expert_path(path) for sh in s.addressable_shards})
        for tree in (c["wstate"].params, c["bstate"][0]))
    c["wstate"], wl = c["w_step"](c["wstate"], c["placed"][0])
    c["bstate"], bl = c["b_step"](c["bstate"], c["placed"][0])
    jax.block_until_ready((c["wstate"], wl, c["bstate"], bl))
    loss_rel = abs(float(wl) - float(bl)) / abs(float(bl))
    p_errs = jax.tree.map(rel_err, c["wstep"].params(c["wstate"]), c["bstate"][0])
    p_err = max(jax.tree.leaves(p_errs))
    moved = max(jax.tree.leaves(jax.tree.map(rel_err, c["bstate"][0], c["params0"])))
    assert loss_rel < TOL, f"loss differs: whalex {float(wl)!r} vs GSPMD {float(bl)!r} (rel {loss_rel:.2e})"
    assert p_err < TOL, f"params differ after one step: {p_errs}"
    assert moved > 1e-4, "the step did not move the parameters; the comparison would be vacuous"
    c.update(loss_rel=loss_rel, p_errs=p_errs, p_err=p_err, first_loss=float(bl))


def time_sides(args, c: dict) -> dict:
    """Warm up, then time both steps interleaved (A B, B A, ...); the collectives of each compiled HLO."""
    sides = {"whalex": [c["w_step"], c["wstate"]], "gspmd": [c["b_step"], c["bstate"]]}
    counter = {"whalex": 1, "gspmd": 1}
    last, placed = {}, c["placed"]

    def run(side):
        fn, state = sides[side]
        b = placed[counter[side] % len(placed)]
        counter[side] += 1
        sides[side][1], last[side] = fn(state, b)
        return sides[side][1], last[side]

    timings = harness.interleaved({s: (lambda s=s: run(s)) for s in sides}, args.steps, warmup=args.warmup)
    times = {s: timings.times(s) for s in sides}
    coll = {"whalex": summarise(c["a_hlo"], c["param_shapes"]), "gspmd": summarise(c["b_hlo"], c["param_shapes"])}
    med = {s: harness.median(t) for s, t in times.items()}
    return {"times": times, "warm_time": timings.warmup_s, "timed_time": timings.timed_s, "counter": counter,
            "final_loss_diff": abs(float(last["whalex"]) - float(last["gspmd"])), "coll": coll, "med": med,
            "bytes_ratio": coll["gspmd"]["hlo_bytes"] / coll["whalex"]["hlo_bytes"],
            "ring_ratio": coll["gspmd"]["ring_bytes"] / coll["whalex"]["ring_bytes"],
            "time_ratio": med["gspmd"] / med["whalex"]}


NAMES = {"whalex": "A whalex (shard_map a2a)", "gspmd": "B plain GSPMD"}


def report_setting(args, c: dict, r: dict) -> None:
    """The model, the batch, both placements, the check, then collectives and median step per variant."""
    g = args.batch
    print(f"MoE dispatch benchmark: {N_DEV} simulated CPU devices ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores), jax {jax.__version__}")
    print(f"model: Dense({args.features}->{args.d}) -> {args.layers} x residual MoE({args.experts} experts x "
          f"{args.hidden} hidden, top-{args.top_k}, capacity factor {args.capacity} -> {c['cap']} slots/expert/group) "
          f"-> Dense({args.features}); {c['n_params']:,} params ({c['n_expert']:,} in experts); "
          f"Adam(lr={args.lr}, eps=1e-4)")
    print(f"batch: {g} sequences x {args.seq} tokens ({g // N_DEV} sequences/device), routing group = one "
          f"sequence; dispatched buffer [G={g}, E={args.experts}, C={c['cap']}, d={args.d}] per layer")
    print(f"A whalex: strategies {[t.strategy for t in c['plan'].task_graphs]}, expert weight rows per device "
          f"{c['a_shard_rows']}; B GSPMD: expert weight rows per device {c['b_shard_rows']}")
    print(f"check: one step from the same params/batch: loss {c['first_loss']:.6f}, |dloss|/loss = "
          f"{c['loss_rel']:.1e}, max rel param error {c['p_err']:.1e} (< {TOL}: asserted)")
    print(f"timing: {args.steps} steps per variant after {args.warmup} warm-up, alternating A B / B A, each step "
          f"ended with block_until_ready")
    print()
    hdr = f"  {'variant':<26} {'collectives in compiled HLO':<44} {'HLO bytes':>11} {'ring bytes':>11} " \
          f"{'median ms':>10}"
    print(hdr)
    print("  " + "-" * (len(hdr) - 2))
    for s in ("whalex", "gspmd"):
        cs = r["coll"][s]
        print(f"  {NAMES[s]:<26} {_kinds(cs):<44} {_kb(cs['hlo_bytes']):>11} {_kb(cs['ring_bytes']):>11} "
              f"{r['med'][s] * 1e3:>10.2f}")
    print()


def report_collectives(c: dict, r: dict, t_all: float) -> None:
    """Bytes by kind and by source op, whether GSPMD chose an all-to-all, the ratios, the run's seconds."""
    coll = r["coll"]
    print("bytes by kind (HLO result bytes per step per device):")
    for s in ("whalex", "gspmd"):
        print(f"  {NAMES[s]:<26} " + ", ".join(f"{k} {_kb(v['bytes'])}" for k, v in coll[s]["by_kind"].items()))
    print(f"parameter-shaped collective results (weights gathered / gradients synced): whalex "
          f"{_kb(coll['whalex']['param_shaped_bytes'])}, GSPMD {_kb(coll['gspmd']['param_shaped_bytes'])}")
    print("where the collectives come from (kind x count <- jax op in the HLO metadata, bytes):")
    for s in ("whalex", "gspmd"):
        print(f"  {NAMES[s]}")
        for (kind, src), (n, b) in _by_source(coll[s]).items():
            print(f"    {kind:<18} x{n:<2} <- {src:<58} {_kb(b):>10}")
    print(f"B's HLO contains all-to-all: {'YES' if coll['gspmd']['has_all_to_all'] else 'NO'} "
          f"({coll['gspmd']['by_kind'].get('all-to-all', {'count': 0})['count']} all-to-all; XLA chose the "
          f"collectives)")
    print()
    print(f"ratio B/A (GSPMD / whalex): collective bytes {r['bytes_ratio']:.3f} (ring estimate {r['ring_ratio']:.3f}), "
          f"median step time {r['time_ratio']:.3f}")
    print(f"(setup: whalex plan+init+compile {c['a_setup']:.1f}s, GSPMD init+compile {c['b_setup']:.1f}s; warm-up "
          f"{r['warm_time']:.1f}s, timed {r['timed_time']:.1f}s; final |dloss| after {r['counter']['whalex']} steps "
          f"each {r['final_loss_diff']:.1e}; total {time.perf_counter() - t_all:.0f}s)")


def record(args, c: dict, r: dict, t_all: float) -> dict:
    coll, med, times = r["coll"], r["med"], r["times"]
    return {
        "benchmark": "moe_dispatch", "devices": N_DEV, "device_kind": "simulated CPU", "cpu_cores": os.cpu_count(),
        "jax": jax.__version__,
        "what": "one Adam training step of the same MoE model: A = whalex expert parallelism (shard_map with "
                "explicit all-to-all), B = plain GSPMD sharding annotations (experts P('x'), dispatched buffer "
                "constrained P(None,'x') before the experts and P('x') after; XLA picks the collectives). Bytes = "
                "collective result bytes per step per device from the compiled HLO; ring_bytes = ring estimate "
                "of bytes sent; time = median per-step wall time, steps interleaved A/B",
        "model": {**c["kw"], "features": args.features, "params": c["n_params"], "expert_params": c["n_expert"],
                  "capacity_slots": c["cap"], "optimizer": f"adam({args.lr}, eps=1e-4)"},
        "global_batch": args.batch, "seq": args.seq, "num_batches": args.num_batches,
        "steps_timed": args.steps, "warmup": args.warmup,
        "check": {"loss": c["first_loss"], "loss_rel_diff": c["loss_rel"], "max_rel_param_err": c["p_err"],
                  "tol": TOL, "param_errs": c["p_errs"], "final_loss_abs_diff": r["final_loss_diff"]},
        "whalex": {**coll["whalex"], "median_ms": med["whalex"] * 1e3, "min_ms": min(times["whalex"]) * 1e3,
                   "times_ms": [t * 1e3 for t in times["whalex"]], "param_specs": c["a_specs"],
                   "expert_rows_per_device": c["a_shard_rows"], "setup_s": c["a_setup"]},
        "gspmd": {**coll["gspmd"], "median_ms": med["gspmd"] * 1e3, "min_ms": min(times["gspmd"]) * 1e3,
                  "times_ms": [t * 1e3 for t in times["gspmd"]], "expert_rows_per_device": c["b_shard_rows"],
                  "setup_s": c["b_setup"]},
        "ratio_bytes_gspmd_over_whalex": r["bytes_ratio"], "ratio_ring_bytes_gspmd_over_whalex": r["ring_ratio"],
        "ratio_time_gspmd_over_whalex": r["time_ratio"],
        "gspmd_has_all_to_all": coll["gspmd"]["has_all_to_all"],
        "total_wall_s": time.perf_counter() - t_all,
    }


def main():
    args = parse()
    t_all = time.perf_counter()
    c = build(args)
    build_whalex(c)
    build_gspmd(c)
    check(c)
    r = time_sides(args, c)
    report_setting(args, c, r)
    report_collectives(c, r, t_all)
    if args.dump_hlo:
        harness.RESULTS.mkdir(parents=True, exist_ok=True)
        (harness.RESULTS / "moe_dispatch_whalex.hlo.txt").write_text(c["a_hlo"])
        (harness.RESULTS / "moe_dispatch_gspmd.hlo.txt").write_text(c["b_hlo"])
    print(f"wrote {harness.write_result('moe_dispatch', record(args, c, r, t_all), args.out)}")


if __name__ == "__main__":
    main()
