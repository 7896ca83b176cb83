"""Reading collectives out of compiled HLO text."""
import re

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_SHAPE = re.compile(r"\b(f16|bf16|f32|f64|s8|s16|s32|s64|u8|u32|pred)\[([0-9,]*)\]")


def collectives(hlo_text: str):
    """[(op, [(dtype, shape), ...])] for every collective instruction (sync or async start)."""
    found = []
    for line in hlo_text.splitlines():
        line = line.strip()
        m = re.match(r"^(ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+([a-z\-]+)\(", line)
        if not m:
            continue
        op = m.group(3)
        base = op[:-6] if op.endswith("-start") else op
        if base not in _COLLECTIVES:
            continue
        shapes = [(d, tuple(int(x) for x in s.split(",") if x)) for d, s in _SHAPE.findall(m.group(2))]
        found.append((base, shapes))
    return found


def shapes_of(hlo_text: str, op: str):
    """Shapes (dims sorted, since XLA may transpose) of every result of collective `op`."""
    return [tuple(sorted(s)) for o, ss in collectives(hlo_text) if o == op for _, s in ss]
