"""Performance accounting: what a step costs in FLOPs, and what a device can do.

    DEVICE_KINDS   one table of device kinds: peak dense FLOP/s per compute dtype and matmul
                   precision (bf16, TF32, FP32), HBM bandwidth and capacity per JAX device
                   (vendors' datasheets), read by the benchmarks, the memory roofline and the
                   runs' `perf/mfu` (`peak_flops` picks the rate that ran)
    ModelFlops     the one FLOP count of a model: 2 FLOPs per weight a position multiplies
                   (PaLM's 2N forward, 6N forward and backward) plus the attention's
                   4 x layers x heads x head_dim FLOPs per position and key it reads
    ppo_step_flops the model FLOPs of one PPO / MA-PPO step per phase, every model counted
    step_fields    the `perf/*` fields of a metrics row from a step's seconds, tokens and FLOPs

The count is of model FLOPs, not of the FLOPs the compiled program executes: remat's
recomputation, padding of the vocabulary head's chunks, and the work a shared frozen trunk or a
frozen base (LoRA, `num_layers_unfrozen`) saves are not in it, so MFU compares implementations
of the same work. Whole-sequence passes (scoring, updates, SFT and reward-model steps) count
every position of their `[B, T]` shapes (padding included: the programs compute it) and, as
PaLM does, each position attending to all T keys; a decode step's token attends to the keys
cached so far. The embedding lookup costs nothing; the LM head runs only where a token is
scored (the response positions of a scoring pass, the last position of a prefill).
"""
from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

import jax
import numpy as np

GIB = 2 ** 30


class DeviceKind(NamedTuple):
    """One row of `DEVICE_KINDS` (per JAX device: TPU v2 / v3 expose each TensorCore as a device,
    half a chip; v4 and later, and GPUs, one device per chip). Rates are dense (no 2:4
    sparsity): NVIDIA's datasheets print the sparse rate of the tensor cores, twice these."""

    match: str  # the kind's words, lower-cased (`device_kind` matches whole words)
    bfloat16_flops: float  # bfloat16 (and float16) operands, at any matmul precision
    # float32 operands at matmul precision default or high: NVIDIA's TF32 tensor-core rate (on
    # V100, which has no TF32, its FP32 rate); None on TPUs (`peak_flops` says why).
    tf32_flops: float | None
    # float32 operands at precision highest: NVIDIA's FP32 rate; None on TPUs and where the
    # datasheet gives none.
    float32_flops: float | None
    hbm_bandwidth: float  # bytes/s
    hbm_bytes: int | None  # capacity; None where the kind comes in several sizes

    @property
    def is_tpu(self) -> bool:
        return self.match.split()[0] == "tpu"


# Sources: cloud.google.com/tpu/docs/<version> (TPUs); NVIDIA's datasheets of each part (H100 SXM
# and PCIe: TF32 989 and 756 TFLOP/s with sparsity; A100: TF32 312, bf16 624 with sparsity; L40:
# FP32 90.5, TF32 181, bf16 362.1 with sparsity; L40S: FP32 91.6, TF32 366, bf16 733 with
# sparsity; L4: FP32 30.3, TF32 120, bf16 242 with sparsity; A10: FP32 31.2, TF32 125, bf16 250
# with sparsity). A10G (AWS G5 only, no NVIDIA datasheet): a GA102 of 80 SMs at 1.71 GHz, FP32
# 80 x 128 x 2 x 1.71e9 = 35.0 TFLOP/s (a higher CUDA-core rate than the A10's), its tensor cores
# at GeForce GA102's rate with float32 accumulation, half the A10's per SM: bf16 70 and TF32 35
# (140 and 70 with sparsity). B200 / GB200: no float32 rate is in the table. Rows are in any
# order: `device_kind` takes the most specific row that matches.
DEVICE_KINDS = (
    DeviceKind("tpu v6 lite", 918e12, None, None, 1.64e12, 32 * GIB),  # v6e (Trillium)
    DeviceKind("tpu v6e", 918e12, None, None, 1.64e12, 32 * GIB),
    DeviceKind("tpu v5 lite", 197e12, None, None, 0.819e12, 16 * GIB),  # v5e
    DeviceKind("tpu v5e", 197e12, None, None, 0.819e12, 16 * GIB),
    DeviceKind("tpu v5p", 459e12, None, None, 2.765e12, 95 * GIB),
    DeviceKind("tpu v5", 459e12, None, None, 2.765e12, 95 * GIB),  # v5p reports "TPU v5"
    DeviceKind("tpu v4", 275e12, None, None, 1.2e12, 32 * GIB),
    DeviceKind("tpu v3", 61.5e12, None, None, 0.45e12, 16 * GIB),
    DeviceKind("tpu v2", 22.5e12, None, None, 0.35e12, 8 * GIB),
    DeviceKind("gb200", 2.5e15, None, None, 8.0e12, None),
    DeviceKind("b200", 2.25e15, None, None, 8.0e12, None),
    DeviceKind("gh200", 989e12, 494.5e12, 67e12, 4.0e12, None),
    DeviceKind("h200", 989e12, 494.5e12, 67e12, 4.8e12, 141 * 10 ** 9),
    DeviceKind("h100 pcie", 756e12, 378e12, 51e12, 2.0e12, 80 * 10 ** 9),
    DeviceKind("h100", 989e12, 494.5e12, 67e12, 3.35e12, 80 * 10 ** 9),  # SXM
    DeviceKind("h800", 989e12, 494.5e12, 67e12, 3.35e12, 80 * 10 ** 9),
    DeviceKind("a100", 312e12, 156e12, 19.5e12, 2.0e12, None),
    DeviceKind("a800", 312e12, 156e12, 19.5e12, 2.0e12, None),
    DeviceKind("l40s", 362e12, 183e12, 91.6e12, 0.864e12, 48 * 10 ** 9),
    DeviceKind("l40", 181e12, 90.5e12, 90.5e12, 0.864e12, 48 * 10 ** 9),
    DeviceKind("l4", 121e12, 60e12, 30.3e12, 0.3e12, 24 * 10 ** 9),
    DeviceKind("a10g", 70e12, 35e12, 35e12, 0.6e12, 24 * 10 ** 9),
    DeviceKind("a10", 125e12, 62.5e12, 31.2e12, 0.6e12, 24 * 10 ** 9),
    DeviceKind("v100", 125e12, 15.7e12, 15.7e12, 0.9e12, None),  # fp16 tensor cores (no bf16)
)


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def device_kind(kind: str) -> DeviceKind | None:
    """The table's row of a `jax.Device.device_kind` string, or None (CPUs, kinds it lacks).

    A row matches when each of its words is a whole word of the kind ("NVIDIA A100-SXM4-80GB" is
    `a100`; "NVIDIA L40S" is not `l40`, "NVIDIA A10G" not `a10`), and of the rows that match the
    one with the most words wins ("NVIDIA H100 PCIe" is `h100 pcie`, "TPU v5 lite" `tpu v5 lite`).
    """
    words = _words(kind)
    rows = [row for row in DEVICE_KINDS if _words(row.match) <= words]
    return max(rows, key=lambda row: len(_words(row.match)), default=None)


