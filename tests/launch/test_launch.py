"""Real multi-process runs on loopback through `python -m whalex.launch`.

Two processes, each with 1 or 2 CPU devices, join one jax.distributed group (gloo collectives)
and train a data-parallel MLP with whalex, with the even plan and with a balanced plan that gives
process 0 more rows. Each process fills only its `plan.local_rows` of the global batch (the rest
is NaN). Losses and parameters must match single-device training in this process. The launcher's
argument errors exit 2 with its usage, before any process starts.
"""
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import whalex as wh
from conftest import reference_train, rel_err
from support import launch_worker as worker, restart_worker

WORKERS = pathlib.Path(__file__).resolve().parents[1] / "support"   # the workers, run from their folder
ROOT = WORKERS.parents[1]


def child_env(devices_per_process: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices_per_process}"])
    env["JAX_PLATFORMS"] = "cpu"
    for var in ("WHALEX_COORDINATOR_ADDRESS", "WHALEX_NUM_PROCESSES", "WHALEX_PROCESS_ID"):
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def run_launch(args, env, timeout=120):
    return subprocess.run([sys.executable, "-m", "whalex.launch", *args], env=env, cwd=WORKERS,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def reference():
    params, batch = worker.data()
    return reference_train(worker.loss_fn, params, batch, worker.optimizer(), worker.STEPS)


@pytest.mark.parametrize("devices_per_process", [1, 2])
def test_two_processes_match_single_device(tmp_path, reference, devices_per_process):
    r = run_launch(["-n", "2", "--timeout", "100", "launch_worker.py", str(tmp_path)],
                   child_env(devices_per_process))
    assert r.returncode == 0, f"launch failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    assert "[0] even:" in r.stdout and "[1] balanced:" in r.stdout       # output forwarded with prefixes
    check_results(tmp_path, reference, devices_per_process)


def check_results(out_dir, reference, devices_per_process):
    ref_losses, ref_params = reference
    params0, batch = worker.data()
    B, k = worker.B, 2 * devices_per_process
    for name in ("even", "balanced"):
        results = [np.load(out_dir / f"{name}_{i}.npz") for i in range(2)]
        for res in results:
            np.testing.assert_allclose(res["losses"], ref_losses, rtol=1e-5, atol=0)
            for key in params0:
                err = rel_err(res[f"param_{key}"], ref_params[key])
                assert err < 1e-5, f"{name}: param {key} differs from single-device training: {err:.2e}"
        assert max(rel_err(ref_params[key], params0[key]) for key in params0) > 1e-3     # training moved
        sizes = results[0]["batch_sizes"]
        owners = results[0]["owners"]
        assert len(sizes) == k and sizes.sum() == B
        assert list(owners) == sorted(owners) and set(owners) == {0, 1}
        # local_rows(i) is the contiguous run of rows owned by process i's devices
        rows = [[tuple(r) for r in res["local_rows"]] for res in results]
        n0 = int(sizes[owners == 0].sum())
        assert rows == [[(0, n0)], [(n0, B)]]
        if name == "even":
            assert not results[0]["applied"] and n0 == B // 2
        else:
            assert results[0]["applied"] and n0 > B // 2           # process 0's devices measured 2x faster
            assert len(set(sizes[owners == 0])) == 1 and sizes[owners == 0][0] > sizes[owners == 1][0]


def _free_port_in(lo, hi):
    import random
    import socket
    for port in random.sample(range(lo, hi + 1), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    pytest.fail(f"no free port in [{lo}, {hi}]")


def test_scheduler_environment_with_auto(tmp_path, reference):
    """The same worker under a (simulated) Open MPI launch: WHALEX_DISTRIBUTED=auto makes whalex call
    jax.distributed.initialize() with no arguments, and JAX's cluster detection finds the group."""
    port = _free_port_in(65536 - 4096, 65535)             # JAX derives the port from the Open MPI job id
    job_id = (port - (65536 - 4096)) * 4096
    procs = []
    for i in range(2):
        env = child_env(1)
        env.update(WHALEX_DISTRIBUTED="auto", OMPI_MCA_orte_hnp_uri=f"{job_id}.0;tcp://127.0.0.1:1",
                   OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK=str(i), OMPI_COMM_WORLD_LOCAL_RANK=str(i))
        procs.append(subprocess.Popen([sys.executable, "launch_worker.py", str(tmp_path)], env=env, cwd=WORKERS,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    check_results(tmp_path, reference, 1)


def test_launch_propagates_failure_and_stops_the_others(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\n"
        "i = int(os.environ['WHALEX_PROCESS_ID'])\n"
        "print('up', i, os.environ['WHALEX_NUM_PROCESSES'], os.environ['WHALEX_COORDINATOR_ADDRESS'], flush=True)\n"
        "if i == 1:\n"
        "    sys.exit(3)\n"
        "time.sleep(60)\n")
    r = run_launch(["-n", "3", "--no-pin", str(script)], child_env(1), timeout=40)
    assert r.returncode == 3, r.stderr
    assert "[1] up 1 3 127.0.0.1:" in r.stdout and "process 1 exited with status 3" in r.stderr
    ok = tmp_path / "ok.py"
    ok.write_text("import sys; print('args', sys.argv[1:])\n")
    r = run_launch(["-n", "2", str(ok), "--flag", "x"], child_env(1), timeout=40)
    assert r.returncode == 0 and "[0] args ['--flag', 'x']" in r.stdout and "[1] args" in r.stdout


def test_core_sets():
    from whalex.launch import core_sets
    assert core_sets(2, None, True, [0, 1]) == [[0], [1]]
    assert core_sets(3, None, True, [0, 1]) == [None] * 3              # more processes than cores
    assert core_sets(2, 2, True, [0, 1, 2, 3]) == [[0, 1], [2, 3]]
    assert core_sets(2, None, False, [0, 1]) == [None, None]


def test_maybe_initialize_is_a_no_op_without_launch_env():
    from whalex.distributed import launch_env, maybe_initialize
    assert launch_env() is None and maybe_initialize() is False
    assert not jax.distributed.is_initialized() and len(jax.devices()) == 8


def test_touching_devices_before_joining_is_a_clear_error():
    env = child_env(1)
    env.update(WHALEX_COORDINATOR_ADDRESS="127.0.0.1:1", WHALEX_NUM_PROCESSES="2", WHALEX_PROCESS_ID="1")
    code = ("import jax; jax.devices()\n"
            "import warnings; warnings.simplefilter('error')\n"
            "try:\n"
            "    import whalex\n"
            "except RuntimeWarning as w:\n"
            "    print('warned:', w)\n"
            "warnings.simplefilter('ignore')\n"
            "import whalex as wh\n"
            "try:\n"
            "    wh.Cluster.detect()\n"
            "except RuntimeError as e:\n"
            "    print('raised:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "warned: this is process 1 of 2" in r.stdout
    assert "raised: this is process 1 of 2" in r.stdout and "maybe_initialize()" in r.stdout


# ---- restarts and heartbeats ---------------------------------------------------------------------


def start_launch(args, env, out_dir):
    """The launcher in the background, its output in files (no pipe to fill)."""
    so, se = open(out_dir / "launch.out", "w"), open(out_dir / "launch.err", "w")
    p = subprocess.Popen([sys.executable, "-m", "whalex.launch", *args], env=env, cwd=WORKERS, stdout=so, stderr=se)
    so.close()
    se.close()
    return p


def finish(p, out_dir, timeout):
    try:
        p.wait(timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, (out_dir / "launch.out").read_text(), (out_dir / "launch.err").read_text()


def wait_progress(out_dir, i, step, timeout=60.0, restart=0):
    """Wait until process i of start `restart` finished `step` steps; its pid."""
    path, end = out_dir / f"progress_{i}", time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            r, s, pid = map(int, path.read_text().split())
            if r == restart and s >= step:
                return pid
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    pytest.fail(f"process {i} did not reach step {step} in {timeout} s")


def starts(out_dir, i):
    """[(restart, nproc, first_step)] for every start of process i."""
    return [tuple(map(int, line.split()[:3])) for line in (out_dir / f"starts_{i}.txt").read_text().splitlines()]


STEPS = 40


def check_mechanics_results(out_dir, nproc):
    for i in range(nproc):
        np.testing.assert_array_equal(np.load(out_dir / f"result_{i}.npy"), restart_worker.uninterrupted(i, STEPS))


def test_restart_after_a_killed_worker_completes(tmp_path):
    p = start_launch(["-n", "2", "--no-pin", "--restarts", "1", "--grace", "1", "--timeout", "50",
                      "restart_worker.py", str(tmp_path), str(STEPS)], child_env(1), tmp_path)
    wait_progress(tmp_path, 0, 5)                                       # both have a step-5 checkpoint:
    pid = wait_progress(tmp_path, 1, 5)                                 # process 0 may start a step later
    os.kill(pid, signal.SIGKILL)
    rc, out, err = finish(p, tmp_path, 50)
    assert rc == 0, err
    assert "[whalex.launch] process 1 exited with status 137" in err
    assert "restart 1 of 1 with 2 process(es)" in err and "attempt 1: all 2 process(es) exited with status 0" in err
    for i in range(2):
        s = starts(tmp_path, i)
        assert [(r, n) for r, n, _ in s] == [(0, 2), (1, 2)] and s[1][2] >= 5      # resumed, not from 0
    check_mechanics_results(tmp_path, 2)


def test_stopped_worker_is_detected_by_heartbeat_and_restarted(tmp_path):
    p = start_launch(["-n", "2", "--no-pin", "--restarts", "1", "--heartbeat-timeout", "2.5",
                      "--startup-grace", "30", "--grace", "1", "--timeout", "50",
                      "restart_worker.py", str(tmp_path), str(STEPS)], child_env(1), tmp_path)
    pid = wait_progress(tmp_path, 0, 5)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    wait_progress(tmp_path, 0, 6, restart=1, timeout=30)                # the restarted process 0 moves on
    assert time.monotonic() - stopped < 2.5 + 10
    rc, out, err = finish(p, tmp_path, 50)
    assert rc == 0, err
    assert "process 0: heartbeat timeout" in err and "restart 1 of 1 with 2 process(es)" in err
    assert "process 0: first heartbeat" in err
    with pytest.raises(ProcessLookupError):                             # the stopped process is gone
        os.kill(pid, 0)
    assert [r for r, _, _ in starts(tmp_path, 0)] == [0, 1]
    check_mechanics_results(tmp_path, 2)


def test_min_processes_restarts_with_fewer_processes(tmp_path):
    env = child_env(1)
    env["FAIL_FIRST_START"] = "1"
    r = run_launch(["-n", "2", "--no-pin", "--restarts", "2", "--min-processes", "1", "--grace", "1",
                    "--timeout", "50", "restart_worker.py", str(tmp_path), "10"], env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "process 1 exited with status 5" in r.stderr and "restart 1 of 2 with 1 process(es)" in r.stderr
    assert "attempt 1: starting 1 process(es)" in r.stderr
    assert [(r_, n) for r_, n, _ in starts(tmp_path, 0)] == [(0, 2), (1, 1)]
    assert [(r_, n) for r_, n, _ in starts(tmp_path, 1)] == [(0, 2)]      # slot 1 not started again
    np.testing.assert_array_equal(np.load(tmp_path / "result_0.npy"), restart_worker.uninterrupted(0, 10))


def test_no_restarts_keeps_failing_fast(tmp_path):
    """--restarts 0 (the default): a killed worker ends the run with its status; a stopped one, with
    --heartbeat-timeout, ends it with 124 instead of hanging the launcher."""
    p = start_launch(["-n", "2", "--no-pin", "--grace", "1", "--timeout", "50",
                      "restart_worker.py", str(tmp_path), str(STEPS)], child_env(1), tmp_path)
    os.kill(wait_progress(tmp_path, 1, 3), signal.SIGKILL)
    rc, out, err = finish(p, tmp_path, 30)
    assert rc == 137, err
    assert "process 1 exited with status 137; stopped the others; exiting with status 137." in err
    assert "restart 1" not in err and [r for r, _, _ in starts(tmp_path, 0)] == [0]
    (tmp_path / "hb").mkdir()
    p = start_launch(["-n", "2", "--no-pin", "--heartbeat-timeout", "2.5", "--grace", "1", "--timeout", "50",
                      "restart_worker.py", str(tmp_path / "hb"), str(STEPS)], child_env(1), tmp_path)
    pid = wait_progress(tmp_path / "hb", 1, 3)
    os.kill(pid, signal.SIGSTOP)
    rc, out, err = finish(p, tmp_path, 30)
    assert rc == 124, err
    assert "process 1: heartbeat timeout" in err
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_startup_grace_bounds_a_worker_that_never_heartbeats(tmp_path):
    script = tmp_path / "silent.py"
    script.write_text("import time; time.sleep(60)\n")
    t0 = time.monotonic()
    r = run_launch(["-n", "1", "--no-pin", "--heartbeat-timeout", "1", "--startup-grace", "1.5", "--grace", "0.5",
                    "--restarts", "1", str(script)], child_env(1), timeout=40)
    assert r.returncode == 124, r.stderr
    assert r.stderr.count("no heartbeat within the startup grace of 1.5 s") == 2 and time.monotonic() - t0 < 20


def test_heartbeat_touches_the_file_at_most_once_a_second(tmp_path, monkeypatch):
    from whalex import distributed
    assert distributed.heartbeat() is False                          # not under whalex.launch: no-op
    path = tmp_path / "hb"
    monkeypatch.setenv(distributed.HEARTBEAT, str(path))
    monkeypatch.setattr(distributed, "_last_beat", -float("inf"))
    assert distributed.heartbeat() is True and path.exists()
    assert distributed.heartbeat() is False                          # throttled
    monkeypatch.setattr(distributed, "_last_beat", time.monotonic() - 2)
    os.utime(path, (0, 0))
    assert distributed.heartbeat() is True and path.stat().st_mtime > time.time() - 10


# ---- restarts from real checkpoints: wh.CheckpointManager ------------------------------------------

CKPT_STEPS, KILL_AT = 8, 3


@pytest.fixture(scope="module")
def ckpt_reference():
    params, batch = worker.data()
    return reference_train(worker.loss_fn, params, batch, worker.optimizer(), CKPT_STEPS)


def run_checkpoint_worker(tmp_path, devices_per_process, *flags, sig="KILL", heartbeat=20, grace=1):
    """checkpoint_worker.py under `whalex.launch -n 2 --restarts 1`: the last process sends itself SIG`sig`
    after step KILL_AT's checkpoint on the first start; the launcher's stderr."""
    r = run_launch(["-n", "2", "--no-pin", "--restarts", "1", "--heartbeat-timeout", str(heartbeat),
                    "--startup-grace", "90", "--grace", str(grace), "--timeout", "110", *flags, "checkpoint_worker.py",
                    str(tmp_path), str(CKPT_STEPS), str(KILL_AT), sig], child_env(devices_per_process), timeout=130)
    assert r.returncode == 0, f"launch failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    assert f"[1] process 1: sending myself SIG{sig} after step 3" in r.stdout
    assert ("status 137" if sig == "KILL" else "heartbeat timeout") in r.stderr
    return r.stderr


def starts_with_devices(out_dir, i):
    """[(restart, nproc, first_step, devices)] for every start of checkpoint_worker process i."""
    return [tuple(map(int, line.split()[:4])) for line in (out_dir / f"starts_{i}.txt").read_text().splitlines()]


def check_checkpoint_result(out_dir, reference, first=KILL_AT):
    """Process 0's final params (and the losses of the resumed start, from step `first`) equal uninterrupted
    single-device training; the checkpoint directory holds the last two steps (max_to_keep=2)."""
    ref_losses, ref_params = reference
    params0, _ = worker.data()
    res = np.load(out_dir / "result.npz")
    assert int(res["first"]) == first
    np.testing.assert_allclose(res["losses"], ref_losses[first:], rtol=1e-5, atol=0)
    for key in params0:
        err = rel_err(res[f"param_{key}"], ref_params[key])
        assert err < 1e-5, f"param {key} differs from uninterrupted single-device training: {err:.2e}"
    assert max(rel_err(ref_params[key], params0[key]) for key in params0) > 1e-3          # training moved
    saved = sorted(int(p.name) for p in (out_dir / "ckpt").iterdir() if p.name.isdigit())
    assert saved == [CKPT_STEPS - 1, CKPT_STEPS]


def test_checkpoint_manager_restart_after_a_killed_worker(tmp_path, ckpt_reference):
    """Two jax.distributed processes save a wh.CheckpointManager checkpoint every step; one is
    SIGKILLed; the launcher restarts both, they restore the latest checkpoint and finish, equal to an
    uninterrupted single-device run."""
    err = run_checkpoint_worker(tmp_path, 1)
    assert "restart 1 of 1 with 2 process(es)" in err and "attempt 1: all 2 process(es) exited with status 0" in err
    for i in range(2):
        assert starts_with_devices(tmp_path, i) == [(0, 2, 0, 2), (1, 2, KILL_AT, 2)]
    check_checkpoint_result(tmp_path, ckpt_reference)


def test_checkpoint_manager_restart_after_a_stopped_worker(tmp_path, ckpt_reference):
    """A hung worker: SIGSTOP instead of SIGKILL. Nothing exits, so only the heartbeat shows it:
    the launcher stops both within the timeout, restarts, and the run resumes from the latest checkpoint.
    (The stop sends SIGTERM and SIGCONT before SIGKILL; jax.distributed handles SIGTERM, so the woken
    processes may train and checkpoint a few more steps first: the restart resumes from whichever is latest.)"""
    err = run_checkpoint_worker(tmp_path, 1, sig="STOP", heartbeat=6, grace=0)
    assert "restart 1 of 1 with 2 process(es)" in err and "attempt 1: all 2 process(es) exited with status 0" in err
    first = starts_with_devices(tmp_path, 0)[1][2]
    assert KILL_AT <= first < CKPT_STEPS
    for i in range(2):
        assert starts_with_devices(tmp_path, i) == [(0, 2, 0, 2), (1, 2, first, 2)]
    check_checkpoint_result(tmp_path, ckpt_reference, first)


def test_checkpoint_manager_restart_on_fewer_processes(tmp_path, ckpt_reference):
    """With --min-processes 1 the run restarts with the one process left, re-plans onto its
    2 devices (4 before), restores the checkpoint 2 processes saved, and equals the reference."""
    err = run_checkpoint_worker(tmp_path, 2, "--min-processes", "1")
    assert "restart 1 of 1 with 1 process(es)" in err and "attempt 1: all 1 process(es) exited with status 0" in err
    assert starts_with_devices(tmp_path, 0) == [(0, 2, 0, 4), (1, 1, KILL_AT, 2)]
    assert starts_with_devices(tmp_path, 1) == [(0, 2, 0, 4)]                     # slot 1 not started again
    check_checkpoint_result(tmp_path, ckpt_reference)


# -------------------------------------------------------------------------------- the launcher

@pytest.mark.parametrize("args,message", [
    (["-n", "0", "x.py"], "-n/--nproc must be >= 1"),
    (["-n", "2", "--restarts", "-1", "{script}"], "--restarts must be >= 0"),
    (["-n", "2", "--min-processes", "3", "{script}"], r"--min-processes must be in \[1, 2\]"),
    (["-n", "2", "--timeout", "0", "{script}"], "--timeout must be > 0"),
    (["-n", "2", "missing.py"], "script 'missing.py' not found"),
], ids=["n0", "restarts", "min-processes", "timeout", "script"])
def test_launcher_argument_errors_exit_2_with_usage(args, message, tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    argv = [a.format(script=script) for a in args]
    r = subprocess.run([sys.executable, "-m", "whalex.launch", *argv], env=child_env(1), cwd=WORKERS,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "usage: python -m whalex.launch" in r.stderr and "Traceback" not in r.stderr
    assert __import__("re").search(message, r.stderr), r.stderr
    assert "ran" not in r.stdout                                 # no process was started


def test_launch_function_raises_a_config_error():
    from whalex.launch import launch
    with pytest.raises(wh.ConfigError, match="-n/--nproc must be >= 1"):
        launch(0, [sys.executable, "-c", "pass"])
