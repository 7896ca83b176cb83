"""Per-device memory and collectives of 3D parallelism against pipeline-only and split-only (issue 13).

What it measures
    One decoder-only LM (embedding, blocks of attention + MLP, final norm, logits; stock Flax
    layers), one global batch, Adam, 8 simulated CPU devices, planned four ways:

    * 3d:        Config(auto_parallel=True, num_task_graph=2, num_micro_batch=M) with every block's
                 MLP under ``wh.split(2)``: a (data=2, stage=2, model=2) mesh.
    * pipeline:  the same pipeline without the split: (data=4, stage=2).
    * split:     the split MLPs without a pipeline: one GSPMD program, model=2 x 4 data replicas.
    * dp:        pure data parallelism over 8 devices (the baseline every other plan improves on).

    Each training step is compiled (nothing runs). Memory is XLA's memory analysis of the compiled
    step per device (arguments: the stored state and the batch; temp: activations, stashes,
    gathered rows); "peak" = arguments + outputs + temp - aliased.
    Collectives are read from the compiled HLO (after the SPMD partitioner: what each device runs).
    A collective inside a while loop runs once per iteration: the parser multiplies by the loop's
    known trip count (the pipeline's tick scan, the micro-batch loops). Inside a conditional (the
    pipeline's per-tick `lax.switch` between idle, forward and backward of each stage) only one
    branch runs per tick; the table counts the largest branch per tick, an upper bound on what a
    device sends per step, and prints the split into loop and straight-line parts.

Run: ``python bench/pipeline_3d.py`` (about 2 minutes on 2 cores). Writes bench/results/pipeline_3d.json.
"""
from __future__ import annotations

import harness

harness.simulate_devices(8)

import argparse
import time

import flax.linen as nn
import jax
import optax

import whalex as wh

KEYS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")


def make_lm(vocab: int, width: int, heads: int, blocks: int, split: bool):
    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            def mlp():
                return nn.Dense(width, name="down")(nn.gelu(nn.Dense(4 * width, name="up")(x)))
            if split:
                with wh.split(2):
                    return mlp()
            return mlp()

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=heads, name="attn")(h, h, mask=mask)
            return x + Mlp(name="mlp")(nn.LayerNorm()(x))

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(vocab, width, name="embed")(tokens)
            mask = nn.make_causal_mask(tokens)
            for i in range(blocks):
                x = Block(name=f"block_{i}")(x, mask)
            return nn.Dense(vocab, name="logits")(nn.LayerNorm(name="norm")(x))

    return LM()


# ------------------------------------------------------------------------------------ the plans

def measure(name, loss_fn, params, batch, config):
    t0 = time.perf_counter()
    plan = wh.plan(loss_fn, params, batch, optax.adam(1e-3), config=config)
    compiled = plan.lowered().compile()
    m = compiled.memory_analysis()
    mem = {k: int(getattr(m, k)) for k in KEYS}
    mem["peak"] = mem["argument_size_in_bytes"] + mem["output_size_in_bytes"] + mem["temp_size_in_bytes"] \
        - mem["alias_size_in_bytes"]
    comm = harness.looped_ring_bytes(compiled.as_text(), 8)
    mesh = " x ".join(f"{a}={n}" for a, n in zip(plan.layout.axis_names, plan.layout.axis_sizes))
    return {"plan": name, "mesh": mesh, "memory": mem, "collectives": comm,
            "predicted_comm": plan.predicted_comm_bytes, "seconds": time.perf_counter() - t0}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches of the pipelines")
    ap.add_argument("--out", default=None, help="the results file (default bench/results/pipeline_3d.json)")
    args = ap.parse_args()
    tokens = jax.random.randint(jax.random.key(0), (args.batch, args.length + 1), 0, args.vocab)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    rows = []
    for name, split, config in [
        ("3d", True, wh.Config(auto_parallel=True, num_task_graph=2, num_micro_batch=args.micro)),
        ("pipeline", False, wh.Config(auto_parallel=True, num_task_graph=2, num_micro_batch=args.micro)),
        ("split", True, wh.Config()),
        ("dp", False, wh.Config()),
    ]:
        model = make_lm(args.vocab, args.width, args.heads, args.blocks, split)
        params = model.init(jax.random.key(1), batch["inputs"])["params"]

        def loss_fn(p, b, model=model):
            logits = model.apply({"params": p}, b["inputs"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

        rows.append(measure(name, loss_fn, params, batch, config))
        r = rows[-1]
        print(f"{name}: {r['mesh']}, peak {r['memory']['peak'] / 2**20:.2f} MiB, "
              f"collectives {r['collectives']['total'] / 2**20:.2f} MiB ({r['seconds']:.0f} s)", flush=True)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print()
    print(f"LM: vocab {args.vocab}, width {args.width}, {args.heads} heads, {args.blocks} blocks, length "
          f"{args.length}; {n_params / 1e6:.2f}M parameters; global batch {args.batch}; Adam; 8 CPU devices; "
          f"pipelines: 2 stages, {args.micro} micro-batches (1F1B)")
    head = (f"{'plan':<9} {'mesh':<28} {'args MiB':>9} {'temp MiB':>9} {'peak MiB':>9} {'coll MiB':>9} "
            f"{'in loops':>9} {'predicted':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        m, c = r["memory"], r["collectives"]
        print(f"{r['plan']:<9} {r['mesh']:<28} {m['argument_size_in_bytes'] / 2**20:>9.2f} "
              f"{m['temp_size_in_bytes'] / 2**20:>9.2f} {m['peak'] / 2**20:>9.2f} {c['total'] / 2**20:>9.2f} "
              f"{c['in_loops'] / 2**20:>9.2f} {r['predicted_comm'] / 2**20:>9.2f}")
    print("coll = ring bytes each device sends per step, read from the compiled HLO (loops times their trip "
          "count; a per-tick switch counts its largest branch: an upper bound for the pipelines); predicted = "
          "plan.predicted_comm_bytes")
    config = {k: v for k, v in vars(args).items() if k != "out"}
    path = harness.write_result("pipeline_3d", {"config": config, "params": int(n_params), "rows": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
