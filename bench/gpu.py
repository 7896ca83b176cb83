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
alone (CPU devices report no memory stats: the figure is then absent). Each records XLA's figure for
the step it ran (`compiled_bytes`: arguments + outputs + temporaries - aliased, as the step runs).
`offload="opt_state"` also times the host link alone: its state moved to the device and back in one
jitted program, the transfers no offloaded step can avoid.

    python bench/gpu.py --deviceless    # on a GPU: also the device's own XLA:GPU target and deviceless compiles

With `--deviceless`, a `device` case first reads the GPU's CUDA properties and the XLA:GPU target they
describe (`gpu_targets.from_cuda_properties`), beside the spec table's; then, in a process that sees no
GPU (`JAX_PLATFORMS=cpu`, as on a CPU machine), each memory case is compiled for one GPU of that kind by
the deviceless compiler, with the spec table's target and with the recorded one, while the cases run.
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
DEVICELESS = ("plain", "plain_remat_block", "whalex", "whalex_remat_full", "whalex_offload_opt_state")
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
        m = fn.lower(state, gbatch).compile().memory_analysis()
        res["compiled_bytes"] = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                                 - m.alias_size_in_bytes)
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
        res["compiled_bytes"] = fn.plan.step_memory().total       # XLA's figure for the step as it runs
        save_hlo(fn.plan, name, "device")
    state, metrics = fn(state, gbatch)
    loop = Loop(fn, state, gbatch, size["steps"])
    times = [dt / size["steps"] for dt in harness.interleaved({name: loop}, size["rounds"]).times(name)]
    res.update(step_s=times, median_step_s=harness.median(times), loss=float(loop.metrics["loss"]),
               peak_bytes=peak_bytes(), flops_per_step=flops)
    if name == "whalex_offload_opt_state":
        res["host_link"] = host_link(loop.state.opt_state, 5 * size["rounds"])


def on_device(tree, dev):
    """A copy of the pinned-host `tree` in device memory, made by a jitted program (jax 0.12.1's CPU client
    refuses `jax.device_put` of a pinned-host array's layout)."""
    import jax
    return jax.jit(lambda t: jax.device_put(t, dev), out_shardings=dev)(tree)


def host_link(tree, rounds: int) -> dict:
    """Seconds (medians) to move `tree`, stored in pinned host memory, to the device and back in one
    jitted program, and each way alone: what an offloaded step's transfers cost with nothing else."""
    import jax
    import numpy as np
    host = jax.tree.map(lambda a: a.sharding, tree)
    dev = jax.tree.map(lambda s: s.with_memory_kind("device"), host)
    bump = lambda t: jax.tree.map(lambda a: a + np.ones((), a.dtype), t)       # noqa: E731 (XLA cannot elide it)
    moves = {"round_trip": (jax.jit(lambda t: bump(jax.device_put(t, dev)), out_shardings=host), tree),
             "to_device": (jax.jit(lambda t: bump(jax.device_put(t, dev)), out_shardings=dev), tree),
             "to_host": (jax.jit(bump, out_shardings=host), on_device(tree, dev))}
    out = {"bytes": float(sum(a.nbytes for a in jax.tree.leaves(tree)))}
    for name, (fn, arg) in moves.items():
        jax.block_until_ready(fn(arg))
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(arg))
            times.append(time.perf_counter() - t0)
        out[f"{name}_s"] = harness.median(times)
    return out


def cuda_properties() -> dict:
    """The GPU's CUDA device properties (CuPy's `getDeviceProperties`, the clocks read as attributes
    where the CUDA runtime's struct no longer holds them)."""
    import cupy
    rt = cupy.cuda.runtime
    props = dict(rt.getDeviceProperties(0))
    for key, attr in (("clockRate", 13), ("memoryClockRate", 36), ("memoryBusWidth", 37)):
        if not props.get(key):
            props[key] = rt.deviceGetAttribute(attr, 0)
    return {k: v.decode(errors="replace") if isinstance(v, bytes) else v for k, v in props.items()
            if isinstance(v, (int, float, str, bytes))}


