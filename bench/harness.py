"""What every bench shares: simulated devices, interleaved timing, medians and bootstrap intervals,
collective bytes from compiled HLO, worker processes (one case per process, and the two-process runs
on an emulated heterogeneous cluster, with their entry point), and the results files (one per bench,
its other runs kept as variants).

A bench is run as ``python bench/<name>.py``: Python puts the script's directory first on its module
search path, so the benches read this module as ``import harness``, as they read bench/models.py. It
stays out of the whalex package: results files, busy loops and bootstraps are the benches' business,
not the library's. The HLO parser it builds on is the package's (``whalex.jaxpr.hlo``), which the
tests read too, and the bytes a collective sends are priced by ``whalex.records.comm``, as the planner
prices them.

This module imports neither JAX nor whalex (which imports JAX) at the top, but where a function first
needs them: a bench calls ``harness.simulate_devices(8)`` before JAX is imported, and the driver of the
two-process runs never imports JAX.

Timing (``interleaved``): the compared programs run in rounds, one block of calls of each per round,
their order changing from round to round so that machine drift hits all of them alike; each call is
timed to ``jax.block_until_ready`` of what it returns (or to whatever ``sync`` the bench passes).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"


# ------------------------------------------------------------------------------- before JAX

def simulate_devices(n: int) -> None:
    """`n` simulated CPU devices: call before JAX is imported (it sets the environment JAX reads)."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


# ------------------------------------------------------------------------------- timing

def block_until_ready(x):
    """`jax.block_until_ready`."""
    import jax
    return jax.block_until_ready(x)


def order(names: list, r: int, how) -> list:
    """The order of round `r`: 'fixed'; 'alternate' (reversed every other round); 'rotate' (round r
    starts at name r mod n); 'rotate-alternate' (rotated, and reversed every n rounds); or a function
    (names, r) -> names."""
    n = len(names)
    if callable(how):
        return list(how(names, r))
    if how == "fixed":
        return list(names)
    if how == "alternate":
        return list(names) if r % 2 == 0 else list(names)[::-1]
    k = r % n
    rotated = list(names[k:]) + list(names[:k])
    if how == "rotate":
        return rotated
    if how == "rotate-alternate":
        return rotated[::-1] if (r // n) % 2 else rotated
    raise ValueError(f"unknown order {how!r}")


def time_call(fn: Callable, *args, sync: Callable | None = block_until_ready, sync_timed: bool = True,
              cpu_clock: Callable | None = None):
    """(wall seconds, CPU seconds or None, result) of one call `fn(*args)`, timed up to `sync` of its
    result (`sync_timed=False`: up to its return, then synced untimed; `sync=None`: no sync)."""
    c0 = cpu_clock() if cpu_clock else None
    t0 = time.perf_counter()
    out = fn(*args)
    if sync is not None and sync_timed:
        sync(out)
    wall = time.perf_counter() - t0
    cpu = cpu_clock() - c0 if cpu_clock else None
    if sync is not None and not sync_timed:
        sync(out)
    return wall, cpu, out


@dataclasses.dataclass
class Timings:
    """Seconds of each name's calls: `wall[name]` one list per block (round) it ran in; `cpu` likewise
    when a CPU clock was given."""

    wall: dict
    cpu: dict
    warmup_s: float = 0.0
    timed_s: float = 0.0

    def times(self, name) -> list[float]:
        """Every call's wall seconds, in the order they ran."""
        return [t for b in self.wall[name] for t in b]

    def cpu_times(self, name) -> list[float]:
        return [t for b in self.cpu[name] for t in b]

    def median(self, name) -> float:
        return median(self.times(name))


def interleaved(calls: dict, rounds: int, *, block: int = 1, warmup: int = 0, order_by="alternate",
                sync: Callable | None = block_until_ready, sync_timed: bool = True, cpu_clock: Callable | None = None,
                setup: dict | None = None, select: Callable | None = None,
                after_block: Callable | None = None, on_round: Callable | None = None) -> Timings:
    """Time `calls` ({name: fn()}) in interleaved rounds: `warmup` untimed calls of each first, then
    `rounds` rounds of one block of `block` calls of each, in `order(names, r, order_by)`.

    setup:        {name: fn() -> args}, run untimed before each call, whose arguments it returns
    select:       r -> the names that run in round r (default: all)
    after_block:  (name, r) -> None, run untimed after each timed block
    on_round:     (r, Timings) -> None, after each round (progress lines)
    """
    setup = setup or {}
    names = list(calls)
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names} if cpu_clock else {}
    out = Timings(wall, cpu)

    def one(name):
        args = setup[name]() if name in setup else ()
        return time_call(calls[name], *args, sync=sync, sync_timed=sync_timed, cpu_clock=cpu_clock)

    t0 = time.perf_counter()
    for name in names:
        for _ in range(warmup):
            one(name)
    out.warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for r in range(rounds):
        for name in order(select(r) if select else names, r, order_by):
            ws, cs = [], []
            for _ in range(block):
                w, c, _ = one(name)
                ws.append(w)
                cs.append(c)
            wall[name].append(ws)
            if cpu_clock:
                cpu[name].append(cs)
            if after_block:
                after_block(name, r)
        if on_round:
            on_round(r, out)
    out.timed_s = time.perf_counter() - t0
    return out