def peak_flops(kind: str, dtype: str = "bfloat16", precision: str | None = None) -> float | None:
    """Peak dense FLOP/s of one device of `kind` whose matmuls take `dtype` operands at matmul
    `precision` ("default", "high" or "highest"; None: as `ModelConfig.precision` resolves it,
    highest in float32 and default otherwise), or None where the table lacks the kind or that
    rate: a model FLOP count over it is an MFU of what ran.

    bfloat16 and float16 run on the tensor cores (the MXU) at every precision. float32 on an
    NVIDIA GPU runs as TF32 on the tensor cores at default and high, as FP32 at highest (V100:
    FP32 at every precision). float32 on a TPU runs as one bfloat16 pass at default (the bfloat16
    rate) and as three (high) or six (highest) passes, which no datasheet rates: None (the
    table's float32 columns are None for TPUs).
    """
    from marl_jax.models.config import MATMUL_PRECISIONS

    dtype = str(dtype)
    if precision is None:
        precision = "highest" if dtype == "float32" else "default"
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul precision {precision!r} is not one of {MATMUL_PRECISIONS}")
    row = device_kind(kind)
    if row is None:
        return None
    if dtype in ("bfloat16", "float16"):
        return row.bfloat16_flops
    if dtype != "float32":
        return None
    if row.is_tpu:
        return row.bfloat16_flops if precision == "default" else None
    return row.float32_flops if precision == "highest" else row.tf32_flops


def devices_peak_flops(dtype: str, precision: str | None = None) -> float | None:
    """Peak FLOP/s of every device of the job (`jax.devices()`, all processes) computing in
    `dtype` at matmul `precision` (`peak_flops`)."""
    peak = peak_flops(jax.devices()[0].device_kind, dtype, precision)
    return None if peak is None else peak * jax.device_count()


# ---- the FLOP count of a model ----------------------------------------------------------------
def attention_flops(num_layers: int, num_heads: int, head_dim: int, positions, keys):
    """Forward FLOPs of the attention's two matmuls (q k^T and the weighted sum of values):
    2 x 2 x layers x heads x head_dim per position and key it reads."""
    return 4 * num_layers * num_heads * head_dim * positions * keys


@dataclasses.dataclass(frozen=True)
class ModelFlops:
    """The FLOP count of one model (a `CausalLM` or a `ScalarHeadModel`).

    body: the weights of the decoder layers a position multiplies (every matmul kernel of the
    backbone but the embedding table, which is a lookup); head: the output head's (`[D, V]` of
    the LM head, tied or not; `[D, 1]` of a scalar head); num_layers, num_heads, head_dim: the
    attention's shape.
    """

    body: int
    head: int
    num_layers: int
    num_heads: int
    head_dim: int

    def forward(self, positions, keys, head_positions=None) -> float:
        """FLOPs of a forward pass over `positions` positions, each attending to `keys` keys,
        the head applied at `head_positions` of them (default: all)."""
        head_positions = positions if head_positions is None else head_positions
        return float(2 * self.body * positions + 2 * self.head * head_positions
                     + attention_flops(self.num_layers, self.num_heads, self.head_dim,
                                       positions, keys))

    def train(self, positions, keys, head_positions=None) -> float:
        """Forward and backward: 3 x the forward (PaLM's 6N plus attention)."""
        return 3 * self.forward(positions, keys, head_positions)

    def prefill(self, prompt: int) -> float:
        """A prompt of `prompt` positions written into the KV cache, the head at its last."""
        return self.forward(prompt, prompt, 1)

    def generation(self, prompt: int, new) -> float:
        """`new` tokens decoded one at a time after a prompt of `prompt` positions: 2N each (the
        head included), token t attending to the prompt and the t tokens before it and itself."""
        new = float(new)
        keys = new * prompt + new * (new + 1) / 2
        return 2 * (self.body + self.head) * new + attention_flops(
            self.num_layers, self.num_heads, self.head_dim, 1, keys)


