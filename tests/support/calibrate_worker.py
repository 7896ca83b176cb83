"""Helper for tests/balance/test_calibrate.py: one process of
`python -m whalex.launch -n 2 calibrate_worker.py OUT_DIR`.

Calibrates every process's devices (each process times only its own, then medians and spreads are
all-gathered and grouped), the links between them (the cluster spans processes) and each device's step
extras (`step_timing.time_extras`, each process timing its own devices), and writes what
this process got to OUT_DIR/calib_{process}.npz.
"""
import sys


def main(out_dir: str):
    import os

    import jax
    import numpy as np

    import whalex as wh  # joins the process group (whalex.launch env)
    from whalex.balance.calibrate import calibrate
    from whalex.balance.step_timing import time_extras

    cluster = calibrate(wh.Cluster.detect(), size=128, chain=2, repeats=5)
    extras = time_extras(cluster.devices, {"w": np.zeros((64, 64), np.float32)},
                         {"x": np.ones((16, 8), np.float32)}, block=8, repeats=3)
    owners = [d.process_index for d in cluster.devices]
    links = [] if cluster.links is None else [cluster.links.latency, cluster.links.bandwidth]
    np.savez(os.path.join(out_dir, f"calib_{jax.process_index()}.npz"), speeds=np.array(cluster.speeds),
             spread=np.array(cluster.spread), owners=np.array(owners), links=np.array(links),
             extras=extras)
    print(f"speeds {[round(s / 1e9, 1) for s in cluster.speeds]} GFLOP/s, spread {np.round(cluster.spread, 3)}")


if __name__ == "__main__":
    main(sys.argv[1])
