"""Start N local processes of a script as one multi-process JAX run.

    python -m whalex.launch -n N [--cores-per-process K | --no-pin] [--timeout S] script.py [args...]

Each process i runs `python script.py args...` with

    WHALEX_COORDINATOR_ADDRESS=127.0.0.1:PORT   (a free loopback port; process 0 serves it)
    WHALEX_NUM_PROCESSES=N
    WHALEX_PROCESS_ID=i
    WHALEX_CPU_CORES=c0,c1,...                   (only when pinned: the cores it may run on)

and whalex joins the process group from them (`whalex.distributed.maybe_initialize`, called on
`import whalex` and by `Cluster(...)`). Output lines are forwarded prefixed with `[i] ` (stdout to
stdout, stderr to stderr). If any process fails, the others are stopped (SIGTERM, then SIGKILL)
and the launcher exits with that process's status; it exits 0 when all succeed.

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
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from whalex.distributed import ADDRESS, NUM_PROCESSES, PROCESS_ID


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


def _stop(procs, grace: float = 5.0):
    """SIGTERM every live child (by PID), then SIGKILL what is left after `grace` seconds."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            p.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _status(rc: int) -> int:
    return rc if rc >= 0 else 128 - rc                 # killed by signal s: 128 + s, as a shell reports


def launch(n: int, command: list[str], cores_per_process: int | None = None, pin: bool = True,
           timeout: float | None = None, host: str = "127.0.0.1", env: dict | None = None,
           stdout=None, stderr=None) -> int:
    """Run `command` (argv) as processes 0..n-1 of one group; the launcher's exit status."""
    if n < 1:
        raise ValueError(f"-n must be >= 1, got {n}.")
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    address = f"{host}:{free_port(host)}"
    sets = core_sets(n, cores_per_process, pin)
    base = dict(os.environ if env is None else env)
    base["PYTHONUNBUFFERED"] = "1"
    procs: list[subprocess.Popen] = []
    try:
        for i in range(n):                               # all children first: no threads during fork
            e = dict(base)
            e.update({ADDRESS: address, NUM_PROCESSES: str(n), PROCESS_ID: str(i)})
            if sets[i] is not None:
                e["WHALEX_CPU_CORES"] = ",".join(map(str, sets[i]))
            procs.append(subprocess.Popen(command, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          stdin=subprocess.DEVNULL, preexec_fn=_preexec(sets[i])))
    except BaseException:
        _stop(procs)
        raise
    lock = threading.Lock()
    threads = []
    for i, p in enumerate(procs):
        for stream, out in ((p.stdout, stdout), (p.stderr, stderr)):
            t = threading.Thread(target=_forward, args=(stream, out, f"[{i}] ", lock), daemon=True)
            t.start()
            threads.append(t)

    class Stopped(Exception):
        pass

    def on_signal(signum, frame):
        raise Stopped(signum)

    old = signal.signal(signal.SIGTERM, on_signal) if threading.current_thread() is threading.main_thread() else None
    start = time.monotonic()
    failed: tuple[int, int] | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                break
            if timeout is not None and time.monotonic() - start > timeout:
                failed = (-1, 124)
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        failed = (-1, 130)
    except Stopped as e:
        failed = (-1, 128 + e.args[0])
    finally:
        if failed is not None:
            _stop(procs)
        for t in threads:
            t.join(timeout=5)
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    if failed is None:
        return 0
    i, code = failed
    with lock:
        if i >= 0:
            stderr.write(f"whalex.launch: process {i} exited with status {_status(code)}; stopped the others.\n")
        elif code == 124:
            stderr.write(f"whalex.launch: timed out after {timeout:g} s; stopped all processes.\n")
        else:
            stderr.write("whalex.launch: interrupted; stopped all processes.\n")
        stderr.flush()
    return _status(code)


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
                    help="stop every process and exit 124 after S seconds")
    ap.add_argument("--host", default="127.0.0.1", help="coordinator host (default: loopback)")
    ap.add_argument("script", help="the Python script every process runs")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    a = ap.parse_args(argv)
    return launch(a.nproc, [sys.executable, a.script, *a.args], a.cores_per_process, not a.no_pin, a.timeout,
                  a.host)


if __name__ == "__main__":
    sys.exit(main())