def progress(log: Callable, rounds: int) -> Callable:
    """An `on_round` for `interleaved` that logs each name's median of the round, in ms."""
    return lambda r, t: log(f"round {r + 1}/{rounds}: " + ", ".join(
        f"{n} {1e3 * median(blocks[-1]):.1f} ms" for n, blocks in t.wall.items() if blocks))


def step_runner(steps: dict, states: dict, batch, losses: dict | None = None) -> Callable[[str], float]:
    """`run(name)`: one step of `steps[name]` on `batch`, its state kept in `states`; returns the loss as
    a float (so it waits for the step), recorded in `losses` where given."""
    def run(name: str) -> float:
        states[name], metrics = steps[name](states[name], batch)
        loss = float(metrics["loss"])
        if losses is not None:
            losses[name] = loss
        return loss
    return run


def median(xs) -> float:
    return float(statistics.median(xs))


def paired_ratio(times, baseline, draws: int = 2000) -> tuple[float, float, float]:
    """(median, and the 5th and 95th percentiles of its bootstrap over rounds) of the per-round ratios
    `times[i] / baseline[i]`: two names timed in the same interleaved rounds, compared round by round,
    so that drift over the run falls on both."""
    ratios = np.asarray(times, np.float64) / np.asarray(baseline, np.float64)
    picks = np.random.default_rng(0).integers(0, len(ratios), (draws, len(ratios)))
    lo, hi = np.percentile(np.median(ratios[picks], axis=1), [5, 95])
    return float(np.median(ratios)), float(lo), float(hi)


def round_medians(times, block: int) -> list[float]:
    """The median of each round's block of `block` calls, from `Timings.times` (rounds in order)."""
    return [median(times[i:i + block]) for i in range(0, len(times) - block + 1, block)]


def by_config(runs: list[dict], fields: tuple[str, ...]) -> list[tuple[tuple, list[dict]]]:
    """Repeated runs grouped by their values of `fields`, in the order the configurations first ran:
    (values, the runs of those values that did not fail)."""
    keys = list(dict.fromkeys(tuple(r[f] for f in fields) for r in runs))
    return [(k, [r for r in runs if tuple(r[f] for f in fields) == k and "failed" not in r]) for k in keys]


def bootstrap_ratio(a, b, rng: np.random.Generator, n_boot: int = 2000) -> list[float]:
    """95% interval of median(a) / median(b) by the bootstrap: rows (calls, or rounds of calls when
    2-D) resampled with replacement, the same rows for `a` and `b` (they ran side by side)."""
    a, b = np.asarray(a), np.asarray(b)
    idx = rng.integers(0, len(a), (n_boot, len(a)))
    boot = np.median(a[idx].reshape(n_boot, -1), axis=1) / np.median(b[idx].reshape(n_boot, -1), axis=1)
    return [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))]


# ------------------------------------------------------------------------------- collectives in HLO

def collectives(text: str, num_devices: int) -> list[dict]:
    """Every collective of compiled HLO text (`whalex.jaxpr.hlo.collectives`) as a record: kind, async,
    result arrays, group size (`num_devices` when it spans all), bytes of the result, bytes each device
    sends (`whalex.records.comm.result_ring_bytes`: ring algorithms), and the JAX operation it came from."""
    from whalex.jaxpr import hlo
    from whalex.records.comm import result_ring_bytes

    out = []
    for c in hlo.collectives(text):
        n = c.group or num_devices
        out.append({"kind": c.kind, "async": c.is_async, "arrays": [list(a) for a in c.arrays], "group": n,
                    "bytes": c.bytes, "ring_bytes": result_ring_bytes(c.kind, c.bytes, n), "op_name": c.op_name})
    return out


