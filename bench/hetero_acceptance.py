"""How often do whalex's balanced plans land within their bars, beside how often the fastest split itself
does when built and timed again? Read from recorded sweeps.

What it reads
    `bench/results/hetero_sweep.json`'s variants (``--variants``, name prefixes), each run of
    `bench/hetero_sweep.py`: its confirmation's per-round block medians of whalex's calibrated and refined
    plans (calibrated on a quarter of the batch and on all of it), of the sweep's fastest splits, and of the
    A/A twin (the sweep's fastest split built as a second step and timed beside it).

What it computes
    Per plan, the median over rounds of its block's median over the fastest found's in the same round, with
    a 90% bootstrap interval over the rounds (`harness.paired_ratio`), as `bench/hetero_sweep.py` prints it.
    The bars: calibrated within 5% (``--calibrated``), refined within 3% (``--refined``). The twin is a
    plan that is the sweep's fastest split, measured as the plans are (against the fastest found, chosen
    from the same confirmation): how often it lands within a bar is how often a perfect plan can, in one
    run, at that run's noise. A plan whose interval lies wholly above its bar is a miss the run can tell
    from noise ("beyond"), unless the run's twin is beyond that bar too (`tellable`: that run's floor
    lies above the bar). Where a refinement moved the split, the refined plan over its own calibrated plan,
    paired the same way: what refining bought against not refining.

    python bench/hetero_acceptance.py [--variants PREFIX,...] [--runs]     (default: `VARIANTS`)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import harness
from hetero_sweep import emulation

RESULTS = pathlib.Path(__file__).parent / "results" / "hetero_sweep.json"
PLANS = ("whalex (quarter)", "whalex (whole)", "refined (quarter)", "refined (whole)")


@dataclasses.dataclass(frozen=True)
class Ratio:
    """One plan against the fastest found: the paired median and its 90% interval."""

    plan: str
    mid: float
    lo: float
    hi: float
    where: str = ""                    # the variant and setting it was measured in

    def __str__(self) -> str:
        return f"{self.where}  {self.plan} {self.mid:.3f} [{self.lo:.3f}-{self.hi:.3f}]"

    def within(self, bar: float) -> bool:
        return self.mid <= bar

    def beyond(self, bar: float) -> bool:
        return self.lo > bar


def fastest(run: dict) -> dict | None:
    """The fastest found: the sweep point with the least confirmed median (None: a run before the
    confirmation)."""
    confirmed = [v for v in run["variants"] if v["name"].startswith("x") and "confirmed_rounds" in v]
    return min(confirmed, key=lambda v: v["confirmed_s"]) if confirmed else None


def ratios(run: dict, where: str = "") -> list[Ratio]:
    """Each plan's and the twin's paired ratio to the fastest found, in `PLANS` order then the twin's."""
    best = fastest(run)
    if best is None:
        return []
    named = {v["name"]: v for v in run["variants"]}          # a plan timed under another name holds its rounds
    twin = next((n for n in named if n.startswith("A/A ")), None)
    out = []
    for n in (*PLANS, *([twin] if twin else [])):
        if n in named and "confirmed_rounds" in named[n]:
            out.append(Ratio(n, *harness.paired_ratio(named[n]["confirmed_rounds"], best["confirmed_rounds"]), where))
    return out


def refinement_moves(run: dict, where: str = "") -> list[Ratio]:
    """Each refined plan over its own calibrated plan (the same calibration), paired round by round, where
    the refinement moved the split: what refining bought or cost against not refining."""
    named = {v["name"]: v for v in run["variants"]}
    out = []
    for part in ("quarter", "whole"):
        cal, ref = named.get(f"whalex ({part})"), named.get(f"refined ({part})")
        if cal and ref and "confirmed_rounds" in cal and "confirmed_rounds" in ref \
                and ref.get("split", ref["rows"]) != cal.get("split", cal["rows"]):
            out.append(Ratio(f"refined ({part}) / whalex ({part})",
                             *harness.paired_ratio(ref["confirmed_rounds"], cal["confirmed_rounds"]), where))
    return out


