"""Predicted per-device memory (`plan.predicted_memory()`) against XLA's compiled figure.

    python bench/memory_prediction.py          # on CPU: the test models' plans on 8 simulated devices
    python bench/memory_prediction.py --gpt    # on the default backend (one GPU): also the ~170M GPT-style
                                               # model at 16x1024 tokens

The prediction replays the training step's jaxpr (whalex/memory/peak.py) without compiling; XLA's
figure is the compiled step as `wh.parallelize` runs it, state donated: arguments + outputs + temp -
aliased. For comparison, the activation estimate whalex printed before (the residuals JAX saves for
the backward pass, divided over the devices) is shown beside the state. Writes
bench/results/memory_prediction_<platform>.json.
"""
from __future__ import annotations

import argparse
import sys
import time

import harness

GPT_SIZES = {
    "tiny": dict(vocab=256, d=64, heads=4, layers=2, seq=64, batch=16),
    "full": dict(vocab=32768, d=1024, heads=16, layers=8, seq=1024, batch=16),
}


def gpt(size: dict):
    """(loss_fn, params, batch) of a stock Flax linen GPT: pre-LN blocks of LayerNorm, causal
    MultiHeadDotProductAttention and a GELU MLP; Embed and an untied Dense head."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from models import GPT  # a sibling module: imports flax, so loaded with jax

    model = GPT(size["vocab"], size["d"], size["heads"], size["layers"])

    tokens = np.random.default_rng(0).integers(0, size["vocab"], (size["batch"], size["seq"] + 1)).astype(np.int32)
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), batch["x"][:1])["params"])

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["x"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    return loss_fn, params, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)


def mlp(rows: int = 256):
    import jax
    import jax.numpy as jnp
    shapes = {"w1": (32, 256), "b1": (256,), "w2": (256, 256), "w3": (256, 16)}
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    batch = {"x": jax.ShapeDtypeStruct((rows, 32), jnp.float32), "y": jax.ShapeDtypeStruct((rows, 16), jnp.float32)}

    def loss_fn(p, b):
        h = jax.nn.relu(jax.nn.relu(b["x"] @ p["w1"] + p["b1"]) @ p["w2"])
        return jnp.mean((h @ p["w3"] - b["y"]) ** 2)

    return loss_fn, params, batch


def two_stages(rows: int = 256):
    """The MLP as two annotated TaskGraphs (a pipeline with num_micro_batch > 1)."""
    import jax
    import jax.numpy as jnp

    import whalex as wh
    _, params, batch = mlp(rows)

    def loss_fn(p, b):
        with wh.replicate(1):
            h = jax.nn.relu(b["x"] @ p["w1"] + p["b1"])
        with wh.replicate(1):
            return jnp.mean((jax.nn.relu(h @ p["w2"]) @ p["w3"] - b["y"]) ** 2)

    return loss_fn, params, batch


def cases(with_gpt: bool, devices: int) -> dict:
    """name -> (model builder, Config keywords)."""
    out = {"gpt block stack": (lambda: gpt(GPT_SIZES["tiny"]), {}),
           "mlp": (mlp, {}),
           "pipeline": (two_stages, {"num_micro_batch": 4}),
           "zero 3": (mlp, {"zero_level": 3})}
    if devices < 2:
        out = {k: v for k, v in out.items() if k in ("gpt block stack", "mlp")}
    if with_gpt:
        out.update({"gpt 170M fp32": (lambda: gpt(GPT_SIZES["full"]), {}),
                    "gpt 170M amp bf16": (lambda: gpt(GPT_SIZES["full"]), {"amp": "bf16"})})
    return out


def measure(name: str, build, config: dict) -> dict:
    import jax
    import optax

    import whalex as wh
    from whalex.memory import residual_bytes

    loss_fn, params, batch = build()
    t0 = time.perf_counter()
    plan = wh.plan(loss_fn, params, batch, optax.adamw(1e-4), config=wh.Config(**config))
    t1 = time.perf_counter()
    predicted = plan.predicted_memory()
    t2 = time.perf_counter()
    compiled = plan.step_memory()
    t3 = time.perf_counter()
    cap = plan.report.captured
    state = plan.memory[0].state
    old = residual_bytes(cap.jaxpr, cap.num_params) * cap.global_batch / plan.global_batch / plan.layout.size
    return {"case": name, "config": config, "program": plan.program_kind,
            "predicted": vars(predicted) | {"total": predicted.total},
            "compiled": vars(compiled) | {"total": compiled.total},
            "ratio": predicted.total / compiled.total,
            "state_bytes": state, "residual_estimate_bytes": old, "old_prediction_bytes": state + old,
            "plan_s": t1 - t0, "predict_s": t2 - t1, "compile_s": t3 - t2,
            "device": jax.devices()[0].device_kind, "jax": jax.__version__}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpt", action="store_true", help="also the ~170M GPT-style model, on the default backend (a GPU)")
    ap.add_argument("--out", default=None,
                    help="results file (default bench/results/memory_prediction_<platform>.json)")
    args = ap.parse_args(argv)
    if not args.gpt:
        harness.simulate_devices(8)
    import jax

    mib = 2.0 ** 20
    rows = []
    print(f"{'case':<20} {'program':<16} {'predicted':>10} {'XLA':>10} {'ratio':>6} {'old':>10}   MiB per device")
    for name, (build, config) in cases(args.gpt, len(jax.devices())).items():
        r = measure(name, build, config)
        rows.append(r)
        print(f"{name:<20} {r['program']:<16} {r['predicted']['total'] / mib:>10.2f} "
              f"{r['compiled']['total'] / mib:>10.2f} {r['ratio']:>6.3f} {r['old_prediction_bytes'] / mib:>10.2f}",
              flush=True)
    platform = jax.devices()[0].platform
    harness.write_result(f"memory_prediction_{platform}", {
        "method": "plan.predicted_memory() (a replay of the step's jaxpr, no compilation) against plan.step_memory() "
                  "(XLA memory_analysis of the donated step: arguments + outputs + temp - aliased); old: the state "
                  "plus the residuals JAX saves for the backward pass divided over the devices (the former estimate)",
        "rows": rows}, args.out)


if __name__ == "__main__":
    sys.exit(main())
