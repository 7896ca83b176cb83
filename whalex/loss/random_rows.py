"""Rows of a global random draw, computed one part at a time.

When whalex evaluates a loss in parts (rows ``[offset, offset + rows)`` of a global batch of ``B``
rows: one device's block, one micro-batch), every ``random_bits`` draw whose leading dimension is
the batch must give the part exactly the rows that one device drawing for the whole batch with the
same key would give, or dropout masks (and so losses and gradients) differ from single-device
training.

With partitionable threefry (``jax_threefry_partitionable``, the default), element ``e`` of
``random_bits(key, shape)`` is ``threefry2x32(key, (hi, lo))`` of its flat row-major index
``e = hi * 2**32 + lo`` in ``shape`` (jax: ``_threefry_random_bits_partitionable`` over
``iota_2x32_shape``). So a part's rows are the hash of their *global* flat indices: the work is
proportional to the part, never to the global shape, and ``offset`` may be traced (a ``fori_loop``
index, ``axis_index`` inside ``shard_map``).

Entry points:

* :func:`bits_rows` computes ``jax.random.bits(key, global_shape, uint{bit_width})[offset:offset +
  rows]``; it *raises* :class:`UnsupportedKeyError` for keys it cannot reproduce (a PRNG other
  than threefry2x32, or ``jax_threefry_partitionable`` off), so a caller never silently gets
  different bits.
* :func:`row_bits_override` looks at a captured ``random_bits`` equation and *returns None* when it
  does not apply (so the caller keeps the plain equation, or refuses), else a function of the
  equation's inputs that returns the part's global-consistent bits.

Only public JAX is used: ``jax.extend.random.threefry2x32_p`` (the elementwise hash, the same
primitive jax's own draw binds), ``jax.random.key_data`` and ``jax.random.key_dtype``.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p

from whalex import _compat

THREEFRY = "threefry2x32"
BIT_WIDTHS = (8, 16, 32, 64)
_U32 = np.dtype("uint32")
_M32 = (1 << 32) - 1


class UnsupportedKeyError(NotImplementedError):
    """The key's draws cannot be computed row by row here; the caller should fall back."""


# -- keys ---------------------------------------------------------------------------------------

def is_threefry_partitionable() -> bool:
    """Whether draws currently use partitionable threefry (read at trace time)."""
    return bool(jax.config.jax_threefry_partitionable)


def threefry_words(key: Any) -> jax.Array:
    """The ``uint32[..., 2]`` threefry words of `key`, as ``random_bits`` hashes them.

    `key` is a typed key array (``jax.random.key``; also what a ``random_bits`` equation's operand
    is inside a jaxpr) or a raw ``uint32[..., 2]`` key (``jax.random.PRNGKey``, which
    ``jax.random.bits`` wraps with the default implementation). Concrete or traced.
    Raises :class:`UnsupportedKeyError` for any other implementation.
    """
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if dtype != jax.random.key_dtype(THREEFRY):
            raise UnsupportedKeyError(
                f"key of type {dtype} ({jax.random.key_impl(key)}): only threefry2x32 draws can be "
                "computed row by row; fall back to drawing the whole batch")
        return jax.random.key_data(key)
    key = jnp.asarray(key)
    default = str(jax.config.jax_default_prng_impl)
    if key.dtype != _U32 or key.shape[-1:] != (2,) or default != THREEFRY:
        raise UnsupportedKeyError(
            f"raw key {key.dtype}{list(key.shape)} with default PRNG {default!r}: only raw "
            "threefry2x32 keys (uint32[..., 2]) can be used; fall back to drawing the whole batch")
    return key


# -- flat indices as (hi, lo) uint32 words -------------------------------------------------------

def _u32(x) -> jax.Array:
    return jnp.asarray(x, dtype=_U32)


