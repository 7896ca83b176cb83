"""Helper for tests/test_launch.py's restart tests: one process of
`python -m whalex.launch -n N --restarts K ... restart_worker.py OUT_DIR STEPS [--whalex]`.

Both modes checkpoint after every step and resume from the latest checkpoint on start (what a
real script does with its checkpoint manager), so a restarted run ends where an uninterrupted one
does. Every start is appended to OUT_DIR/starts_{i}.txt ("restart nproc first_step pid") and the
last finished step is in OUT_DIR/progress_{i} ("restart step pid"), for the test to time its kills.

Default (mechanics, no JAX: starts in milliseconds): process i evolves its own numpy array for
STEPS steps of STEP_SECONDS each, checkpoints it to OUT_DIR/ckpt_{i}.npz, heartbeats by touching
$WHALEX_HEARTBEAT_FILE itself (the file protocol whalex.distributed.heartbeat() implements; this
mode does not import whalex, hence JAX), and writes OUT_DIR/result_{i}.npy at the end.
`FAIL_FIRST_START=i` in the environment: process i exits 5 at once on the first start
(WHALEX_RESTART_COUNT=0).

`--whalex`: the processes join one jax.distributed group (import whalex) and train launch_worker's
MLP data-parallel with SGD through wh.parallelize; Step.__call__ heartbeats by itself. Process 0
checkpoints the (replicated) parameters and the losses so far to OUT_DIR/ckpt.npz; every process
resumes from it. At the end process 0 writes OUT_DIR/result.npz (losses, param_*).
"""
import os
import sys
import time

import numpy as np

STEP_SECONDS = 0.05
LR = 0.1


def save_atomic(path, **arrays):
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)                                  # a kill never leaves half a checkpoint


def note_start(out, i, nproc, step):
    restart = int(os.environ.get("WHALEX_RESTART_COUNT", "0"))
    with open(os.path.join(out, f"starts_{i}.txt"), "a") as f:
        f.write(f"{restart} {nproc} {step} {os.getpid()}\n")
    return restart


def note_progress(out, i, restart, step):
    tmp = os.path.join(out, f"progress_{i}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{restart} {step} {os.getpid()}\n")
    os.replace(tmp, os.path.join(out, f"progress_{i}"))


def touch_heartbeat():
    path = os.environ.get("WHALEX_HEARTBEAT_FILE")
    if path:
        open(path, "a").close()
        os.utime(path)


def update(x, step, i):
    return np.sin(x) * 0.5 + 0.01 * step + i


def uninterrupted(i, steps):
    x = np.arange(8, dtype=np.float64) * (i + 1)
    for s in range(steps):
        x = update(x, s, i)
    return x


def mechanics(out, steps):
    i, nproc = int(os.environ["WHALEX_PROCESS_ID"]), int(os.environ["WHALEX_NUM_PROCESSES"])
    ckpt = os.path.join(out, f"ckpt_{i}.npz")
    if os.path.exists(ckpt):
        with np.load(ckpt) as z:
            step, x = int(z["step"]), z["x"]
    else:
        step, x = 0, np.arange(8, dtype=np.float64) * (i + 1)
    restart = note_start(out, i, nproc, step)
    if restart == 0 and os.environ.get("FAIL_FIRST_START") == str(i):
        print(f"process {i}: failing on the first start", flush=True)
        sys.exit(5)
    while step < steps:
        x = update(x, step, i)
        step += 1
        save_atomic(ckpt, step=step, x=x)
        note_progress(out, i, restart, step)
        touch_heartbeat()
        time.sleep(STEP_SECONDS)
    np.save(os.path.join(out, f"result_{i}.npy"), x)
    print(f"process {i} of {nproc}: done after {steps} steps", flush=True)


def with_whalex(out, steps):
    import optax
    import whalex as wh                                    # joins the process group
    import jax

    import launch_worker

    i, nproc = jax.process_index(), jax.process_count()
    params, batch = launch_worker.data()
    ckpt = os.path.join(out, "ckpt.npz")
    losses = []
    if os.path.exists(ckpt):
        with np.load(ckpt) as z:
            losses = list(z["losses"])
            params = {k: z[f"param_{k}"] for k in params}
    restart = note_start(out, i, nproc, len(losses))
    step = wh.parallelize(launch_worker.loss_fn, optax.sgd(LR))
    state = step.init(params, batch)
    while len(losses) < steps:
        state, metrics = step(state, batch)               # heartbeats (at most once a second)
        losses.append(float(metrics["loss"]))
        if i == 0:
            leaves = {f"param_{k}": np.asarray(v.addressable_data(0)) for k, v in state.params.items()}
            save_atomic(ckpt, losses=np.array(losses), **leaves)
        note_progress(out, i, restart, len(losses))
        time.sleep(0.2)                                    # long enough for the test to interrupt
    if i == 0:
        leaves = {f"param_{k}": np.asarray(v.addressable_data(0)) for k, v in state.params.items()}
        np.savez(os.path.join(out, "result.npz"), losses=np.array(losses), **leaves)
    print(f"process {i} of {nproc}: done, loss {losses[0]:.6f} -> {losses[-1]:.6f}", flush=True)


if __name__ == "__main__":
    (with_whalex if "--whalex" in sys.argv[3:] else mechanics)(sys.argv[1], int(sys.argv[2]))
