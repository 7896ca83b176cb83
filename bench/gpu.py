"""One GPU: whalex against a hand-written `jax.jit` step, and each memory option's peak device memory.

The model is what users train: a GPT-style stock Flax linen model (pre-LN blocks of `nn.LayerNorm`,
`nn.MultiHeadDotProductAttention` with a causal mask and a GELU MLP; `nn.Embed` and an untied
`nn.Dense` head), about 170M parameters at the default size, adamw, bf16 compute on fp32 parameters.

    python bench/gpu.py            # on a GPU: every case, each in its own process; writes bench/results/
    python bench/gpu.py --small    # a tiny model on CPU in seconds (the suite runs this)

Cases:
- `pair_bf16`, `pair_fp32`: whalex (`amp="bf16"` or fp32) and the hand-written step in one process,
  interleaved rounds on the same batch: step-time ratio (medians), MFU, first and last loss,
  parameters after the same updates, whalex's predicted step time and FLOPs beside the measured.
- `plain`, `plain_remat_block`: the hand-written anchors (no remat, `nn.remat(Block)`).
- `whalex`, `whalex_remat_full`, `whalex_offload_opt_state`, `whalex_offload_params`: whalex with one memory
  option each (parameters offloaded per layer: each block's fetched for its forward and backward);
  `whalex_remat_full_offload_params`: both, ZeRO-Offload with activation checkpointing.
Memory cases run in their own process, so `memory_stats()["peak_bytes_in_use"]` is that option's
alone (CPU devices report no memory stats: the figure is then absent).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import harness

SIZES = {
    "full": dict(vocab=32768, d=1024, heads=16, layers=8, seq=1024, batch=16, steps=10, rounds=3),
    "small": dict(vocab=256, d=32, heads=2, layers=2, seq=16, batch=4, steps=2, rounds=2),
}
PAIRS = ("pair_bf16", "pair_fp32")
MEMORY = ("plain", "plain_remat_block", "whalex", "whalex_remat_full", "whalex_offload_opt_state",
          "whalex_offload_params", "whalex_remat_full_offload_params")
WHALEX_CONFIG = {"whalex": {}, "whalex_remat_full": {"remat": "full"},
                 "whalex_offload_opt_state": {"offload": "opt_state"}, "whalex_offload_params": {"offload": "params"},
                 "whalex_remat_full_offload_params": {"remat": "full", "offload": "params"}}


# ---- the model ------------------------------------------------------------------------------------

def gpt(size: dict, remat_block: bool = False):
    """(loss_fn, bf16 loss_fn, params, batch, training FLOPs per step) of the stock Flax GPT."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from models import GPT  # a sibling module: imports flax, so loaded with jax

    model = GPT(size["vocab"], size["d"], size["heads"], size["layers"], remat_block)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, size["vocab"], (size["batch"], size["seq"] + 1)).astype(np.int32)
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    params = jax.device_get(model.init(jax.random.key(0), batch["x"][:1])["params"])

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["x"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    def bf16_loss_fn(p, b):          # what amp="bf16" does, by hand: bf16 compute, fp32 parameters
        return loss_fn(jax.tree.map(lambda a: a.astype(jnp.bfloat16), p), b)

    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    n_dense = n_params - size["vocab"] * size["d"]           # the embedding table is a gather, not a matmul
    tokens_per_step, layers, seq, d = size["batch"] * size["seq"], size["layers"], size["seq"], size["d"]
    flops = 6 * n_dense * tokens_per_step + 12 * layers * seq * d * tokens_per_step   # matmuls + attention
    return loss_fn, bf16_loss_fn, params, batch, flops


def plain_step(loss_fn, optimizer):
    """The hand-written step: value_and_grad, the optimizer, donated state, one `jax.jit`."""
    import jax
    import optax

    def train(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    return jax.jit(lambda p: (p, optimizer.init(p))), jax.jit(train, donate_argnums=0)


# ---- measuring ------------------------------------------------------------------------------------

def peak_bytes():
    import jax
    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


class Loop:
    """`steps` steps of `fn` run back to back on one batch (the way a training loop runs), from the
    state it holds: one call of it is what `harness.interleaved` times."""

    def __init__(self, fn, state, batch, steps: int):
        self.fn, self.state, self.batch, self.steps, self.metrics = fn, state, batch, steps, None

    def __call__(self):
        for _ in range(self.steps):
            self.state, self.metrics = self.fn(self.state, self.batch)
        return self.state, self.metrics


def peak_flops(device_kind: str) -> float:
    """The device's dense bf16 peak FLOP/s (whalex's spec table), the MFU's denominator for every
    precision (XLA runs fp32 matmuls on tensor cores too: TF32 by default on GPUs)."""
    from whalex.mesh import specs
    try:
        return specs.lookup(device_kind).bf16_flops
    except ValueError:
        return float("nan")


def case_pair(size: dict, res: dict, amp: bool):
    """whalex and the hand-written step in one process, rounds interleaved, the order alternating."""
    import jax
    import optax

    import whalex as wh
    from whalex.view.timing import predict

    loss_fn, bf16_loss_fn, params, batch, flops = gpt(size)
    optimizer = optax.adamw(1e-4)
    pinit, pstep = plain_step(bf16_loss_fn if amp else loss_fn, optimizer)
    gbatch = jax.device_put(batch)
    pstate = pinit(jax.device_put(params))
    pstate, pm = pstep(pstate, gbatch)
    step = wh.parallelize(loss_fn, optimizer, config=wh.Config(amp="bf16") if amp else None)
    t0 = time.perf_counter()
    wstate = step.init(params, batch)
    res["whalex_init_s"] = time.perf_counter() - t0
    wstate, wm = step(wstate, gbatch)
    res["first_loss"] = {"plain": float(pm["loss"]), "whalex": float(wm["loss"])}
    loops = {"plain": Loop(pstep, pstate, gbatch, size["steps"]), "whalex": Loop(step, wstate, gbatch, size["steps"])}
    t = harness.interleaved(loops, size["rounds"])             # rounds alternate the order
    times = {n: [dt / size["steps"] for dt in t.times(n)] for n in loops}
    pstate, pm = loops["plain"].state, loops["plain"].metrics
    wstate, wm = loops["whalex"].state, loops["whalex"].metrics
    plain, whalex = harness.median(times["plain"]), harness.median(times["whalex"])
    peak = peak_flops(jax.devices()[0].device_kind)
    prediction = predict(step.plan)
    res.update(step_s=times, ratio=whalex / plain, flops_per_step=flops, mfu_plain=flops / plain / peak,
               mfu_whalex=flops / whalex / peak, last_loss={"plain": float(pm["loss"]), "whalex": float(wm["loss"])},
               plan_flops=sum(t.flops for t in step.plan.task_graphs), predicted_step_s=prediction.step_time,
               predicted_basis=prediction.basis, summary=step.plan.summary())
    res.update(param_diff(jax.device_get(wstate.params), jax.device_get(pstate[0])))


def param_diff(a, b) -> dict:
    """How far two parameter trees are apart: relative L2 of the whole tree, and the worst leaf
    (max |a-b| / max |b|) among leaves of scale above 1e-3 (a near-zero leaf, such as an attention
    key bias whose gradient is exactly zero, would measure only float noise)."""
    import jax
    import numpy as np
    pairs = [(np.float64(x), np.float64(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    num = sum(float(np.sum((x - y) ** 2)) for x, y in pairs)
    den = sum(float(np.sum(y ** 2)) for _, y in pairs)
    leaves = [float(np.max(np.abs(x - y)) / np.max(np.abs(y))) for x, y in pairs if np.max(np.abs(y)) > 1e-3]
    return {"param_rel_l2": (num / den) ** 0.5 if den else 0.0, "max_rel_param_diff": max(leaves, default=0.0)}


def case_memory(size: dict, res: dict, name: str):
    """One step kind alone in this process: its step time and peak device memory."""
    import jax
    import optax

    remat_block = name == "plain_remat_block"
    loss_fn, bf16_loss_fn, params, batch, flops = gpt(size, remat_block=remat_block)
    optimizer = optax.adamw(1e-4)
    gbatch = jax.device_put(batch)
    if name.startswith("plain"):
        init, fn = plain_step(bf16_loss_fn, optimizer)
        state = init(jax.device_put(params))
    else:
        import whalex as wh
        fn = wh.parallelize(loss_fn, optimizer, config=wh.Config(amp="bf16", **WHALEX_CONFIG[name]))
        state = fn.init(params, batch)
        res["summary"] = fn.plan.summary()
        res["predicted_bytes"] = max((m.state + m.activations for m in fn.plan.memory), default=None)
        res["offloaded_bytes"] = max((m.host for m in fn.plan.memory), default=0.0)
        r = fn.plan.report.remat
        if r is not None and r.flops:
            res["predicted_flops_ratio"] = r.flops / r.baseline_flops     # what recomputation adds
        m = fn.plan.compiled_memory()           # XLA's figure for the same step: args + outputs + temp - alias
        res["compiled_bytes"] = (m.get("argument_size_in_bytes", 0) + m.get("output_size_in_bytes", 0)
                                 + m.get("temp_size_in_bytes", 0) - m.get("alias_size_in_bytes", 0))
    state, metrics = fn(state, gbatch)
    loop = Loop(fn, state, gbatch, size["steps"])
    times = [dt / size["steps"] for dt in harness.interleaved({name: loop}, size["rounds"]).times(name)]
    res.update(step_s=times, median_step_s=harness.median(times), loss=float(loop.metrics["loss"]),
               peak_bytes=peak_bytes(), flops_per_step=flops)


def run_case(name: str, size: dict, out: str) -> None:
    """Run one case in this process and write `<out>/<name>.json` (the error, when it fails)."""
    import jax
    res = {"case": name, "jax": jax.__version__, "device": jax.devices()[0].device_kind,
           "platform": jax.devices()[0].platform}
    t0 = time.perf_counter()
    try:
        if name in PAIRS:
            case_pair(size, res, amp=name == "pair_bf16")
        else:
            case_memory(size, res, name)
        res["ok"] = True
    except Exception as e:          # noqa: BLE001 (recorded, and the table shows the failure)
        res.update(ok=False, error="".join(traceback.format_exception(e))[-3000:])
    res["wall_s"] = time.perf_counter() - t0
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


# ---- the driver -----------------------------------------------------------------------------------

def gb(n) -> str:
    return "n/a" if n is None else f"{n / 1e9:.2f} GB"


def ms(s) -> str:
    return "n/a" if s is None else f"{s * 1e3:.1f} ms"


def table(results: dict) -> str:
    """The printed summary: pairs (ratio, MFU, loss) and memory cases (peak, time against plain)."""
    lines = [f"{'case':33} {'step':>10} {'plain':>10} {'ratio':>7} {'peak':>10}  note"]
    base = results.get("plain", {}).get("median_step_s")
    for name, r in results.items():
        if not r.get("ok"):
            lines.append(f"{name:33} FAILED: {(r.get('error') or '').strip().splitlines()[-1:]}")
        elif name in PAIRS:
            w, p = harness.median(r["step_s"]["whalex"]), harness.median(r["step_s"]["plain"])
            lines.append(f"{name:33} {ms(w):>10} {ms(p):>10} {r['ratio']:>7.3f} {'':>10}  MFU {r['mfu_whalex']:.1%} vs "
                         f"{r['mfu_plain']:.1%}; first loss {r['first_loss']['whalex']:.4f} vs "
                         f"{r['first_loss']['plain']:.4f}; predicted {ms(r['predicted_step_s'])}")
        else:
            t = r["median_step_s"]
            ratio = f"{t / base:>7.3f}" if base else f"{'':>7}"
            plan = (f"; plan predicts {gb(r['predicted_bytes'])}, XLA compiled {gb(r.get('compiled_bytes'))}"
                    if r.get("predicted_bytes") is not None else "")
            lines.append(f"{name:33} {ms(t):>10} {ms(base):>10} {ratio} {gb(r.get('peak_bytes')):>10}  "
                         f"loss {r['loss']:.4f}{plan}")
    return "\n".join(lines)


def checks(results: dict) -> dict:
    """The memory options' bars against the hand-written step without remat (where both ran on a GPU):
    remat="full" at most 0.40x its peak at most +30% step time; offload="opt_state" lowering the peak
    by at least 90% of the bytes it moves to the host; offload="params" (per layer) by at least half of
    them (a block's parameters, the embedding's and the head's come to the device in turn)."""
    plain, out = results.get("plain", {}), {}
    if not (plain.get("ok") and plain.get("peak_bytes")):
        return out
    remat, off, whalex, offp = (results.get(k, {}) for k in ("whalex_remat_full", "whalex_offload_opt_state", "whalex",
                                                             "whalex_offload_params"))
    if remat.get("ok") and remat.get("peak_bytes"):
        out["remat full: peak <= 0.40x plain"] = remat["peak_bytes"] <= 0.40 * plain["peak_bytes"]
        out["remat full: step time <= 1.30x plain"] = remat["median_step_s"] <= 1.30 * plain["median_step_s"]
    if off.get("ok") and whalex.get("ok") and off.get("peak_bytes") and whalex.get("peak_bytes"):
        out["offload opt_state: peak lowered by >= 90% of the offloaded bytes"] = \
            whalex["peak_bytes"] - off["peak_bytes"] >= 0.9 * off["offloaded_bytes"]
    # per layer, one block's parameters (and the embedding or head) are on the device at a time
    for name, case, base in (("offload params", offp, whalex),
                             ("remat full + offload params", results.get("whalex_remat_full_offload_params", {}),
                              remat)):
        if case.get("ok") and base.get("ok") and case.get("peak_bytes") and base.get("peak_bytes"):
            out[f"{name}: peak lowered by >= 50% of the offloaded bytes"] = \
                base["peak_bytes"] - case["peak_bytes"] >= 0.5 * case["offloaded_bytes"]
    return out


def write(results: dict, size: dict, args) -> tuple[dict, str]:
    """The record so far, written to --out or bench/results/gpu_<device>_jax<version>.json."""
    first = next((r for r in results.values() if "device" in r), {})
    record = {"bench": "gpu", "size": "small" if args.small else "full", "model": size, "jax": first.get("jax"),
              "device": first.get("device"), "platform": first.get("platform"), "cases": results,
              "checks": checks(results)}
    device = "".join(c if c.isalnum() else "-" for c in str(first.get("device", "unknown"))).strip("-")
    return first, harness.write_result(f"gpu_{device}_jax{first.get('jax')}", record, args.out, indent=1, default=str)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a tiny model: runs on CPU in seconds")
    ap.add_argument("--out", help="the results file (default bench/results/gpu_<device>_jax<version>.json)")
    ap.add_argument("--cases", nargs="*", default=list(PAIRS + MEMORY), choices=list(PAIRS + MEMORY))
    ap.add_argument("--case", help=argparse.SUPPRESS)         # a worker: run this one case here
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=240, help="seconds per case")
    args = ap.parse_args(argv)
    size = SIZES["small" if args.small else "full"]
    if args.case:
        return run_case(args.case, size, args.workdir)
    import tempfile
    work = tempfile.mkdtemp(prefix="whalex-gpu-")
    env = harness.worker_env()
    results = {}
    for name in args.cases:
        cmd = [sys.executable, os.path.abspath(__file__), "--case", name, "--workdir", work] + \
            (["--small"] if args.small else [])
        p = harness.run_worker(cmd, args.timeout, env)
        tail = f"timed out after {args.timeout} s" if p is None else (p.stdout + p.stderr)[-2000:]
        path = os.path.join(work, f"{name}.json")
        results[name] = json.load(open(path)) if os.path.exists(path) else {"ok": False, "error": tail}
        print(f"{name}: {'ok' if results[name].get('ok') else 'FAILED'} ({results[name].get('wall_s', 0):.0f} s)",
              flush=True)
        first, out = write(results, size, args)          # after every case: a time-out keeps what finished
    print(f"{first.get('device')} ({first.get('platform')}), jax {first.get('jax')}, model {size}")
    print(table(results))
    for name, ok in checks(results).items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    print(f"wrote {out}")
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
