#!/usr/bin/env python
"""An M6-style Mixture-of-Experts transformer trained with Whale's Example 5 on 8 devices.

Whale section 5.3.2 trains M6-MoE at 100B-10T parameters with four lines of annotation:

    wh.init()
    wh.set_default_strategy(wh.replicate(total_gpus))     # everything data parallel by default
    combined_weights, dispatch_inputs = gating_dispatch()
    with wh.split(total_gpus):                            # the experts: expert parallelism
        outputs = MoE(combined_weights, dispatch_inputs)

Here the same annotations are written in a Flax model: the loss sets the default strategy to
`wh.replicate(devices)`, and every MoE layer runs its experts under `wh.split(devices)`
(`wh.moe.MoE(..., expert_parallel=devices)`). whalex keeps gating, dispatch and combine data
parallel with the rest of the model, shards the experts over the devices, and exchanges the
dispatched tokens with all-to-all (one `shard_map`), so each device holds `experts / devices`
experts and their Adam moments, and no expert gradient is ever all-reduced.

The model: token + position embeddings, pre-LayerNorm blocks of causal self-attention and a
feed-forward that is an MoE layer in every `--moe-every`-th block (a dense GELU MLP otherwise),
final LayerNorm and output projection. The loss is next-token cross-entropy plus
`--aux-weight` x the load-balancing loss and `--z-weight` x the router z-loss; the progress bar and
the summary report both. The data are the learnable second-order Markov chain of
`pipeline_transformer.py`: the loss falls from ln(vocab) toward the chain's own entropy.

    python examples/moe_transformer.py                     # ~1 min on 2 CPU cores
    python examples/moe_transformer.py --top-k 1 --capacity 1.0
    python examples/moe_transformer.py --check             # also trains single-device, compares, exits 1 if not equal

On CPU the script simulates `--devices` devices unless XLA_FLAGS already sets a device count.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--moe-every", type=int, default=2, help="every k-th block has an MoE feed-forward")
    p.add_argument("--d-model", type=int, default=64, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--experts", type=int, default=16, help="experts per MoE layer (a multiple of --devices)")
    p.add_argument("--expert-hidden", type=int, default=128, help="each expert's hidden width")
    p.add_argument("--top-k", type=int, default=2, choices=(1, 2), help="experts per token (1 Switch, 2 GShard)")
    p.add_argument("--capacity", type=float, default=1.25, help="capacity factor (<= 0: dropless)")
    p.add_argument("--aux-weight", type=float, default=1e-2, help="load-balancing loss weight")
    p.add_argument("--z-weight", type=float, default=1e-3, help="router z-loss weight")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (one routing group)")
    p.add_argument("--vocab", type=int, default=32, help="vocabulary size")
    p.add_argument("--batch", type=int, default=32, help="global batch (sequences), a multiple of --devices")
    p.add_argument("--steps", type=int, default=200, help="training steps")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--devices", type=int, default=8, help="devices; simulated on CPU")
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
    if args.experts % args.devices:
        p.error(f"--experts {args.experts} must be a multiple of --devices {args.devices} (experts per device)")
    if args.batch % args.devices:
        p.error(f"--batch {args.batch} must be a multiple of --devices {args.devices}")
    if args.d_model % args.heads:
        p.error(f"--heads {args.heads} must divide --d-model {args.d_model}")
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and "jax" not in sys.modules:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={ARGS.devices}".strip()

import flax.linen as nn  # noqa: E402  (after XLA_FLAGS)
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import whalex as wh  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import single_device_check  # noqa: E402
from pipeline_transformer import INIT, MLP, CausalSelfAttention, Embeddings, MarkovTokens  # noqa: E402


class MoEBlock(nn.Module):
    """Pre-LayerNorm block whose feed-forward is a Mixture of Experts (or a dense MLP)."""

    d_model: int
    heads: int
    moe: wh.moe.MoE | None

    @nn.compact
    def __call__(self, x):
        x = x + CausalSelfAttention(self.d_model, self.heads, name="attn")(nn.LayerNorm(name="ln1")(x))
        ffn = self.moe if self.moe is not None else MLP(self.d_model, name="mlp")
        return x + ffn(nn.LayerNorm(name="ln2")(x))


class MoETransformer(nn.Module):
    """Decoder-only LM with MoE feed-forwards; `expert_parallel=n` is Whale's Example 5."""

    vocab: int
    seq: int
    d_model: int
    heads: int
    layers: int
    experts: int
    expert_hidden: int
    top_k: int = 2
    capacity_factor: float | None = 1.25
    moe_every: int = 2
    expert_parallel: int | None = None

    @nn.compact
    def __call__(self, tokens):
        if self.expert_parallel:
            wh.set_default_strategy(wh.replicate(self.expert_parallel))     # Example 5, line 3
        x = Embeddings(self.vocab, self.seq, self.d_model, name="embed")(tokens)
        for i in range(self.layers):
            moe = None
            if (i + 1) % self.moe_every == 0:
                moe = wh.moe.MoE(self.experts, self.expert_hidden, k=self.top_k,
                                 capacity_factor=self.capacity_factor, router_init=INIT,
                                 expert_parallel=self.expert_parallel, name=f"moe_{i}")   # Example 5, line 5
            x = MoEBlock(self.d_model, self.heads, moe, name=f"block_{i}")(x)
        return nn.Dense(self.vocab, kernel_init=INIT, name="proj")(nn.LayerNorm(name="ln_f")(x))


