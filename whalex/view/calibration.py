"""What a calibration says and where it holds: the measured speeds, and whether the loads a plan gives
lie inside the rows calibrate timed (outside them, a device's times are extrapolated)."""
from __future__ import annotations

from whalex.view.format import fmt_devices, fmt_pct, fmt_speed, fmt_time


def speed_lines(cluster) -> list[str]:
    """Calibrated speeds, one line per group of devices that the noise made equal: the common
    speed, and the spread (or range of spreads) of the members' measurements."""
    if cluster.measured is None:
        return []
    groups: dict[float, list[int]] = {}
    for i, s in enumerate(cluster.measured):
        groups.setdefault(s, []).append(i)
    lines = ["calibrated speeds " + ("(median over timing rounds ± relative spread; speeds equal within the noise "
                                     "are merged):" if cluster.spread is not None else "(given without a spread):")]
    for speed, ids in sorted(groups.items(), key=lambda g: -g[0]):
        text = f"  {fmt_speed(speed)} on device{'s' if len(ids) > 1 else ''} {fmt_devices(tuple(ids))}"
        if cluster.spread is not None:
            lo, hi = min(cluster.spread[i] for i in ids), max(cluster.spread[i] for i in ids)
            text += f", spread ± {fmt_pct(lo)}" + (f" to {fmt_pct(hi)}" if hi > lo else "")
        if cluster.overhead is not None:
            text += f", fixed {fmt_time(cluster.overhead[ids[0]])} per step"
        lines.append(text)
    return lines


def calibrated_range_lines(plan, report) -> list[str]:
    """Where the plan's row shares fall outside the rows calibrate timed (their times extrapolated)."""
    span = plan.cluster.calibrated_rows
    if span is None or not report.of_batch:
        return []
    lo, hi = span
    rows = [d.rows if report.applied else d.even_rows for d in report.devices]
    out = [i for i, n in enumerate(rows) if not lo <= n <= hi]
    line = f"calibrated at {lo} to {hi} rows per device"
    if not out:
        return [line + ": every device's share lies inside"]
    return [f"{line}; outside it: device{'s' if len(out) > 1 else ''} {fmt_devices(tuple(out))} "
            f"({', '.join(str(rows[i]) for i in out)} rows), whose fixed and per-row times are extrapolated: "
            + _calibration_fix(span, min(rows[i] for i in out), max(rows[i] for i in out), plan.global_batch)]


def micro_batch_range_lines(plan) -> list[str]:
    """Whether a heterogeneous pipeline's micro-batch lies inside the rows calibrate timed: a stage runs
    one micro-batch at a time, so its speed is the one at those rows, not at the whole batch's."""
    span, s = plan.cluster.calibrated_rows, plan.schedule
    if span is None or s is None or len(set(plan.cluster.speeds)) < 2:
        return []
    parts = plan.layout.axis_sizes[0] * s.num_micro_batch
    micro = plan.global_batch // parts
    line = f"calibrated at {span[0]} to {span[1]} rows per device"
    if span[0] <= micro <= span[1]:
        return [f"{line}: a stage's micro-batch of {micro} rows lies inside"]
    return [f"{line}, but a stage runs one micro-batch of {micro} rows at a time, so the stage cut rests on "
            f"extrapolated speeds: calibrate(..., num_micro_batch={parts}) on the step's batch times a "
            "micro-batch's rows; or " + _calibration_fix(span, micro, micro, plan.global_batch)]


def _calibration_fix(span, fewest: int, most: int, global_batch: int) -> str:
    """How to calibrate so that loads of `fewest` to `most` rows lie inside the rows timed."""
    fix = []
    if fewest < span[0]:
        fix.append(f"a calibration batch of at most {4 * fewest} rows (its quarter is timed)")
    if most > span[1]:
        fix.append(f"one of at least {most} rows (or calibrate(..., global_batch={global_batch}), which repeats "
                   "a smaller batch's rows up to the step's)")
    return f"calibrate with {' or '.join(fix)}, or refine on the real step (Config(hardware_aware='refine'))"
