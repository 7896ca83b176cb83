"""Number formats shared by the plan's text, HTML and pictures: bytes, FLOPs, times, device lists."""
from __future__ import annotations


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def fmt_pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def fmt_speed(speed: float, spread: float | None = None) -> str:
    return f"{fmt_flops(speed)}/s" + ("" if spread is None else f" ± {fmt_pct(spread)}")


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    if s >= 1e-6 or s == 0:
        return f"{s * 1e6:.2f} us"
    return f"{s * 1e9:.2f} ns"


def fmt_devices(ids: tuple[int, ...]) -> str:
    """Device indices, a run of consecutive ones as "a-b"."""
    if len(ids) > 1 and list(ids) == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def text_table(head, rows) -> list[str]:
    """A left-aligned, space-padded table, indented by two spaces: the header, a rule, the rows."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return ["  " + fmt.format(*head), "  " + "  ".join("-" * w for w in widths)] + \
        ["  " + fmt.format(*r) for r in rows]
