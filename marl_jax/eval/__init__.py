"""Evaluation: sandboxed APPS execution and pass@k, pairwise judges, reward-score statistics.

Submodules are imported on use (`from marl_jax.eval import apps`), so that importing one part
does not load the others (matplotlib, HTTP, sandbox).
"""
