"""A 1.1B-parameter GPT (12 blocks of d=2560, vocabulary 32768, 1024 tokens) planned 3D on 64 H100s
in 8 hosts (data 4 x stage 4 x model 4, 8 micro-batches): XLA:GPU compiles it on this machine and its
per-device memory and collective bytes are the plan's predictions; and bench/gpu_compile.py's small
run, which writes its results file."""
import json
import time

import jax
import optax

import whalex as wh
from support.gpu_bench import gpu_compile


def test_a_1b_gpt_3d_on_64_gpus_compiles_as_predicted():
    cluster = wh.Cluster.gpu_topology(kinds=["H100-80GB"] * 64)
    annotations, config = gpu_compile.CASES["3d_4x4x4"]
    loss_fn, params, batch = gpu_compile.problem(gpu_compile.SIZES["1b"], 64, annotations)
    assert sum(x.size for x in jax.tree.leaves(params)) > 1e9
    plan = wh.plan(loss_fn, params, batch, optax.adamw(1e-4), config=wh.Config(**config), cluster=cluster)
    assert plan.layout.axis_sizes == (4, 4, 4)
    t0 = time.perf_counter()
    compiled = plan.step_memory()
    seconds = time.perf_counter() - t0
    predicted = plan.predicted_memory()
    assert abs(predicted.total / compiled.total - 1) <= 0.10, (predicted, compiled)
    coll = plan.compiled_collectives()
    # The compiled figure counts each conditional's heaviest branch: here the busiest stage's forward and
    # the last stage's backward, which sums the loss head's gradients over `model` every micro-batch (its
    # rows are split there). So it lies between the busiest stage's prediction and that plus the head's.
    head = sum(c.bytes for c in plan.comms if c.reason.startswith("loss head"))
    assert head > 0
    assert 0.95 * plan.predicted_comm_bytes <= coll.ring_bytes <= 1.05 * (plan.predicted_comm_bytes + head), \
        (plan.predicted_comm_bytes, head, coll)
    assert compiled.total < cluster.specs[0].memory_bytes
    print(f"1.1B GPT 3D on 64 x H100: compiled in {seconds:.0f} s")


def test_the_bench_small_run_writes_its_table(tmp_path):
    out = tmp_path / "gpu_compile_small.json"
    assert gpu_compile.main(["--small", "--cases", "plain", "split", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["plain", "plain_remat_block", "split"]
    split = rows[-1]
    assert split["program"] == "Program" and split["comm_ratio"] is not None and split["collectives"] > 0