def by_kind(colls: list[dict]) -> dict:
    """{kind: {count, bytes, ring_bytes}} over the kinds present."""
    from whalex.jaxpr import hlo

    out = {}
    for c in colls:
        k = out.setdefault(c["kind"], {"count": 0, "bytes": 0.0, "ring_bytes": 0.0})
        k["count"] += 1
        k["bytes"] += c["bytes"]
        k["ring_bytes"] += c["ring_bytes"]
    return {k: out[k] for k in hlo.KINDS if k in out}


def looped_ring_bytes(text: str, num_devices: int) -> dict:
    """Ring bytes each device sends per step: straight-line collectives, and those in loops times the
    trip count (a conditional: its largest branch), from `whalex.jaxpr.hlo.step_collectives`."""
    from whalex.jaxpr import hlo

    found = hlo.step_collectives(text, num_devices)
    return {"straight_line": found.ring_bytes - found.looped_bytes, "in_loops": found.looped_bytes,
            "total": found.ring_bytes}


# ------------------------------------------------------------------------------- worker processes

def worker_env(env: dict | None = None) -> dict:
    """`env` (this process's environment by default) with the repository root first on PYTHONPATH, so
    that a worker imports this checkout's whalex."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def run_worker(cmd: list[str], timeout: float, env: dict | None = None):
    """One worker process, its output captured: the finished process, or None where it ran past
    `timeout` seconds (it is killed). A bench whose cases must not share a process (a device count
    fixed before JAX starts, a peak memory of its own) runs each case this way."""
    try:
        return subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return None


# ------------------------------------------------------------------------------- two-process runs

THROTTLE_ENV = "WHALEX_BENCH_THROTTLE"      # "<process id>:<cgroup directory>", set by run_config


def is_worker() -> bool:
    """Whether this process is one of the workers `python -m whalex.launch` started. The worker that
    `run_config` throttles joins its CPU cgroup here, before it starts JAX (threads started later
    inherit the cgroup)."""
    pid = os.environ.get("WHALEX_PROCESS_ID")
    spec = os.environ.get(THROTTLE_ENV)
    if pid is not None and spec and spec.split(":", 1)[0] == pid:
        pathlib.Path(spec.split(":", 1)[1], "cgroup.procs").write_text(str(os.getpid()))
    return pid is not None


def two_process_main(argv, parse, worker, driver):
    """The entry point of a two-process bench: `parse(argv)`, then `worker(args)` in a worker that
    `python -m whalex.launch` started, or `driver(args, argv, cores, env, load_before)` in the driver
    (after `launch_env`; nothing, after its SKIP line, without 2 cores)."""
    args = parse(argv)
    if is_worker():
        return worker(args)
    setup = launch_env()
    if setup is None:
        return None
    return driver(args, argv, *setup)


def worker_start(script: str = "its driver"):
    """(process id, process 0's log) of a worker, which must be one of 2 processes of one device each.
    Importing whalex first joins the process group `python -m whalex.launch` set up."""
    import jax

    import whalex  # noqa: F401

    pid = jax.process_index()
    assert jax.process_count() == 2 and jax.device_count() == 2, f"run through {script}"
    return pid, process0_log(pid)


def configs(args) -> list[tuple[int, int]]:
    """(busy loops, batch) of each configuration `--slowdowns` x `--batches` names, in that order."""
    return [(hogs, batch) for hogs in [int(x) for x in args.slowdowns.split(",")]
            for batch in [int(x) for x in args.batches.split(",")]]


# glibc keeps freed blocks up to 256 MiB in its heap (no mmap per call) and never trims it: both are needed,
# setting either alone turns off glibc's dynamic threshold and makes small temporaries fault too. XLA CPU
# allocates an executable's temporaries on every call; above glibc's (dynamic, at most 32 MiB) mmap threshold
# each call gets fresh pages from the kernel and faults on every first touch, and whether a buffer crosses
# that threshold depends on what was freed before. A GPU runtime keeps its memory pooled, so the emulated
# devices should too.
CACHED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


def add_emulation_args(ap, result: str, *, batches: str, slowdowns: str = "1,2", slow_by: str | None = None,
                       timeout: float = 900, notes: dict[str, str] | None = None) -> None:
    """The arguments of a two-process bench run through `run_emulations`: ``--batches``, ``--slowdowns``,
    ``--slow-by`` (where `slow_by` gives its default), ``--timeout`` (seconds per run), ``--out`` (default
    bench/results/`result`.json), and the worker's own ``--batch`` and ``--worker-out``. `notes`: more help
    for some of them, by destination (a bench whose defaults depend on its other arguments says so)."""
    notes = notes or {}
    ap.add_argument("--batches", default=batches, help="global batches, comma-separated" + notes.get("batches", ""))
    ap.add_argument("--slowdowns", default=slowdowns,
                    help="1: process 1 at 1/2 of its core; 2: at 1/3" + notes.get("slowdowns", ""))
    if slow_by is not None:
        ap.add_argument("--slow-by", default=slow_by, type=emulations,
                        help="emulations, comma-separated: quota (a CPU cgroup quota; busy loops where it cannot "
                             "be written), busy")
    ap.add_argument("--timeout", type=float, default=timeout, help="seconds per run")
    ap.add_argument("--out", default=None,
                    help=f"the results file (default bench/results/{result}.json{notes.get('out', '')})")
    ap.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)


EMULATIONS = ("quota", "busy")


def slowed(run: dict) -> str:
    """How a run's process 1 was slowed, for a table: its emulation and the share of its core."""
    return f"{run.get('slow_by', 'busy')} 1/{1 + run['hogs']}"


def emulations(text: str) -> str:
    """`--slow-by`'s value checked: comma-separated names from `EMULATIONS`."""
    bad = [name for name in text.split(",") if name not in EMULATIONS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown emulation(s) {', '.join(map(repr, bad))}: use "
                                         f"{' or '.join(EMULATIONS)}, comma-separated")
    return text


def add_allocator_arg(ap) -> None:
    """`--allocator cached|default` on a two-process bench's parser (see `CACHED_MALLOC`)."""
    ap.add_argument("--allocator", default="cached", choices=("cached", "default"),
                    help="cached: glibc keeps freed memory (harness.CACHED_MALLOC), as a GPU runtime pools it; "
                         "default: glibc's own thresholds")


def allocator_env(env: dict, allocator: str) -> dict:
    """`env` with `CACHED_MALLOC` for `allocator == 'cached'`, as it is otherwise."""
    return {**env, **CACHED_MALLOC} if allocator == "cached" else dict(env)


CPU_CGROUP = pathlib.Path("/sys/fs/cgroup/cpu")     # cgroup v1 CPU controller (CFS bandwidth)
THROTTLE_PERIOD_US = 1000                           # quota per period: the smallest period the kernel takes


def cgroup_throttle(share: float):
    """A fresh CPU cgroup whose members run `share` of each THROTTLE_PERIOD_US period of one core (CFS
    bandwidth control), or None where this machine's cgroup v1 CPU controller cannot be written (no
    root, cgroup v2 only). Throttling by quota slows a process by the same factor in every millisecond,
    where busy loops sharing its core slow it by scheduler time slices, which shift with how long it
    sleeps waiting for the other process."""
    try:
        path = pathlib.Path(tempfile.mkdtemp(prefix="whalex_bench_", dir=CPU_CGROUP))
    except OSError:
        return None
    try:
        (path / "cpu.cfs_period_us").write_text(str(round(THROTTLE_PERIOD_US / share)))
        (path / "cpu.cfs_quota_us").write_text(str(THROTTLE_PERIOD_US))
    except OSError:
        path.rmdir()
        return None
    return path


def process0_log(pid: int):
    """print(..., flush=True) on process 0, nothing elsewhere."""
    return (lambda *a: print(*a, flush=True)) if pid == 0 else (lambda *a: None)


def busy_loop(core: int) -> subprocess.Popen:
    """`while True: pass` pinned to `core`; it also dies with this process (PR_SET_PDEATHSIG)."""
    code = (f"import ctypes, os, signal\n"
            f"ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
            f"os.sched_setaffinity(0, {{{core}}})\n"
            f"while True:\n    pass\n")
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)


