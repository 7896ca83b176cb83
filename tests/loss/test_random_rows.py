"""Per-part rows of a global random draw equal the rows of the single-device draw."""
import functools

import flax.linen as nn
import jax
import jax.extend.random  # noqa: F401
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from whalex import _compat
from whalex.loss.random_rows import UnsupportedKeyError, bits_rows, flat_index_2x32, row_bits_override, threefry_words

SHAPES = [(13,), (13, 3, 7), (9, 1, 5)]
PARTS = [(0, 5), (4, 5), (8, 5), (0, 9), (8, 1), (3, 0)]


def _keys():
    return {"typed": jax.random.key(42), "raw": jax.random.PRNGKey(42)}


@pytest.mark.parametrize("bit_width", [8, 16, 32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["typed", "raw"])
def test_rows_equal_slices_of_the_global_draw(bit_width, shape, kind):
    key = _keys()[kind]
    dtype = np.dtype(f"uint{bit_width}")
    whole = jax.random.bits(key, shape, dtype)
    for offset, rows in [(o, r) for o, r in PARTS if o + r <= shape[0]] + [(0, shape[0])]:
        part = bits_rows(key, bit_width, shape, offset, rows)
        assert part.dtype == dtype and part.shape == (rows,) + shape[1:]
        np.testing.assert_array_equal(part, whole[offset:offset + rows])


@pytest.mark.parametrize("kind", ["typed", "raw"])
def test_64_bit(kind):
    with jax.enable_x64(True):
        key = _keys()[kind]
        shape = (11, 3)
        whole = jax.random.bits(key, shape, jnp.uint64)
        assert whole.dtype == np.uint64
        for offset, rows in [(0, 4), (5, 6), (10, 1)]:
            part = bits_rows(key, 64, shape, offset, rows)
            assert part.dtype == np.uint64
            np.testing.assert_array_equal(part, whole[offset:offset + rows])
    with pytest.raises(ValueError, match="x64"):
        bits_rows(jax.random.key(0), 64, (4,), 0, 2)


@pytest.mark.parametrize("kind", ["typed", "raw"])
def test_traced_offset_under_jit(kind):
    key = _keys()[kind]
    shape, rows = (13, 3, 7), 4
    whole = jax.random.bits(key, shape, jnp.uint16)
    f = jax.jit(lambda k, o: bits_rows(k, 16, shape, o, rows))
    for offset in range(0, 10):
        np.testing.assert_array_equal(f(key, jnp.int32(offset)), whole[offset:offset + rows])


@pytest.mark.parametrize("kind", ["typed", "raw"])
def test_offset_from_fori_loop(kind):
    key = _keys()[kind]
    shape, rows = (15, 2, 3), 3
    whole = jax.random.bits(key, shape, jnp.uint32)

    @jax.jit
    def by_parts(k):
        def body(i, buf):
            part = bits_rows(k, 32, shape, i * rows, rows)
            return lax.dynamic_update_slice_in_dim(buf, part, i * rows, axis=0)
        return lax.fori_loop(0, shape[0] // rows, body, jnp.zeros(shape, jnp.uint32))

    np.testing.assert_array_equal(by_parts(key), whole)


@pytest.mark.parametrize("key_varies", [False, True])
def test_offset_from_axis_index_in_shard_map(key_varies):
    # data=4 x model=2: the part's counts vary over 'data'; the key is replicated, or (cast)
    # varies over 'model' only, so the hash must reconcile both.
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rows, shape = 3, (12, 5)
    key = jax.random.key(7)
    whole = jax.random.bits(key, shape, jnp.uint8)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(), out_specs=P("data", "model"))
    def by_device(k):
        if key_varies:
            k = lax.pcast(k, ("model",), to="varying")
        part = bits_rows(k, 8, shape, lax.axis_index("data") * rows, rows)
        return lax.pcast(part, ("model",), to="varying") if not key_varies else part

    out = by_device(key)
    np.testing.assert_array_equal(out[:, :5], whole)
    np.testing.assert_array_equal(out[:, 5:], whole)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(), out_specs=P("data", "model"))
    def static_offset(k):                     # counts replicated, key varying
        k = lax.pcast(k, ("data", "model"), to="varying")
        return bits_rows(k, 8, shape, 6, rows)

    out = static_offset(key)
    np.testing.assert_array_equal(out[:rows, :5], whole[6:6 + rows])


def test_batched_keys_draw_per_key():
    keys = jax.random.split(jax.random.key(1), 3)
    shape = (10, 4)
    whole = jax.vmap(lambda k: jax.random.bits(k, shape, jnp.uint32))(keys)
    np.testing.assert_array_equal(bits_rows(keys, 32, shape, 6, 4), whole[:, 6:10])
    raw = jax.random.key_data(keys)
    np.testing.assert_array_equal(bits_rows(raw, 32, shape, 2, 3), whole[:, 2:5])