def cuda_versions() -> tuple[tuple[int, int], tuple[int, int]]:
    """(cuDNN, CUDA runtime) versions the device's JAX runs with: its cuDNN wheel's and CuPy's runtime."""
    from importlib import metadata

    import cupy
    dnn = (9, 8)
    for wheel in ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"):
        try:
            dnn = tuple(int(x) for x in metadata.version(wheel).split(".")[:2])
            break
        except metadata.PackageNotFoundError:
            continue
    runtime = cupy.cuda.runtime.runtimeGetVersion()
    return dnn, (runtime // 1000, runtime % 1000 // 10)


def case_device(res: dict) -> None:
    """The GPU's own XLA:GPU target description, and where the spec table's differs from it."""
    import jax

    from whalex.mesh import gpu_targets, specs
    props = cuda_properties()
    kind = specs.lookup(jax.devices()[0].device_kind).name
    versions = cuda_versions()
    real = gpu_targets.from_cuda_properties(props, *versions)
    res.update(properties=props, kind=kind, target_config=real.text(), versions=versions,
               differences={k: list(v) for k, v in gpu_targets.differences(gpu_targets.gpu_target(kind), real).items()})


def deviceless(size: dict, names, kind: str, target_config: str | None = None) -> dict:
    """XLA:GPU's per-device bytes (arguments + outputs + temporaries - aliased) of each case compiled
    for one GPU of `kind` without a GPU: the spec table's target, or `target_config`."""
    import optax

    import gpu_compile
    import whalex as wh
    cluster = wh.Cluster.gpu_topology(kinds=[kind], target_config=target_config)
    out = {}
    for name in names:
        t0 = time.perf_counter()
        if name.startswith("plain"):
            total = gpu_compile.plain_step(size, cluster, name == "plain_remat_block")["xla_gpu_bytes"]
        else:
            loss_fn, params, batch = gpu_compile.problem(size, 1, {})
            plan = wh.plan(loss_fn, params, batch, optax.adamw(1e-4), cluster=cluster,
                           config=wh.Config(amp="bf16", **WHALEX_CONFIG[name]))
            total = plan.step_memory().total
            save_hlo(plan, name, "deviceless")
        out[name] = {"bytes": float(total), "compile_s": time.perf_counter() - t0}
    return out


def save_hlo(plan, case: str, where: str) -> None:
    """With WHALEX_BENCH_HLO set (a folder), the scheduled HLO of `whalex_remat_full` as compiled `where`."""
    folder = os.environ.get("WHALEX_BENCH_HLO")
    if folder and case == "whalex_remat_full":
        from whalex.jaxpr.compiled import compile_step
        devices = plan.cluster.compile_devices
        text = compile_step(plan.functions, plan.report.platform, None if devices is None else devices[:1])[1]
        with open(os.path.join(folder, f"hlo_{where}_{os.environ.get('WHALEX_BENCH_TAG', 'spec')}.txt"), "w") as f:
            f.write(text)


def run_case(name: str, size: dict, out: str) -> None:
    """Run one case in this process and write `<out>/<name>.json` (the error, when it fails)."""
    import jax
    res = {"case": name, "jax": jax.__version__, "device": jax.devices()[0].device_kind,
           "platform": jax.devices()[0].platform}
    t0 = time.perf_counter()
    try:
        if name in PAIRS:
            case_pair(size, res, amp=name == "pair_bf16")
        elif name == "device":
            case_device(res)
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
            plan = (f"; plan predicts {gb(r['predicted_bytes'])}" if r.get("predicted_bytes") is not None else "") + \
                (f"; XLA compiled {gb(r.get('compiled_bytes'))}" if r.get("compiled_bytes") else "") + \
                (f", deviceless {gb(r.get('deviceless_bytes'))}" if r.get("deviceless_bytes") else "") + \
                (f" ({gb(r.get('deviceless_recorded_bytes'))} recorded target)"
                 if r.get("deviceless_recorded_bytes") else "") + \
                (f" ({gb(r.get('deviceless_autotuned_bytes'))} with its autotuning)"
                 if r.get("deviceless_autotuned_bytes") else "") + \
                (f"; host link round trip {ms(r['host_link']['round_trip_s'])}" if r.get("host_link") else "")
            lines.append(f"{name:33} {ms(t):>10} {ms(base):>10} {ratio} {gb(r.get('peak_bytes')):>10}  "
                         f"loss {r['loss']:.4f}{plan}")
    return "\n".join(lines)


def checks(results: dict) -> dict:
    """The memory options' bars against the hand-written step without remat (where both ran on a GPU):
    remat="full" at most 0.40x its peak at most +30% step time; offload="opt_state" lowering the peak
    by at least 90% of the bytes it moves to the host; offload="params" (per layer) by at least half of
    them (a block's parameters, the embedding's and the head's come to the device in turn)."""
    plain, out = results.get("plain", {}), compile_checks(results)
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


def compile_checks(results: dict) -> dict:
    """The deviceless compile against the same step compiled on the GPU (equal) and against its measured
    peak (within 1%), per case; the offloaded step's time against the plain step's and the host link's."""
    out = {}
    for name, r in results.items():
        for key, what in (("deviceless_bytes", "spec table's target"), ("deviceless_recorded_bytes", "recorded target"),
                          ("deviceless_autotuned_bytes", "recorded target and autotuning")):
            if r.get(key) and r.get("compiled_bytes"):
                out[f"{name}: deviceless ({what}) == on-device compile"] = r[key] == r["compiled_bytes"]
            if r.get(key) and r.get("peak_bytes"):
                out[f"{name}: deviceless ({what}) within 1% of the measured peak"] = \
                    abs(r[key] / r["peak_bytes"] - 1) <= 0.01
    off, plain = results.get("whalex_offload_opt_state", {}), results.get("plain", {})
    if off.get("host_link") and plain.get("median_step_s"):
        bound = max(plain["median_step_s"], off["host_link"]["round_trip_s"])
        out["offload opt_state: step <= 1.15x max(plain step, host-link round trip)"] = \
            off["median_step_s"] <= 1.15 * bound
    return out


def write(results: dict, size: dict, args, extra: dict | None = None) -> tuple[dict, str]:
    """The record so far, written to --out or bench/results/gpu_<device>_jax<version>.json; `extra`: the
    device's target and the deviceless compiles (--deviceless)."""
    first = next((r for r in results.values() if "device" in r), {})
    record = {"bench": "gpu", "size": "small" if args.small else "full", "model": size, "jax": first.get("jax"),
              "device": first.get("device"), "platform": first.get("platform"), "cases": results,
              "checks": checks(results), **(extra or {})}
    device = "".join(c if c.isalnum() else "-" for c in str(first.get("device", "unknown"))).strip("-")
    return first, harness.write_result(f"gpu_{device}_jax{first.get('jax')}", record, args.out, indent=1, default=str)


def deviceless_worker(args, size: dict) -> None:
    """A process that sees no GPU: the deviceless compiles of `args.cases`, written to the work folder."""
    config = open(args.target_config).read() if args.target_config else None
    out = {"jax": __import__("jax").__version__, "kind": args.kind, "recorded_target": config is not None}
    try:
        out["cases"] = deviceless(size, [c for c in args.cases if c in DEVICELESS], args.kind, config)
    except Exception as e:          # noqa: BLE001 (recorded beside the cases' results)
        out["error"] = "".join(traceback.format_exception(e))[-3000:]
    name = args.tag or ("deviceless_recorded" if config else "deviceless")
    with open(os.path.join(args.workdir, f"{name}.json"), "w") as f:
        json.dump(out, f, indent=1)


def _no_gpu_env(**extra) -> dict:
    """A worker's environment in which JAX sees no GPU (as on a CPU machine) and compiles for one."""
    return dict(harness.worker_env(), JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1",
                CUDA_VISIBLE_DEVICES="", **extra)


def _deviceless_cmd(args, work: str, kind: str, cases, *more: str) -> list[str]:
    """The command line of a deviceless worker compiling `cases` for `kind`."""
    return [sys.executable, os.path.abspath(__file__), "--deviceless-worker", "--kind", kind, "--workdir", work,
            *more, "--cases", *cases] + (["--small"] if args.small else [])


def start_deviceless(args, work: str, kind: str, device: dict) -> list:
    """The deviceless compiles, started in the background (spec table's target, then the recorded one)."""
    import shlex
    import subprocess
    cases = [c for c in args.cases if c in DEVICELESS]
    script = shlex.join(_deviceless_cmd(args, work, kind, cases))
    if device.get("target_config"):
        path = os.path.join(work, "target_config.txtpb")
        open(path, "w").write(device["target_config"])
        script += " && WHALEX_BENCH_TAG=recorded " + shlex.join(_deviceless_cmd(args, work, kind, cases,
                                                                                  "--target-config", path))
    return [subprocess.Popen(["bash", "-c", script], env=_no_gpu_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)]


def start_autotuned(args, work: str, kind: str) -> list:
    """Each case compiled deviceless for the recorded target with the autotuner's results from its run on
    the GPU (`--xla_gpu_load_autotune_results_from`), one process per case, in parallel."""
    import subprocess
    config = os.path.join(work, "target_config.txtpb")
    procs = []
    for name in [c for c in args.cases if c in DEVICELESS]:
        results = os.path.join(work, f"autotune_{name}.txtpb")
        if not (os.path.exists(config) and os.path.exists(results)):
            continue
        env = _no_gpu_env(WHALEX_BENCH_TAG="autotuned", XLA_FLAGS=f"--xla_gpu_load_autotune_results_from={results}")
        cmd = _deviceless_cmd(args, work, kind, [name], "--target-config", config,
                              "--tag", f"deviceless_autotuned_{name}")
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def merge_deviceless(results: dict, work: str) -> dict:
    """The deviceless compiles' records, their bytes copied beside each case's on-device figures."""
    found = {}
    tags = [("deviceless", "deviceless_bytes"), ("deviceless_recorded", "deviceless_recorded_bytes")] + \
        [(f"deviceless_autotuned_{c}", "deviceless_autotuned_bytes") for c in DEVICELESS]
    for name, key in tags:
        path = os.path.join(work, f"{name}.json")
        if os.path.exists(path):
            found[name] = json.load(open(path))
            for case, r in found[name].get("cases", {}).items():
                results.get(case, {})[key] = r["bytes"]
    return found


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a tiny model: runs on CPU in seconds")
    ap.add_argument("--out", help="the results file (default bench/results/gpu_<device>_jax<version>.json)")
    ap.add_argument("--cases", nargs="*", default=list(PAIRS + MEMORY), choices=list(PAIRS + MEMORY))
    ap.add_argument("--deviceless", action="store_true",
                    help="also record the GPU's XLA:GPU target and compile each memory case for it without a GPU")
    ap.add_argument("--kind", help="the spec table's kind for --deviceless-worker")
    ap.add_argument("--case", help=argparse.SUPPRESS)         # a worker: run this one case here
    ap.add_argument("--deviceless-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--target-config", help=argparse.SUPPRESS)
    ap.add_argument("--tag", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=240, help="seconds per case")
    return ap.parse_args(argv)


def run_in_worker(name: str, args, work: str, env: dict) -> dict:
    if args.deviceless and name in DEVICELESS:       # the autotuner's choices, for the deviceless compile
        flag = f"--xla_gpu_dump_autotune_results_to={os.path.join(work, f'autotune_{name}.txtpb')}"
        env = dict(env, XLA_FLAGS=" ".join(filter(None, [env.get("XLA_FLAGS"), flag])))
    cmd = [sys.executable, os.path.abspath(__file__), "--case", name, "--workdir", work] + \
        (["--small"] if args.small else [])
    p = harness.run_worker(cmd, args.timeout, env)
    tail = f"timed out after {args.timeout} s" if p is None else (p.stdout + p.stderr)[-2000:]
    path = os.path.join(work, f"{name}.json")
    r = json.load(open(path)) if os.path.exists(path) else {"ok": False, "error": tail}
    print(f"{name}: {'ok' if r.get('ok') else 'FAILED'} ({r.get('wall_s', 0):.0f} s)", flush=True)
    return r


def main(argv=None):
    args = parse(argv)
    size = SIZES["small" if args.small else "full"]
    if args.case:
        return run_case(args.case, size, args.workdir)
    if args.deviceless_worker:
        return deviceless_worker(args, size)
    import tempfile
    work = tempfile.mkdtemp(prefix="whalex-gpu-")
    env = harness.worker_env()
    results, extra, compiles = {}, {}, []
    if args.deviceless:
        extra["target"] = run_in_worker("device", args, work, env)      # the GPU's own XLA:GPU target
        kind = args.kind or extra["target"].get("kind") or "H200-141GB"
        compiles = start_deviceless(args, work, kind, extra["target"])
    for name in args.cases:
        results[name] = run_in_worker(name, args, work, env)
        first, out = write(results, size, args, extra)          # after every case: a time-out keeps what finished
    if args.deviceless:
        compiles += start_autotuned(args, work, kind)
    for p in compiles:
        log = p.communicate()[0]
        print(log[-1500:] if p.returncode else "deviceless compiles: ok", flush=True)
    extra.update(merge_deviceless(results, work))
    first, out = write(results, size, args, extra)
    print(f"{first.get('device')} ({first.get('platform')}), jax {first.get('jax')}, model {size}")
    print(table(results))
    for name, ok in checks(results).items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    print(f"wrote {out}")
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
