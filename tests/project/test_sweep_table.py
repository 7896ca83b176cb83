"""bench/hetero_sweep.py's table and bench/hetero_pipeline.py's paired gains: whalex's plans are
compared with the sweep's fastest split as timed again beside them (the confirmation), not with the
least of the sweep's own medians, which favours a lucky draw (runs recorded before the confirmation
keep the sweep's medians), and round by round, with an interval over the rounds."""
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench(module: str):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))


def _sweep_table():
    return _bench("hetero_sweep").table


def _run(confirmed: bool) -> dict:
    def v(name, median, again=None):
        out = {"name": name, "rows": [700, 324], "median_s": median, "spread": 0.02}
        return {**out, "confirmed_s": again} if confirmed and again is not None else out
    return {"slow_by": "quota", "hogs": 1, "batch": 1024,
            "variants": [v("whalex (whole)", 0.050, 0.049), v("x0.85", 0.045, 0.050), v("x0.925", 0.047, 0.048),
                         v("x1", 0.052)]}


def test_the_table_compares_with_the_confirmed_fastest_split():
    table = _sweep_table()
    rows = [r.split() for r in table([_run(True)])[2:]]
    ours = next(r for r in rows if r[3] == "whalex")
    fastest = next(r for r in rows if r[3] == "fastest")
    assert "(x0.925)" in fastest and fastest[-1] == "1.000"     # x0.85's lucky 45 ms did not hold up
    assert ours[-1] == f"{0.049 / 0.048:.3f}"


def test_runs_without_a_confirmation_use_the_sweep_medians():
    rows = [r.split() for r in _sweep_table()([_run(False)])[2:]]
    ours = next(r for r in rows if r[3] == "whalex")
    assert "(x0.85)" in next(r for r in rows if r[3] == "fastest") and ours[-1] == f"{0.050 / 0.045:.3f}"


def test_confirmed_rounds_compare_round_by_round_with_an_interval():
    """Each round's block of whalex's plan over the fastest's in that round: a round slow for both
    (drift) leaves the ratio, and the interval brackets the rounds' middle ratios."""
    run = _run(True)
    drift = [1.0, 1.0, 1.4, 1.4, 1.4, 1.0, 1.0]
    ratio = [1.01, 1.02, 1.03, 1.02, 1.02, 1.04, 1.00]
    for v in run["variants"]:
        if v["name"] == "x0.925":
            v["confirmed_rounds"] = [0.048 * d for d in drift]
        elif v["name"] == "whalex (whole)":
            v["confirmed_rounds"] = [0.048 * d * q for d, q in zip(drift, ratio)]
    ours = next(r for r in _sweep_table()([run])[2:] if "whalex" in r)
    mid, interval = ours.split()[-2:]
    lo, hi = map(float, interval.strip("[]").split("-"))
    assert mid == "1.020" and 1.0 <= lo <= 1.02 <= hi <= 1.04


def test_a_paired_ratio_is_not_the_ratio_of_medians():
    ours, fastest = [50, 60, 70, 80, 90], [60, 70, 80, 90, 45]     # faster in every round but the last
    mid, lo, hi = _bench("harness").paired_ratio(ours, fastest)
    assert abs(mid - 70 / 80) < 1e-12 and lo <= mid <= hi            # the medians' ratio is 70 / 70


def test_schedule_gains_pair_each_round_of_blocks():
    """bench/hetero_pipeline.py's paired gain: each round's block median of the baseline over the
    schedule's; a round slow for both leaves it, a run recorded without its block has none."""
    base = [1.00, 1.02, 0.98, 1.5, 1.5, 1.5, 1.0, 1.0, 1.0]            # three rounds of three calls
    zb = [0.91, 0.90, 0.93, 1.36, 1.37, 1.38, 0.91, 0.92, 0.90]
    res = {"baseline": "1f1b", "block": 3, "times": {"1f1b": base, "zb-h1": zb}}
    row = _bench("hetero_pipeline").paired_gain(res, "zb-h1")
    expected = sorted([1.00 / 0.91, 1.5 / 1.37, 1.0 / 0.91])[1] - 1
    assert abs(row["gain_paired"] - expected) < 1e-12
    assert row["gain_interval"][0] <= row["gain_paired"] <= row["gain_interval"][1]
    assert _bench("hetero_pipeline").paired_gain({k: v for k, v in res.items() if k != "block"}, "zb-h1") == {}


