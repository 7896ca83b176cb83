"""Reading compiled HLO text (`jax.stages.Compiled.as_text()`: after the SPMD partitioner, what one
device runs): its collectives, its computations and their loops.

Text only, no JAX: the tests read which collectives a plan compiles to (tests/support/hlo.py), and bench/
reads their bytes (bench/harness.py adds the bytes each device sends, `whalex.records.comm.result_ring_bytes`).

    for c in collectives(compiled.as_text()):
        c.kind, c.arrays, c.bytes, c.group       # 'all-reduce', (('f32', (512, 512)),), 1048576.0, 8
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

from whalex.records.comm import KINDS, result_ring_bytes

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0,
               "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5}

# `%name = <result type> op(...)`; the result type is an array type or a (possibly nested) tuple
_COLLECTIVE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+(" + "|".join(KINDS) +
                         r")(-start|-done)?\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')

Array = tuple  # (dtype name, shape)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program (an async `-start`/`-done` pair counted once)."""

    kind: str                       # one of KINDS (whalex.records.comm)
    arrays: tuple                   # its result arrays, (dtype, shape) each; async: the `-done`'s result
    is_async: bool
    group: int | None               # devices in one group; None: every device (`replica_groups={}`)
    op_name: str                    # the JAX operation it was partitioned from (HLO metadata), or ""

    @property
    def bytes(self) -> float:
        """Bytes of its result arrays."""
        return nbytes(self.arrays)


def arrays(type_text: str) -> tuple:
    """The (dtype, shape) arrays of an HLO type (an array type or a tuple of them)."""
    return tuple((dt, tuple(int(d) for d in dims.split(",") if d))
                 for dt, dims in _ARRAY.findall(type_text) if dt in DTYPE_BYTES)


def nbytes(arrs) -> float:
    return float(sum(DTYPE_BYTES[dt] * math.prod(shape) for dt, shape in arrs))


