"""Algorithm 1 (memory-constrained balancing) as a pure function."""
import numpy as np
import pytest

import whalex as wh
from whalex.balance.algorithm import balance, proportional

V100, T4 = wh.SPECS["V100-32GB"], wh.SPECS["T4-16GB"]


def test_proportional_keeps_the_total():
    assert proportional(10, [2, 1, 1]) == [5, 3, 2] or sum(proportional(10, [2, 1, 1])) == 10
    for total in range(0, 50):
        out = proportional(total, [15.7, 15.7, 8.1, 8.1])
        assert sum(out) == total
        exact = np.array([15.7, 15.7, 8.1, 8.1]) * total / 47.6
        assert np.all(np.abs(np.array(out) - exact) < 1)


def test_loads_follow_capacity_when_memory_allows():
    speeds = [V100.fp32_flops] * 4 + [T4.fp32_flops] * 4
    caps = [V100.memory_bytes] * 4 + [T4.memory_bytes] * 4
    b = balance(96, speeds, caps, fixed=[1e9] * 8, per_unit=[1e6] * 8)
    assert sum(b.loads) == 96 and b.shifted == 0
    assert b.loads[:4] == (16,) * 4 and b.loads[4:] == (8,) * 4          # 15.7 : 8.1 rounds to 2 : 1
    assert max(b.mem_utils) <= 1


def test_oom_device_is_repaired_and_the_bound_holds():
    # device 0 is fast but small: proportional loading puts it over memory
    speeds = [4.0, 1.0, 1.0, 1.0]
    caps = [10.0, 100.0, 100.0, 100.0]
    fixed = [2.0, 2.0, 2.0, 2.0]
    per = [1.0, 1.0, 1.0, 1.0]
    naive = proportional(28, speeds)
    assert fixed[0] + naive[0] * per[0] > caps[0]                         # 16 units would need 18 bytes
    b = balance(28, speeds, caps, fixed, per)
    assert sum(b.loads) == 28 and b.shifted > 0
    for i in range(4):
        assert fixed[i] + b.loads[i] * per[i] <= caps[i]                  # the memory bound holds
    assert b.loads[0] == 8                                               # as much as fits, no less
    assert max(b.mem_utils) <= 1


def test_load_moves_to_the_least_utilised_free_device():
    speeds = [4.0, 2.0, 1.0]
    b = balance(14, speeds, [5.0, 100.0, 100.0], [0.0] * 3, [1.0] * 3)
    # 8 units for device 0 do not fit (5); the 3 extra go first to the device with the lowest load/speed
    assert b.loads[0] == 5 and sum(b.loads) == 14
    assert b.loads[1] / 2.0 <= b.loads[2] / 1.0 + 1


def test_impossible_case_names_the_device_and_shortfall():
    with pytest.raises(wh.PlanError, match=r"device 0 is 5 B over its 40 B .*total shortfall 5 B"):
        balance(100, [1.0, 1.0], [40.0, 55.0], [0.0, 0.0], [1.0, 1.0], names=["device 0", "device 1"])
    with pytest.raises(wh.PlanError, match="model state alone does not fit"):
        balance(10, [1.0, 1.0], [60.0, 5.0], [1.0, 10.0], [1.0, 1.0])


def _brute_force_best(total, w, off):
    """The smallest max_i(off_i + load_i / w_i) over every split of `total` (small cases only)."""
    import itertools
    best = float("inf")
    for loads in itertools.product(range(total + 1), repeat=len(w)):
        if sum(loads) == total:
            best = min(best, max(o + x / s for x, s, o in zip(loads, w, off)))
    return best


def test_proportional_with_fixed_times_is_the_integer_optimum():
    rng = np.random.default_rng(0)
    for _ in range(40):
        n, total = int(rng.integers(2, 4)), int(rng.integers(0, 13))
        w = rng.uniform(0.5, 3.0, n)
        off = rng.uniform(0.0, 4.0, n) * (rng.uniform(size=n) < 0.7)
        loads = proportional(total, w, off)
        assert sum(loads) == total and min(loads) >= 0
        got = max(o + x / s for x, s, o in zip(loads, w, off))
        assert got == pytest.approx(_brute_force_best(total, w, off)), (total, w, off, loads)
    # no offsets: the proportional split as before; a large offset takes the device out
    assert proportional(4096, [2, 1], [0.0, 0.0]) == proportional(4096, [2, 1]) == [2731, 1365]
    assert proportional(5, [1, 1], [0.0, 100.0]) == [5, 0]
    with pytest.raises(ValueError, match="non-negative offset"):
        proportional(5, [1, 1], [0.0, -1.0])


def test_fixed_times_per_step_shift_rows_to_the_fast_device():
    # 3:1 speeds; the slow device also spends 3x the fast one's fixed time per step (its optimizer
    # update runs 3x slower too): proportional rows would leave it last by the difference
    work, speeds, over = 1e6, [3e9, 1e9], [0.002, 0.006]
    plain = balance(2048, speeds, [1e12] * 2, [0.0] * 2, [1.0] * 2)
    fixed = balance(2048, speeds, [1e12] * 2, [0.0] * 2, [1.0] * 2, overheads=over, work_per_unit=work)
    assert plain.loads == (1536, 512)
    t = [o + x * work / s for x, s, o in zip(fixed.loads, speeds, over)]
    assert fixed.loads[0] > 1536 and abs(t[0] - t[1]) <= work / min(speeds)          # equal to within one unit
    t_plain = [o + x * work / s for x, s, o in zip(plain.loads, speeds, over)]
    assert max(t) < max(t_plain)
    with pytest.raises(ValueError, match="work of one unit"):
        balance(8, speeds, [1e12] * 2, [0.0] * 2, [1.0] * 2, overheads=over, work_per_unit=0.0)


def test_split_chunk_balances_within_two_percent_with_matmuls_at_least_128_wide():
    from whalex.balance.cost import split_chunk
    # hidden units: chunks of 256 give 2816/1280 at 2.12:1 (512 would give 3072/1024, 12% over the ideal)
    assert split_chunk(4096, [2.12, 1.0]) == 256
    # heads 128 wide: chunks of 2 give 22/10 at 2.2:1, the ideal; chunks of 4 give 24/8, 9.6% over
    assert split_chunk(32, [2.2, 1.0], columns_per_unit=128) == 2
    # heads 32 wide: one head at a time would balance better (21/11 at 1.94:1), but chunks of 4 heads
    # are the narrowest 128-wide matmuls, and of those 20/12 comes closest to the ideal
    assert split_chunk(32, [1.94, 1.0], columns_per_unit=32) == 4
    # at 2.54:1 chunks of 4 and of 8 both give 24/8: the larger, fewer loop trips
    assert split_chunk(32, [2.54, 1.0], columns_per_unit=32) == 8
    # too few units for 128-wide chunks: every divisor is a candidate (640 classes on 8 devices: 105/55)
    assert split_chunk(640, [1.94] * 4 + [1.0] * 4) == 5
    # at least one chunk per device
    assert split_chunk(8, [100.0, 1.0]) == 1
