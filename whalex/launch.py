"""Start N local processes of a script as one multi-process JAX run.

    python -m whalex.launch -n N [--cores-per-process K | --no-pin] [--timeout S]
        [--restarts K] [--heartbeat-timeout S] [--startup-grace S] [--min-processes P] [--grace S]
        script.py [args...]

Each process i runs `python script.py args...` with

    WHALEX_COORDINATOR_ADDRESS=127.0.0.1:PORT   (a free loopback port; process 0 serves it)
    WHALEX_NUM_PROCESSES=N
    WHALEX_PROCESS_ID=i
    WHALEX_CPU_CORES=c0,c1,...                   (only when pinned: the cores it may run on)
    WHALEX_RESTART_COUNT=k                       (0 on the first start, k after the k-th restart)
    WHALEX_HEARTBEAT_FILE=path                   (only with --heartbeat-timeout)

and whalex joins the process group from them (`whalex.distributed.maybe_initialize`, called on
`import whalex` and by `Cluster(...)`). Output lines are forwarded prefixed with `[i] ` (stdout to
stdout, stderr to stderr). If any process fails, the others are stopped (SIGTERM and SIGCONT, then
SIGKILL after --grace seconds) and the launcher exits with that process's status; it exits 0 when
all succeed. The launcher's own lines go to stderr, prefixed `[whalex.launch] `: every start
(process count, coordinator, pids), every exit status, first heartbeats, heartbeat timeouts,
restarts.

Failures and restarts:
    --heartbeat-timeout S  a process whose heartbeat file (touched by
                           `whalex.distributed.heartbeat()`, which every `Step.__call__` calls, at
                           most once a second) is older than S seconds has failed: hung, stopped
                           (SIGSTOP), deadlocked in a collective. Before its first heartbeat a process
                           gets --startup-grace seconds (default 300: imports, compilation).
                           Without this flag heartbeats are not watched.
    --restarts K           after a failure (non-zero exit or heartbeat timeout) stop every process
                           and start the group again, on a fresh coordinator port, up to K times; the
                           script resumes from its own checkpoint (WHALEX_RESTART_COUNT tells it
                           which start this is). Default 0: the first failure ends the run.
    --min-processes P      restart k after k failures runs max(P, N - k) processes (processes
                           0..m-1, WHALEX_NUM_PROCESSES=m), so the script re-plans on fewer
                           processes. Default N: every start has N processes.
    --timeout S            bounds the whole run, restarts included (exit 124).
The exit status after the last allowed failure is the failing process's status (128 + signal
when killed by a signal), 124 for a heartbeat timeout.

CPU pinning (Linux `sched_setaffinity`), over the cores this launcher may use:
    default               N <= cores: process i on core i % cores; N > cores: not pinned
    --cores-per-process K process i on cores [i*K, (i+1)*K) (wrapping around)
    --no-pin              no pinning
Each child also dies with the launcher (PR_SET_PDEATHSIG), so a killed launcher leaves no
orphans waiting on a coordinator.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from whalex.distributed import ADDRESS, HEARTBEAT, NUM_PROCESSES, PROCESS_ID, RESTART_COUNT
from whalex.errors import ConfigError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def available_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:                              # not Linux
        return list(range(os.cpu_count() or 1))


def core_sets(n: int, cores_per_process: int | None, pin: bool, cores: list[int] | None = None):
    """Per process, the cores it is pinned to (None: not pinned)."""
    cores = available_cores() if cores is None else cores
    if not pin or not hasattr(os, "sched_setaffinity"):
        return [None] * n
    if cores_per_process is None:
        if n > len(cores):
            return [None] * n
        cores_per_process = 1
    if cores_per_process < 1:
        raise ValueError(f"--cores-per-process must be >= 1, got {cores_per_process}.")
    return [sorted({cores[(i * cores_per_process + j) % len(cores)] for j in range(cores_per_process)})
            for i in range(n)]


def _preexec(cores):
    def fn():
        if cores is not None:
            os.sched_setaffinity(0, cores)
        try:                                            # die with the launcher (Linux)
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG = 1
        except Exception:
            pass
    return fn


def _forward(stream, out, prefix: str, lock: threading.Lock):
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        if not line.endswith("\n"):
            line += "\n"
        with lock:
            out.write(prefix + line)
            out.flush()
    stream.close()


def _stop(procs, grace: float = 5.0, log=None):
    """Stop every live child (by PID): SIGTERM (and SIGCONT, so a stopped one can act on it), then
    SIGKILL what is left after `grace` seconds. Every wait is bounded."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        for sig in (signal.SIGTERM, signal.SIGCONT):
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            p.kill()                                     # SIGKILL also ends a stopped process
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:            # e.g. stuck in the kernel: give up on it
                if log is not None:
                    log(f"pid {p.pid} did not exit after SIGKILL; leaving it")


