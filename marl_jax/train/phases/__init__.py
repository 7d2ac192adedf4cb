"""The phases of one PPO / MA-PPO step, each a pure function of typed inputs
(`marl_jax.train.ppo_types`) to typed outputs; `marl_jax.train.ppo_core` composes them.

    rollout      sample `group_size` responses to each prompt from the current actor
    score        old and reference logprobs, critic values, the sequence score, per-token rewards
    advantages   termination -> segment ids, (macro) GAE or a critic-free estimator, rollout-
                 correction weights
    update       `ppo_epochs` x `num_minibatches` actor and critic updates, the KL controller

The metrics' `timing/<phase>_s` fields name these modules.
"""

from marl_jax.train.phases import advantages, rollout, score, update  # noqa: E402,F401
