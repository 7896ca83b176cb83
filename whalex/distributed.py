"""Joining a multi-process run before JAX first touches devices.

`python -m whalex.launch -n N script.py` starts N processes and tells each, through environment
variables, who it is:

    WHALEX_COORDINATOR_ADDRESS   host:port of the coordinator (process 0 serves it)
    WHALEX_NUM_PROCESSES         N
    WHALEX_PROCESS_ID            0 .. N-1

`maybe_initialize()` reads them and calls `jax.distributed.initialize(...)` with CPU collectives
set to gloo (`jax_cpu_collectives_implementation`; needed for cross-process collectives between
CPU devices, harmless on GPU). Without those variables it does nothing, so the same script runs

* alone (one process, as before),
* under `whalex.launch`, and
* under a cluster scheduler (SLURM, Open MPI, Kubernetes/GKE, Cloud TPU...), where
  `jax.distributed.initialize()` with no arguments finds its own settings: set
  `WHALEX_DISTRIBUTED=auto` in the job's environment and whalex makes that call for you, or call
  `jax.distributed.initialize()` yourself at the top of the script (`maybe_initialize()` sees that
  the group is already joined and leaves it alone), or set the three variables above per process.

whalex calls `maybe_initialize()` on `import whalex` and again at the start of `Cluster(...)` and
`Cluster.detect()` (a no-op once joined), so a script that imports whalex before touching devices
needs nothing else. JAX can join a process group only before its backend starts: a script that
touches devices (`jax.devices()`, `jnp.ones(...)`, `jax.device_put`...) BEFORE importing whalex
must call `whalex.distributed.maybe_initialize()` first (or import whalex first). Otherwise
`import whalex` warns and `Cluster(...)` raises a RuntimeError that says so, instead of N
processes silently training alone.

Heartbeat: `python -m whalex.launch --heartbeat-timeout S` sets `WHALEX_HEARTBEAT_FILE` per process
and restarts the run when a process's file is older than S seconds (hung, stopped, deadlocked in a
collective). `heartbeat()` touches that file (at most once a second; a no-op without the
variable); every `Step.__call__` calls it, and a training loop that does long work outside the
step (evaluation, checkpointing) may call it too.

On one host with several GPUs, give each process its own GPU(s) before whalex is imported, e.g.
`os.environ["JAX_LOCAL_DEVICE_IDS"] = os.environ["WHALEX_PROCESS_ID"]` (jax.distributed reads it).
"""
from __future__ import annotations

import os
import time
import warnings

import numpy as np

ADDRESS = "WHALEX_COORDINATOR_ADDRESS"
NUM_PROCESSES = "WHALEX_NUM_PROCESSES"
PROCESS_ID = "WHALEX_PROCESS_ID"
ENV_VARS = (ADDRESS, NUM_PROCESSES, PROCESS_ID)
AUTO = "WHALEX_DISTRIBUTED"        # "auto": jax.distributed.initialize() with JAX's cluster detection
HEARTBEAT = "WHALEX_HEARTBEAT_FILE"   # set by `whalex.launch --heartbeat-timeout`: the file heartbeat() touches
RESTART_COUNT = "WHALEX_RESTART_COUNT"  # set by whalex.launch: 0 on the first start, k after the k-th restart

_last_beat = -float("inf")


def heartbeat(min_interval: float = 1.0) -> bool:
    """Tell `whalex.launch` this process is making progress: touch `$WHALEX_HEARTBEAT_FILE`.

    Cheap enough for every step: a clock read, then at most once per `min_interval` seconds
    (monotonic clock) it reads the environment and touches the file (a no-op without the variable).
    Returns True when it touched the file. Never raises on a file-system error (the launcher then
    sees a stale heartbeat, which is what it should see).
    """
    global _last_beat
    now = time.monotonic()
    if now - _last_beat < min_interval:
        return False
    _last_beat = now
    path = os.environ.get(HEARTBEAT)
    if not path:
        return False
    try:
        os.utime(path)
    except FileNotFoundError:
        try:
            open(path, "a").close()
        except OSError:
            return False
    except OSError:
        return False
    return True