def _kernel_size(tree) -> int:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return sum(int(np.prod(x.shape)) for path, x in leaves
               if getattr(path[-1], "key", None) == "kernel")


def model_flops(module) -> ModelFlops:
    """`ModelFlops` of a `CausalLM` or `ScalarHeadModel` from its parameter shapes (nothing is
    allocated)."""
    from marl_jax import models

    shapes = jax.eval_shape(lambda: models.init_params(module, jax.random.key(0)))
    cfg = module.config
    if "head" in shapes:  # a scalar head
        head = _kernel_size(shapes["head"])
    else:
        head = cfg.hidden_size * cfg.vocab_size
    return ModelFlops(body=_kernel_size(shapes["backbone"]), head=head,
                      num_layers=cfg.num_layers, num_heads=cfg.num_heads, head_dim=cfg.head_dim)


# ---- a PPO step ---------------------------------------------------------------------------
PHASES = ("rollout", "score", "advantages", "update")


def ppo_step_flops(static, policy: ModelFlops, critic: ModelFlops, reward: ModelFlops,
                   prompt_length: int, generated_tokens, response_length_mean=None,
                   observation_tokens=None) -> dict:
    """Model FLOPs of one PPO step per phase `{rollout, score, advantages, update}` (and
    `total`), every model counted.

    rollout: the policy's prefill of `static.prompts_per_step` prompts of `prompt_length`
    positions and 2N per generated token (`generated_tokens`, a host number: the step's
    `budget/generated_tokens`), each attending to the prompt and the tokens before it (at the
    mean response length `response_length_mean`, default the whole budget). score: a forward
    over every sampled row `[prompts_per_step x group_size, P + R]` of the actor (unless the
    sampler's logprobs are reused), the reference, the critic (with one) and the reward model
    (when it scores). update: `ppo_epochs` x the
    actor's (and critic's) forward and backward over `[B, P + R]`. advantages: none counted
    (Monte Carlo branches' tokens are in `generated_tokens`; their scoring is not counted).

    A multi-turn step (`observation_tokens`: the environment's tokens its rollout prefilled
    between turns, a host number) prefills every row's prompt (each sample plays its own
    episode) and the observations into the cache, each attending to the prompt and, on
    average, half the trajectory budget (no head at them): the work its `budget/prefill_tokens`
    count.
    """
    b, p, r = static.batch_size, prompt_length, static.response_length
    length = max(float(r if response_length_mean is None else response_length_mean), 1.0)
    # Scoring covers every sampled row (dynamic sampling scores m x the rows it trains on).
    sampled = static.prompts_per_step * static.group_size
    decoded = float(np.sum(generated_tokens)) / length * policy.generation(p, length)
    if observation_tokens is None:
        rollout = static.prompts_per_step * policy.prefill(p) + decoded
    else:
        rollout = (sampled * policy.prefill(p) + decoded
                   + policy.forward(float(np.sum(observation_tokens)), p + r / 2, 0))
    positions, keys = b * (p + r), p + r
    scorers = [reward] if static.reward_source == "rm" else []
    if not static.reuses_sampler_logprobs:
        scorers.append(policy)
    scorers.append(policy)  # the reference
    if static.uses_critic:
        scorers.append(critic)
    score = sum(m.forward(sampled * (p + r), keys, sampled * r if m is policy else None)
                for m in scorers)
    trained = [policy] + ([critic] if static.uses_critic else [])
    update = static.ppo_epochs * sum(m.train(positions, keys, b * r if m is policy else None)
                                     for m in trained)
    out = dict(rollout=rollout, score=score, advantages=0.0, update=update)
    out["total"] = sum(out.values())
    return out


def step_fields(seconds: float, tokens: float, flops: float, peak: float | None) -> dict:
    """The `perf/*` fields of one step: `perf/step_s`, `perf/tokens_per_s`, `perf/tflops_per_s`
    (model FLOPs) and, with the devices' `peak` FLOP/s, `perf/mfu`."""
    seconds = max(float(seconds), 1e-9)
    out = {"perf/step_s": float(seconds), "perf/tokens_per_s": float(tokens) / seconds,
           "perf/tflops_per_s": float(flops) / seconds / 1e12}
    if peak:
        out["perf/mfu"] = float(flops) / seconds / peak
    return out
