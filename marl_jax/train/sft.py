"""Stage 1: supervised fine-tuning on demonstrations (masked cross-entropy on responses; on a
multi-turn task's trajectories, on the policy's action tokens only)."""
from __future__ import annotations

from marl_jax import losses
from marl_jax.models.heads import continuation_scores
from marl_jax.train import supervised
from marl_jax.train.optim import adapter_weight_decay


def sft_loss(policy, params, batch, rngs=None):
    """Cross-entropy of the response tokens given the prompt; batch holds `[B, P]` prompt and
    `[B, R]` response ids and masks. The LM head runs over response positions only, in chunks.
    With an `action_mask` `[B, R]` (a multi-turn trajectory) the model reads every response
    token but only the action tokens are targets: observations are context.
    `rngs`: the adapters' dropout (`{"dropout": key}`), or None."""
    out = continuation_scores(policy, params, batch["prompt_ids"], batch["prompt_mask"],
                              batch["response_ids"], batch["response_mask"], rngs=rngs)
    return losses.token_cross_entropy(out.base_logprobs, out.correct, target_mask(batch))


def target_mask(batch):
    """`[B, R]` the tokens SFT trains: the action tokens where the batch has an action mask,
    else every response token."""
    return batch.get("action_mask", batch["response_mask"])


def run_sft(config, task, policy, init_params, *, mesh, writer, workdir):
    """Trains the policy on `task.sft`; returns the SFT params (resumes, or reuses a finished run)."""
    return supervised.train(
        name="sft", cfg=config.sft, seed=config.seed, module=policy, init_params=init_params,
        loss_fn=lambda params, batch, rngs=None: sft_loss(policy, params, batch, rngs),
        # A multi-turn task's turn ids are the PPO stage's; SFT reads the masks.
        data={k: v for k, v in task.sft.items() if k != "turn_ids"}, mesh=mesh,
        writer=writer, workdir=workdir, checkpoint_every=config.checkpoint_every,
        log_every=config.log_every, max_to_keep=config.max_to_keep,
        metadata=dict(stage="sft", config=config.to_dict()), progress_keys=("loss",),
        weight_fn=lambda batch: target_mask(batch).sum(),
        lora_weight_decay=adapter_weight_decay(config) or 0.0)
