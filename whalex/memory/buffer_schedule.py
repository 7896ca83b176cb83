"""The buffers of one jaxpr level as a graph (what each equation allocates, reads and waits for), and
the most bytes live at once when its equations run in a given order or in a memory-greedy list
schedule. Plain data and pure functions: `peak.py` builds the graph from a replayed jaxpr."""
from __future__ import annotations

import dataclasses
import heapq


@dataclasses.dataclass(frozen=True)
class BufferGraph:
    """Buffers of one jaxpr level: what each equation allocates and reads, and what it waits for."""

    alloc: list              # per equation: bytes of its buffers (outputs, partial sums)
    inner: list              # per equation: the peak inside its body
    reads: list              # per equation: the buffers it reads (directly or through fused values)
    made: list               # per equation: its buffers
    inplace: list            # per equation: element-wise or a loop, so a dying operand can hold its output
    deps: list               # per equation: the equations whose outputs it takes
    size: list               # per buffer
    readers: list            # per buffer: the equations that read it
    first_only: list         # per buffer: freed at its first read (partial sums before their all-reduce)
    pinned: list             # per buffer: holds an output of the jaxpr (live to the end)
    entry: list              # per equation: buffers it reads only at its start (sliced into a shard_map)
    external: list           # per buffer: the caller's (counted there), reusable here once read
    into_caller: list        # per equation: an output it writes into a dying caller's buffer stays the caller's

def sweep(g: BufferGraph, order) -> float:
    """The most bytes live at once when the equations run in `order`. An element-wise equation
    or a loop writes its output into an operand's buffer when that operand dies there (XLA
    shares it); where the equation is `into_caller` and that buffer is the caller's, the output
    stays the caller's (`_shared`); a buffer nobody reads is freed as soon as it is made."""
    left = [len(r) for r in g.readers]
    freed = [False] * len(g.size)
    external = list(g.external)
    live = peak = 0.0
    for i in order:
        dying = []
        for b in g.reads[i]:
            left[b] -= 1
            if not freed[b] and not g.pinned[b] and (g.first_only[b] or left[b] == 0):
                freed[b] = True
                dying.append(b)
        shared, held = _shared(g, i, dying, external if g.into_caller[i] else None) if g.inplace[i] else (0.0, 0.0)
        early = sum(g.size[b] for b in dying if b in g.entry[i] and not external[b])
        peak = max(peak, live - early + max(g.inner[i], g.alloc[i] - shared))
        live += g.alloc[i] - held - sum(g.size[b] for b in dying if not external[b])
        live -= sum(g.size[b] for b in g.made[i] if not g.readers[b] and not g.pinned[b] and not external[b])
    return peak


def _shared(g: BufferGraph, i: int, dying: list, external: list | None) -> tuple[float, float]:
    """(bytes of equation i's outputs written into its dying operands' buffers, those of them written
    into the caller's buffers). With `external` (the buffers that are the caller's, updated here), an
    output in a caller's buffer is the caller's too: counted there, not here, and not freed here."""
    free = sorted(dying, key=lambda b: not (external and external[b]))    # the caller's first, as XLA aliases a carry
    shared = held = 0.0
    for b in g.made[i]:
        d = next((d for d in free if g.size[d] == g.size[b]), None)
        if d is None:
            continue
        free.remove(d)
        shared += g.size[b]
        if external is not None and external[d]:
            external[b] = True
            held += g.size[b]
    return shared, held


def list_schedule(g: BufferGraph) -> list:
    """A memory-greedy list schedule, as XLA's list scheduler: among the equations whose operands
    are ready, run the one that frees the most bytes net of what it allocates (program order on ties)."""
    n = len(g.alloc)
    waiting = [len(d) for d in g.deps]
    users: list = [[] for _ in range(n)]
    for i, ds in enumerate(g.deps):
        for d in ds:
            users[d].append(i)
    left = [set(r) for r in g.readers]
    freed = [False] * len(g.size)

    def gain(i) -> float:
        return sum(g.size[b] for b in g.reads[i] if not freed[b] and not g.pinned[b] and not g.external[b]
                   and (g.first_only[b] or left[b] == {i})) - g.alloc[i]

    heap = [(-gain(i), i) for i in range(n) if not waiting[i]]
    heapq.heapify(heap)
    done, order = [False] * n, []
    while heap:
        prio, i = heapq.heappop(heap)
        if done[i]:
            continue
        now = -gain(i)
        if now > prio:                      # it frees less than when it was queued
            heapq.heappush(heap, (now, i))
            continue
        done[i] = True
        order.append(i)
        for b in g.reads[i]:
            left[b].discard(i)
            if g.first_only[b] or not left[b]:
                freed[b] = True
            elif len(left[b]) == 1:
                j = next(iter(left[b]))
                if not waiting[j] and not done[j]:
                    heapq.heappush(heap, (-gain(j), j))
        for j in users[i]:
            waiting[j] -= 1
            if not waiting[j]:
                heapq.heappush(heap, (-gain(j), j))
    return order
