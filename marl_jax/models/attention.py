"""Attention over whole sequences (training, scoring, prefill) behind one function, `attend`, and
the reference einsums that the decode step and the tests use.

Implementations (`ModelConfig.attention`):
- `reference`: two einsums over head-major float32 scores `[B, K, G, T, S]`, softmax in float32;
  the numbers every other path is tested against;
- `xla`: `jax.nn.dot_product_attention(implementation="xla")`;
- `cudnn`: cuDNN's fused flash attention through `jax.nn.dot_product_attention` (NVIDIA GPUs,
  bfloat16 / float16, head dim a multiple of 8 and at most 128, or 256 on Hopper and later; no
  logit soft-capping; in training, even query and key lengths); the causal structure and a
  static sliding window let the kernel skip whole blocks, the padding mask rides as a bias;
- `splash`: the Pallas splash-attention kernel on TPUs (`marl_jax.models.splash`);
- `auto`: cudnn on an NVIDIA GPU where it applies, splash on a TPU where it applies, else
  reference. An automatic choice that cannot take its kernel for a given shape falls back to
  reference; a kernel asked for by name never does (`check` refuses it before anything compiles).

Shapes: q `[B, T, N, H]` (already scaled), k, v `[B, S, K, H]` (N a multiple of K: grouped-query
attention), mask bool `[B, T, S]` (causal, padding and sliding window combined) -> `[B, T, N, H]`.
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np

IMPLEMENTATIONS = ("auto", "reference", "xla", "cudnn", "splash")

# A large finite negative instead of -inf: a fully masked (padded) query row then gets a uniform
# distribution rather than NaN.
MASKED = float(np.finfo(np.float32).min)


_TARGET_PLATFORM: list[str] = []


def traced_platform() -> str:
    """The platform programs are traced for: `target_platform`'s, else JAX's default backend."""
    return _TARGET_PLATFORM[-1] if _TARGET_PLATFORM else jax.default_backend()


@contextlib.contextmanager
def target_platform(platform: str):
    """Programs traced inside choose their attention for `platform` ("tpu", "gpu", "cpu")
    instead of JAX's default backend: compiling for a TPU slice on a CPU machine."""
    _TARGET_PLATFORM.append(platform)
    try:
        yield
    finally:
        _TARGET_PLATFORM.pop()


