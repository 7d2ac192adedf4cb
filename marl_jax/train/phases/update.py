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
from marl_jax.train import async_schedule
from marl_jax.train.optim import accumulate_gradients, applied_updates, apply_if_finite
from marl_jax.train.phases.advantages import Advantages
from marl_jax.train.phases import score
from marl_jax.train.ppo_types import Experience, Frozen, Models, PPOState, PPOStatic, role_params


def update_batch(static: PPOStatic, models: Models, state: PPOState, exp: Experience,
                 adv: Advantages):
    """(the rows every minibatch draws from: a dict of `[B, ...]` arrays, the shared trunk's
    layer count or None). The frozen trunk's output is computed once for every epoch and
    minibatch of actor and critic (the score phase's, when the experience carries it)."""
    # The forward passes read `response_mask` (a trajectory's observations too); the losses
    # `loss_mask`: the policy's tokens, without the rows that leave the loss (`adv.loss_rows`)
    # and, asynchronously, the tokens more than `max_token_staleness` versions old.
    loss_mask = exp.actions if adv.loss_rows is None else (
        exp.actions * adv.loss_rows[:, None].astype(exp.actions.dtype))
    if static.max_token_staleness >= 0 and exp.versions is not None:
        loss_mask = loss_mask * async_schedule.fresh_tokens(
            exp.versions, state.step, static.max_token_staleness).astype(loss_mask.dtype)
    data = dict(prompt_ids=exp.prompt_ids, prompt_mask=exp.prompt_mask,
                response_ids=exp.response_ids, response_mask=exp.response_mask,
                loss_mask=loss_mask, old_logprobs=exp.old_logprobs, old_values=exp.values,
                advantages=adv.advantages, returns=adv.returns)
    if adv.is_weights is not None:
        data["is_weights"] = adv.is_weights
    if static.ratio_level == "macro":
        data["segment_ids"] = adv.segment_ids
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
    """(the policy loss of one micro-batch, metrics): the clipped surrogate of the ratio of each
    token, macro or response (`static.ratio_level`) with its advantage, plus kl_coef x the k3
    KL to the reference where the estimator puts the KL in the loss (GRPO, Dr. GRPO). The
    weights are cast to the compute dtype once here, not at every layer call."""
    logprobs, entropy = score.token_logprobs(
        models.policy, compute_weights(role_params(static, "actor", frozen, params),
                                       models.policy.config),
        batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"],
        batch["response_mask"], static.temperature, _trunk_of(batch, trunk_layers), rngs)
    loss, m = losses.ppo_policy_loss(logprobs, batch["old_logprobs"], batch["advantages"],
                                     batch["loss_mask"], cliprange=static.cliprange,
                                     aggregation=static.loss_aggregation,
                                     is_weights=batch.get("is_weights"),
                                     ratio_level=static.ratio_level,
                                     ratio_form=static.ratio_form,
                                     segment_ids=batch.get("segment_ids"),
                                     cliprange_low=static.cliprange_low,
                                     cliprange_high=static.cliprange_high,
                                     dual_clip=static.dual_clip)
    m = dict(m, entropy=losses.masked_mean(entropy, batch["loss_mask"] != 0))
    if static.kl_in_loss:
        kl_loss = losses.kl_penalty_loss(logprobs, batch["ref_logprobs"],
                                         batch["loss_mask"], kl_coef=kl_coef,
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
                                    batch["loss_mask"],
                                    cliprange_value=static.cliprange_value)
    return static.vf_coef * loss, dict(m, value_loss=loss)


def token_count(batch):
    return batch["loss_mask"].sum()


def sequence_count(batch):
    return (batch["loss_mask"].sum(axis=1) > 0).sum()


def macro_count(batch):
    """Macros with a token in the loss: a row's segment ids run from 0 to its last one."""
    ids = jnp.where(batch["loss_mask"] != 0, batch["segment_ids"], -1)
    return (ids.max(axis=1) + 1).sum()


def actor_weight(static: PPOStatic):
    """The weight of a micro-batch's policy loss in its minibatch's (`accumulate_gradients`):
    the units the loss averages over (tokens, macros or responses), or responses for the
    per-response aggregations."""
    if static.loss_aggregation != "token_mean":
        return sequence_count
    return {"token": token_count, "macro": macro_count,
            "sequence": sequence_count}[static.ratio_level]


def kl_term_weights(static: PPOStatic):
    """`accumulate_gradients`' weights of the KL loss term (GRPO, Dr. GRPO: `kl_in_loss`), or
    None where they are the policy loss's: the KL is aggregated over tokens as the policy loss
    is over units, so under `token_mean` with a macro or sequence ratio its micro-batches weigh
    by their tokens, the policy loss's by their macros or responses."""
    if not static.kl_in_loss or static.loss_aggregation != "token_mean" \
            or static.ratio_level == "token":
        return None
    return {"kl_loss": token_count}


def actor_gradients(static: PPOStatic, models: Models, frozen: Frozen, kl_coef, trunk_layers,
                    params, batch, dropout_key=None):
    """`(loss, metrics), grads` of `actor_loss` on a minibatch, accumulated over
    `grad_accum_steps` micro-batches: the minibatch's own loss and gradient."""
    return accumulate_gradients(
        functools.partial(actor_loss, static, models, frozen, kl_coef, trunk_layers), params,
        batch, static.grad_accum_steps, actor_weight(static), static.num_layers_unfrozen,
        dropout_key, term_weights=kl_term_weights(static))


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
    (a_loss, a_m), a_grads = actor_gradients(static, models, frozen, kl_coef, trunk_layers,
                                             actor_params, batch, actor_key)
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
    if static.ratio_level != "token" or static.cliprange_high != static.cliprange_low:
        metrics["policy/clipfrac_low_avg"] = a_m["clipfrac_low"]
        metrics["policy/clipfrac_high_avg"] = a_m["clipfrac_high"]
    if static.dual_clip is not None:
        metrics["policy/dual_clipfrac_avg"] = a_m["dual_clipfrac"]
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
    valid = exp.actions != 0
    metrics["objective/advantage_avg"] = losses.masked_mean(adv.advantages, valid)
    if static.ratio_level == "macro":
        metrics["policy/ratio_units_avg"] = (macro_count(data) / jnp.maximum(
            sequence_count(data), 1)).astype(jnp.float32)
    if static.uses_critic:
        metrics["critic/explained_variance"] = explained_variance(exp.values, adv.returns,
                                                                  exp.actions)
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
