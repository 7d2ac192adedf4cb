"""The update phase: `ppo_epochs` x `num_minibatches` actor and critic updates from the
advantages, each minibatch's gradient accumulated over `grad_accum_steps` micro-batches; the
adaptive KL controller."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from marl_jax import losses
from marl_jax.models import compute_weights
from marl_jax.train.optim import accumulate_gradients, applied_updates, apply_if_finite
from marl_jax.train.phases.advantages import Advantages
from marl_jax.train.phases import score
from marl_jax.train.ppo_types import Experience, Frozen, Models, PPOState, PPOStatic, role_params


def update_batch(static: PPOStatic, models: Models, state: PPOState, exp: Experience,
                 adv: Advantages):
    """(the rows every minibatch draws from: a dict of `[B, ...]` arrays, the shared trunk's
    layer count or None). The frozen trunk's output is computed once for every epoch and
    minibatch of actor and critic (the score phase's, when the experience carries it)."""
    data = dict(prompt_ids=exp.prompt_ids, prompt_mask=exp.prompt_mask,
                response_ids=exp.response_ids, response_mask=exp.response_mask,
                old_logprobs=exp.old_logprobs, old_values=exp.values,
                advantages=adv.advantages, returns=adv.returns)
    if adv.is_weights is not None:
        data["is_weights"] = adv.is_weights
    if static.kl_in_loss:
        data["ref_logprobs"] = exp.ref_logprobs
    if exp.trunk is not None and static.shared_trunk_layers:
        trunk = (exp.trunk, static.shared_trunk_layers)
    else:
        trunk = score.shared_trunk(static, models, state.actor_params, exp.prompt_ids,
                             exp.prompt_mask, exp.response_ids, exp.response_mask)
    if trunk is None:
        return data, None
    data["trunk"] = trunk[0]
    return data, trunk[1]


def _trunk_of(batch, trunk_layers):
    return None if trunk_layers is None else (batch["trunk"], trunk_layers)


def actor_loss(static: PPOStatic, models: Models, frozen: Frozen, kl_coef, trunk_layers,
               params, batch, rngs=None):
    """(the policy loss of one micro-batch, metrics): the clipped surrogate of each token's
    ratio with its macro's advantage, plus kl_coef x the k3 KL to the reference where the
    estimator puts the KL in the loss (GRPO, Dr. GRPO). The weights are cast to the compute
    dtype once here, not at every layer call."""
    logprobs, entropy = score.token_logprobs(
        models.policy, compute_weights(role_params(static, "actor", frozen, params),
                                       models.policy.config),
        batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"],
        batch["response_mask"], static.temperature, _trunk_of(batch, trunk_layers), rngs)
    loss, m = losses.ppo_policy_loss(logprobs, batch["old_logprobs"], batch["advantages"],
                                     batch["response_mask"], cliprange=static.cliprange,
                                     aggregation=static.loss_aggregation,
                                     is_weights=batch.get("is_weights"))
    m = dict(m, entropy=losses.masked_mean(entropy, batch["response_mask"] != 0))
    if static.kl_in_loss:
        kl_loss = losses.kl_penalty_loss(logprobs, batch["ref_logprobs"],
                                         batch["response_mask"], kl_coef=kl_coef,
                                         aggregation=static.loss_aggregation)
        loss, m = loss + kl_loss, dict(m, kl_loss=kl_loss)
    return loss, m


def critic_loss(static: PPOStatic, models: Models, frozen: Frozen, trunk_layers, params, batch,
                rngs=None):
    """(vf_coef x the clipped value loss of one micro-batch, metrics): each token's value
    regressed onto its macro's return."""
    values = score.response_values(models.critic,
                             compute_weights(role_params(static, "critic", frozen, params),
                                             models.critic.config),
                             batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"],
                             batch["response_mask"], _trunk_of(batch, trunk_layers), rngs)
    loss, m = losses.ppo_value_loss(values, batch["old_values"], batch["returns"],
                                    batch["response_mask"],
                                    cliprange_value=static.cliprange_value)
    return static.vf_coef * loss, dict(m, value_loss=loss)


def token_count(batch):
    return batch["response_mask"].sum()


def sequence_count(batch):
    return (batch["response_mask"].sum(axis=1) > 0).sum()


def uses_dropout(static: PPOStatic, models: Models) -> bool:
    """The adapters' dropout (LoRA with `model.lora.dropout` > 0) is on for the actor or the
    critic: each minibatch then draws one key, from which actor and critic draw their masks."""
    return models.policy.config.lora_dropout > 0 or (
        static.uses_critic and models.critic.config.lora_dropout > 0)


def minibatch_step(static: PPOStatic, models: Models, frozen: Frozen, kl_coef, trunk_layers,
                   carry, xs):
    """One actor (and critic) optimizer update on a minibatch: the `lax.scan` body of an
    epoch. carry = (actor params, actor optimizer state, critic params, critic optimizer state,
    skipped updates); xs = the minibatch (and its dropout key, with dropout)."""
    batch, dropout_key = xs if uses_dropout(static, models) else (xs, None)
    actor_key, critic_key = (None, None) if dropout_key is None else (
        jax.random.fold_in(dropout_key, 0), jax.random.fold_in(dropout_key, 1))
    actor_params, actor_opt, critic_params, critic_opt, skipped = carry
    k = static.grad_accum_steps
    actor_weight = token_count if static.loss_aggregation == "token_mean" else sequence_count
    (a_loss, a_m), a_grads = accumulate_gradients(
        functools.partial(actor_loss, static, models, frozen, kl_coef, trunk_layers),
        actor_params, batch, k, actor_weight, static.num_layers_unfrozen, actor_key)
    actor_params, actor_opt, a_skip = apply_if_finite(
        a_loss, a_grads, actor_params, actor_opt, models.actor_optimizer)
    metrics = {
        "loss/policy_avg": a_loss, "policy/approxkl_avg": a_m["approxkl"],
        "policy/clipfrac_avg": a_m["clipfrac"], "policy/entropy_avg": a_m["entropy"],
        "val/ratio": a_m["ratio_mean"], "val/ratio_var": a_m["ratio_var"],
        "grad/actor_norm": optax.global_norm(a_grads),
    }
    if static.kl_in_loss:
        metrics["loss/kl_avg"] = a_m["kl_loss"]
    if static.uses_critic:
        (c_loss, c_m), c_grads = accumulate_gradients(
            functools.partial(critic_loss, static, models, frozen, trunk_layers),
            critic_params, batch, k, token_count, static.num_layers_unfrozen, critic_key)
        critic_params, critic_opt, c_skip = apply_if_finite(
            c_loss, c_grads, critic_params, critic_opt, models.critic_optimizer)
        skipped = skipped + c_skip
        metrics.update({"loss/value_avg": c_m["value_loss"],
                        "val/clipfrac_avg": c_m["clipfrac"],
                        "grad/critic_norm": optax.global_norm(c_grads)})
    return (actor_params, actor_opt, critic_params, critic_opt, skipped + a_skip), metrics


def update(static: PPOStatic, models: Models, state: PPOState, exp: Experience,
           adv: Advantages, key, frozen: Frozen = None):
    """`ppo_epochs` x `num_minibatches` actor and critic updates: (state, metrics). The actor
    alone for the critic-free estimators (`adv.returns` unused); `adv.is_weights` weigh each
    token's policy-gradient term. With LoRA the gradients are those of the adapters and heads
    alone, attached to `frozen`'s base. Each epoch permutes the rows and scans its minibatches.
    """
    b, n = static.batch_size, static.num_minibatches
    data, trunk_layers = update_batch(static, models, state, exp, adv)
    step = functools.partial(minibatch_step, static, models, frozen, state.kl_coef, trunk_layers)

    def epoch(carry, epoch_key):
        perm = jax.random.permutation(epoch_key, b)
        shuffled = jax.tree.map(lambda x: x[perm].reshape((n, b // n) + x.shape[1:]), data)
        if uses_dropout(static, models):
            keys = jax.random.split(jax.random.fold_in(epoch_key, 1), n)
            return jax.lax.scan(step, carry, (shuffled, keys))
        return jax.lax.scan(step, carry, shuffled)

    carry = (state.actor_params, state.actor_opt_state, state.critic_params,
             state.critic_opt_state, state.skipped_updates)
    carry, metrics = jax.lax.scan(epoch, carry, jax.random.split(key, static.ppo_epochs))
    actor_params, actor_opt, critic_params, critic_opt, skipped = carry
    metrics = jax.tree.map(jnp.mean, metrics)
    valid = exp.response_mask != 0
    metrics["objective/advantage_avg"] = losses.masked_mean(adv.advantages, valid)
    if static.uses_critic:
        metrics["critic/explained_variance"] = explained_variance(exp.values, adv.returns,
                                                                  exp.response_mask)
        metrics["objective/return_avg"] = losses.masked_mean(adv.returns, valid)
    metrics["train/skipped_updates"] = skipped
    # The rates of this step's first update, at the optimizers' own counts of applied updates
    # (a skipped non-finite update does not count).
    if models.actor_schedule is not None:
        metrics["lr"] = models.actor_schedule(applied_updates(state.actor_opt_state))
    if models.critic_schedule is not None and static.uses_critic:
        metrics["lr_critic"] = models.critic_schedule(
            applied_updates(state.critic_opt_state))
    new_state = state.replace(actor_params=actor_params, actor_opt_state=actor_opt,
                              critic_params=critic_params, critic_opt_state=critic_opt,
                              skipped_updates=skipped)
    return new_state, metrics


def explained_variance(values, returns, mask):
    """1 - Var(returns - values) / Var(returns) over valid tokens (0 when returns are constant)."""
    m = mask.astype(jnp.float32)
    n = jnp.maximum(m.sum(), 1.0)
    def var(x):
        mean = (x * m).sum() / n
        return (((x - mean) ** 2) * m).sum() / n
    v_ret = var(returns)
    return jnp.where(v_ret > 0, 1.0 - var(returns - values) / jnp.maximum(v_ret, 1e-12), 0.0)


def adapt_kl_coef(static: PPOStatic, kl_coef, kl):
    """The adaptive KL controller of Ziegler et al. (TRL's AdaptiveKLController)."""
    if not static.adaptive_kl:
        return kl_coef
    error = jnp.clip(kl / static.kl_target - 1.0, -0.2, 0.2)
    return kl_coef * (1.0 + error * static.batch_size / static.kl_horizon)
