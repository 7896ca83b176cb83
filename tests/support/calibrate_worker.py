"""Helper for tests/balance/test_calibrate.py: one process of
`python -m whalex.launch -n 2 calibrate_worker.py OUT_DIR`.

Calibrates every process's devices (each process times only its own, then medians and spreads are
all-gathered and grouped), and the links between them (the cluster spans processes), and writes what
this process got to OUT_DIR/calib_{process}.npz.
"""
import sys


def main(out_dir: str):
    import os

    import jax
    import numpy as np

    import whalex as wh  # joins the process group (whalex.launch env)
    from whalex.balance.calibrate import calibrate

    cluster = calibrate(wh.Cluster.detect(), size=128, chain=2, repeats=5)
    owners = [d.process_index for d in cluster.devices]
    links = [] if cluster.links is None else [cluster.links.latency, cluster.links.bandwidth]
    np.savez(os.path.join(out_dir, f"calib_{jax.process_index()}.npz"), speeds=np.array(cluster.speeds),
             spread=np.array(cluster.spread), owners=np.array(owners), links=np.array(links))
    print(f"speeds {[round(s / 1e9, 1) for s in cluster.speeds]} GFLOP/s, spread {np.round(cluster.spread, 3)}")


if __name__ == "__main__":
    main(sys.argv[1])
