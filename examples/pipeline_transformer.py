#!/usr/bin/env python
"""A GPT-style language model trained as a 4-stage pipeline with nested data parallelism.

Whale section 3.1.2 and its Examples 1 (pipeline) and 3 (auto pipeline): consecutive
`wh.replicate(1)` scopes are pipeline stages once `wh.Config(num_micro_batch=M)` has M > 1. Each
stage runs on its own device and holds only its own parameters (and Adam moments); micro-batches
flow through the stages under a 1F1B (PipeDream-flush) or GPipe schedule. When the cluster has
more devices than the stages ask for, whalex replicates the whole pipeline (nested data
parallelism): 8 devices and 4 stages of `replicate(1)` give 2 pipeline replicas, each taking half
of the global batch. In Whale (TensorFlow) the same model is written as:

    with wh.replicate(1):              # stage 0
        x = embeddings(tokens); x = blocks[0](x)
    with wh.replicate(1):              # stage 1
        x = blocks[1](x); x = blocks[2](x)
    ...
    with wh.replicate(1):              # last stage
        x = blocks[-1](x); loss = cross_entropy(head(final_norm(x)), targets)

The model is a small decoder-only transformer (Flax linen): token embedding + learned position
embedding, pre-LayerNorm blocks of causal multi-head self-attention and a GELU MLP, a final
LayerNorm and an (untied) output projection. The annotations are written in the model: the
blocks are spread over the stages counting the embeddings and the head as one block each, so
`--layers 6` over 4 stages gives 1, 2, 2, 1 blocks (embeddings + 1 block, 2, 2, 1 block + head +
loss). The loss is computed inside the last stage, and every parameter belongs to one stage, which
is why the output projection is not tied to the token embedding.

`--auto` trains the same model written without any annotation: `auto_parallel=True,
num_task_graph=4` lets whalex cut it into 4 stages balanced by FLOPs under each device's memory
(for the default model it picks the same cut as the annotations).

The data are synthetic and learnable: token streams from a random sparse second-order Markov
chain (each pair of previous tokens allows only a few next tokens). Predicting well needs the token
before the current one, i.e. attention. The script prints the best achievable loss (the chain's
own conditional entropy on the batch) next to the uniform guess ln(vocab). With the default
flags the loss falls from ln(32) = 3.47 to about 1.06 in 400 steps (the chain itself: 0.89), the
same curve as plain single-device training: the plan changes where the work runs, not the maths.

    python examples/pipeline_transformer.py                       # ~1-2 min on 2 CPU cores
    python examples/pipeline_transformer.py --schedule gpipe
    python examples/pipeline_transformer.py --auto                # whalex picks the stages
    python examples/pipeline_transformer.py --check               # compare with one device; exit 1 if not equal

On CPU the script simulates `--devices` devices (XLA_FLAGS=--xla_force_host_platform_device_count)
unless XLA_FLAGS already sets a device count.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=6, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=64, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads (must divide --d-model)")
    p.add_argument("--seq", type=int, default=32, help="tokens per training sequence")
    p.add_argument("--vocab", type=int, default=32, help="vocabulary size")
    p.add_argument("--batch", type=int, default=64,
                   help="global batch (sequences); a multiple of micro-batches x pipeline replicas")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step and pipeline replica")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages (must divide --devices)")
    p.add_argument("--steps", type=int, default=400, help="training steps")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b", help="pipeline schedule")
    p.add_argument("--lr", type=float, default=1e-2, help="peak Adam learning rate")
    p.add_argument("--warmup", type=int, default=50,
                   help="linear learning-rate warmup steps (then cosine decay to lr/10); 0: constant lr")
    p.add_argument("--devices", type=int, default=8, help="devices; simulated on CPU")
    p.add_argument("--auto", action="store_true",
                   help="no annotations in the model: auto_parallel=True, num_task_graph=--stages")
    p.add_argument("--branching", type=int, default=3, help="possible next tokens per context in the data")
    p.add_argument("--check", action="store_true",
                   help="also train on one device and compare the parameters; exit 1 if they differ")
    p.add_argument("--check-steps", type=int, default=5, help="Adam steps of the --check comparison")
    p.add_argument("--check-tol", type=float, default=1e-4, help="largest accepted relative parameter error")
    p.add_argument("--perturb", action="store_true", help=argparse.SUPPRESS)   # tests: a deliberately wrong plan
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < (0 if args.check else 1):
        p.error("--steps must be at least 1 (0 only with --check: the comparison alone)")
    for name in ("layers", "d_model", "heads", "seq", "vocab", "batch", "micro_batches", "stages",
                 "devices", "branching"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.d_model % args.heads:
        p.error(f"--heads {args.heads} must divide --d-model {args.d_model}")
    if args.stages < 2:
        p.error("--stages must be at least 2 for a pipeline")
    if args.devices % args.stages:
        p.error(f"--stages {args.stages} must divide --devices {args.devices} "
                "(the pipeline is replicated devices/stages times)")
    if not args.auto and args.layers + 2 < args.stages:
        p.error(f"--layers {args.layers} is too few for {args.stages} stages: the embeddings and the head count "
                f"as one layer each, so use --layers {args.stages - 2} or more")
    replicas = args.devices // args.stages
    if args.batch % (args.micro_batches * replicas):
        p.error(f"--batch {args.batch} must be a multiple of --micro-batches x pipeline replicas = "
                f"{args.micro_batches} x {replicas} = {args.micro_batches * replicas}")
    if args.branching > args.vocab:
        p.error("--branching must be at most --vocab")
    return args


def simulate_cpu_devices(n: int) -> None:
    """Ask XLA for `n` host (CPU) devices; must run before jax is imported.

    The flag only affects the CPU platform: on a GPU machine jax.devices() is still the GPUs.
    A device count the user already put in XLA_FLAGS is left alone.
    """
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    simulate_cpu_devices(ARGS.devices)

import flax.linen as nn  # noqa: E402  (after XLA_FLAGS)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import whalex as wh  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import single_device_check  # noqa: E402  (--check)

# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------
INIT = nn.initializers.normal(0.02)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends to positions <= t (plain jnp ops)."""

    d_model: int
    heads: int

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        hd = d // self.heads
        qkv = nn.Dense(3 * d, kernel_init=INIT, name="qkv")(x).reshape(b, t, 3, self.heads, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]                 # (b, t, heads, hd)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd).astype(np.float32)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores, axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
        return nn.Dense(d, kernel_init=INIT, name="out")(y)