def launch_env() -> tuple[str, int, int] | None:
    """(coordinator address, process count, process id) from the environment, or None."""
    present = [v for v in ENV_VARS if os.environ.get(v)]
    if not present:
        return None
    if len(present) != len(ENV_VARS):
        missing = [v for v in ENV_VARS if v not in present]
        raise RuntimeError(f"whalex multi-process environment is incomplete: {', '.join(present)} set but "
                           f"{', '.join(missing)} missing; start the script with `python -m whalex.launch -n N "
                           "script.py`, or set all three variables.")
    try:
        n, i = int(os.environ[NUM_PROCESSES]), int(os.environ[PROCESS_ID])
    except ValueError:
        raise RuntimeError(f"{NUM_PROCESSES} and {PROCESS_ID} must be integers, got "
                           f"{os.environ[NUM_PROCESSES]!r} and {os.environ[PROCESS_ID]!r}.") from None
    if not 0 <= i < n:
        raise RuntimeError(f"{PROCESS_ID}={i} must be in [0, {NUM_PROCESSES}={n}).")
    return os.environ[ADDRESS], n, i


def is_initialized() -> bool:
    import jax  # lazily, here and below: the environment is read before JAX is imported
    return jax.distributed.is_initialized()


def maybe_initialize(initialization_timeout: int = 120, strict: bool = True) -> bool:
    """Join the process group named by the WHALEX_* variables, once, before JAX touches devices.

    With `WHALEX_DISTRIBUTED=auto` and no WHALEX_* process variables, calls
    `jax.distributed.initialize()` with no arguments (JAX's own cluster detection).
    Returns True if this call initialized `jax.distributed`, False if there was nothing to do (no
    variables, a single process, or already initialized, e.g. by the user or a scheduler). If the
    variables are set but JAX's backend already started, raises RuntimeError (`strict=False`: warns
    and returns False; `import whalex` uses that, `Cluster(...)` does not).
    """
    env = launch_env()
    auto = os.environ.get(AUTO, "").strip().lower() == "auto"
    if env is None and not auto:
        return False
    import jax

    from whalex._compat import backends_initialized  # lazily: it imports JAX

    if jax.distributed.is_initialized():
        return False
    if env is not None and env[1] == 1:
        return False
    who = f"process {env[2]} of {env[1]} (started by whalex.launch)" if env else f"a {AUTO}=auto process"
    if backends_initialized():
        msg = (
            f"this is {who}, but JAX's backend was already "
            "initialized before the process group was joined, so each process would only see its own "
            "devices. Call `whalex.distributed.maybe_initialize()` (or `import whalex`) before anything "
            "that touches devices (jax.devices(), jnp arrays, jax.device_put...).")
        if strict:
            raise RuntimeError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        return False
    if not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):      # respect an explicit choice (mpi)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if env is None:                                                     # a scheduler: JAX detects it
        jax.distributed.initialize(initialization_timeout=initialization_timeout)
    else:
        address, n, i = env
        jax.distributed.initialize(coordinator_address=address, num_processes=n, process_id=i,
                                   initialization_timeout=initialization_timeout)
    return True


def place_global(tree, shardings):
    """`jax.device_put(tree, shardings)` for a host batch, without the cross-process equality check.

    With a sharding that spans several processes, `jax.device_put` of a host array all-gathers
    it to assert every process passed the same value (jax 0.10.2, `multihost_utils.assert_equal`):
    a collective over the whole batch every step, and an error when each process filled only the
    rows it owns (`plan.local_rows`). Here each process reads only the slices its own devices
    hold (`jax.make_array_from_callback`). An array already placed with its sharding is returned
    as it is (what `jax.device_put` returns too, at a fraction of its cost); fully addressable
    shardings (one process) and other placed arrays go through `jax.device_put`.
    """
    import jax

    def put(x, s):
        if isinstance(x, jax.Array) and x.sharding == s:
            return x
        if s.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
            return jax.device_put(x, s)
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

    return jax.tree.map(put, tree, shardings)
