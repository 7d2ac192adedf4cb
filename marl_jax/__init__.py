"""marl_jax: MA-RLHF (RLHF with macro actions) in JAX/Flax."""

__version__ = "0.1.0"