class MLP(nn.Module):
    d_model: int

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(4 * self.d_model, kernel_init=INIT, name="up")(x))
        return nn.Dense(self.d_model, kernel_init=INIT, name="down")(h)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(LN(x)), then x + mlp(LN(x))."""

    d_model: int
    heads: int

    @nn.compact
    def __call__(self, x):
        x = x + CausalSelfAttention(self.d_model, self.heads, name="attn")(nn.LayerNorm(name="ln1")(x))
        return x + MLP(self.d_model, name="mlp")(nn.LayerNorm(name="ln2")(x))


class Embeddings(nn.Module):
    vocab: int
    seq: int
    d_model: int

    @nn.compact
    def __call__(self, tokens):
        tok = nn.Embed(self.vocab, self.d_model, embedding_init=INIT, name="token")(tokens)
        pos = self.param("position", INIT, (self.seq, self.d_model))
        return tok + pos[None, : tokens.shape[1]]


class LMHead(nn.Module):
    """Final LayerNorm, output projection (not tied to the token embedding) and next-token loss."""

    vocab: int

    @nn.compact
    def __call__(self, x, targets):
        logits = nn.Dense(self.vocab, kernel_init=INIT, name="proj")(nn.LayerNorm(name="ln_f")(x))
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def stage_blocks(layers: int, stages: int) -> tuple[int, ...]:
    """Blocks per stage, counting the embeddings (before block 0) and the head (after the last
    block) as one block each: 6 layers over 4 stages -> (1, 2, 2, 1)."""
    units = layers + 2
    bounds = [round(units * k / stages) for k in range(stages + 1)]
    return tuple(sum(1 <= u <= layers for u in range(bounds[k], bounds[k + 1])) for k in range(stages))


class GPT(nn.Module):
    """Decoder-only LM. `blocks_per_stage` annotates it for a pipeline (one `wh.replicate(1)` scope per
    stage); `None` leaves it un-annotated (for `auto_parallel`, or plain single-device training)."""

    vocab: int
    seq: int
    d_model: int
    heads: int
    layers: int
    blocks_per_stage: tuple[int, ...] | None = None

    @nn.compact
    def __call__(self, tokens, targets):
        if self.blocks_per_stage is not None:
            assert sum(self.blocks_per_stage) == self.layers, (self.blocks_per_stage, self.layers)
            per_stage = self.blocks_per_stage
        else:
            per_stage = (self.layers,)
        last = len(per_stage) - 1
        block = 0
        for s, count in enumerate(per_stage):
            scope = wh.replicate(1) if self.blocks_per_stage is not None else contextlib.nullcontext()
            with scope:                                          # pipeline stage s
                if s == 0:
                    x = Embeddings(self.vocab, self.seq, self.d_model, name="embed")(tokens)
                for _ in range(count):
                    x = Block(self.d_model, self.heads, name=f"block_{block}")(x)
                    block += 1
                if s == last:
                    return LMHead(self.vocab, name="head")(x, targets)   # the loss, in the last stage


# --------------------------------------------------------------------------------------------
# Synthetic, learnable data
# --------------------------------------------------------------------------------------------
class MarkovTokens:
    """Token streams from a random sparse second-order Markov chain.

    For every context (token two back, previous token) only `branching` next tokens are possible,
    with random (Dirichlet) probabilities. Each sequence starts from a uniformly random pair. The
    best any model can do is the chain's own conditional entropy, returned by `optimal_loss`.
    """

    def __init__(self, vocab: int, branching: int, seed: int):
        rng = np.random.default_rng(seed)
        self.vocab = vocab
        succ = np.argsort(rng.random((vocab, vocab, vocab)), axis=-1)[..., :branching]
        probs = rng.dirichlet(np.ones(branching), size=(vocab, vocab))
        self.table = np.zeros((vocab, vocab, vocab))
        np.put_along_axis(self.table, succ, probs, axis=-1)
        self.cdf = np.cumsum(self.table, axis=-1)
        self.rng = np.random.default_rng(seed + 1)

    def batch(self, size: int, seq: int) -> dict:
        """`seq` input tokens and the `seq` tokens that follow them."""
        toks = np.empty((size, seq + 1), np.int64)
        toks[:, :2] = self.rng.integers(0, self.vocab, (size, 2))
        for t in range(2, seq + 1):
            cdf = self.cdf[toks[:, t - 2], toks[:, t - 1]]
            toks[:, t] = np.minimum((cdf < self.rng.random((size, 1))).sum(-1), self.vocab - 1)
        return {"inputs": toks[:, :-1].astype(np.int32), "targets": toks[:, 1:].astype(np.int32)}

    def optimal_loss(self, batch: dict) -> float:
        """Mean -log p_true(target | context) on `batch`: the loss of the chain itself."""
        x, y = batch["inputs"], batch["targets"]
        p = np.full(y.shape, 1.0 / self.vocab)                  # the first target: uniform given one token
        p[:, 1:] = self.table[x[:, :-1], x[:, 1:], y[:, 1:]]
        return float(-np.log(p).mean())


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------
def build(args):
    """The model (annotated unless --auto), loss_fn and whalex config for `args`."""
    blocks = None if args.auto else stage_blocks(args.layers, args.stages)
    model = GPT(args.vocab, args.seq, args.d_model, args.heads, args.layers, blocks)

    def loss_fn(params, batch):
        return model.apply({"params": params}, batch["inputs"], batch["targets"])

    if args.auto:
        config = wh.Config(num_micro_batch=args.micro_batches, schedule=args.schedule,
                           auto_parallel=True, num_task_graph=args.stages)
    else:
        config = wh.Config(num_micro_batch=args.micro_batches, schedule=args.schedule)
    return model, loss_fn, config


def make_optimizer(args) -> optax.GradientTransformation:
    """Adam with linear warmup and cosine decay (or a constant learning rate with --warmup 0)."""
    if args.warmup <= 0:
        return optax.adam(args.lr)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(args.warmup, args.steps),
                                                  max(args.steps, args.warmup + 1), end_value=args.lr / 10)
    return optax.adam(schedule)


def main(args) -> dict:
    if jax.device_count() < args.devices:
        raise SystemExit(
            f"--devices {args.devices} but JAX sees {jax.device_count()} device(s) ({jax.devices()[0].platform}). "
            "On CPU, leave XLA_FLAGS unset (the script sets --xla_force_host_platform_device_count) or set "
            f"it to at least {args.devices}; on GPUs pass --devices {jax.device_count()} or fewer.")
    cluster = wh.Cluster(devices=jax.devices()[: args.devices]) if jax.device_count() > args.devices else None

    data = MarkovTokens(args.vocab, args.branching, args.seed)
    model, loss_fn, config = build(args)
    example = data.batch(args.batch, args.seq)
    params = jax.jit(model.init)(jax.random.key(args.seed), example["inputs"], example["targets"])["params"]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"GPT: {args.layers} blocks, d_model {args.d_model}, {args.heads} heads, vocab {args.vocab}, "
          f"seq {args.seq}, {n_params:,} parameters; global batch {args.batch} sequences, "
          f"{args.micro_batches} micro-batches, {args.devices} {jax.devices()[0].platform} device(s)")
    if args.auto:
        print(f"annotations: none (auto_parallel=True, num_task_graph={args.stages})")
    else:
        print(f"annotations: {args.stages} x wh.replicate(1), blocks per stage {stage_blocks(args.layers, args.stages)}"
              " (embeddings in the first stage, head and loss in the last)")

    if args.steps == 0:                                        # --check --steps 0: the comparison alone
        return check(args, {}, loss_fn, params, data, config, cluster)
    step = wh.parallelize(loss_fn, make_optimizer(args), config=config, cluster=cluster)
    t0 = time.perf_counter()
    state = step.init(params, example)
    del params
    print(step.plan.summary())

    losses, optimal = [], []
    t_first = t1 = None
    with tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=True) as bar:
        for i in bar:
            batch = example if i == 0 else data.batch(args.batch, args.seq)
            state, metrics = step(state, batch)
            loss = float(metrics["loss"])                       # waits for the step: fine here
            if t_first is None:
                t_first = time.perf_counter() - t0              # planning + compilation + first step
                t1 = time.perf_counter()
            losses.append(loss)
            optimal.append(data.optimal_loss(batch))
            bar.set_postfix(loss=f"{loss:.4f}")
    t_rest = time.perf_counter() - t1

    k = max(1, min(10, len(losses) // 5))
    print(f"plan + compile + first step: {t_first:.1f} s; "
          + (f"then {1000 * t_rest / (len(losses) - 1):.0f} ms/step" if len(losses) > 1 else ""))
    print(f"loss: first {losses[0]:.4f}, mean of first {k} steps {np.mean(losses[:k]):.4f}, "
          f"mean of last {k} steps {np.mean(losses[-k:]):.4f} (uniform guess ln({args.vocab}) = "
          f"{np.log(args.vocab):.4f}; the Markov chain itself = {np.mean(optimal[-k:]):.4f})")
    print(f"final loss: {losses[-1]:.4f}")
    result = {"losses": losses, "state": state, "step": step, "model": model, "loss_fn": loss_fn}
    params = jax.jit(model.init)(jax.random.key(args.seed), example["inputs"], example["targets"])["params"]
    return check(args, result, loss_fn, params, data, config, cluster)


def check(args, result: dict, loss_fn, params, data, config, cluster) -> dict:
    """--check: whalex and one device train from `params` for --check-steps steps; the verdict in `result`."""
    if args.check:
        batches = [data.batch(args.batch, args.seq) for _ in range(args.check_steps)]
        worst = single_device_check.compare(loss_fn, params, batches, args.lr, has_aux=False, perturb=args.perturb,
                                            config=config, cluster=cluster)
        result["max_rel_err"] = worst
        result["check_ok"] = single_device_check.verdict(worst, args.check_tol, args.check_steps)
    return result


if __name__ == "__main__":
    single_device_check.exit_status(main(ARGS))
