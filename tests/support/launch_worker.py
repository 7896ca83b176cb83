"""Helper for tests/launch/test_launch.py: one process of `python -m whalex.launch -n 2 launch_worker.py OUT_DIR`
(or of a scheduler-started group with WHALEX_DISTRIBUTED=auto).

Trains the same small data-parallel MLP twice over every process's devices: with the even plan
(Cluster.detect()) and with a balanced plan whose measured speeds favour process 0's devices.
Each process reads only the rows `plan.local_rows(process_index)` names (the other rows of the
global batch it passes are NaN, so a row read by the wrong process would poison the loss), and
writes its losses and final parameters to OUT_DIR/{plan}_{process}.npz.

The model, data and optimizer are importable (no side effects on import) so the test can train
the single-device reference on the same global batch.
"""
import sys

B, D_IN, D_HID, D_OUT, STEPS = 48, 12, 32, 4, 5


def data():
    import numpy as np
    rng = np.random.default_rng(0)
    params = {"w1": rng.standard_normal((D_IN, D_HID)).astype(np.float32) / D_IN ** 0.5,
              "b1": np.zeros(D_HID, np.float32),
              "w2": rng.standard_normal((D_HID, D_OUT)).astype(np.float32) / D_HID ** 0.5,
              "b2": np.zeros(D_OUT, np.float32)}
    batch = {"x": rng.standard_normal((B, D_IN)).astype(np.float32),
             "y": rng.standard_normal((B, D_OUT)).astype(np.float32)}
    return params, batch


def loss_fn(p, b):
    import jax.numpy as jnp

    import whalex as wh
    with wh.replicate():                                   # every device of every process
        h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - b["y"]) ** 2)


def optimizer():
    import optax
    return optax.adam(1e-2, eps=1e-4)                      # as conftest.adam()


def main(out_dir: str):
    import os

    import jax
    import numpy as np

    import whalex as wh  # joins the process group (whalex.launch env)

    pid, nproc = jax.process_index(), jax.process_count()
    if "WHALEX_PROCESS_ID" in os.environ:                  # started by whalex.launch (else: a scheduler)
        assert nproc == int(os.environ["WHALEX_NUM_PROCESSES"]) and pid == int(os.environ["WHALEX_PROCESS_ID"])
    if os.environ.get("WHALEX_CPU_CORES"):                 # pinned by the launcher
        assert os.sched_getaffinity(0) == {int(c) for c in os.environ["WHALEX_CPU_CORES"].split(",")}
    cluster = wh.Cluster.detect()
    assert cluster.size == jax.device_count() > jax.local_device_count()
    per = jax.local_device_count()
    speeds = [2.0 if d.process_index == 0 else 1.0 for d in cluster.devices]
    params, batch = data()
    for name, cl in (("even", cluster), ("balanced", cluster.with_speeds(speeds))):
        step = wh.parallelize(loss_fn, optimizer(), cluster=cl)
        state = step.init(params, batch)
        plan = step.plan
        mine = plan.local_rows(pid)
        local = {k: np.full_like(v, np.nan) for k, v in batch.items()}     # what a data loader would read
        for a, b in mine:
            for k in batch:
                local[k][a:b] = batch[k][a:b]
        losses = []
        for _ in range(STEPS):
            state, metrics = step(state, local)
            losses.append(float(metrics["loss"]))
        leaves = {k: np.asarray(v.addressable_data(0)) for k, v in state.params.items()}
        owners = [d.process_index for d in plan.cluster.devices]
        np.savez(os.path.join(out_dir, f"{name}_{pid}.npz"), losses=np.array(losses),
                 batch_sizes=np.array(plan.batch_sizes), owners=np.array(owners),
                 local_rows=np.array(mine, dtype=np.int64).reshape(-1, 2),
                 applied=np.array(bool(plan.balance is not None and plan.balance.applied)),
                 **{f"param_{k}": v for k, v in leaves.items()})
        print(f"{name}: {per} local device(s), batch_sizes={plan.batch_sizes}, local_rows={mine}, "
              f"loss {losses[0]:.6f} -> {losses[-1]:.6f}")


if __name__ == "__main__":
    main(sys.argv[1])
