"""One row of a batch draw, computed for that row alone.

The sampler's default keys draw one categorical over the whole batch per step:
`jax.random.categorical(fold_in(key, t), logits [B, C])`. Row r of that draw is
`argmax(gumbel[r] + logits[r])`, and JAX's partitionable threefry makes `gumbel[r, c]` a function
of the key and the flat index `r * C + c` alone. `categorical_rows` computes exactly those values for
any set of rows, each with its own key, so rows decoding at different steps (continuous batching)
draw what the batch draw gives them. `check_supported` names the JAX settings this relies on; the
tests compare the result with `jax.random.categorical` bit for bit.

What this relies on: the public `jax.extend.random.threefry2x32_p` (the threefry hash itself),
and the way JAX releases turn its bits into a categorical draw, which no public API states: the
partitionable counter layout (entry `r * C + c` hashed with counter words `(0, r * C + c)`),
uniform floats from the top 23 bits with `minval = tiny`, and Gumbel noise `-log(-log(u))` added
to the logits before an argmax. JAX 0.10.2 and 0.11.2, the two ends of setup.cfg's range, both do
this: tests/test_decode_slots.py compares the draws with `jax.random.categorical` bit for bit,
and CI runs that test (`pytest -m smoke`) at both ends. A JAX release that changes any of it
fails that test; the static sampler's draws (`jax.random.categorical`) are not affected.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p


def check_supported(key: jax.Array, batch: int, width: int) -> None:
    """Raises ValueError unless row-wise draws reproduce the batch draw of `key` over `[batch, width]`
    logits: a threefry key, partitionable threefry, low-range Gumbel noise, fewer than 2^32 entries."""
    impl = str(jax.random.key_impl(key))
    if "threefry" not in impl:
        raise ValueError(f"decode_slots with key= needs a threefry key (got {impl}); pass row_keys instead")
    if not jax.config.jax_threefry_partitionable or jax.config.jax_high_dynamic_range_gumbel:
        raise ValueError("decode_slots with key= needs jax_threefry_partitionable=True and "
                         "jax_high_dynamic_range_gumbel=False (JAX's defaults); pass row_keys instead")
    if batch * width >= 2 ** 32:
        raise ValueError(f"decode_slots with key= draws over at most 2^32 entries per step, got {batch} x {width}")


def _gumbel_row(key: jax.Array, row, width: int) -> jax.Array:
    """`jax.random.gumbel(key, (batch, width))[row]` `[width]` float32."""
    key_words = jax.random.key_data(key)
    counts = row.astype(jnp.uint32) * np.uint32(width) + jnp.arange(width, dtype=jnp.uint32)
    k1, k2 = (jnp.broadcast_to(word, counts.shape) for word in (key_words[0], key_words[1]))
    bits1, bits2 = threefry2x32_p.bind(k1, k2, jnp.zeros_like(counts), counts)
    bits = bits1 ^ bits2
    # jax.random.uniform(minval=tiny, maxval=1): 23 random mantissa bits under exponent 0 -> [1, 2).
    mantissa = jax.lax.shift_right_logical(bits, np.uint32(32 - 23)) | np.uint32(0x3F800000)
    floats = jax.lax.bitcast_convert_type(mantissa, jnp.float32) - np.float32(1.0)
    tiny = np.float32(np.finfo(np.float32).tiny)
    uniform = jnp.maximum(tiny, floats * (np.float32(1.0) - tiny) + tiny)
    return -jnp.log(-jnp.log(uniform))


def categorical_rows(keys: jax.Array, logits: jax.Array, rows: jax.Array) -> jax.Array:
    """keys `[S]` (typed), logits `[S, C]` float32, rows `[S]` int -> `[S]` int32: entry s is row
    `rows[s]` of `jax.random.categorical(keys[s], L)` for any `L` whose row `rows[s]` is `logits[s]`."""
    width = logits.shape[-1]

    def one(key, row_logits, row):
        return jnp.argmax(_gumbel_row(key, row, width) + row_logits).astype(jnp.int32)

    return jax.vmap(one)(keys, logits, rows)