def make_loss(model: MoETransformer, aux_weight: float, z_weight: float):
    """loss_fn(params, batch) -> (loss, {"ce", "aux_loss", "z_loss"}) for `wh.parallelize(has_aux=True)`."""

    def loss_fn(params, batch):
        logits, updates = model.apply({"params": params}, batch["inputs"], mutable=[wh.moe.layer.COLLECTION])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
        moe = wh.moe.moe_losses(updates)
        loss = ce + aux_weight * moe["aux_loss"] + z_weight * moe["z_loss"]
        return loss, {"ce": ce, "aux_loss": moe["aux_loss"], "z_loss": moe["z_loss"]}

    return loss_fn


def main(args) -> dict:
    if jax.device_count() < args.devices:
        raise SystemExit(f"--devices {args.devices} but JAX sees {jax.device_count()} device(s); on CPU leave "
                         "XLA_FLAGS unset (the script simulates the devices), on GPUs pass fewer --devices.")
    cluster = wh.Cluster(devices=jax.devices()[: args.devices]) if jax.device_count() > args.devices else None
    capacity = args.capacity if args.capacity > 0 else None
    model = MoETransformer(args.vocab, args.seq, args.d_model, args.heads, args.layers, args.experts,
                           args.expert_hidden, args.top_k, capacity, args.moe_every, expert_parallel=args.devices)
    loss_fn = make_loss(model, args.aux_weight, args.z_weight)
    data = MarkovTokens(args.vocab, args.branching, args.seed)
    example = data.batch(args.batch, args.seq)
    params = jax.jit(model.init)(jax.random.key(args.seed), example["inputs"])["params"]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    n_expert = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params)
                   if any(getattr(k, "key", "").startswith("moe_") for k in path) and x.ndim and
                   x.shape[0] == args.experts)
    print(f"MoE transformer: {args.layers} blocks ({args.layers // args.moe_every} MoE), d_model {args.d_model}, "
          f"{args.experts} experts x {args.expert_hidden} hidden, top-{args.top_k}, capacity factor "
          f"{capacity or 'dropless'}; {n_params:,} parameters ({n_expert:,} in experts); "
          f"global batch {args.batch} x {args.seq} tokens on {args.devices} {jax.devices()[0].platform} devices")
    print(f"annotations (Example 5): set_default_strategy(replicate({args.devices})), experts under "
          f"split({args.devices}): {args.experts // args.devices} expert(s) per device")

    if args.steps == 0:                                        # --check --steps 0: the comparison alone
        return check(args, {}, loss_fn, params, data, cluster)
    optimizer = optax.adam(args.lr)
    step = wh.parallelize(loss_fn, optimizer, has_aux=True, cluster=cluster)
    t0 = time.perf_counter()
    state = step.init(params, example)
    print(step.plan.summary())

    history, t_first, t1 = [], None, None
    with tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=True) as bar:
        for i in bar:
            batch = example if i == 0 else data.batch(args.batch, args.seq)
            state, metrics = step(state, batch)
            m = {k: float(v) for k, v in {"loss": metrics["loss"], **metrics["aux"]}.items()}
            if t_first is None:
                t_first, t1 = time.perf_counter() - t0, time.perf_counter()
            history.append(m)
            bar.set_postfix(loss=f"{m['loss']:.3f}", ce=f"{m['ce']:.3f}", aux=f"{m['aux_loss']:.3f}")
    t_rest = time.perf_counter() - t1
    k = max(1, min(10, len(history) // 5))
    mean = lambda key, part: float(np.mean([h[key] for h in part]))   # noqa: E731
    print(f"plan + compile + first step: {t_first:.1f} s; "
          + (f"then {1000 * t_rest / (len(history) - 1):.0f} ms/step" if len(history) > 1 else ""))
    print(f"cross-entropy: first {history[0]['ce']:.4f}, last {k} steps {mean('ce', history[-k:]):.4f} "
          f"(uniform ln({args.vocab}) = {np.log(args.vocab):.4f}; the Markov chain = "
          f"{data.optimal_loss(example):.4f})")
    layers = max(1, args.layers // args.moe_every)
    print(f"load-balancing loss per MoE layer: first {history[0]['aux_loss'] / layers:.4f}, last {k} steps "
          f"{mean('aux_loss', history[-k:]) / layers:.4f} (1.0 = perfectly balanced); router z-loss per layer, "
          f"last {k} steps {mean('z_loss', history[-k:]) / layers:.4f}")
    result = {"history": history, "state": state, "step": step}
    return check(args, result, loss_fn, params, data, cluster)


def check(args, result: dict, loss_fn, params, data, cluster) -> dict:
    """--check: whalex and one device train from `params` for --check-steps steps; the verdict in `result`."""
    if args.check:
        batches = [data.batch(args.batch, args.seq) for _ in range(args.check_steps)]
        worst = single_device_check.compare(loss_fn, params, batches, args.lr, has_aux=True, perturb=args.perturb,
                                            cluster=cluster)
        result["max_rel_err"] = worst
        result["check_ok"] = single_device_check.verdict(worst, args.check_tol, args.check_steps)
    return result


if __name__ == "__main__":
    single_device_check.exit_status(main(ARGS))
