"""The rollout engine: the sampler (`engine`: jitted prefill and KV-cache decode loop), continuous
batching over decode slots (`slots`: JetStream's prefill / insert / generate) and the row-wise
draws that let a row sample the same in any slot (`draws`), and multi-turn rollouts over one KV cache
against a host callback (`turns`)."""
from marl_jax.rollout.engine import (
    DECODE_BLOCK,
    SampleOutput,
    continue_responses,
    filtered_logits,
    generate,
    read_widths,
)
from marl_jax.rollout.turns import ACTION, OBSERVATION, PAD, Trajectory, reprefill_turns, run_turns

__all__ = ["DECODE_BLOCK", "SampleOutput", "continue_responses", "filtered_logits", "generate", "read_widths",
           "ACTION", "OBSERVATION", "PAD", "Trajectory", "reprefill_turns", "run_turns"]