def launch_env():
    """(cores, environment, load average) for the 2-process runs; None (and a SKIP line) without 2 cores."""
    from whalex.launch import available_cores

    cores = available_cores()
    if len(cores) < 2:
        print(f"SKIP: needs 2 CPU cores to pin two processes, this process may use {cores}")
        return None
    env = worker_env()
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=1"])
    env["JAX_PLATFORMS"] = "cpu"
    load_before = os.getloadavg()[0]
    if load_before > 1.0:
        print(f"WARNING: load average {load_before:.2f} before the run: other work on this machine competes with "
              "both processes and makes the calibration and the timings noisy", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))       # run the `finally` blocks on SIGTERM too
    return cores, env, load_before


def run_config(args, argv, hogs: int, batch: int, cores, env, script: str) -> dict:
    """One 2-process run of `script`'s worker (`python -m whalex.launch -n 2 script argv --batch batch
    --worker-out FILE`, `args.timeout` seconds at most) with `hogs` busy loops on process 1's core: the
    JSON the worker wrote, with `hogs` and `batch`, or a `failed` record."""
    loops, group = [], None
    with tempfile.TemporaryDirectory() as tmp:
        out_path = pathlib.Path(tmp) / "worker.json"
        cmd = [sys.executable, "-m", "whalex.launch", "-n", "2", "--timeout", str(args.timeout),
               str(pathlib.Path(script).resolve()), *argv, "--batch", str(batch), "--worker-out", str(out_path)]
        try:
            if getattr(args, "slow_by", "busy") == "quota" and hogs > 0:
                group = cgroup_throttle(1 / (1 + hogs))
                if group is None:
                    print("WARNING: cannot write a CPU cgroup here (needs root and cgroup v1's cpu controller): "
                          "busy loops instead", flush=True)
            if group is not None:
                env = {**env, THROTTLE_ENV: f"1:{group}"}
                print(f"\n=== process 1 throttled to 1/{1 + hogs} of core {cores[1]} (CPU quota), batch {batch} ===",
                      flush=True)
            else:
                loops = [busy_loop(cores[1]) for _ in range(hogs)]
                print(f"\n=== {hogs} busy loop(s) on core {cores[1]}, batch {batch} ===", flush=True)
            rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
        finally:
            for hog in loops:
                hog.kill()
                hog.wait()
            if group is not None:
                group.rmdir()
        if rc != 0 or not out_path.exists():
            return {"hogs": hogs, "batch": batch, "failed": f"the 2-process run exited with status {rc}"}
        return {"hogs": hogs, "batch": batch, **json.loads(out_path.read_text())}


