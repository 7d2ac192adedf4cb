"""Input checks shared by the macro-action core and the losses.

Static checks (ranks, shapes, option names) always run. Value checks (binary masks, left-aligned
responses, ranges) run only on concrete inputs, so they cost nothing inside `jax.jit` and fire
before anything is traced when a function is called eagerly.
"""
import jax
import numpy as np


def is_concrete(x):
    """True when `x` holds values now (numpy, Python or a committed jax array), not a tracer."""
    return not isinstance(x, jax.core.Tracer)


def check_rank(x, rank, name):
    if np.ndim(x) != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {np.shape(x)}")


def check_same_shape(reference, reference_name, **others):
    """Every array in `others` must have the shape of `reference`."""
    for name, x in others.items():
        if np.shape(x) != np.shape(reference):
            raise ValueError(
                f"{name} has shape {np.shape(x)} but {reference_name} has shape "
                f"{np.shape(reference)}")


def check_choice(value, choices, name):
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_mask(mask, name, *, left_aligned):
    """A [B, T] mask of zeros and ones; left-aligned means no 1 after a 0 within a row."""
    check_rank(mask, 2, name)
    if not is_concrete(mask):
        return
    values = np.asarray(mask)
    if not np.all((values == 0) | (values == 1)):
        raise ValueError(f"{name} must contain only 0 and 1 (or booleans)")
    if left_aligned and values.shape[1] > 1:
        ones = values != 0
        if np.any(ones[:, 1:] & ~ones[:, :-1]):
            rows = np.nonzero(np.any(ones[:, 1:] & ~ones[:, :-1], axis=1))[0]
            raise ValueError(
                f"{name} must be left-aligned (ones then zeros in each row); rows {rows.tolist()} "
                "have a 1 after a 0")
