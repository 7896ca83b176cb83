"""Per-device memory of one training step of a GPT-style transformer under whalex's memory options.

Remat against the hand-written equivalents (first table; ``--remat-only`` runs it alone, in seconds)
    bench/models.GPT (stock Flax blocks, no annotation), data parallel on 8 devices. For whalex's
    ``remat="full"`` and ``remat="dots_with_no_batch_dims_saveable"`` beside ``nn.remat(Block)`` with
    the same policy, and ``remat="auto"`` at half of the no-remat step (state + saved residuals):
    what ``jax.vjp`` keeps for the backward pass per device and the training FLOPs (recomputed
    forwards included, ``whalex.jaxpr.flops``), each as a fraction of no remat. Both are read from
    the jaxpr, so they hold on every backend (XLA's CPU compiler drops remat's barriers: its
    compiled memory cannot show remat). Peak bytes in use and step time on a GPU: bench/gpu.py.

XLA's compiled memory per option (second table)
    One training step (forward, backward, Adam update) of the same model, planned with ``wh.plan``
    on 8 simulated CPU devices, pure data parallelism (the model is not annotated: every operation
    takes the default strategy, replicate over all 8 devices), under ``wh.Config``:
        baseline            nothing
        zero 1 / 2 / 3      ZeRO: optimizer state / + gradients / + parameters sharded over the 8 replicas
                            (2 and 3 run as explicit reduce-scatter / all-gather in shard_map: "UnevenProgram")
        remat full          jax.checkpoint per repeated layer: on CPU the same figures as the baseline,
                            since XLA's CPU compiler drops remat's barriers (the first table is the measure)
        offload             optimizer state in pinned host memory between steps
        zero 1 + offload    both (acceptance 1)
    Each plan is lowered and COMPILED by XLA, never run: params and batch are ShapeDtypeStructs.
    A row whose config whalex refuses prints "not built" or "refused" with whalex's reason.

    The default shape (1 sequence of 64 tokens per device, 5.3M parameters) is the regime ZeRO is
    for: the training state (params + grads + Adam = 16 bytes a parameter) dominates the activations.
    With more tokens per device the activations dominate XLA's temp and hide the gradient saving
    (``--batch 16 --seq 128``: ZeRO 2 = ZeRO 1, and ZeRO 3's gathered parameters add to the temp).

The figures (per device, XLA's ``Compiled.memory_analysis()`` of the step as ``wh.parallelize``
runs it, the state donated; ``peak*`` is ``plan.compiled_memory()``, which does not donate)
    argument   XLA's argument bytes: parameters + optimizer state + this device's batch rows
    params     the parameter bytes among the arguments, from the step's argument shardings
               (``shard_shape`` of each ShapeDtypeStruct passed to XLA), not from a model
    opt state  the optimizer-state bytes among the arguments, likewise
    host       argument bytes placed in ``pinned_host`` memory. On CPU, XLA counts them inside
               ``argument_size_in_bytes`` (its ``host_argument_size_in_bytes`` stays 0: host and
               device memory are the same RAM), so "device" = argument - host here
    temp       XLA's preallocated scratch: activations kept for the backward, gradients, the
               update's temporaries, after buffer reuse
    peak       argument + output + temp - alias, less the pinned_host state: what the device holds
               at once. On CPU, moving the offloaded state to "device" memory for the update is a no-op
               (same RAM), so the offload rows' peak does not include the update's transient copy
               of it that a GPU would hold (the streamed state: up to the "opt st." column)
    The args split is checked: params + opt state + batch + step counter == XLA's argument bytes.

Plain-JAX reference, in the same run
    ``jax.jit`` of the same loss + ``optax.adam`` update with replicated parameters and optimizer
    state and the batch sharded over the same 8-device mesh (what a user writes without whalex).
    whalex's baseline should equal it; each row's total is also given as a ratio to it.

Checks (printed PASS/FAIL; the ZeRO-1 one is asserted)
    remat="full" saves at most 1.10x and recomputes at most 1.02x what nn.remat(Block) does (fractions
    of no remat); remat="auto" fits half the no-remat step; ZeRO-1 optimizer state per device = 1/8
    of the baseline's (within Adam's 4-byte step count); ZeRO-3 params per device = 1/8 of the
    baseline's; the baseline matches plain JAX within 5%; the peak falls with every ZeRO level.

Run from the repo root: ``python bench/memory.py`` (about a minute on 2 CPU cores).
Writes bench/results/memory.json.
"""
from __future__ import annotations

