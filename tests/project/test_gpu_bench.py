"""bench/gpu.py --small: the GPU bench's every case runs on CPU (a tiny model), so it cannot rot
between the sessions that have a GPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_bench_small_runs_every_case(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}    # one CPU device, as on one GPU
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"             # compiled as the suite compiles (conftest)
    out = tmp_path / "gpu.json"
    cases = ["pair_bf16", "plain_remat_block", "whalex_remat_full", "whalex_offload_opt_state"]
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--small", "--out", str(out),
                        "--cases", *cases], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    record = json.loads(out.read_text())
    assert record["jax"] == __import__("jax").__version__ and record["platform"] == "cpu"
    assert set(record["cases"]) == set(cases) and all(r["ok"] for r in record["cases"].values())
    pair = record["cases"]["pair_bf16"]
    assert pair["first_loss"]["whalex"] == pair["first_loss"]["plain"]       # the same model, maths and batch
    assert pair["max_rel_param_diff"] < 1e-2                                # bf16 compute on both sides
    assert pair["plan_flops"] > 0 and pair["predicted_step_s"] > 0
    assert 0.9 < pair["plan_flops"] / pair["flops_per_step"] < 1.1          # the jaxpr count vs 6ND + attention
    assert "ratio" in p.stdout and "pair_bf16" in p.stdout
    remat, off = record["cases"]["whalex_remat_full"], record["cases"]["whalex_offload_opt_state"]
    assert remat["predicted_flops_ratio"] > 1.0 and off["offloaded_bytes"] > 0
    assert record["checks"] == {}          # CPU devices report no peak bytes: the GPU bars are not judged
