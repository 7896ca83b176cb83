"""bench/memory.py --remat-only: whalex's remat options beside the hand-written nn.remat models, on
the bench's own model, in the suite (seconds), so the comparison cannot rot."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_memory_bench_compares_remat_with_the_hand_written_model(tmp_path):
    out = tmp_path / "memory_remat.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "memory.py"), "--remat-only", "--layers", "2",
                        "--d-model", "64", "--vocab", "512", "--remat-batch", "512", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    remat = json.loads(out.read_text())["remat"]
    assert all(remat["checks"].values()), remat["checks"]
    full, dots, auto = remat["rows"]
    assert full["hand_written"] == "nn.remat(Block)" and 0 < full["whalex_saved_fraction"] < 1
    assert full["whalex_flops_ratio"] > 1.05                     # it recomputes the blocks' forward
    assert abs(dots["whalex_saved_fraction"] / dots["hand_saved_fraction"] - 1) < 0.05
    assert auto["fits"] and "nn.remat(Block)" in p.stdout
