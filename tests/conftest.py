"""Tests run on 8 simulated CPU devices; the flag must be set before JAX is imported."""
import importlib.metadata
import os

# --xla_backend_optimization_level=0: LLVM without its optimisation passes. The suite's models are tiny, so
# compiling is most of its time, and the suite takes about 30% less (docs/benchmarks.md). Results differ from
# the default level in the last bits (LLVM fuses multiply-adds at -O2), but whalex and the single-device
# reference it is compared with are compiled alike, under the same tolerances.
_flags = " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
# jaxlib before 0.11 still has XLA:CPU's older element-wise emitters beside its fusion emitters: with
# them the suite's programs compile faster (docs/benchmarks.md), to the same tolerances. Later jaxlibs
# have only the fusion emitters and refuse the flag.
if tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11):
    _flags += " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + _flags).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import importlib.util  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

# one compilation cache for the whole run, shared by pytest-xdist's workers (the same programs
# compile once, not once per worker); a fresh directory per run
_run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
_d = (os.path.join(tempfile.gettempdir(), f"whalex-xla-cache-{_run}") if _run
      else tempfile.mkdtemp(prefix="whalex-xla-cache-"))
os.makedirs(_d, exist_ok=True)
jax.config.update("jax_compilation_cache_dir", _d)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA plugin (the [cuda] extra) is installed: XLA's GPU compiler is then here."""
    for name in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


# tests/gpu_compile compiles plans with XLA's GPU compiler (no GPU needed) and needs JAX's CUDA plugin
# (the [cuda] extra). CI runs that folder in its own environment with WHALEX_GPU_COMPILE=1, where a
# missing plugin fails the run by name; a CPU-only environment does not collect it.
if os.environ.get("WHALEX_GPU_COMPILE") == "1" and not cuda_plugin_installed():
    raise pytest.UsageError("WHALEX_GPU_COMPILE=1 but JAX's CUDA plugin is not installed: pip install -e "
                            "'.[cuda,test]' (no GPU needed); the GPU-compile suite must not be skipped.")
collect_ignore_glob = [] if cuda_plugin_installed() else ["gpu_compile/*"]


def pytest_collection_modifyitems(items):
    for item in items:
        if f"{os.sep}gpu_compile{os.sep}" in str(item.fspath):
            item.add_marker(pytest.mark.gpu_compile)


HETERO = ["V100-32GB"] * 4 + ["T4-16GB"] * 4   # a declared heterogeneous cluster over the 8 devices


def rel_err(a, b) -> float:
    """max |a-b| / max |b| (docs/architecture.md#testing-and-measuring): robust to Adam's noise on
    near-zero gradients."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.max(np.abs(b))
    return float(np.max(np.abs(a - b)) / (scale if scale > 0 else 1.0))


def adam(lr=1e-2):
    """Adam with eps well above float32 gradient noise.

    With the default eps=1e-8, an element whose true gradient is ~1e-9 (a cancelling sum) gets an
    update of size ~lr from reassociation noise alone (measured: 4.6e-5 on one head weight after 5
    steps of pure DP, gradient -3.8e-9 there). eps=1e-4 keeps Adam's per-element scaling for real
    gradients while noise stays noise.
    """
    return optax.adam(lr, eps=1e-4)


def reference_train(loss_fn, params, batch, optimizer, steps, has_aux=False):
    """Single-device training of the same model on the same batch: (losses, params)."""
    dev = jax.devices()[0]
    params = jax.device_put(params, dev)
    batch = jax.device_put(batch, dev)
    opt_state = optimizer.init(params)
    step = reference_step(loss_fn, optimizer, has_aux)
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return losses, params


def reference_step(loss_fn, optimizer, has_aux=False):
    """One single-device training step, jitted: (params, opt_state, batch) -> (params, opt_state, loss)."""
    @jax.jit
    def step(p, o, b):
        (loss, _), g = jax.value_and_grad(lambda p, b: _with_aux(loss_fn, has_aux)(p, b), has_aux=True)(p, b)
        u, o = optimizer.update(g, o, p)
        return optax.apply_updates(p, u), o, loss
    return step


def assert_each_step_matches(loss_fn, params, batch, steps, optimizer, tol=1e-5, until=None, **kwargs):
    """Train with whalex for `steps` steps (or until two steps after `until(step)` holds); each step's
    loss and parameters agree within `tol` with one single-device step from the same parameters and
    optimizer state (the optimizer state must be the caller's pytree: a plan without its own parameter
    layout, or a stateless optimizer). Over a run of a thousand steps in which the split moves (each
    split sums the rows in its own order), float32 rounding compounds along the trajectory; step by step,
    what is compared is what each step computes."""
    import whalex as wh
    step = wh.parallelize(loss_fn, optimizer, **kwargs)
    state = step.init(params, batch)
    one = reference_step(loss_fn, optimizer)
    first, last = None, steps - 1
    for k in range(steps):
        p0, o0 = jax.device_get((step.params(state), state.opt_state))
        ref_params, _, ref_loss = one(p0, o0, batch)
        state, metrics = step(state, batch)
        loss, ref_loss = float(metrics["loss"]), float(ref_loss)
        first = abs(ref_loss) if first is None else first
        # relative, or within rounding of the first loss's size (a loss trained near zero is a difference
        # of terms that size: its last digits are theirs)
        assert abs(loss - ref_loss) <= tol * abs(ref_loss) + 1e-6 * first, (k, loss, ref_loss)
        worst = max(jax.tree.leaves(jax.tree.map(rel_err, step.params(state), ref_params)))
        assert worst < tol, f"step {k}: parameters differ from one single-device step: {worst}"
        if until is not None and until(step):
            last = min(k + 2, last)
        if k >= last:
            break
    moved = max(jax.tree.leaves(jax.tree.map(rel_err, step.params(state), params)))
    assert moved > 1e-3                                   # training moved the parameters
    return step, state


def _with_aux(loss_fn, has_aux):
    if has_aux:
        return loss_fn
    return lambda p, b: (loss_fn(p, b), None)


def whalex_train(loss_fn, params, batch, optimizer, steps, has_aux=False, **kwargs):
    import whalex as wh
    step = wh.parallelize(loss_fn, optimizer, has_aux=has_aux, **kwargs)
    state = step.init(params, batch)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, state, step


def assert_matches(loss_fn, params, batch, steps=5, optimizer=None, tol=1e-5, has_aux=False, param_tol=None,
                   **kwargs):
    """Train with whalex and on one device; losses agree within `tol` and every parameter within
    `param_tol` (default `tol`; the issues' bound for parameters is 1e-4)."""
    optimizer = optimizer or adam()
    ref_losses, ref_params = reference_train(loss_fn, params, batch, optimizer, steps, has_aux)
    losses, state, step = whalex_train(loss_fn, params, batch, optimizer, steps, has_aux, **kwargs)
    np.testing.assert_allclose(losses, ref_losses, rtol=tol, atol=0)
    errs = jax.tree.map(rel_err, step.params(state), ref_params)
    worst = max(jax.tree.leaves(errs))
    assert worst < (param_tol or tol), f"parameters differ from single-device training: {errs}"
    # Training really moved the parameters (so the comparison is not vacuous).
    moved = max(jax.tree.leaves(jax.tree.map(rel_err, ref_params, params)))
    assert moved > 1e-3
    return step, state


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    assert len(jax.devices()) == 8, "tests need 8 simulated CPU devices (XLA_FLAGS set in conftest.py)"