def moves(found: list[Ratio]) -> str:
    """How the refinements that moved the split compare with not refining: faster or slower beyond their
    90% intervals, and the median of their ratios."""
    if not found:
        return "none moved the split"
    mids = [r.mid for r in found]
    faster, slower = sum(r.hi < 1 for r in found), sum(r.lo > 1 for r in found)
    return (f"{len(found)} moved the split: faster beyond noise in {faster}, slower beyond noise in {slower}, "
            f"median ratio {harness.median(mids):.3f} (range {min(mids):.3f}-{max(mids):.3f})")


def setting(name: str, run: dict) -> str:
    return f"{run.get('model', name.split('_')[0])} {run['batch']} {emulation(run)}"


def kind(r: Ratio) -> str:
    """"calibrated", "refined" or "twin"."""
    return "twin" if r.plan.startswith("A/A") else "refined" if r.plan.startswith("refined") else "calibrated"


def tellable(found: list[Ratio], bar: float) -> list[Ratio]:
    """The plans of one run beyond `bar` where the run can tell it: its twin (a second build of the fastest
    split) is not beyond it too (a run whose twin is beyond the bar measures its own noise above it)."""
    twin = next((r for r in found if kind(r) == "twin"), None)
    if twin is not None and twin.beyond(bar):
        return []
    return [r for r in found if kind(r) != "twin" and r.beyond(bar)]


def count(found: list[Ratio], bar: float, beyond: list[Ratio]) -> str:
    within = sum(r.within(bar) for r in found)
    return f"{within} of {len(found)} within {bar - 1:.0%}, {len(beyond)} beyond it"


VARIANTS = ",".join(["mlp_lead", "hybrid_lead", "mlp_pinned", "hybrid_pinned", "pipeline_parts",
                     "mlp_paired_points", "hybrid_paired_points", "pipeline_paired_points",
                     "mlp_extended_rounds", "hybrid_extended_rounds", "pipeline_extended_rounds",
                     "mlp_sweep_rounds", "hybrid_sweep_rounds", "pipeline_sweep_rounds"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--variants", default=VARIANTS,
                    help="comma-separated name prefixes of the variants to read")
    ap.add_argument("--calibrated", type=float, default=1.05, help="the calibrated plans' bar")
    ap.add_argument("--refined", type=float, default=1.03, help="the refined plans' bar")
    ap.add_argument("--runs", action="store_true", help="print every plan's ratio, run by run")
    args = ap.parse_args(argv)
    bars = {"calibrated": args.calibrated, "refined": args.refined}
    prefixes = tuple(args.variants.split(","))
    data = json.loads(RESULTS.read_text())["variants"]
    groups: dict[str, list[Ratio]] = {"calibrated": [], "refined": [], "twin": []}
    beyond: dict[str, list[Ratio]] = {"calibrated": [], "refined": [], "twin": []}
    moved: list[Ratio] = []
    for name, variant in data.items():
        if not name.startswith(prefixes):
            continue
        for run in variant.get("runs", []):
            where = f"{name} ({setting(name, run)})"
            found = ratios(run, where)
            moved += refinement_moves(run, where)
            for r in found:
                groups[kind(r)].append(r)
            for k, bar in bars.items():
                beyond[k] += [r for r in tellable(found, bar) if kind(r) == k]
            beyond["twin"] += [r for r in found if kind(r) == "twin" and r.beyond(args.refined)]
            if args.runs:
                print("\n".join(map(str, found)))
    cal, ref = args.calibrated, args.refined
    twins = groups["twin"]
    print(f"calibrated plans: {count(groups['calibrated'], cal, beyond['calibrated'])}")
    print(f"refined plans:    {count(groups['refined'], ref, beyond['refined'])}")
    print(f"A/A twins:        {count(twins, ref, beyond['twin'])}; "
          f"{count(twins, cal, [r for r in twins if r.beyond(cal)])}")
    print(f"refined over calibrated: {moves(moved)}")
    for k in ("calibrated", "refined", "twin"):
        for r in beyond[k]:
            print(f"  {k} beyond {bars.get(k, ref) - 1:.0%}: {r}")


if __name__ == "__main__":
    main()
