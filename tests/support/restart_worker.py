"""Helper for tests/launch/test_launch.py's restart tests: one process of
`python -m whalex.launch -n N --restarts K ... restart_worker.py OUT_DIR STEPS`.

It checkpoints after every step and resume from the latest checkpoint on start (what a
real script does with its checkpoint manager), so a restarted run ends where an uninterrupted one
does. Every start is appended to OUT_DIR/starts_{i}.txt ("restart nproc first_step pid") and the
last finished step is in OUT_DIR/progress_{i} ("restart step pid"), for the test to time its kills.

Mechanics only (no JAX: starts in milliseconds): process i evolves its own numpy array for
STEPS steps of STEP_SECONDS each, checkpoints it to OUT_DIR/ckpt_{i}.npz, heartbeats by touching
$WHALEX_HEARTBEAT_FILE itself (the file protocol whalex.distributed.heartbeat() implements; this
mode does not import whalex, hence JAX), and writes OUT_DIR/result_{i}.npy at the end.
`FAIL_FIRST_START=i` in the environment: process i exits 5 on the first start
(WHALEX_RESTART_COUNT=0), once the other processes have noted theirs.

Training with whalex itself (wh.CheckpointManager, a SIGKILLed or SIGSTOPped worker, fewer processes)
is checkpoint_worker.py's job.
"""
import os
import sys
import time

import numpy as np

STEP_SECONDS = 0.05


def save_atomic(path, **arrays):
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)                                  # a kill never leaves half a checkpoint


def note_start(out, i, nproc, step):
    restart = int(os.environ.get("WHALEX_RESTART_COUNT", "0"))
    with open(os.path.join(out, f"starts_{i}.txt"), "a") as f:
        f.write(f"{restart} {nproc} {step} {os.getpid()}\n")
    return restart


def wait_for_starts(out, others, timeout=20.0):
    """Until each of `others` has noted a start (the launcher stops them when this process fails)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(os.path.exists(os.path.join(out, f"starts_{j}.txt"))
                                                  for j in others):
        time.sleep(0.01)


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
        wait_for_starts(out, [j for j in range(nproc) if j != i])   # the others' first start is on record
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


if __name__ == "__main__":
    mechanics(sys.argv[1], int(sys.argv[2]))