def run_emulations(args, argv, cores, env, script: str, on_run: Callable[[dict], None] | None = None) -> list[dict]:
    """`run_config` for every emulation in `args.slow_by` x `configs(args)`, in that order: each run's record
    with its ``slow_by``; `on_run(record)` as each ends (a bench that reports runs as they come)."""
    runs = []
    for slow_by in args.slow_by.split(","):
        for hogs, batch in configs(args):
            ns = argparse.Namespace(**{**vars(args), "slow_by": slow_by})
            runs.append({"slow_by": slow_by, **run_config(ns, argv, hogs, batch, cores, env, script)})
            if on_run is not None:
                on_run(runs[-1])
    return runs


def write_worker_result(path: str, record: dict, pid: int) -> None:
    """A worker's half of `run_config`: process 0 writes its record where the driver reads it."""
    if pid == 0:
        pathlib.Path(path).write_text(json.dumps(record))


# ------------------------------------------------------------------------------- results

VARIANTS = "variants"        # a results file's other runs of the same bench: name -> its record


def write_result(name: str, record: Any, out: str | os.PathLike | None = None, indent: int = 2,
                 default: Callable | None = None, newline: bool = False,
                 variant: str | None = None) -> pathlib.Path:
    """Write `record` as JSON to `out`, by default bench/results/<name>.json (`name` is the bench's
    name, or `<bench>_<mode>` where a mode has its own file); returns the path. One file per bench
    keeps every run: a rerun keeps the file's "variants", and with `variant` the record becomes
    `variants[variant]`, the rest of the file kept."""
    path = pathlib.Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.exists() and (variant or isinstance(record, dict)) else {}
    old = old if isinstance(old, dict) else {}
    if variant is not None:
        record = {**old, VARIANTS: {**old.get(VARIANTS, {}), variant: record}}
    elif isinstance(record, dict) and VARIANTS in old and VARIANTS not in record:
        record = {**record, VARIANTS: old[VARIANTS]}
    path.write_text(json.dumps(record, indent=indent, default=default) + ("\n" if newline else ""))
    return path


def load_example(name: str):
    """The module examples/<name>.py, loaded from its file."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