def test_cost_is_proportional_to_the_part():
    shape, rows = (1_000_000, 64), 4          # the global draw would be 256 MB
    key = jax.random.key(0)
    jaxpr = jax.make_jaxpr(lambda k, o: bits_rows(k, 32, shape, o, rows))(key, jnp.int32(8))

    def sizes(jx):
        for eqn in jx.eqns:
            for v in eqn.outvars:
                yield int(np.prod(v.aval.shape))
            for p in eqn.params.values():
                sub = getattr(p, "jaxpr", p)
                if isinstance(sub, _compat.Jaxpr):
                    yield from sizes(sub)

    assert max(sizes(jaxpr.jaxpr)) == rows * shape[1]
    # And it runs under jit without materialising the global draw.
    part = jax.jit(lambda k, o: bits_rows(k, 32, shape, o, rows))(key, jnp.int32(999_990))
    assert part.shape == (rows, 64)


def _jax_iota_2x32(shape):
    """jax's own iota_2x32_shape equation, as its threefry random_bits traces it (public API)."""
    closed = jax.make_jaxpr(lambda kd: jax.extend.random.threefry_prng_impl.random_bits(kd, 32, shape))(
        jnp.zeros((2,), jnp.uint32))

    def find(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "iota_2x32_shape":
                return eqn
            if _compat.is_call(eqn) and (found := find(_compat.call_jaxpr(eqn)[0])) is not None:
                return found

    return find(closed.jaxpr)


@pytest.mark.parametrize("shape", [(1_250_001, 4_001), (600_001, 2, 4_001)])
def test_flat_index_words_beyond_two_to_the_32(shape):
    # ~5e9 elements: the hi words of the last rows are nonzero. Checked against numpy uint64 and
    # against jax's iota_2x32_shape for the global shape, sliced under jit (XLA computes only the
    # slice of that fused iota, so the global array is never materialised).
    eqn = _jax_iota_2x32(shape)
    assert eqn.params["shape"] == shape
    stride = int(np.prod(shape[1:]))
    ours = jax.jit(lambda o, rows: flat_index_2x32(shape, o, rows), static_argnums=1)
    crossed = False
    for offset, rows in [(0, 2), ((1 << 32) // stride - 1, 3), (shape[0] - 3, 3)]:
        hi, lo = ours(jnp.int32(offset), rows)               # traced offset
        idx = (np.arange(offset, offset + rows, dtype=np.uint64).reshape((rows,) + (1,) * (len(shape) - 1))
               * np.uint64(stride)
               + np.arange(stride, dtype=np.uint64).reshape(shape[1:]))
        got = (np.asarray(hi, np.uint64) << np.uint64(32)) | np.asarray(lo, np.uint64)
        np.testing.assert_array_equal(got, idx)
        jax_hi, jax_lo = jax.jit(lambda: [x[offset:offset + rows] for x in _compat.bind(eqn, [])])()  # noqa: B023
        np.testing.assert_array_equal(hi, jax_hi)
        np.testing.assert_array_equal(lo, jax_lo)
        crossed |= bool(np.any(np.diff(np.asarray(hi).ravel()) != 0))
    assert crossed                                           # some part straddles 2**32


def test_wide_path_matches_narrow_path():
    # The wide path (64-bit products and carries) agrees with the 32-bit one on small shapes.
    for wide_shape in [(13,), (13, 3, 7), (5, 1, 4)]:
        for offset, rows in [(0, 2), (2, 3)]:
            a = flat_index_2x32(wide_shape, offset, rows, wide=True)
            b = flat_index_2x32(wide_shape, offset, rows, wide=False)
            np.testing.assert_array_equal(a[0], b[0])
            np.testing.assert_array_equal(a[1], b[1])


def test_mul_const_against_numpy():
    from whalex.loss.random_rows import _mul_const
    rng = np.random.default_rng(0)
    a = rng.integers(0, 1 << 32, 1000, dtype=np.uint64).astype(np.uint32)
    a[:3] = [0, 1, (1 << 32) - 1]
    for c in [0, 1, 7, 4001, 65536, (1 << 32) - 1, 1 << 32, (1 << 32) + 12345, 3 << 40]:
        hi, lo = _mul_const(jnp.asarray(a), c)
        want = [(int(x) * c) % (1 << 64) for x in a]
        got = [(int(h) << 32) | int(l) for h, l in zip(np.asarray(hi), np.asarray(lo))]
        assert got == want, c


def test_non_threefry_keys_are_refused():
    rbg = jax.random.key(0, impl="rbg")
    with pytest.raises(UnsupportedKeyError, match="threefry2x32"):
        bits_rows(rbg, 32, (8, 2), 0, 4)
    with pytest.raises(UnsupportedKeyError):
        threefry_words(jnp.zeros((4,), jnp.uint32))          # a raw rbg-shaped key
    jaxpr = jax.make_jaxpr(lambda k: jax.random.bits(k, (4, 2)))(rbg)
    eqn = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "random_bits")
    assert row_bits_override(eqn, 0, 8) is None


def test_partitionable_off_is_refused():
    with jax.threefry_partitionable(False):
        with pytest.raises(UnsupportedKeyError, match="partitionable"):
            bits_rows(jax.random.key(0), 32, (8, 2), 0, 4)
        jaxpr = jax.make_jaxpr(lambda k: jax.random.bits(k, (4, 2)))(jax.random.key(0))
        eqn = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "random_bits")
        assert row_bits_override(eqn, 0, 8) is None


def test_override_declines_what_it_cannot_do():
    key = jax.random.key(0)
    jaxpr = jax.make_jaxpr(lambda k: jnp.sin(jax.random.bits(k, (4, 2)).astype(jnp.float32)))(key)
    eqns = jaxpr.jaxpr.eqns
    assert [row_bits_override(e, 0, 8) is None for e in eqns] == [
        e.primitive.name != "random_bits" for e in eqns]
    keys = jax.random.split(key, 4)
    batched = jax.make_jaxpr(jax.vmap(lambda k: jax.random.bits(k, (3,))))(keys)
    eqn = next(e for e in batched.jaxpr.eqns if e.primitive.name == "random_bits")
    assert row_bits_override(eqn, 0, 8) is None              # leading dim is the keys'
    eqn = next(e for e in eqns if e.primitive.name == "random_bits")
    assert row_bits_override(eqn, 0, 3) is None              # part larger than the batch


# -- end to end: a part-size jaxpr evaluated with its random_bits replaced -----------------------

def eval_parts(closed, args, offset, global_rows):
    """Evaluate `closed`, recursing into jit calls; random_bits at part size gets the global rows."""
    replaced = []

    def run(jaxpr, consts, args):
        env = {}
        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            invals = [_compat.read(env, v) for v in eqn.invars]
            if _compat.is_call(eqn):
                sub, sub_consts = _compat.call_jaxpr(eqn)
                outs = run(sub, sub_consts, invals)
            else:
                fn = row_bits_override(eqn, offset, global_rows)
                if fn is not None:
                    replaced.append(eqn)
                    outs = fn(*invals)
                else:
                    outs = _compat.bind(eqn, invals)
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        return [_compat.read(env, v) for v in jaxpr.outvars]

    outs = run(closed.jaxpr, closed.consts, args)
    assert replaced, "no random_bits equation was replaced"
    return outs


@pytest.mark.parametrize("kind", ["typed", "raw"])
def test_bernoulli_jaxpr_with_random_bits_replaced(kind):
    key = _keys()[kind]
    B = 13
    whole = jax.random.bernoulli(key, 0.7, (B, 5))
    for offset, rows in [(0, 4), (4, 5), (9, 4), (12, 1)]:
        closed = jax.make_jaxpr(lambda k: jax.random.bernoulli(k, 0.7, (rows, 5)))(key)  # noqa: B023
        part, = eval_parts(closed, [key], offset, B)
        np.testing.assert_array_equal(part, whole[offset:offset + rows])
        # Under jit with a traced offset too.
        f = jax.jit(lambda k, o: eval_parts(closed, [k], o, B)[0])  # noqa: B023  (called in this iteration)
        np.testing.assert_array_equal(f(key, jnp.int32(offset)), whole[offset:offset + rows])


def test_flax_dropout_rows_match():
    B, rows = 12, 4
    drop = nn.Dropout(rate=0.3, deterministic=False)
    x = jax.random.normal(jax.random.key(5), (B, 8)) + 3.0    # no zeros: the mask is visible
    key = jax.random.key(11)
    whole = drop.apply({}, x, rngs={"dropout": key})
    assert 0 < int((whole == 0).sum()) < whole.size
    closed = jax.make_jaxpr(lambda k, xs: drop.apply({}, xs, rngs={"dropout": k}))(key, x[:rows])

    @jax.jit
    def by_parts(k, x):
        def body(i, buf):
            xs = lax.dynamic_slice_in_dim(x, i * rows, rows)
            part, = eval_parts(closed, [k, xs], i * rows, B)
            return lax.dynamic_update_slice_in_dim(buf, part, i * rows, axis=0)
        return lax.fori_loop(0, B // rows, body, jnp.zeros_like(x))

    got = by_parts(key, x)
    np.testing.assert_array_equal(got == 0, whole == 0)        # the same rows' masks, bit for bit
    np.testing.assert_allclose(got, whole, rtol=1e-6)          # the kept values' 1/(1-rate), to rounding
    # A part evaluated plainly (without the override) draws different masks: the test is not vacuous.
    plain = drop.apply({}, x[4:8], rngs={"dropout": key})
    assert not np.array_equal(plain, whole[4:8])
