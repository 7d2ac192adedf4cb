"""Stage 1: supervised fine-tuning on demonstrations (masked cross-entropy on responses)."""
from __future__ import annotations

import jax.numpy as jnp

from marl_jax import losses
from marl_jax.train import supervised


def sft_loss(policy, params, batch):
    """Cross-entropy of the response tokens given the prompt; batch holds `[B, P]` prompt and
    `[B, R]` response ids and masks."""
    ids = jnp.concatenate([batch["prompt_ids"], batch["response_ids"]], axis=1)
    mask = jnp.concatenate([batch["prompt_mask"], batch["response_mask"]], axis=1)
    logits = policy.apply({"params": params}, ids, mask)
    p = batch["prompt_ids"].shape[1]
    return losses.sft_cross_entropy(logits[:, p - 1:-1], batch["response_ids"],
                                    batch["response_mask"])


def run_sft(config, task, policy, init_params, *, mesh, writer, workdir):
    """Trains the policy on `task.sft`; returns the SFT params (resumes, or reuses a finished run)."""
    return supervised.train(
        name="sft", cfg=config.sft, seed=config.seed, module=policy, init_params=init_params,
        loss_fn=lambda params, batch: sft_loss(policy, params, batch), data=task.sft, mesh=mesh,
        writer=writer, workdir=workdir, checkpoint_every=config.checkpoint_every,
        log_every=config.log_every, max_to_keep=config.max_to_keep,
        metadata=dict(stage="sft", config=config.to_dict()), progress_keys=("loss",))