def jit_per_platform(fun, *, static_argnums=(), static_argnames=(), **jit_kwargs):
    """`jax.jit(fun, static_argnums=..., static_argnames=..., **jit_kwargs)` traced for the
    platform of each call (`traced_platform()`), which is a static argument: a program traced for
    the host is not reused inside `target_platform("gpu")` or `("tpu")`, whose attention kernel
    and sampler layout differ (`jax.jit`'s cache key does not see a trace-time global)."""
    def traced(platform, *args, **kwargs):
        with target_platform(platform):
            return fun(*args, **kwargs)

    # `fun`'s signature behind the platform, every static argument by name (jit maps names to
    # positions through the signature).
    signature = inspect.signature(fun)
    parameters = list(signature.parameters)
    traced.__signature__ = signature.replace(parameters=[
        inspect.Parameter("platform", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        *signature.parameters.values()])
    nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    jitted = jax.jit(traced, static_argnames=("platform", *names, *(parameters[n] for n in nums)),
                     **jit_kwargs)

    @functools.wraps(fun)
    def call(*args, **kwargs):
        return jitted(traced_platform(), *args, **kwargs)

    return call


def _cudnn_head_dim_limit() -> int:
    """256 on Hopper (compute capability 9.0) and later, else 128 (cuDNN's flash attention)."""
    capability = getattr(jax.devices()[0], "compute_capability", "0.0")
    try:
        major = int(str(capability).split(".")[0])
    except ValueError:
        major = 0
    return 256 if major >= 9 else 128


def cudnn_problem(config, backend: str) -> str | None:
    """Why cuDNN's flash attention cannot run this config here (None: it can)."""
    if backend != "gpu":
        return f"it needs an NVIDIA GPU (the backend is {backend})"
    if config.dtype not in ("bfloat16", "float16"):
        return f"it computes in bfloat16 or float16 only (model.dtype is {config.dtype})"
    limit = _cudnn_head_dim_limit()
    if config.head_dim % 8 or config.head_dim > limit:
        return f"it takes head dims that are multiples of 8 up to {limit} (head_dim is {config.head_dim})"
    if config.attn_logit_softcap is not None:
        return "it has no attention logit soft-capping (Gemma-2's attn_logit_softcap)"
    return None


def splash_problem(config, backend: str) -> str | None:
    """Why the TPU splash kernel cannot run this config here (None: it can)."""
    from marl_jax.models import splash

    if backend != "tpu":
        return f"it needs a TPU (the backend is {backend})"
    return splash.problem(config)


def xla_problem(config, backend: str) -> str | None:
    """Why `jax.nn.dot_product_attention`'s XLA path cannot run this config (None: it can)."""
    if config.attn_logit_softcap is not None:
        return "it has no attention logit soft-capping (Gemma-2's attn_logit_softcap)"
    return None


def resolve(config, backend: str | None = None) -> str:
    """The concrete implementation `config.attention` selects on `backend` (default: JAX's).
    Raises ValueError, naming the field, when a kernel asked for by name cannot run here."""
    backend = backend or traced_platform()
    choice = config.attention
    if choice == "reference":
        return choice
    problems = {"xla": xla_problem, "cudnn": cudnn_problem, "splash": splash_problem}
    if choice in problems:
        problem = problems[choice](config, backend)
        if problem:
            raise ValueError(f"model.attention={choice!r} cannot run here: {problem}; use "
                             "attention=auto (the fastest path available) or reference")
        return choice
    if backend == "gpu" and cudnn_problem(config, backend) is None:
        return "cudnn"
    if backend == "tpu" and splash_problem(config, backend) is None:
        return "splash"
    return "reference"


def describe(config, backend: str | None = None) -> str:
    """One line naming the attention path a model takes here (the run's first log lines)."""
    backend = backend or traced_platform()
    chosen = resolve(config, backend)
    if config.attention != "auto" or chosen != "reference":
        reason = "as asked" if config.attention != "auto" else f"auto on {backend}, {config.dtype}"
    else:
        problems = [p for p in (cudnn_problem(config, backend) if backend == "gpu" else None,
                                splash_problem(config, backend) if backend == "tpu" else None) if p]
        reason = f"auto on {backend}" + (f": no kernel, {problems[0]}" if problems else "")
    return (f"attention: {chosen} ({reason}); matmul precision {config.precision}; "
            f"remat {config.remat}")


def reference(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
              softcap: float | None = None) -> jax.Array:
    """Grouped-query attention with the keys and values head-major: q `[B, T, N, H]` (already
    scaled), k, v `[B, K, S, H]`, mask bool `[B, T, S]` -> `[B, T, N, H]`. Softmax in float32;
    `softcap` (Gemma-2) squashes the scores to (-softcap, softcap) with tanh before masking.

    Both dots see their batch dims (B, K) leading, so the decode step reads the cache as stored,
    without per-step transposes of the cache or of the scores."""
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim).transpose(0, 2, 3, 1, 4)
    scores = jnp.einsum("bkgth,bksh->bkgts", q, k, preferred_element_type=jnp.float32)
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(mask[:, None, None, :, :], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bksh->bkgth", probs, v)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, heads, head_dim)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, valid: jax.Array, config,
           window: int | None = None, window_active=None) -> jax.Array:
    """Causal attention of a whole sequence: q `[B, T, N, H]` (already scaled), k, v
    `[B, S, K, H]`, mask bool `[B, T, S]` (causal, padding and sliding window combined; True =
    attend), valid bool `[B, S]` (the tokens that are not padding) -> `[B, T, N, H]` in v's
    dtype. `window`: the sliding window the mask holds (static; lets the fused kernels skip
    blocks outside it), applied when `window_active` (a traced flag, for a scan over windowed and
    full layers; None: always). Query t sits at key slot t (T == S), as in a forward without
    cache or a prefill from slot 0. Rows of padding queries are not defined by this contract
    (the kernels disagree on them); every valid query row is."""
    implementation = resolve(config)
    softcap = config.attn_logit_softcap
    # cuDNN takes the padding mask as a bias, and a bias in a differentiated forward needs even
    # query and key lengths.
    if implementation == "cudnn" and (q.shape[1] % 2 or k.shape[1] % 2):
        if config.attention == "cudnn":
            raise ValueError(f"model.attention='cudnn' needs even sequence lengths with a padding mask, "
                             f"got queries {q.shape[1]} and keys {k.shape[1]}; use attention=auto")
        implementation = "reference"
    if implementation == "splash":
        from marl_jax.models import splash

        if splash.shape_problem(q, k) is not None:
            if config.attention == "splash":
                raise ValueError(f"model.attention='splash': {splash.shape_problem(q, k)}; use attention=auto")
            implementation = "reference"
    if implementation == "reference":
        return reference(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask, softcap)
    if implementation == "splash":
        from marl_jax.models import splash

        return splash.attend(q, k, v, valid, softcap=softcap, window=window, window_active=window_active)
    local = None if window is None or window_active is not None else (window - 1, 0)
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask[:, None], scale=1.0, is_causal=True, local_window_size=local,
        implementation=implementation).astype(v.dtype)