def _mul_const(a: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
    """``a * c`` as 64-bit (hi, lo) words, for uint32 `a` and a static ``0 <= c < 2**64``."""
    c_lo, c_hi = c & _M32, c >> 32
    lo = a * _u32(c_lo)                                   # wraps mod 2**32: the low word
    a0, a1 = a & _u32(0xFFFF), a >> _u32(16)              # 16-bit limbs: no product overflows
    c0, c1 = _u32(c_lo & 0xFFFF), _u32(c_lo >> 16)
    p00, p01, p10, p11 = a0 * c0, a0 * c1, a1 * c0, a1 * c1
    mid = (p00 >> _u32(16)) + (p01 & _u32(0xFFFF)) + (p10 & _u32(0xFFFF))
    hi = p11 + (p01 >> _u32(16)) + (p10 >> _u32(16)) + (mid >> _u32(16))
    if c_hi:
        hi = hi + a * _u32(c_hi)                          # mod 2**32, as in a uint64 product
    return hi, lo


def _add(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]):
    """64-bit sum of (hi, lo) word pairs (broadcasting)."""
    lo = a[1] + b[1]
    carry = (lo < b[1]).astype(_U32)
    return a[0] + b[0] + carry, lo


def _along(x: jax.Array, dim: int, ndim: int) -> jax.Array:
    return x.reshape((1,) * dim + x.shape + (1,) * (ndim - dim - 1))


def _row_index(offset, rows: int) -> jax.Array:
    offset = jnp.asarray(offset)
    if offset.ndim:
        raise ValueError(f"offset must be a scalar, got shape {offset.shape}")
    if not jnp.issubdtype(offset.dtype, jnp.integer):
        raise TypeError(f"offset must be an integer, got {offset.dtype}")
    return offset.astype(_U32) + lax.iota(_U32, rows)