def _status(rc: int) -> int:
    return rc if rc >= 0 else 128 - rc                 # killed by signal s: 128 + s, as a shell reports


class _Stopped(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class _Run:
    """What every attempt of one launch shares: the command and its environment, the coordinator host,
    the heartbeat directory and limits, the deadline, the output streams and the launcher's log."""

    command: list
    base: dict
    host: str
    hb_dir: str | None
    heartbeat_timeout: float | None
    startup_grace: float
    deadline: float | None
    grace: float
    stdout: Any
    stderr: Any
    lock: threading.Lock
    log: Callable[[str], None]


def _run_once(run: _Run, n: int, sets, attempt: int, live: list):
    """One start of processes 0..n-1: ("ok" | "failed" | "hung" | "timeout", process, status)."""
    address = f"{run.host}:{free_port(run.host)}"
    hb_files = [None if run.hb_dir is None else os.path.join(run.hb_dir, f"attempt{attempt}-process{i}")
                for i in range(n)]
    run.log(f"attempt {attempt}: starting {n} process(es), coordinator {address}"
            + ("" if run.hb_dir is None else f", heartbeat timeout {run.heartbeat_timeout:g} s after a startup "
                                             f"grace of {run.startup_grace:g} s"))
    procs = live
    _spawn(run, n, sets, attempt, address, hb_files, procs)
    run.log(f"attempt {attempt}: pids " + " ".join(f"{i}:{p.pid}" for i, p in enumerate(procs)))
    threads = []
    for i, p in enumerate(procs):
        for stream, out in ((p.stdout, run.stdout), (p.stderr, run.stderr)):
            t = threading.Thread(target=_forward, args=(stream, out, f"[{i}] ", run.lock), daemon=True)
            t.start()
            threads.append(t)
    reported: set = set()
    outcome = None
    try:
        outcome = _watch(run, procs, hb_files, reported)
    finally:
        if outcome is None or outcome[0] != "ok":
            _stop(procs, run.grace, run.log)
            for i, p in enumerate(procs):
                if i not in reported and p.returncode is not None:
                    run.log(f"process {i} stopped (status {_status(p.returncode)})")
        join_by = time.monotonic() + 5
        for t in threads:
            t.join(timeout=max(join_by - time.monotonic(), 0.01))
        procs.clear()
    return outcome


def _spawn(run: _Run, n: int, sets, attempt: int, address: str, hb_files, procs: list) -> None:
    """Start processes 0..n-1 into `procs`, all children first (no threads during fork); on any
    failure stop those already started."""
    try:
        for i in range(n):
            e = dict(run.base)
            e.update({ADDRESS: address, NUM_PROCESSES: str(n), PROCESS_ID: str(i), RESTART_COUNT: str(attempt)})
            if hb_files[i] is not None:
                e[HEARTBEAT] = hb_files[i]
            if sets[i] is not None:
                e["WHALEX_CPU_CORES"] = ",".join(map(str, sets[i]))
            procs.append(subprocess.Popen(run.command, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          stdin=subprocess.DEVNULL, preexec_fn=_preexec(sets[i])))
    except BaseException:
        _stop(procs, run.grace, run.log)
        raise


def _watch(run: _Run, procs: list, hb_files, reported: set):
    """Poll the processes until one fails, all succeed, the deadline passes or one stops beating (the
    outcome); every exit is logged once, as it is seen, and recorded in `reported`."""
    t0 = time.monotonic()
    beating: set = set()
    while True:
        codes = [p.poll() for p in procs]
        for i, c in enumerate(codes):
            if c is not None and i not in reported:
                reported.add(i)
                run.log(f"process {i} exited with status {_status(c)}")
        bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            return ("failed", bad[0][0], _status(bad[0][1]))
        if all(c == 0 for c in codes):
            return ("ok", -1, 0)
        now = time.monotonic()
        if run.deadline is not None and now > run.deadline:
            return ("timeout", -1, 124)
        if run.hb_dir is not None:
            hung = _stale(run, codes, hb_files, now - t0, beating)
            if hung:                                     # every stale one is logged; the first is blamed
                return ("hung", hung[0], 124)
        time.sleep(0.05)


def _stale(run: _Run, codes, hb_files, elapsed: float, beating: set) -> list[int]:
    """The running processes with no heartbeat past the startup grace or one older than the timeout,
    each logged; `beating` records the processes seen beating (their first beat is logged)."""
    wall, hung = time.time(), []
    for i, c in enumerate(codes):
        if c is not None:
            continue
        try:
            age = wall - os.stat(hb_files[i]).st_mtime
        except OSError:                                  # no heartbeat yet: starting, compiling
            if elapsed > run.startup_grace:
                run.log(f"process {i}: no heartbeat within the startup grace of {run.startup_grace:g} s")
                hung.append(i)
            continue
        if i not in beating:
            beating.add(i)
            run.log(f"process {i}: first heartbeat {elapsed:.1f} s after start")
        if age > run.heartbeat_timeout:
            run.log(f"process {i}: heartbeat timeout "
                    f"(last heartbeat {age:.1f} s ago > {run.heartbeat_timeout:g} s)")
            hung.append(i)
    return hung


def argument_error(n: int, restarts: int = 0, min_processes: int | None = None,
                   heartbeat_timeout: float | None = None, startup_grace: float = 300.0, grace: float = 5.0,
                   timeout: float | None = None, cores_per_process: int | None = None) -> str | None:
    """What is wrong with the launcher's arguments (one sentence naming the flag), or None. One check for
    `launch()` (a ConfigError) and the command line (argparse's usage line and exit status 2)."""
    if n < 1:
        return f"-n/--nproc must be >= 1 (the number of processes), got {n}"
    if restarts < 0:
        return f"--restarts must be >= 0, got {restarts}"
    if min_processes is not None and not 1 <= min_processes <= n:
        return f"--min-processes must be in [1, {n}] (at most -n), got {min_processes}"
    if heartbeat_timeout is not None and heartbeat_timeout <= 0:
        return f"--heartbeat-timeout must be > 0 seconds, got {heartbeat_timeout:g}"
    if startup_grace <= 0:
        return f"--startup-grace must be > 0 seconds, got {startup_grace:g}"
    if grace < 0:
        return f"--grace must be >= 0 seconds, got {grace:g}"
    if timeout is not None and timeout <= 0:
        return f"--timeout must be > 0 seconds, got {timeout:g}"
    if cores_per_process is not None and cores_per_process < 1:
        return f"--cores-per-process must be >= 1, got {cores_per_process}"
    return None


def launch(n: int, command: list[str], cores_per_process: int | None = None, pin: bool = True,
           timeout: float | None = None, host: str = "127.0.0.1", env: dict | None = None,
           stdout=None, stderr=None, restarts: int = 0, heartbeat_timeout: float | None = None,
           startup_grace: float = 300.0, min_processes: int | None = None, grace: float = 5.0) -> int:
    """Run `command` (argv) as processes 0..n-1 of one group; the launcher's exit status.

    A process that exits non-zero, or (with `heartbeat_timeout`) whose heartbeat file is older than
    `heartbeat_timeout` seconds, or that has not touched it `startup_grace` seconds after its start,
    stops every process; the group then starts again, up to `restarts` times, on a fresh
    coordinator port. Restart k after k failures runs `max(min_processes, n - k)` processes
    (`min_processes` defaults to n: the same size every time). `timeout` bounds the whole run.
    """
    problem = argument_error(n, restarts, min_processes, heartbeat_timeout, startup_grace, grace, timeout,
                             cores_per_process)
    if problem:
        raise ConfigError(problem)
    min_processes = n if min_processes is None else min_processes
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    base = dict(os.environ if env is None else env)
    base["PYTHONUNBUFFERED"] = "1"
    lock = threading.Lock()

    def log(msg):
        with lock:
            stderr.write(f"[whalex.launch] {msg}\n")
            stderr.flush()

    def on_signal(signum, frame):
        raise _Stopped(signum)

    old = signal.signal(signal.SIGTERM, on_signal) if threading.current_thread() is threading.main_thread() else None
    hb_dir = tempfile.mkdtemp(prefix="whalex-heartbeat-") if heartbeat_timeout is not None else None
    deadline = None if timeout is None else time.monotonic() + timeout
    run = _Run(command, base, host, hb_dir, heartbeat_timeout, startup_grace, deadline, grace, stdout, stderr,
               lock, log)
    live: list[subprocess.Popen] = []
    log(f"{' '.join(command)}: {n} process(es), up to {restarts} restart(s)"
        + (f", down to {min_processes} process(es)" if min_processes < n else ""))
    try:
        return _attempts(run, n, min_processes, restarts, cores_per_process, pin, timeout, live)
    except KeyboardInterrupt:
        _stop(live, grace, log)
        log("interrupted; stopped all processes.")
        return 130
    except _Stopped as e:
        _stop(live, grace, log)
        log(f"received signal {e.args[0]}; stopped all processes.")
        return 128 + e.args[0]
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
        if hb_dir is not None:
            shutil.rmtree(hb_dir, ignore_errors=True)


def _attempts(run: _Run, n: int, min_processes: int, restarts: int, cores_per_process: int | None, pin: bool,
              timeout: float | None, live: list) -> int:
    """Start the group up to `restarts` + 1 times, one process fewer after each failure (down to
    `min_processes`): the exit status of the last attempt."""
    log, failures = run.log, 0
    for attempt in range(restarts + 1):
        m = max(min_processes, n - failures)
        sets = core_sets(m, cores_per_process, pin)
        kind, i, code = _run_once(run, m, sets, attempt, live)
        if kind == "ok":
            log(f"attempt {attempt}: all {m} process(es) exited with status 0")
            return 0
        if kind == "timeout":
            log(f"timed out after {timeout:g} s; stopped all processes.")
            return code
        failures += 1
        what = (f"process {i} exited with status {code}" if kind == "failed"
                else f"process {i} stopped making progress (heartbeat)")
        if attempt == restarts:
            log(f"{what}; stopped the others; "
                + (f"no restart left ({restarts} used); " if restarts else "")
                + f"exiting with status {code}.")
            return code
        log(f"{what}; stopped the others; restart {attempt + 1} of {restarts} with "
            f"{max(min_processes, n - failures)} process(es)")
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m whalex.launch",
        description="Run N local processes of a script as one multi-process JAX run (loopback coordinator).")
    ap.add_argument("-n", "--nproc", type=int, required=True, help="number of processes")
    pin = ap.add_mutually_exclusive_group()
    pin.add_argument("--cores-per-process", type=int, default=None, metavar="K",
                     help="pin process i to cores [i*K, (i+1)*K) of the available cores")
    pin.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    ap.add_argument("--timeout", type=float, default=None, metavar="S",
                    help="stop every process and exit 124 after S seconds (the whole run, restarts included)")
    ap.add_argument("--host", default="127.0.0.1", help="coordinator host (default: loopback)")
    ap.add_argument("--restarts", type=int, default=0, metavar="K",
                    help="after a failure (non-zero exit, heartbeat timeout), stop all and start again, "
                         "up to K times (default 0: a failure ends the run)")
    ap.add_argument("--heartbeat-timeout", type=float, default=None, metavar="S",
                    help="a process whose heartbeat (whalex.distributed.heartbeat(), called by every step) "
                         "is older than S seconds counts as failed (default: not watched)")
    ap.add_argument("--startup-grace", type=float, default=300.0, metavar="S",
                    help="with --heartbeat-timeout: seconds a process may take to its first heartbeat "
                         "(import, compilation; default 300)")
    ap.add_argument("--min-processes", type=int, default=None, metavar="P",
                    help="restart k after k failures runs max(P, N - k) processes (default: N)")
    ap.add_argument("--grace", type=float, default=5.0, metavar="S",
                    help="seconds between SIGTERM and SIGKILL when stopping processes (default 5)")
    ap.add_argument("script", help="the Python script every process runs")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    a = ap.parse_args(argv)
    problem = argument_error(a.nproc, a.restarts, a.min_processes, a.heartbeat_timeout, a.startup_grace, a.grace,
                             a.timeout, a.cores_per_process)
    if problem is None and not os.path.isfile(a.script):
        problem = f"script {a.script!r} not found (the Python file every process runs)"
    if problem:
        ap.error(problem)            # the usage line and the problem on stderr, exit status 2, no traceback
    return launch(a.nproc, [sys.executable, a.script, *a.args], a.cores_per_process, not a.no_pin, a.timeout,
                  a.host, restarts=a.restarts, heartbeat_timeout=a.heartbeat_timeout,
                  startup_grace=a.startup_grace, min_processes=a.min_processes, grace=a.grace)


if __name__ == "__main__":
    sys.exit(main())