def _group(rest: str) -> int | None:
    """Devices in one group of a collective, from its attributes; None when it spans every device."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)  # mesh['a'=8,'b'=1] {'a'}
    if m:
        sizes = dict(re.findall(r"'?([\w.\-]+)'?=(\d+)", m.group(1)))
        axes = re.findall(r"'?([\w.\-]+)'?", m.group(2))
        return math.prod(int(sizes[a]) for a in axes) if axes else None
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", rest)           # iota form [groups,size]<=[...]
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{(\{[0-9,]*\})", rest)           # explicit {{0,1},{2,3}}
    if m:
        ids = [x for x in m.group(1).strip("{}").split(",") if x]
        return len(ids) or None
    if re.search(r"source_target_pairs=\{", rest):                   # collective-permute: pairs
        return 2
    return None                                                      # replica_groups={}: everyone


def _op_name(line: str) -> str:
    m = _OP_NAME.search(line)
    return m.group(1) if m else ""


def collectives(text: str) -> list[Collective]:
    """Every collective instruction of HLO text, in program order (an async one where it is done)."""
    starts, found = {}, []
    for line in text.splitlines():
        m = _COLLECTIVE.match(line)
        if not m:
            continue
        name, rtype, kind, suffix, rest = m.groups()
        if suffix == "-start":
            starts[name] = (kind, _group(rest))
        elif suffix == "-done":           # its operand is the -start; its result is the collective's output
            op = re.match(r"\s*(?:[^%]*\s)?%?([\w.\-]+)", rest)
            kind, group = starts.pop(op.group(1), (kind, None)) if op else (kind, None)
            found.append(Collective(kind, arrays(rtype), True, group, _op_name(line)))
        else:
            found.append(Collective(kind, arrays(rtype), False, _group(rest), _op_name(line)))
    # a -start without its -done (not seen in XLA's output): counted, with no result
    found += [Collective(kind, (), True, group, "") for kind, group in starts.values()]
    return found


def shapes_of(text: str, kind: str) -> list[tuple]:
    """The shapes (dims sorted, since XLA may transpose) of every result of the collectives of `kind`."""
    return [tuple(sorted(s)) for c in collectives(text) if c.kind == kind for _, s in c.arrays]


def count(text: str, opcode: str) -> int:
    """Instructions with this opcode (e.g. 'while', 'dot', 'fusion', 'all-reduce-start')."""
    return len(re.findall(rf"^\s*(?:ROOT\s+)?%[\w.\-]+ = .*? {re.escape(opcode)}\(", text, re.M))


def computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    """({computation name: its instruction lines}, the entry computation's name)."""
    comps, cur, entry = {}, None, None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            cur = m.group(1)
            comps[cur] = []
            if line.startswith("ENTRY"):
                entry = cur
        elif cur is not None:
            if line.strip() == "}":
                cur = None
            else:
                comps[cur].append(line)
    return comps, entry


def trip_count(line: str) -> int | None:
    """A while instruction's trip count when XLA knows it."""
    m = _TRIP.search(line)
    return int(m.group(1)) if m else None


_CALLS = re.compile(r"\b(calls|to_apply|body)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_PREDICATED = re.compile(r"\btrue_computation=%?([\w.\-]+).*?\bfalse_computation=%?([\w.\-]+)")


def _arms(line: str) -> list[str]:
    """A conditional's branch computations in index order (a predicated one: false, then true)."""
    b = _BRANCHES.search(line)
    if b:
        return [callee.strip().lstrip("%") for callee in b.group(1).split(",")]
    p = _PREDICATED.search(line)
    return [p.group(2), p.group(1)] if p else []


def looped_collectives(text: str, largest_branch: Callable[[Collective], float] | None = None,
                       tick_arms: tuple[float, ...] | None = None) -> list[tuple[Collective, float]]:
    """(collective, trips) for every collective of compiled HLO text: in a while body, trips is its
    known trip count (nested loops multiply). Every branch of a conditional counts, or, given
    `largest_branch` (a weight per collective), only the branch whose collectives weigh the most
    (weight x trips, summed): what one step runs at most. `tick_arms`: the fraction of a loop's trips
    that runs each arm of the first conditional of its body (a pipeline tick: forward or backward),
    instead of the largest."""
    comps, entry = computations(text)

    def walk(name, trips, seen, loop_body=False):
        if name in seen or name not in comps:
            return []
        lines = comps[name]
        out = [(c, trips) for c in collectives("\n".join(lines))]
        weighted = loop_body and tick_arms is not None
        for line in lines:
            for kind, callee in _CALLS.findall(line):
                inner = trips * (trip_count(line) or 1) if kind == "body" else trips
                out += walk(callee, inner, seen | {name}, kind == "body")
            callees = _arms(line)
            if weighted and callees:
                weighted = False
                for callee, share in zip(callees, tick_arms):
                    out += walk(callee, trips * share, seen | {name})
                continue
            arms = [walk(callee, trips, seen | {name}) for callee in callees]
            if arms and largest_branch is not None:
                arms = [max(arms, key=lambda arm: sum(largest_branch(c) * t for c, t in arm))]
            for arm in arms:
                out += arm
        return out

    return walk(entry, 1, frozenset())


_START = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?\s(" + "|".join(KINDS) + r"|copy)-start\(")
_DONE_OF = re.compile(r"\s(?:" + "|".join(KINDS) + r"|copy)-done\(.*?%([\w.\-]+)")
_MATMUL = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]*(?:gemm|dot)[\w.\-]*\s*=|\sdot\(|__cublas")
_COMPUTE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=.*?\s(fusion|custom-call|convolution|dot)\(")


@dataclasses.dataclass(frozen=True)
class AsyncOverlap:
    """One asynchronous operation of a scheduled program (a collective or a host copy): its kind and
    how many compute instructions (fusions, library calls, dots) the schedule runs between its
    `-start` and its `-done`, i.e. the work that hides it."""

    kind: str
    name: str
    computation: str
    overlapped_ops: int
    overlapped_matmuls: int = 0      # of those, matrix multiplications (cuBLAS calls, dots, gemm fusions)

    @property
    def overlaps(self) -> bool:
        return self.overlapped_ops > 0


def async_overlaps(text: str) -> list[AsyncOverlap]:
    """Every async start/done pair of a scheduled HLO module (`is_scheduled=true`: instructions in
    their run order), with the compute instructions scheduled between them."""
    comps, _ = computations(text)
    out = []
    for comp, lines in comps.items():
        open_: dict[str, tuple[str, int, int]] = {}
        compute = matmuls = 0
        for line in lines:
            if _COMPUTE.match(line):
                compute += 1
                matmuls += bool(_MATMUL.search(line))
                continue
            m = _START.match(line)
            if m:
                open_[m.group(1)] = (m.group(2), compute, matmuls)
                continue
            d = _DONE_OF.search(line)
            if d and d.group(1) in open_:
                kind, at, mat = open_.pop(d.group(1))
                out.append(AsyncOverlap(kind, d.group(1), comp, compute - at, matmuls - mat))
    return out


@dataclasses.dataclass(frozen=True)
class StepCollectives:
    """The collectives of one compiled step, per device: how many, the bytes each device sends for
    them per step (ring algorithms; in loops, times the trip count; of a conditional, its heaviest
    branch), and how many run asynchronously with compute scheduled between their start and done."""

    count: int
    ring_bytes: float
    looped_bytes: float          # the part of ring_bytes sent from inside loops
    asynchronous: int
    overlapped: int
    overlapping_matmuls: int = 0     # asynchronous ones with a matrix multiplication between start and done


def step_collectives(text: str, num_devices: int, tick_arms: tuple[float, ...] | None = None) -> StepCollectives:
    """`StepCollectives` of compiled HLO text whose collectives span `num_devices` devices when their
    replica groups say nothing (`tick_arms`: see `looped_collectives`)."""
    def ring(c: Collective) -> float:
        return result_ring_bytes(c.kind, c.bytes, c.group or num_devices)

    found = looped_collectives(text, largest_branch=ring, tick_arms=tick_arms)
    looped = sum((ring(c) * trips for c, trips in found if trips > 1), 0.0)
    total = sum((ring(c) * trips for c, trips in found), 0.0)
    overlaps = [o for o in async_overlaps(text) if o.kind != "copy"]
    return StepCollectives(len(found), total, looped, len(overlaps), sum(o.overlaps for o in overlaps),
                           sum(o.overlapped_matmuls > 0 for o in overlaps))


_HOST_COPY = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\((.*)\)\s+copy-start\(")
_LAID_OUT = re.compile(r"\b[a-z]+[0-9]*[a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?")   # an array type, its layout


@dataclasses.dataclass(frozen=True)
class HostCopies:
    """The asynchronous copies between device and host memory (XLA's memory space S(5)) of one compiled
    step, per device: how many, and of those how many move to the host; the bytes moved (in loops,
    once per copy in the text); how many have compute scheduled between start and done, i.e. overlap."""

    count: int
    to_host: int
    bytes: float
    overlapped: int
    overlapping_matmuls: int = 0


def host_copies(text: str) -> HostCopies:
    """`HostCopies` of scheduled HLO text: the `copy-start`s whose source or destination lives in host
    memory (`S(5)` in its layout)."""
    moves = {}
    for line in text.splitlines():
        m = _HOST_COPY.match(line)
        if m and ":S(5)}" in m.group(2):
            dest, src = _LAID_OUT.findall(m.group(2))[:2]      # (destination, source, context)
            moves[m.group(1)] = (":S(5)}" in src and ":S(5)}" not in dest, nbytes(arrays(src)))
    overlaps = [o for o in async_overlaps(text) if o.kind == "copy" and o.name in moves]
    return HostCopies(len(moves), sum(not from_host for from_host, _ in moves.values()),
                      sum(b for _, b in moves.values()), sum(o.overlaps for o in overlaps),
                      sum(o.overlapped_matmuls > 0 for o in overlaps))

