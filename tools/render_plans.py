#!/usr/bin/env python
"""Look at the notebook view as a user would: four plans rendered in headless Chromium.

Builds a hybrid (Whale's Example 2), a pipeline (4 stages x 2 replicas, 1F1B), a heterogeneous
(4 V100 + 4 T4 declared over the same model as the hybrid) and an MoE plan (experts over 8
devices) on 8 simulated CPU devices, writes each plan's `_repr_html_()` into a page, and takes a
screenshot of each page in light and in dark colour scheme:

    python tools/render_plans.py                     # build/plan_views/{name}.html, {name}-light.png, {name}-dark.png
    python tools/render_plans.py --out /tmp/views --size 1200,2600 --open   # --open: unfold every section

Chromium is Debian's (`apt-get install -y chromium`, /usr/bin/chromium); `--chromium` names
another binary, `--no-screenshots` only writes the HTML. The plan builders are reused by
tests/view/test_plan_view.py.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__" and "jax" not in sys.modules:     # 8 simulated CPU devices, set before jax
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import whalex as wh  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HETERO = ["V100-32GB"] * 4 + ["T4-16GB"] * 4
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--mute-audio"]


# -- the four plans ------------------------------------------------------------------------------
class Backbone(nn.Module):
    @nn.compact
    def __call__(self, x):
        with wh.replicate(8):
            return nn.relu(nn.Dense(64)(nn.relu(nn.Dense(64)(x))))


@wh.split(8)
class Head(nn.Module):
    @nn.compact
    def __call__(self, h, labels):
        logits = nn.Dense(2048)(h)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class Hybrid(nn.Module):
    @nn.compact
    def __call__(self, x, y):
        return Head()(Backbone()(x), y)


def hybrid_problem():
    model = Hybrid()
    kx, ky, kp = jax.random.split(jax.random.key(0), 3)
    batch = {"x": jax.random.normal(kx, (64, 32)), "y": jax.random.randint(ky, (64,), 0, 2048)}
    params = jax.jit(model.init)(kp, batch["x"], batch["y"])["params"]   # jit: eager init compiles op by op
    return (lambda p, b: model.apply({"params": p}, b["x"], b["y"])), params, batch


def pipeline_loss(p, b):
    h = b["x"]
    for i in range(4):                          # 4 stages: consecutive replicate(1) scopes
        with wh.replicate(1):
            h = jnp.tanh(h @ p[f"w{i}"] + p[f"b{i}"])
            if i == 3:
                return jnp.mean((h - b["y"]) ** 2)


def pipeline_problem():
    ks = jax.random.split(jax.random.key(1), 10)
    params = {**{f"w{i}": jax.random.normal(ks[i], (32, 32)) / 6 for i in range(4)},
              **{f"b{i}": 0.1 * jax.random.normal(ks[4 + i], (32,)) for i in range(4)}}
    batch = {"x": jax.random.normal(ks[8], (64, 32)), "y": jax.random.normal(ks[9], (64, 32))}
    return pipeline_loss, params, batch


class MoEModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.tanh(nn.Dense(16)(x))
        h = h + wh.moe.MoE(num_experts=8, hidden=32, k=2, capacity_factor=1.25, expert_parallel=8)(h)
        return nn.Dense(4)(h)


def moe_problem():
    model = MoEModel()
    kx, ky, kp = jax.random.split(jax.random.key(2), 3)
    batch = {"x": jax.random.normal(kx, (16, 8, 12)), "y": jax.random.normal(ky, (16, 8, 4))}
    params = jax.jit(model.init)(kp, batch["x"])["params"]

    def loss_fn(p, b):
        out, updates = model.apply({"params": p}, b["x"], mutable=[wh.moe.layer.COLLECTION])
        return jnp.mean((out - b["y"]) ** 2) + 0.01 * wh.moe.moe_losses(updates)["aux_loss"]

    return loss_fn, params, batch


def build_plans() -> dict:
    """The four plans, by name: hybrid, pipeline, heterogeneous, moe."""
    adam = optax.adam(1e-3)
    hybrid = hybrid_problem()
    pipe = pipeline_problem()
    moe = moe_problem()
    return {
        "hybrid": wh.plan(*hybrid, optimizer=adam),
        "pipeline": wh.plan(*pipe, optimizer=adam, config=wh.Config(num_micro_batch=4)),
        "heterogeneous": wh.plan(*hybrid, optimizer=adam, cluster=wh.Cluster(kinds=HETERO)),
        "moe": wh.plan(*moe, optimizer=adam),
    }


# -- pages and screenshots -----------------------------------------------------------------------
def page(fragment: str, title: str, unfold: bool = False) -> str:
    """A whole HTML document around a plan's HTML fragment, like a notebook's output area."""
    if unfold:
        fragment = fragment.replace("<details ", "<details open ").replace("<details>", "<details open>")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta name="color-scheme" content="light dark"><title>{title}</title>
<style>
body {{ margin: 16px; background: #ffffff; color: #1f2328; font-family: system-ui, sans-serif; }}
@media (prefers-color-scheme: dark) {{ body {{ background: #0d1117; color: #e6edf3; }} }}
</style></head>
<body>
<p style="font-family: monospace; font-size: 12px; opacity: .7">In [1]: {title}</p>
{fragment}
</body></html>
"""


def screenshot(chromium: str, html_path: Path, png_path: Path, size: str, dark: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="whalex-chromium-") as profile:
        cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size}",
               f"--screenshot={png_path}"]
        if dark:
            cmd += ["--force-dark-mode", "--blink-settings=preferredColorScheme=0"]
        else:
            cmd += ["--blink-settings=preferredColorScheme=1"]
        out = subprocess.run(cmd + [html_path.as_uri()], capture_output=True, text=True, timeout=120)
    if out.returncode != 0 or not png_path.exists():
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-2000:]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "build" / "plan_views", help="output folder (git-ignored)")
    p.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser") or
                   "/usr/bin/chromium", help="the Chromium binary")
    p.add_argument("--size", default="1200,2000", help="window size WIDTH,HEIGHT of each screenshot")
    p.add_argument("--open", action="store_true", help="unfold every section before the screenshot")
    p.add_argument("--no-screenshots", action="store_true", help="write the HTML pages only")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.no_screenshots and not Path(args.chromium).exists():
        sys.exit(f"no Chromium at {args.chromium}: install Debian's (apt-get install -y chromium), pass "
                 "--chromium PATH, or --no-screenshots for the HTML only.")
    for name, plan in build_plans().items():
        html_path = args.out / f"{name}.html"
        html_path.write_text(page(plan._repr_html_(), f"{name} plan", args.open))
        print(f"wrote {html_path}")
        if args.no_screenshots:
            continue
        for scheme in ("light", "dark"):
            png_path = args.out / f"{name}-{scheme}.png"
            screenshot(args.chromium, html_path, png_path, args.size, dark=scheme == "dark")
            print(f"wrote {png_path} ({png_path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