import os

import harness

harness.simulate_devices(8)

import argparse
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import whalex as wh
from models import GPT
from whalex.errors import PlanError
from whalex.jaxpr.flops import training_flops
from whalex.memory import vjp_residual_bytes

N_DEV = 8
KEYS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")


# ---- the model: a small GPT (pre-LN decoder blocks, causal attention, untied LM head) ---------------

def make_model(vocab: int, d: int, layers: int, heads: int, seq: int):
    f32 = jnp.float32
    params = {"embed": jax.ShapeDtypeStruct((vocab, d), f32), "pos": jax.ShapeDtypeStruct((seq, d), f32),
              "ln_f": jax.ShapeDtypeStruct((d,), f32), "head": jax.ShapeDtypeStruct((d, vocab), f32)}
    for i in range(layers):
        params[f"block{i}"] = {
            "ln1": jax.ShapeDtypeStruct((d,), f32), "qkv": jax.ShapeDtypeStruct((d, 3 * d), f32),
            "proj": jax.ShapeDtypeStruct((d, d), f32), "ln2": jax.ShapeDtypeStruct((d,), f32),
            "fc1": jax.ShapeDtypeStruct((d, 4 * d), f32), "fc2": jax.ShapeDtypeStruct((4 * d, d), f32)}

    def norm(x, g):
        return g * (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)

    def loss_fn(p, batch):
        tok = batch["tokens"]
        b, t = tok.shape
        x = p["embed"][tok] + p["pos"][:t]
        mask = jnp.tril(jnp.ones((t, t), bool))
        for i in range(layers):
            q = p[f"block{i}"]
            h = norm(x, q["ln1"]) @ q["qkv"]
            qh, kh, vh = (z.reshape(b, t, heads, d // heads) for z in jnp.split(h, 3, -1))
            s = jnp.einsum("bqhd,bkhd->bhqk", qh, kh) / (d // heads) ** 0.5
            a = jax.nn.softmax(jnp.where(mask, s, -1e9), -1)
            x = x + jnp.einsum("bhqk,bkhd->bqhd", a, vh).reshape(b, t, d) @ q["proj"]
            x = x + jax.nn.gelu(norm(x, q["ln2"]) @ q["fc1"]) @ q["fc2"]
        logits = norm(x, p["ln_f"]) @ p["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return loss_fn, params


def batch_shapes(rows: int, seq: int):
    return {"tokens": jax.ShapeDtypeStruct((rows, seq), jnp.int32),
            "targets": jax.ShapeDtypeStruct((rows, seq), jnp.int32)}


# ---- measuring ------------------------------------------------------------------------------------

def shard_bytes(tree, kind: str | None = None) -> int:
    """Per-device bytes of ShapeDtypeStructs with shardings (only those in memory `kind` if given)."""
    total = 0
    for x in jax.tree.leaves(tree):
        if kind is not None and x.sharding.memory_kind != kind:
            continue
        total += int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
    return total


def row(name: str, config: wh.Config, loss_fn, params, batch, optimizer) -> dict:
    t0 = time.perf_counter()
    try:
        plan = wh.plan(loss_fn, params, batch, optimizer, config=config, cluster=wh.Cluster.detect())
    except PlanError as e:
        return {"name": name, "built": False, "reason": str(e)}
    mem = {k: int(v) for k, v in plan.compiled_memory().items() if k in KEYS}
    compiled = plan.lowered(donate=True).compile()      # the step as wh.parallelize runs it: the state is donated
    donated = {k: int(getattr(compiled.memory_analysis(), k)) for k in KEYS}
    state, placed_batch = plan.functions.abstract_args()
    split = {"params": shard_bytes(state.stored_params), "opt_state": shard_bytes(state.opt_state),
             "batch": shard_bytes(placed_batch), "step": shard_bytes(state.step),
             "host": shard_bytes(state, "pinned_host")}
    other = shard_bytes([x for x in jax.tree.leaves(state) if x is not None]) - split["params"] - \
        split["opt_state"] - split["step"]                                     # e.g. amp's loss scale
    return {"name": name, "built": True, "config": _config_dict(config), "memory": mem, "memory_donated": donated,
            "arguments": split, "other_state": other, "args_add_up": split["params"] + split["opt_state"] +
            split["batch"] + split["step"] + other == mem["argument_size_in_bytes"],
            "device_peak": peak(mem, split["host"], donated=False),
            "device_peak_donated": peak(donated, split["host"], donated=True),
            "planned": {"params": plan.memory[0].params, "grads": plan.memory[0].grads,
                        "opt_state": plan.memory[0].opt_state, "activations": plan.memory[0].activations,
                        "host": plan.memory[0].host},
            "program": plan.program_kind, "seconds": time.perf_counter() - t0}


def peak(m: dict, host: int, donated: bool) -> int:
    """Device bytes held at once: argument + output + temp - alias, less the pinned_host state
    (an input and an output; donated, the output aliases the input)."""
    total = m["argument_size_in_bytes"] + m["output_size_in_bytes"] + m["temp_size_in_bytes"] - m["alias_size_in_bytes"]
    return total - (host if donated else 2 * host)


def _config_dict(config) -> dict:
    return {k: getattr(config, k) for k in ("zero_level", "remat", "memory_budget", "offload", "amp")
            if getattr(config, k) not in (None, 0)}


def plain_jax(loss_fn, params, batch, optimizer) -> dict:
    """The same step written with jax.jit: params and Adam state replicated, batch sharded."""
    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def step(p, o, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        u, o = optimizer.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    opt = jax.eval_shape(optimizer.init, params)
    shard = lambda tree, s: jax.tree.map(lambda _: s, tree)  # noqa: E731
    out = {}
    for donate in (False, True):
        f = jax.jit(step, in_shardings=(shard(params, rep), shard(opt, rep), shard(batch, data)),
                    out_shardings=(shard(params, rep), shard(opt, rep), rep), donate_argnums=(0, 1) if donate else ())
        m = f.lower(params, opt, batch).compile().memory_analysis()
        mem = {k: int(getattr(m, k)) for k in KEYS}
        mem["peak"] = peak(mem, 0, donate)
        out["donated" if donate else "not_donated"] = mem
    return out


# ---- remat against the hand-written equivalents: what JAX saves for the backward pass ----------------

DOTS = "dots_with_no_batch_dims_saveable"
HAND = (("no remat", {}), ("nn.remat(Block)", {"remat_block": True}),
        (f"nn.remat(Block, {DOTS})", {"remat_block": True, "remat_policy": DOTS}))


def gpt_loss(size: dict, **hand):
    """bench/models.GPT's token-mean cross-entropy and its parameter shapes (nothing allocated)."""
    model = GPT(size["vocab"], size["d"], size["heads"], size["layers"], **hand)
    tokens = jax.ShapeDtypeStruct((size["batch"], size["seq"]), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(tokens.shape, jnp.int32))["params"])

    def loss_fn(p, batch):
        logits = model.apply({"params": p}, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return loss_fn, params, {"tokens": tokens, "targets": tokens}


def saved_and_flops(loss_fn, params, batch) -> tuple[float, float]:
    """What jax.vjp keeps for the backward pass (bytes, whole batch) and the training FLOPs, the
    recomputed forwards included: both read from the jaxpr, the same on every backend."""
    leaves, tree = jax.tree.flatten((params, batch))
    n = len(jax.tree.leaves(params))
    fn = lambda *xs: loss_fn(*jax.tree.unflatten(tree, xs))  # noqa: E731
    flops = training_flops(jax.make_jaxpr(fn)(*leaves), [k < n for k in range(len(leaves))], [True])
    return vjp_residual_bytes(fn, leaves, range(n)), flops


def remat_rows(size: dict) -> tuple[list[dict], dict]:
    """Each whalex remat option on the un-annotated model beside the hand-written model it stands for:
    per-device saved residuals and training FLOPs, as fractions of no remat; and remat="auto" at half
    of the no-remat step (state + saved residuals), which has no hand-written twin."""
    hand = {}
    for name, kw in HAND:
        saved, flops = saved_and_flops(*gpt_loss(size, **kw))
        hand[name] = {"saved_per_device": saved / N_DEV, "flops": flops}
    base = hand["no remat"]
    loss_fn, params, batch = gpt_loss(size)
    remat = lambda config: wh.plan(loss_fn, params, batch, optax.adam(1e-3), config=config).report.remat  # noqa: E731
    probe = remat(wh.Config(remat="auto"))
    budget = 0.5 * (probe.state + probe.baseline)
    rows = []
    for label, config, twin in (("remat='full'", wh.Config(remat="full"), "nn.remat(Block)"),
                                (f"remat='{DOTS}'", wh.Config(remat=DOTS), f"nn.remat(Block, {DOTS})"),
                                ("remat='auto', 50% budget", wh.Config(remat="auto", memory_budget=budget), None)):
        r = remat(config)
        h = hand.get(twin)
        rows.append({"whalex": label, "hand_written": twin, "levels": r.describe(),
                     "whalex_saved_per_device": r.saved, "whalex_saved_fraction": r.saved / r.baseline,
                     "whalex_flops_ratio": r.flops / r.baseline_flops,
                     "hand_saved_per_device": h and h["saved_per_device"],
                     "hand_saved_fraction": h and h["saved_per_device"] / base["saved_per_device"],
                     "hand_flops_ratio": h and h["flops"] / base["flops"],
                     "fits": r.state + r.saved <= budget if twin is None else None})
    return rows, {"hand": hand, "auto_budget": budget, "state_per_device": probe.state}


def print_remat(rows: list[dict], size: dict) -> None:
    print(f"remat on bench/models.GPT ({size['layers']} blocks, d={size['d']}, vocab {size['vocab']}, "
          f"{size['batch']}x{size['seq']} tokens, no annotation), data parallel on {N_DEV} devices: what JAX "
          "saves for the backward pass per device, and the step's FLOPs, each / no remat")
    head = f"{'whalex':<42}{'saved':>7}{'FLOPs':>7}   {'hand-written':<50}{'saved':>7}{'FLOPs':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        hand = (f"{r['hand_written']:<50}{r['hand_saved_fraction']:>7.3f}{r['hand_flops_ratio']:>7.3f}"
                if r["hand_written"] else "(no hand-written twin; " + ("fits" if r["fits"] else "DOES NOT FIT") + ")")
        print(f"{r['whalex']:<42}{r['whalex_saved_fraction']:>7.3f}{r['whalex_flops_ratio']:>7.3f}   {hand}")
    print()


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences); 1 per device")
    ap.add_argument("--remat-batch", type=int, default=256,
                    help="global batch of the remat comparison (activations, not the state, fill its step)")
    ap.add_argument("--remat-only", action="store_true", help="only the remat comparison (seconds)")
    ap.add_argument("--out", default=None, help="the results file (default bench/results/memory.json)")
    args = ap.parse_args()
    assert len(jax.devices()) == N_DEV, jax.devices()
    return args


def remat_part(args) -> dict:
    """The remat comparison (whalex's remat options against nn.remat), printed and checked."""
    size = {"vocab": args.vocab, "d": args.d_model, "heads": args.heads, "layers": args.layers, "seq": args.seq,
            "batch": args.remat_batch}
    remat_table, remat_info = remat_rows(size)
    print_remat(remat_table, size)
    remat_checks = {
        "remat='full' saves at most 1.10x nn.remat(Block)'s fraction":
            remat_table[0]["whalex_saved_fraction"] <= 1.10 * remat_table[0]["hand_saved_fraction"],
        "remat='full' recomputes at most 1.02x nn.remat(Block)'s FLOPs":
            remat_table[0]["whalex_flops_ratio"] <= 1.02 * remat_table[0]["hand_flops_ratio"],
        "remat='auto' fits half the no-remat step": bool(remat_table[2]["fits"]),
    }
    for name, ok in remat_checks.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    return {"model": {"kind": "bench/models.GPT", **size}, "rows": remat_table, **remat_info,
            "checks": remat_checks}


def option_rows(args):
    """Each memory option's plan, compiled, and plain JAX's: (rows, plain JAX's, parameter count)."""
    loss_fn, params = make_model(args.vocab, args.d_model, args.layers, args.heads, args.seq)
    batch = batch_shapes(args.batch, args.seq)
    optimizer = optax.adam(1e-3)
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))

    rows = [row("baseline", wh.Config(), loss_fn, params, batch, optimizer)]
    configs = [("zero 1", wh.Config(zero_level=1)), ("zero 2", wh.Config(zero_level=2)),
               ("zero 3", wh.Config(zero_level=3)), ("remat full (CPU: no change)", wh.Config(remat="full")),
               ("offload opt_state", wh.Config(offload="opt_state")),
               ("zero 1 + offload", wh.Config(zero_level=1, offload="opt_state"))]
    rows += [row(name, cfg, loss_fn, params, batch, optimizer) for name, cfg in configs]
    return rows, plain_jax(loss_fn, params, batch, optimizer), n_params


def print_options(args, rows, plain, n_params) -> None:
    """Per option: the device's argument, parameter, optimizer-state, host, temp and peak bytes."""
    print(f"whalex memory options: GPT-style transformer, {args.layers} blocks, d={args.d_model}, "
          f"{args.heads} heads, vocab {args.vocab}, seq {args.seq}; {n_params:,} params "
          f"({n_params * 4 / 2**20:.1f} MiB f32), Adam")
    print(f"pure data parallelism on {N_DEV} simulated CPU devices (jax {jax.__version__}), global batch "
          f"{args.batch}; one step compiled, not run. Per device, MiB:")
    head = (f"{'config':<26}{'argument':>9}{'params':>8}{'opt st.':>8}{'host':>7}{'temp':>8}{'peak':>8}"
            f"{'vs plain':>9}{'peak*':>8}  program")
    print(head)
    print("-" * len(head))
    pd, pn = plain["donated"], plain["not_donated"]
    print(f"{'plain JAX (jit, replicated)':<26}{mib(pd['argument_size_in_bytes']):>9}{'':>8}{'':>8}{'':>7}"
          f"{mib(pd['temp_size_in_bytes']):>8}{mib(pd['peak']):>8}{1.0:>9.2f}{mib(pn['peak']):>8}")
    for r in rows:
        if not r["built"]:
            label = "not built" if "not lowered" in r["reason"] else "refused"
            print(f"{r['name']:<26}  {label} ({r['reason'][:80]})")
            continue
        m, a = r["memory_donated"], r["arguments"]
        r["vs_plain"] = r["device_peak_donated"] / pd["peak"]
        print(f"{r['name']:<26}{mib(m['argument_size_in_bytes']):>9}{mib(a['params']):>8}{mib(a['opt_state']):>8}"
              f"{mib(a['host']):>7}{mib(m['temp_size_in_bytes']):>8}{mib(r['device_peak_donated']):>8}"
              f"{r['vs_plain']:>9.2f}{mib(r['device_peak']):>8}  {r['program']}")
    print("The step as wh.parallelize runs it (state donated). peak = argument + output + temp - alias - the "
          "pinned_host state;\nhost = argument bytes in pinned_host (on CPU, XLA counts them in 'argument'); "
          "peak* = the same without donation (plan.compiled_memory())")


def check_options(rows, plain):
    """ZeRO's fractions, the argument bytes adding up, the baseline against plain JAX, printed:
    (checks, ZeRO-1's optimizer-state ratio, ZeRO-3's parameter ratio)."""
    pd, base = plain["donated"], rows[0]
    by = {r["name"]: r for r in rows if r["built"]}
    z1, z3 = by["zero 1"], by["zero 3"]
    opt_ratio = z1["arguments"]["opt_state"] / base["arguments"]["opt_state"]
    param_ratio = z3["arguments"]["params"] / base["arguments"]["params"]
    count = 4                                                           # Adam's step count, replicated
    exact = (base["arguments"]["opt_state"] - count) / N_DEV + count
    print()
    print(f"ZeRO-1 optimizer state per device / baseline = {z1['arguments']['opt_state']:,} / "
          f"{base['arguments']['opt_state']:,} B = {opt_ratio:.4f} (1/8 = 0.125; Adam's {count}-byte step "
          f"count stays replicated)")
    print(f"ZeRO-3 parameters per device / baseline = {param_ratio:.4f}")
    checks = {
        "ZeRO-1 optimizer state per device is 1/8 of the baseline (within the replicated step count)":
            abs(z1["arguments"]["opt_state"] - exact) <= 1,
        "ZeRO-3 parameters per device are 1/8 of the baseline": abs(param_ratio - 1 / N_DEV) < 1e-6,
        "every row's argument bytes = params + opt state + batch + step (+ other state)":
            all(r["args_add_up"] for r in by.values()),
        "baseline peak within 5% of plain JAX": abs(base["device_peak_donated"] / pd["peak"] - 1) <= 0.05,
        "peak falls with every ZeRO level": by["zero 1"]["device_peak_donated"] < base["device_peak_donated"] and
            by["zero 2"]["device_peak_donated"] < by["zero 1"]["device_peak_donated"] and
            by["zero 3"]["device_peak_donated"] < by["zero 2"]["device_peak_donated"],
    }
    for name, ok in checks.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    return checks, opt_ratio, param_ratio


def main():
    args = parse()
    t_start = time.perf_counter()
    remat_out = remat_part(args)
    if args.remat_only:
        path = harness.write_result("memory_remat", {"benchmark": "memory (remat)", "jax": jax.__version__,
                                                     "remat": remat_out}, args.out, default=str, newline=True)
        print(f"wrote {path}")
        return
    rows, plain, n_params = option_rows(args)
    print_options(args, rows, plain, n_params)
    checks, opt_ratio, param_ratio = check_options(rows, plain)
    elapsed = time.perf_counter() - t_start
    print(f"\n{len(rows)} whalex plans + 1 plain compile in {elapsed:.1f} s")
    out = {
        "benchmark": "memory",
        "devices": N_DEV, "device_kind": "simulated CPU", "cpu_cores": os.cpu_count(), "jax": jax.__version__,
        "python": platform.python_version(),
        "model": {"kind": "GPT-style decoder", "vocab": args.vocab, "d_model": args.d_model, "layers": args.layers,
                  "heads": args.heads, "seq": args.seq, "params": n_params, "optimizer": "adam(1e-3)"},
        "global_batch": args.batch,
        "method": "wh.plan on ShapeDtypeStructs, compiled (not run); plan.compiled_memory() per device (state not "
                  "donated); params/opt_state/host split from the step's argument shardings; total = argument + "
                  "output + temp - alias - 2 * host",
        "remat": remat_out, "plain_jax": plain, "rows": rows, "zero1_opt_state_ratio": opt_ratio,
        "zero3_params_ratio": param_ratio,
        "checks": checks, "seconds": elapsed,
    }
    path = harness.write_result("memory", out, args.out, default=str, newline=True)
    print(f"wrote {path.relative_to(pathlib.Path.cwd()) if path.is_relative_to(pathlib.Path.cwd()) else path}")
    assert checks["ZeRO-1 optimizer state per device is 1/8 of the baseline (within the replicated step count)"], \
        opt_ratio


if __name__ == "__main__":
    main()