def flat_index_2x32(global_shape: Sequence[int], offset, rows: int, *,
                    wide: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Row-major flat indices in `global_shape` of rows ``[offset, offset + rows)``, as words.

    Returns ``(hi, lo)``, two ``uint32[rows, *global_shape[1:]]`` arrays with
    ``index = hi * 2**32 + lo``: what jax's ``iota_2x32_shape(global_shape)`` holds in those rows.
    When the global size is at most ``2**32``, ``hi`` is zero and ``lo`` is plain uint32
    arithmetic; otherwise (or with ``wide=True``, for testing) each dimension's contribution is a
    64-bit product, summed with carries. Cost is proportional to the part.
    """
    shape = tuple(int(d) for d in global_shape)
    rest = shape[1:]
    part = (rows,) + rest
    nd = len(shape)
    row = _row_index(offset, rows)
    if wide is None:
        wide = math.prod(shape) > 1 << 32
    if not wide:
        lo = _along(row, 0, nd) * _u32(math.prod(rest))
        if rest:
            lo = lo + lax.iota(_U32, math.prod(rest)).reshape(rest)
        lo = jnp.broadcast_to(lo, part)
        return jnp.zeros(part, _U32), lo
    acc = None
    for d in range(nd):
        idx = row if d == 0 else lax.iota(_U32, shape[d])
        hi, lo = _mul_const(idx, math.prod(shape[d + 1:]))
        term = (_along(hi, d, nd), _along(lo, d, nd))
        acc = term if acc is None else _add(acc, term)
    return jnp.broadcast_to(acc[0], part), jnp.broadcast_to(acc[1], part)


# -- the draw ------------------------------------------------------------------------------------

def _check(bit_width: int, shape: tuple[int, ...], offset, rows: int) -> None:
    if bit_width not in BIT_WIDTHS:
        raise ValueError(f"bit_width must be one of {BIT_WIDTHS}, got {bit_width}")
    if bit_width == 64 and not jax.config.jax_enable_x64:
        raise ValueError("64-bit random bits need jax_enable_x64 (as jax.random.bits does)")
    if not shape:
        raise ValueError("global_shape has no batch dimension (it is a scalar shape)")
    if not 0 <= rows <= shape[0]:
        raise ValueError(f"rows={rows} outside the global batch of {shape[0]}")
    if shape[0] > 1 << 32:
        raise NotImplementedError(f"batch of {shape[0]} rows exceeds 2**32")
    if math.prod(shape) > 1 << 64:
        raise NotImplementedError("random bits array of size exceeding 2 ** 64")
    if isinstance(offset, (int, np.integer)) and not 0 <= offset <= shape[0] - rows:
        raise ValueError(f"rows [{offset}, {offset + rows}) outside the global batch of {shape[0]}")


def bits_rows(key: Any, bit_width: int, global_shape: Sequence[int], offset, rows: int) -> jax.Array:
    """Rows ``[offset, offset + rows)`` of ``jax.random.bits(key, global_shape, uint{bit_width})``.

    Exactly what the ``random_bits`` primitive (``bit_width``, ``shape=global_shape``) gives in
    those rows of dimension 0, every other dimension whole, computed for the part only.

    Args:
      key: a typed threefry2x32 key (``jax.random.key``) or a raw ``uint32[2]`` key
        (``jax.random.PRNGKey``); concrete or traced. A key array of shape ``K`` draws per key, as
        ``vmap`` of ``jax.random.bits`` would: the result is ``[*K, rows, *global_shape[1:]]``.
      bit_width: 8, 16, 32 or 64 (64 needs ``jax_enable_x64``, like jax).
      global_shape: the whole draw's static shape; dimension 0 is the batch.
      offset: first row, a Python int or an integer scalar that may be traced (e.g. a loop index,
        ``axis_index * rows``). It must satisfy ``0 <= offset <= B - rows``; a traced offset is not
        checked (no clamping happens: rows past ``B`` hash indices past the global array).
      rows: static number of rows in the part.

    Returns:
      ``uint{bit_width}[*K, rows, *global_shape[1:]]``.

    Raises:
      UnsupportedKeyError: the key is not threefry2x32 (e.g. ``'rbg'``), or
        ``jax_threefry_partitionable`` is off (then a draw's bits depend on its total size, so a
        part cannot be computed alone). The caller should fall back to drawing the whole batch.
    """
    shape = tuple(int(d) for d in global_shape)
    rows = int(rows)
    _check(bit_width, shape, offset, rows)
    if not is_threefry_partitionable():
        raise UnsupportedKeyError(
            "jax_threefry_partitionable is off: threefry draws depend on their total size, so "
            "rows cannot be computed per part; fall back to drawing the whole batch")
    words = threefry_words(key)
    hi, lo = flat_index_2x32(shape, offset, rows)
    k1, k2 = words[..., 0], words[..., 1]
    if k1.ndim:                                            # batched keys: one draw per key
        out = k1.shape + hi.shape
        kdims = tuple(range(k1.ndim))
        cdims = tuple(range(k1.ndim, len(out)))
        k1, k2 = (lax.broadcast_in_dim(k, out, kdims) for k in (k1, k2))
        hi, lo = (lax.broadcast_in_dim(c, out, cdims) for c in (hi, lo))
    k1, k2, hi, lo = _compat.match_varying(k1, k2, hi, lo)     # inside shard_map
    bits1, bits2 = threefry2x32_p.bind(k1, k2, hi, lo)
    dtype = np.dtype(f"uint{bit_width}")
    if bit_width == 64:
        high = lax.convert_element_type(bits1, dtype)
        return lax.shift_left(high, jnp.asarray(32, dtype)) | lax.convert_element_type(bits2, dtype)
    if bit_width == 32:
        return bits1 ^ bits2
    return lax.convert_element_type(bits1 ^ bits2, dtype)


def row_bits_override(eqn: Any, offset, global_rows: int) -> Callable[..., list] | None:
    """A replacement for a ``random_bits`` equation captured at part size, or None.

    `eqn` was traced with the part's ``rows`` rows (``eqn.params['shape'][0] == rows``); the
    caller has decided that its dimension 0 is the batch of `global_rows` rows (dropout-like draws;
    not e.g. a permutation's sort keys). The returned ``fn(*invals) -> [bits]`` takes the
    equation's input values (a scalar typed key) and returns, like ``_compat.bind``, a one-element
    list: the rows ``[offset, offset + rows)`` of the draw the whole batch would get.

    Returns None, so the caller can fall back, when the equation is not ``random_bits``, has no
    dimension, draws for a batch of keys (its leading output dimensions are the keys', not the
    batch), uses another PRNG than threefry2x32, when partitionable threefry is off, or when
    ``rows > global_rows``.
    """
    if getattr(eqn.primitive, "name", None) != "random_bits":
        return None
    shape = tuple(eqn.params["shape"])
    bit_width = int(eqn.params["bit_width"])
    if not shape or not all(isinstance(d, (int, np.integer)) for d in shape):
        return None
    key_aval = eqn.invars[0].aval
    if key_aval.shape != () or key_aval.dtype != jax.random.key_dtype(THREEFRY):
        return None
    if not is_threefry_partitionable():
        return None
    rows = int(shape[0])
    if rows > global_rows:
        return None
    global_shape = (int(global_rows),) + tuple(int(d) for d in shape[1:])

    def fn(key, *_unused) -> list:
        return [bits_rows(key, bit_width, global_shape, offset, rows)]

    return fn
