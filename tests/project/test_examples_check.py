"""Each example's --check fails (exit status 1, a message) on a deliberately wrong plan.

The hidden `--perturb` flag doubles the whalex side's learning rate: the parameters then leave
single-device training's by ~1e-2, far past the 1e-4 tolerance. The scripts run as `__main__`
(runpy, in this process: the 8 simulated devices are already there) on tiny sizes, with `--steps 0`
(the comparison alone). That the check passes on the right plan: tests/moe/test_moe.py (the MoE example).
"""
import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = {
    "hybrid_classification.py": ["--classes", "64", "--image-size", "8", "--width", "8", "--batch", "16"],
    "pipeline_transformer.py": ["--layers", "1", "--stages", "2", "--d-model", "16", "--heads", "2", "--seq", "8",
                                "--vocab", "16", "--batch", "16", "--micro-batches", "2", "--warmup", "0"],
    "moe_transformer.py": ["--layers", "1", "--moe-every", "1", "--d-model", "16", "--heads", "2", "--experts", "8",
                           "--expert-hidden", "16", "--seq", "8", "--vocab", "16", "--batch", "16"],
}


def _run(monkeypatch, script, *flags):
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / script), *TINY[script], "--steps", "0", "--check",
                                      "--check-steps", "1", *flags])
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")


@pytest.mark.parametrize("script", sorted(TINY))
def test_check_fails_on_a_wrong_plan(monkeypatch, capsys, script):
    with pytest.raises(SystemExit) as exit_:
        _run(monkeypatch, script, "--perturb")
    assert exit_.value.code not in (0, None)                    # sys.exit(message): status 1
    assert "check failed" in str(exit_.value.code)
    assert "FAILED" in capsys.readouterr().out