def test_each_split_is_timed_once_whichever_variants_chose_it():
    """Variants that share a split share its confirmation (one program), the sweep's ranking keeps the
    fastest point of each split, and the A/A twin is left out of both."""
    sweep = _bench("hetero_sweep")
    splits = {"x0.85": "800/224", "x0.925": "780/244", "x1": "780/244", "whalex (whole)": "780/244",
              "refined (whole)": "760/264", "refined (quarter)": "760/264", "A/A x0.925": "780/244"}
    timed = sweep.timed_splits(splits, ["x0.925", "x0.85"])
    assert timed == {"x0.925": "x0.925", "x0.85": "x0.85", "whalex (whole)": "x0.925",
                     "refined (whole)": "refined (whole)", "refined (quarter)": "refined (whole)"}

    class Timings:
        def times(self, name):
            return {"x0.85": [0.052], "x0.925": [0.049], "x1": [0.048]}[name]
    assert sweep.ranked_sweep(Timings(), splits) == ["x1", "x0.85"]


def test_the_twin_is_compared_with_its_own_split():
    """The A/A row is the twin over the split it was built from (the run's noise floor), even where the
    confirmation found another split fastest."""
    run = _run(True)
    rounds = {"x0.85": [0.050, 0.051, 0.049], "x0.925": [0.048, 0.048, 0.048], "whalex (whole)": [0.049] * 3}
    for v in run["variants"]:
        v.update({"confirmed_rounds": rounds[v["name"]]} if v["name"] in rounds else {})
    run["variants"].append({"name": "A/A x0.85", "rows": [700, 324], "median_s": 0.052, "spread": 0.02,
                            "confirmed_s": 0.052, "confirmed_rounds": [0.052, 0.051, 0.049]})
    twin = next(r for r in _sweep_table()([run])[2:] if "A/A" in r)
    assert twin.split()[-2] == "1.000"          # against the fastest found (x0.925): 1.063


