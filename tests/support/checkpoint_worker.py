"""Helper for tests/launch/test_launch.py's checkpoint-restart tests: one process of
`python -m whalex.launch -n N --restarts K [--min-processes P] ... checkpoint_worker.py OUT_DIR STEPS KILL_AT [SIG]`.

Trains launch_worker's MLP (Adam) with wh.parallelize over every process's devices and saves a
real checkpoint with `wh.CheckpointManager` after every step (every process calls `save`; the
checkpoint directory OUT_DIR/ckpt is shared, same machine). On start it restores the latest
checkpoint (`manager.restore(step, param_shapes, batch)`, planned for the devices of THIS start,
whatever plan or process count saved it) or starts fresh (`step.init`).

On the first start (WHALEX_RESTART_COUNT=0) the last process sends itself SIG (KILL, or STOP: a hung
worker, which only the launcher's heartbeat timeout detects) right after step KILL_AT's checkpoint is
committed (every process waits for it: `wait_until_finished`), so the restart resumes from step KILL_AT.
Every start is appended to OUT_DIR/starts_{i}.txt ("restart nproc first_step devices pid"); at the end
process 0 writes OUT_DIR/result.npz (losses of this start, param_*, steps).
"""
import os
import signal
import sys

import numpy as np


def main(out: str, steps: int, kill_at: int, sig: str = "KILL"):
    import jax
    import launch_worker

    import whalex as wh  # joins the process group (whalex.launch env)

    i, nproc = jax.process_index(), jax.process_count()
    restart = int(os.environ.get("WHALEX_RESTART_COUNT", "0"))
    params, batch = launch_worker.data()
    step = wh.parallelize(launch_worker.loss_fn, launch_worker.optimizer())
    with wh.CheckpointManager(os.path.join(out, "ckpt"), max_to_keep=2) as manager:
        if manager.latest_step() is None:
            state = step.init(params, batch)
        else:
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
            state = manager.restore(step, shapes, batch)
        at = first = int(state.step.addressable_data(0))
        with open(os.path.join(out, f"starts_{i}.txt"), "a") as f:
            f.write(f"{restart} {nproc} {first} {jax.device_count()} {os.getpid()}\n")
        losses = []
        while at < steps:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
            at += 1
            manager.save(step, state)                      # every process; asynchronous
            if restart == 0 and at == kill_at:
                manager.wait_until_finished()              # step KILL_AT is committed on every process
                if i == nproc - 1:
                    print(f"process {i}: sending myself SIG{sig} after step {at}", flush=True)
                    os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))
        manager.wait_until_finished()
        assert manager.latest_step() == steps
    final = step.params(state)                             # every process (it may run a computation)
    if i == 0:
        leaves = {f"param_{k}": np.asarray(v.addressable_data(0)) for k, v in final.items()}
        np.savez(os.path.join(out, "result.npz"), losses=np.array(losses), first=first, **leaves)
    print(f"process {i} of {nproc} ({jax.device_count()} devices): steps {first} -> {at}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
