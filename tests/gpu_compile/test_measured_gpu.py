"""The deviceless compile against a real GPU: bench/gpu.py's GPT (stock Flax, adamw, bf16 compute)
planned by whalex on one H200 without a GPU compiles to the per-device bytes XLA compiled on the
GPU, and those are the peak the GPU measured (`python bench/gpu.py --deviceless` on a lent H200
wrote both into its results file, which this test reads)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import optax
import pytest

import whalex as wh
from support.gpu_bench import gpu_compile

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "gpu_NVIDIA-H200_jax0.11.2.json"
CONFIGS = {"whalex_remat_full": {"remat": "full"}, "whalex_offload_opt_state": {"offload": "opt_state"}}


@pytest.fixture(scope="module")
def measured():
    record = json.loads(RESULTS.read_text())
    assert record["device"] == "NVIDIA H200" and record["size"] == "full"
    return record["cases"]


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_deviceless_bytes_are_the_gpus_compile_and_its_measured_peak(case, measured):
    loss_fn, params, batch = gpu_compile.problem(gpu_compile.SIZES["full"], 1, {})
    plan = wh.plan(loss_fn, params, batch, optax.adamw(1e-4), cluster=wh.Cluster.gpu_topology(kinds=["H200-141GB"]),
                   config=wh.Config(amp="bf16", **CONFIGS[case]))
    got, gpu = plan.step_memory().total, measured[case]
    assert abs(got / gpu["compiled_bytes"] - 1) <= 0.01, (got, gpu["compiled_bytes"])
    assert abs(got / gpu["peak_bytes"] - 1) <= 0.01, (got, gpu["peak_bytes"])


def test_the_gpu_bench_compiles_its_cases_deviceless_beside_them(tmp_path):
    """`bench/gpu.py --small --deviceless` on this machine: the cases run on CPU, a process that sees no
    GPU compiles each for the spec table's H200 (no CUDA device to record here: its case says why)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
    out = tmp_path / "gpu.json"
    cases = ["plain_remat_block", "whalex_remat_full"]
    cmd = [sys.executable, str(RESULTS.parents[1] / "gpu.py"), "--small", "--deviceless", "--out", str(out), "--cases"]
    p = subprocess.run(cmd + cases, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    record = json.loads(out.read_text())
    assert record["deviceless"]["kind"] == "H200-141GB" and not record["deviceless"]["recorded_target"]
    assert all(record["cases"][c]["deviceless_bytes"] > 0 and record["cases"][c]["compiled_bytes"] > 0 for c in cases)
    assert record["target"]["ok"] is False and "error" in record["target"]
    assert any("deviceless (spec table's target) == on-device compile" in k for k in record["checks"])