def _accepted_run() -> dict:
    """A confirmed run: the fastest found x1, whalex's whole-batch plan slower by a constant factor in every
    round (beyond a 5% bar), its refinement kept x1's split (timed under x1's name), the twin slower by less
    than a 3% bar."""
    def v(name, rounds, **more):
        return {"name": name, "rows": [700, 324], "median_s": rounds[0], "spread": 0.0,
                "confirmed_s": sorted(rounds)[len(rounds) // 2], "confirmed_rounds": rounds, **more}
    best = [0.050, 0.051, 0.049, 0.050, 0.050]
    return {"slow_by": "busy", "hogs": 2, "batch": 1024, "model": "mlp",
            "variants": [v("whalex (whole)", [t * 1.08 for t in best]),
                         v("refined (whole)", best, timed_as="x1"),
                         v("x1", best), v("x1.15", [t * 1.02 for t in best]),
                         v("A/A x1", [t * 1.01 for t in best])]}


def test_acceptance_reads_each_plan_against_the_confirmed_fastest():
    acc = _bench("hetero_acceptance")
    found = {r.plan: r for r in acc.ratios(_accepted_run())}
    assert set(found) == {"whalex (whole)", "refined (whole)", "A/A x1"}
    assert abs(found["whalex (whole)"].mid - 1.08) < 1e-9 and found["whalex (whole)"].beyond(1.05)
    assert found["refined (whole)"].mid == 1.0 and found["refined (whole)"].within(1.03)
    twin = found["A/A x1"]
    assert twin.within(1.03) and not twin.within(1.005) and not twin.beyond(1.03)
    assert [r.plan for r in acc.tellable(list(found.values()), 1.05)] == ["whalex (whole)"]
    assert acc.count(list(found.values()), 1.05, [found["whalex (whole)"]]) == "2 of 3 within 5%, 1 beyond it"


def test_a_run_whose_twin_is_beyond_the_bar_tells_no_plan_beyond_it():
    """The twin, a second build of the fastest split, slower than the first beyond a 5% bar in every round:
    the run's floor is above that bar, so whalex's plan beyond it is not a miss the run can tell."""
    run = _accepted_run()
    twin = next(v for v in run["variants"] if v["name"] == "A/A x1")
    twin["confirmed_rounds"] = [t * 1.09 / 1.01 for t in twin["confirmed_rounds"]]
    acc = _bench("hetero_acceptance")
    found = acc.ratios(run)
    assert next(r for r in found if r.plan == "whalex (whole)").beyond(1.05)
    assert acc.tellable(found, 1.05) == []


def test_acceptance_skips_runs_before_the_confirmation():
    run = _accepted_run()
    for v in run["variants"]:
        v.pop("confirmed_rounds")
    assert _bench("hetero_acceptance").ratios(run) == []


def test_the_emulation_driver_runs_every_emulation_and_config_in_order(monkeypatch):
    harness = _bench("harness")
    sweep = _bench("hetero_sweep")
    seen, reported = [], []

    def run_config(ns, argv, hogs, batch, cores, env, script):
        seen.append((ns.slow_by, hogs, batch))
        return {"hogs": hogs, "batch": batch, "times": [0.1]}
    monkeypatch.setattr(harness, "run_config", run_config)
    args = sweep.parse(["--slow-by", "quota,busy", "--slowdowns", "1,2", "--batches", "1024"])
    runs = harness.run_emulations(args, [], (0, 1), {}, "bench.py", on_run=reported.append)
    assert seen == [("quota", 1, 1024), ("quota", 2, 1024), ("busy", 1, 1024), ("busy", 2, 1024)]
    assert [r["slow_by"] for r in runs] == ["quota", "quota", "busy", "busy"] and reported == runs
    assert args.slow_by == "quota,busy"                                    # the caller's arguments untouched


def test_every_two_process_bench_takes_the_same_emulation_arguments_and_refuses_an_unknown_one(capsys):
    import pytest
    for name in ("hetero", "hetero_sweep", "hetero_split", "hetero_pipeline", "head_noise", "step_noise",
                 "hetero_probe"):
        parse = _bench(name).parse
        args = parse(["--slow-by", "busy,quota", "--batches", "64", "--timeout", "5"])
        assert (args.slow_by, args.batches, args.timeout, args.out) == ("busy,quota", "64", 5.0, None), name
        with pytest.raises(SystemExit):
            parse(["--slow-by", "quota,cgroup"])
        assert "unknown emulation(s) 'cgroup'" in capsys.readouterr().err, name


def test_acceptance_compares_each_refinement_that_moved_the_split_with_not_refining():
    run = _accepted_run()
    acc = _bench("hetero_acceptance")
    assert acc.refinement_moves(run) == []                         # the same rows: the refinement stayed
    refined = next(v for v in run["variants"] if v["name"] == "refined (whole)")
    refined["rows"] = [680, 344]
    (move,) = acc.refinement_moves(run)
    assert move.plan == "refined (whole) / whalex (whole)" and abs(move.mid - 1 / 1.08) < 1e-9 and move.hi < 1
    assert acc.moves([move]).startswith("1 moved the split: faster beyond noise in 1, slower beyond noise in 0")
    assert acc.moves([]) == "none moved the split"


def test_head_noise_picks_as_the_calibration_decides_from_every_process():
    import numpy as np
    hn = _bench("head_noise")
    scales = [0.4, 0.55, 0.7, 0.85, 1.0, 1.15]
    v = np.array([1.3, 1.15, 1.0, 1.15, 1.3, 1.45])                      # the fastest split at x0.7
    rounds = np.tile(v, (27, 1)) * np.linspace(1.0, 1.2, 27)[:, None]      # drift: every split alike
    skewed = rounds.copy()
    skewed[:, 0] *= 0.7                                                    # process 1 alone: fastest at x0.4
    run = {"slow_by": "quota", "hogs": 2, "batch": 64, "speeds": [3.0, 1.0],
           "trials": [{"scales": scales, "times": [rounds.tolist(), rounds.tolist()]},
                      {"scales": scales, "times": [rounds.tolist(), skewed.tolist()]}]}
    from whalex.balance.head_timing import class_counts
    from whalex.mesh.cluster import scaled_speeds
    at = {s: "/".join(map(str, class_counts(2048, scaled_speeds([3.0, 1.0], s)[0]))) for s in scales}
    picked = hn.tally(run, 2048)
    assert set(picked) == {"9 rounds", "18 rounds", "all rounds", "rounds V", "least median"}
    assert picked["all rounds"][0] == at[0.7] and picked["least median"] == [at[0.7], at[0.7]]
    assert picked["all rounds"][1] != at[0.4]                  # the processes' mean, not process 1's own
    alone = {**run, "trials": [{"scales": scales, "times": [skewed.tolist()]}]}
    assert hn.tally(alone, 2048)["least median"] == [at[0.4]]
    lines = hn.report(run, 2048)                                   # no step timed: the picks alone
    assert lines[0] == "quota 1/3 batch 64" and lines[3].startswith("  all rounds: " + at[0.7])
    old = {**run, "trials": {"whole": [{"scales": scales, "times": rounds.tolist()}]}}    # one process's
    assert hn.tally(old, 2048)["all rounds"] == [at[0.7]]
