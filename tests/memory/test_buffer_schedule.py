"""The replay's buffer sweep: an output written in place into a dying caller's buffer (a loop's carry)
stays the caller's, so a chain of conditionals, each updating the carried buffer in place, holds that
buffer once (a zero-bubble tick's per-chunk B conditionals over the W stash)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from whalex import _compat as C
from whalex.memory.buffer_schedule import BufferGraph, sweep
from whalex.memory.peak import step_peak

N = 1 << 16     # entries per stash row


def _chain(into_caller):
    """A caller's buffer (10 bytes) updated in place by two equations, the second one's output kept
    (written into the caller's output: 0 bytes)."""
    return BufferGraph(alloc=[10.0, 0.0], inner=[0.0, 0.0], reads=[[0], [1]], made=[[1], [2]], inplace=[True, True],
                       deps=[[], [0]], size=[10.0, 10.0, 0.0], readers=[[0], [1], []],
                       first_only=[False] * 3, pinned=[False] * 3, entry=[set(), set()],
                       external=[True, False, False], into_caller=into_caller)


def test_an_update_into_a_callers_buffer_stays_the_callers():
    assert sweep(_chain([True, True]), [0, 1]) == 0.0
    assert sweep(_chain([False, False]), [0, 1]) == 10.0     # counted again here: the rule is what removes it


def _loop(chunks: int):
    """A scan carrying a [2, N] stash whose body runs `chunks` conditionals side by side, each writing a
    row into the stash in place (as a zero-bubble tick's B's do), then reads it."""
    def body(stash, i):
        for k in range(chunks):
            stash = jax.lax.cond(i % chunks == k, lambda s, k=k: s.at[i % 2].set(jnp.full((N,), 1.0 * k)),
                                 lambda s: s, stash)
        return stash, stash[i % 2, 0]

    def fn(x):
        return jax.lax.scan(body, jnp.zeros((2, N), jnp.float32) + x, jnp.arange(4))

    return step_peak(fn, [jax.ShapeDtypeStruct((), jnp.float32)], {}, "cpu")


@pytest.mark.skipif(not C.CONDITIONAL_UPDATES_IN_PLACE, reason="this XLA copies a conditional's updated operand")
def test_a_chain_of_conditionals_over_a_carry_holds_it_once():
    stash = 2 * N * 4
    one, three = _loop(1).temp, _loop(3).temp
    assert three <= one + 0.25 * stash, (one, three)
    assert np.isclose(one, three, rtol=0.25)
