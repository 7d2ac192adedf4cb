"""Train-step and rollout throughput of the policy on the accelerator present (TPU, GPU or CPU),
each number beside its physical bound.

`python experiments/bench.py device [--small] [--batch-per-device 8] [--length 1024] ...`
measures one train step and the sampler:
  train step   tokens/s of one jitted SFT step (forward, backward and AdamW update of the
               policy, `marl_jax.train.supervised.make_train_step`) on `[batch, length]` tokens,
               and MFU = 6 * params * tokens/s / peak FLOP/s of all devices;
  sampler      new tokens/s of `marl_jax.rollout.generate` (KV-cache decoding, top-k 50).
Sizes: on GPUs and TPUs the SmolLM2-135M shape with rematerialisation; on CPUs a 4-layer
width-256 model; `--small` a 2-layer width-64 model (smoke test).

`python experiments/bench.py device --suite [--small] [--only ROW,...]` runs the rows below on
random weights (nothing to download), each number beside its bound, the last line JSON:
  train_smollm2_8x1024_{full,none}   SmolLM2-135M shape, 8 x 1024 tokens per device, remat full /
                                     none: tokens/s, MFU (6 x params x tokens/s / peak) and MFU
                                     with attention FLOPs (PaLM's 6N + 12 L H T per token);
  train_smollm2_8x1024_before        the same at remat full with the reference attention and
                                     the weights cast at every layer call (the step before the
                                     fused attention and the one cast per step);
  train_smollm2_8x1024_percast       remat full, the fused attention, the weights cast at every
                                     layer call (what the one cast per step saves);
  train_smollm2_8x1024_xla           remat full with jax.nn.dot_product_attention's XLA path;
  train_smollm2_max_{full,none}      at the largest per-device batch that fits (the memory a
                                     compile at 8 rows reports, scaled; powers of two, <= 64);
  train_gemma2b_4x2048               the Gemma-2B shape (18 layers, width 2048, vocabulary
                                     256000), remat full;
  decode_b32, decode_b256            new tokens/s of the sampler (bfloat16 on accelerators, 128
                                     prompt + 128 new tokens) in the fused layout (layers
                                     unrolled, q / k / v and gate / up one matmul each:
                                     `models.decode_layout`) and the share of the bound that
                                     reading the weights and the live KV cache once per step
                                     at HBM bandwidth sets; the compiled ops of one decode
                                     step (about the kernels it launches on a GPU); the
                                     sampler's compile time;
  decode_b32_unrolled                the same, layers unrolled, projections separate;
  decode_b32_scan, decode_b256_scan  the same in the training layout (layers in one scan);
  decode_parts_b256                  the decode loop's halves alone, ms per step at batch 256:
                                     the model's step (fused layout) and choosing the tokens
                                     with top-k 50 (on GPUs through the blocked top-k), top-k
                                     16 (XLA's GPU top-k kernel takes k <= 16; above, a sort of
                                     the vocabulary) and no filter; and the top-50 alone:
                                     lax.top_k, the blocked top-k (`rollout/top_k.py`, blocks
                                     of 1024) and its variant taking 16 per block;
  sampler_compile                    seconds to lower and compile `generate` in the training
                                     and the fused layout at 128 and 512 new tokens
                                     (the fused program holds its layers once per decode
                                     block), the persistent compilation cache off;
  slots_chat_b32_s8, slots_chat_b256_s64
                                     the static sampler in B / S calls of S rows (the same
                                     KV-cache memory) against S decode slots, rows stopping at
                                     lengths drawn from the recorded SmolLM2 chat profile
                                     (`bench_rollout.chat_lengths`): speedup, a slot iteration's
                                     cost over a static S-row step, token agreement as a share;
  mismatch_f32                       the sampler's logprobs against the trainer's in float32 at
                                     the default precision (highest): mean and max |diff|;
  ppo_w1, ppo_w2                     one whole PPO / MA-PPO iteration of four SmolLM2-135M-shaped
                                     (256 x (128 + 128)) or Gemma-2B-shaped (256 x (512 + 128))
                                     models (`bench_ppo`, `bench.py ppo --shape=w1|w2`): seconds,
                                     phase split, tokens/s, model TFLOP/s, MFU, MA-PPO / PPO, the
                                     phase-timing overhead, beside verl's anchor (6 timed
                                     iterations of each kind for W1, 1 for W2);
  ppo_async_w1                       the W1 iteration synchronous beside asynchronous PPO at
                                     k = 1, 2 (`bench_async`, `bench.py ppo --async`): the
                                     sampler on half the devices and the trainer on the other
                                     half (one device: they take turns), iteration, rollout and
                                     update seconds and their overlap (6 timed iterations;
                                     `--small`: k = 1 alone, 3 iterations).
`--small` runs every row with the smoke-test model on small shapes (a CPU, under a minute).
`--unrolled` runs the layers unrolled instead of in one scan (compiles take longer).
Peaks and bandwidths come from `bench_hardware` (timed for CPUs).
"""
import argparse
import json
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench_hardware import device_bounds, table_entry
from bench_models import model_settings, random_policy
from bench_timing import best_time

# The legacy single run's presets: (shape, remat, batch per device, length, sampler rows, prompt,
# new tokens, repeats).
PRESETS = {
    "small": dict(shape="small", remat="none", batch_per_device=2, length=64, sample_batch=4, prompt=16, new=16,
                  repeats=2),
    "cpu": dict(shape="cpu", remat="none", batch_per_device=4, length=256, sample_batch=8, prompt=64, new=64,
                repeats=3),
    "accelerator": dict(shape="smollm2", remat="full", batch_per_device=8, length=1024, sample_batch=32, prompt=128,
                        new=128, repeats=5),
}

SUITE_ROWS = ("train_smollm2_8x1024_full", "train_smollm2_8x1024_none", "train_smollm2_8x1024_before",
              "train_smollm2_8x1024_percast", "train_smollm2_8x1024_xla",
              "train_smollm2_max_full", "train_smollm2_max_none", "train_gemma2b_4x2048", "decode_b32",
              "decode_b32_unrolled", "decode_b32_scan", "decode_b256", "decode_b256_scan", "decode_parts_b256",
              "sampler_compile", "slots_chat_b32_s8", "slots_chat_b256_s64", "mismatch_f32", "ppo_w1", "ppo_w2",
              "ppo_async_w1")


def table_peak(device_kind: str, dtype: str = "bfloat16", precision: str | None = None):
    """Peak FLOP/s of one device of `device_kind` for `dtype` matmuls at `precision`
    (`perf.peak_flops`), or None."""
    entry = table_entry(device_kind, dtype, precision)
    return None if entry is None else entry[0]


# ---- train step -----------------------------------------------------------------------------
def train_program(config, module, params, mesh, batch: int, length: int, *, cast: bool = True):
    """(jitted SFT step, initial state, batch of `[batch, length]` tokens, half prompt half
    response). `cast`: the weights cast to the compute dtype once per step (as runs do), else
    at every layer call."""
    import functools

    from marl_jax import models
    from marl_jax.train import build, sft, sharding, supervised
    from marl_jax.train.optim import make_optimizer

    optimizer = make_optimizer(config.sft, 1000)
    shardings = build.train_state_shardings(module, optimizer, mesh, params)
    step = jax.jit(supervised.make_train_step(
        lambda p, b: sft.sft_loss(module, p, b), optimizer,
        compute_weights=functools.partial(models.compute_weights, config=module.config) if cast else None),
        in_shardings=(shardings, sharding.batch_sharding(mesh)),
        out_shardings=(shardings, sharding.replicated(mesh)), donate_argnums=0)
    rng = np.random.default_rng(0)
    half = length // 2
    ids = rng.integers(3, module.config.vocab_size, size=(batch, length)).astype(np.int32)
    data = dict(prompt_ids=ids[:, :half], prompt_mask=np.ones((batch, half), np.int32),
                response_ids=ids[:, half:], response_mask=np.ones((batch, length - half), np.int32))
    return step, build.new_train_state(params, optimizer, shardings), sharding.put_global(data, mesh)


def bench_train(config, module, params, mesh, batch: int, length: int, repeats: int, cast: bool = True):
    """(seconds of the best train step, seconds of the compile and first step)."""
    from marl_jax.train import build, sharding

    step, state0, data = train_program(config, module, params, mesh, batch, length, cast=cast)
    state = [state0]

    def run():
        state[0], metrics = step(state[0], data)
        return metrics["loss"]

    with sharding.mesh_context(mesh, sharding.logical_rules(mesh, build.model_dims(module.config))):
        start = time.perf_counter()
        jax.block_until_ready(run())
        first = time.perf_counter() - start
        return best_time(run, repeats, warmup=False), first


def train_memory(config, module, params, mesh, batch: int, length: int) -> dict:
    """The compiled SFT step's memory analysis at `[batch, length]`: argument and temporary bytes."""
    from marl_jax.train import build, sharding

    step, state, data = train_program(config, module, params, mesh, batch, length)
    with sharding.mesh_context(mesh, sharding.logical_rules(mesh, build.model_dims(module.config))):
        stats = step.lower(state, data).compile().memory_analysis()
    return dict(args=stats.argument_size_in_bytes, temp=stats.temp_size_in_bytes)


def device_capacity() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def largest_batch(probe: dict, probe_batch: int, capacity: int, cap: int = 64) -> int:
    """The largest power-of-two batch (<= cap) whose arguments plus temporaries, scaled linearly
    in the batch from the probe's, fit 85% of `capacity`."""
    per_row = probe["temp"] / probe_batch
    room = 0.85 * capacity - probe["args"]
    rows = max(1, int(room // per_row)) if per_row > 0 else cap
    return max(probe_batch, min(cap, 2 ** int(math.log2(rows))))


def attention_flops_per_token(cfg, length: int) -> float:
    """PaLM's attention FLOPs per token of a train step: 12 x layers x heads x head_dim x T."""
    return 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * length


# ---- sampler --------------------------------------------------------------------------------
def bench_sampler(module, params, mesh, batch: int, prompt: int, new: int, repeats: int, fixed_lengths=False):
    """(seconds of the best `generate` of `new` tokens after `[batch, prompt]` prompts, new tokens
    decoded, seconds of the compile and first call). `fixed_lengths`: every row decodes `new`
    tokens (no early stop)."""
    from marl_jax import distributed, rollout
    from marl_jax.train import build, sharding

    rng = np.random.default_rng(1)
    ids = rng.integers(3, module.config.vocab_size, size=(batch, prompt)).astype(np.int32)
    prompts = sharding.put_global(dict(ids=ids, mask=np.ones_like(ids)), mesh)
    params = jax.device_put(params, build.param_shardings(module, mesh, build.abstract(params)))
    top_k = min(50, module.config.vocab_size)
    lengths = jnp.full((batch,), new, jnp.int32) if fixed_lengths else None
    generate = jax.jit(lambda p, i, m, k: rollout.generate(
        module, p, i, m, key=jax.random.wrap_key_data(k), max_new_tokens=new, temperature=0.8,
        top_k=top_k, eos_id=module.config.eos_token_id, pad_id=module.config.pad_token_id,
        max_lengths=lengths))
    keys = iter(range(1_000_000))
    best, tokens, first = float("inf"), 0, 0.0
    with sharding.mesh_context(mesh, sharding.logical_rules(mesh, build.model_dims(module.config))):
        for attempt in range(repeats + 1):
            key = sharding.put_global(jax.random.key_data(jax.random.key(next(keys))), mesh, axis=None)
            start = time.perf_counter()
            out = jax.block_until_ready(generate(params, prompts["ids"], prompts["mask"], key))
            seconds = time.perf_counter() - start
            # Decoding runs until every row has stopped: count the steps actually taken.
            steps = int(distributed.global_to_host(out.mask).sum(axis=1).max())
            if attempt == 0:
                first = seconds
            elif seconds < best:
                best, tokens = seconds, batch * steps
    return best, tokens, first


# Instructions that launch no work of their own.
_FREE_OPS = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
                       "opt-barrier", "partition-id", "replica-id"})
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.-]+)\s.*\{$")
_OPCODE = re.compile(r"=\s.*?\b([a-z][a-z0-9-]*)\(")


def compiled_ops(hlo_text: str) -> int:
    """Work-launching instructions one run of a compiled program executes: those of its entry
    computation, a `while` counted as its body's times its known trip count (a `conditional` as
    its largest branch), calls inlined; fusions and library calls count one each. On a GPU that
    is about the kernels a step launches."""
    computations, name, entry = {}, None, None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and not line.startswith(" "):
            name = header.group(1)
            computations[name] = []
            entry = name if line.startswith("ENTRY") else entry
        elif line.startswith("}"):
            name = None
        elif name is not None and " = " in line:
            computations[name].append(line)

    def count(computation: str) -> int:
        total = 0
        for line in computations.get(computation, ()):
            opcode = _OPCODE.search(line.split(", metadata=")[0])
            op = opcode.group(1) if opcode else ""
            if op in _FREE_OPS:
                continue
            if op == "while":
                body = re.search(r"body=%?([\w.-]+)", line).group(1)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                total += count(body) * (int(trips.group(1)) if trips else 1)
            elif op == "conditional":
                branches = re.findall(r"%([\w.-]+)", line.split("branch_computations={")[-1].split("}")[0])
                total += 1 + max((count(b) for b in branches), default=0)
            elif op == "call":
                total += count(re.search(r"to_apply=%?([\w.-]+)", line).group(1))
            else:
                total += 1
        return total

    return count(entry)


def decode_step_ops(module, params, batch: int, width: int) -> int:
    """`compiled_ops` of one decode step of the sampler's layout (`models.decode_layout`), the
    weights prepared as the sampler prepares them once per rollout: one token per row against a
    cache of `width` slots."""
    from marl_jax import models
    from marl_jax.models import decode_layout

    config, prepared = decode_layout.for_decoding(module.config, params)
    sampler = models.CausalLM(config)
    cache = models.init_cache(config, batch, width)
    step = jax.jit(lambda p, c, tokens: sampler.apply(
        {"params": p}, tokens, jnp.ones((batch, width), jnp.int32), jnp.full((batch, 1), width - 1, jnp.int32), c,
        jnp.int32(width - 1), method=models.CausalLM.decode))
    return compiled_ops(step.lower(prepared, cache, jnp.zeros((batch, 1), jnp.int32)).compile().as_text())


def bench_decode_parts(module, params, batch: int, prompt: int, new: int, repeats: int) -> dict:
    """Milliseconds per step of the decode loop's two halves, each alone in a jitted loop of `new`
    steps: `model` the sampler's decode step (its layout, `models.decode_layout`; one token per
    row against a cache of prompt + new columns, all read, then an argmax to feed the next), and
    choosing tokens from `[batch, V]` float32 logits at temperature 0.8 with `top_k_50` (the
    decode rows' setting), `top_k_16` and `no_filter` (the whole vocabulary); and the top-50
    alone: `lax_top_k_50`, `blocked_top_k_50` and `blocked16_top_k_50` (`rollout.top_k`)."""
    from marl_jax import models
    from marl_jax.models import decode_layout
    from marl_jax.rollout import engine

    config, prepared = decode_layout.for_decoding(module.config, params)
    sampler = models.CausalLM(config)
    width = prompt + new

    @jax.jit
    def model_steps(p):
        def body(i, carry):
            tokens, cache = carry
            logits, cache = sampler.apply({"params": p}, tokens, jnp.ones((batch, width), jnp.int32),
                                          jnp.full((batch, 1), prompt, jnp.int32) + i, cache, prompt + i,
                                          method=models.CausalLM.decode)
            return jnp.argmax(logits, axis=-1)[:, None].astype(jnp.int32), cache

        start = (jnp.zeros((batch, 1), jnp.int32), models.init_cache(config, batch, width))
        return jax.lax.fori_loop(0, new, body, start)[0]

    logits = jax.random.normal(jax.random.key(0), (batch, config.vocab_size), jnp.float32)

    def choose_steps(top_k):
        @jax.jit
        def run(logits):
            def body(i, total):
                step_key = jax.random.fold_in(jax.random.key(1), i)
                token, _, _ = engine.choose_tokens(logits + i.astype(jnp.float32),
                                             lambda c: jax.random.categorical(step_key, c, axis=-1),
                                             jnp.float32(0.8), jnp.float32(1.0), top_k=top_k, greedy=False,
                                             dynamic_temperature=False, use_top_p=False)
                return total + token.sum()

            return jax.lax.fori_loop(0, new, body, jnp.int32(0))

        return run

    def top_k_steps(select):
        @jax.jit
        def run(logits):
            def body(i, total):
                values, index = select(logits + i.astype(jnp.float32))
                return total + index.sum() + values[:, 0].astype(jnp.int32).sum()

            return jax.lax.fori_loop(0, new, body, jnp.int32(0))

        return run

    from marl_jax.rollout.top_k import blocked_top_k

    k = min(50, config.vocab_size)
    parts = {"model": lambda: model_steps(prepared)}
    for name, top_k in (("top_k_50", 50), ("top_k_16", 16), ("no_filter", 0)):
        run = choose_steps(min(top_k, config.vocab_size))
        parts[name] = lambda run=run: run(logits)
    for name, select in (("lax_top_k_50", lambda x: jax.lax.top_k(x, k)),
                         ("blocked_top_k_50", lambda x: blocked_top_k(x, k)),
                         ("blocked16_top_k_50", lambda x: blocked_top_k(x, k, per_block=16))):
        run = top_k_steps(select)
        parts[name] = lambda run=run: run(logits)
    return {name: 1e3 * best_time(fn, repeats) / new for name, fn in parts.items()}


def decode_bytes(cfg, batch: int, prompt: int, new: int) -> float:
    """Bytes one `generate` must read at least: every weight once per decode step in the compute
    dtype (the tied or untied LM head included) and, per step, the keys and values of the
    positions live so far."""
    itemsize = jnp.dtype(cfg.dtype).itemsize
    weights = _param_count(cfg) * itemsize
    per_position = 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.head_dim * itemsize
    positions = sum(prompt + t for t in range(new))
    return new * weights + per_position * positions


def _param_count(cfg) -> int:
    from marl_jax import models

    module = models.build_model(cfg)
    shapes = jax.eval_shape(lambda: models.init_params(module, jax.random.key(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


# ---- the suite ------------------------------------------------------------------------------
class Suite:
    """The rows of `--suite`: each a method returning its measured numbers and bounds."""

    def __init__(self, small: bool, unrolled: bool, repeats: int, scan_unroll: int = 1):
        from marl_jax.train import sharding

        self.small, self.scan, self.repeats, self.scan_unroll = small, not unrolled, repeats, scan_unroll
        self.backend = jax.default_backend()
        self.dtype = "bfloat16" if self.backend in ("gpu", "tpu") else "float32"
        self.bounds = device_bounds(self.dtype, small)
        self.mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
        self.devices = jax.device_count()
        self.capacity = device_capacity()

    def _policy(self, shape: str, dtype=None, **settings):
        config = model_settings("small" if self.small else shape, dtype or self.dtype, scan_layers=self.scan,
                                **settings)
        if self.scan_unroll > 1:
            config.model.config.scan_unroll = min(self.scan_unroll, config.model.config.num_layers)
        return (config,) + random_policy(config)

    def _train(self, shape, batch, length, remat, attention="auto", cast=True):
        if self.small:
            batch, length = min(batch, 2), min(length, 64)
        config, module, params, count = self._policy(shape, remat=remat, attention=attention)
        global_batch = batch * self.devices
        step_s, first_s = bench_train(config, module, params, self.mesh, global_batch, length, self.repeats, cast)
        tokens_per_s = global_batch * length / step_s
        peak = self.bounds["flops"] * self.devices
        mfu = 6 * count * tokens_per_s / peak
        mfu_attention = (6 * count + attention_flops_per_token(module.config, length)) * tokens_per_s / peak
        from marl_jax.models import attention as attention_lib

        return dict(batch_per_device=batch, length=length, remat=remat, attention=attention_lib.resolve(module.config),
                    weights_cast_once=cast, params=count, step_s=step_s, compile_and_first_s=first_s,
                    tokens_per_s=tokens_per_s, mfu=mfu, mfu_with_attention=mfu_attention,
                    text=f"{tokens_per_s:,.0f} tokens/s, MFU {100 * mfu:.1f}% ({100 * mfu_attention:.1f}% "
                         f"with attention) of {peak / 1e12:.3g} TFLOP/s")

    def train_smollm2_8x1024_full(self):
        return self._train("smollm2", 8, 1024, "full")

    def train_smollm2_8x1024_none(self):
        return self._train("smollm2", 8, 1024, "none")

    def train_smollm2_8x1024_percast(self):
        return self._train("smollm2", 8, 1024, "full", cast=False)

    def train_smollm2_8x1024_xla(self):
        return self._train("smollm2", 8, 1024, "full", attention="xla")

    def train_smollm2_8x1024_before(self):
        return self._train("smollm2", 8, 1024, "full", attention="reference", cast=False)

    def _train_max(self, remat):
        length = 64 if self.small else 1024
        probe_batch = 2 if self.small else 8
        config, module, params, _ = self._policy("smollm2", remat=remat)
        probe = train_memory(config, module, params, self.mesh, probe_batch * self.devices, length)
        capacity = self.capacity or (probe["args"] + 8 * probe["temp"])
        batch = largest_batch(probe, probe_batch, capacity, cap=4 if self.small else 64)
        row = self._train("smollm2", batch, 1024, remat)
        row.update(probe_batch=probe_batch, probe_temp_bytes=probe["temp"], capacity_bytes=capacity)
        return row

    def train_smollm2_max_full(self):
        return self._train_max("full")

    def train_smollm2_max_none(self):
        return self._train_max("none")

    def train_gemma2b_4x2048(self):
        return self._train("gemma2b", 4, 2048, "full")

    def _decode(self, batch, layout):
        prompt, new = (16, 32) if self.small else (128, 128)
        batch = min(batch, 8) if self.small else batch
        _, module, params, _ = self._policy("smollm2", sampler_layout=layout)
        seconds, tokens, first = bench_sampler(module, params, self.mesh, batch * self.devices, prompt, new,
                                               self.repeats, fixed_lengths=True)
        steps = tokens // (batch * self.devices)
        bound_s = decode_bytes(module.config, batch, prompt, steps) / self.bounds["bandwidth"]
        ops = decode_step_ops(module, params, batch, prompt + new)
        return dict(batch=batch, prompt=prompt, new=steps, layout=layout, seconds=seconds,
                    tokens_per_s=tokens / seconds, ms_per_step=1e3 * seconds / steps, bound_s=bound_s,
                    share_of_bound=bound_s / seconds, compile_and_first_s=first, ops_per_step=ops,
                    text=f"{layout} layout: {tokens / seconds:,.0f} new tokens/s, {1e3 * seconds / steps:.2f} ms per "
                         f"step ({ops} compiled ops per step), "
                         f"{100 * bound_s / seconds:.1f}% of the weight + KV read bound "
                         f"({1e3 * bound_s / steps:.3f} ms per step at "
                         f"{self.bounds['bandwidth'] / 1e12:.2f} TB/s); compile + first call {first:.1f} s")

    def decode_b32(self):
        return self._decode(32, "fused")

    def decode_b32_unrolled(self):
        return self._decode(32, "unrolled")

    def decode_b32_scan(self):
        return self._decode(32, "train")

    def decode_b256(self):
        return self._decode(256, "fused")

    def decode_b256_scan(self):
        return self._decode(256, "train")

    def sampler_compile(self):
        """Seconds to lower and compile `generate` (8 x 64 prompt tokens, top-k 50) in the training
        and the fused layout, per decode budget, with the persistent compilation cache off."""
        from marl_jax import models, rollout

        budgets = (16, 64) if self.small else (128, 512)
        seconds = {}
        previous = jax.config.jax_enable_compilation_cache
        jax.config.update("jax_enable_compilation_cache", False)
        try:
            for layout in ("train", "fused"):
                _, module, _, _ = self._policy("smollm2", sampler_layout=layout)
                params = jax.eval_shape(lambda: models.init_params(module, jax.random.key(0)))
                for new in budgets:
                    program = jax.jit(lambda p, ids, module=module, new=new: rollout.generate(
                        module, p, ids, jnp.ones_like(ids), key=jax.random.key(0), max_new_tokens=new,
                        temperature=0.8, top_k=min(50, module.config.vocab_size), eos_id=module.config.eos_token_id,
                        pad_id=module.config.pad_token_id))
                    start = time.perf_counter()
                    program.lower(params, jax.ShapeDtypeStruct((8, 64), jnp.int32)).compile()
                    seconds[f"{layout}_{new}"] = time.perf_counter() - start
        finally:
            jax.config.update("jax_enable_compilation_cache", previous)
        return dict(budgets=list(budgets), compile_s=seconds,
                    text="lower + compile of generate, 8 x 64 prompt tokens: " + ", ".join(
                        f"{new} new tokens {seconds[f'train_{new}']:.1f} s (train) / {seconds[f'fused_{new}']:.1f} s "
                        "(fused)" for new in budgets))

    def decode_parts_b256(self):
        prompt, new = (16, 32) if self.small else (128, 128)
        batch = 8 if self.small else 256
        _, module, params, _ = self._policy("smollm2", sampler_layout="fused")
        parts = bench_decode_parts(module, params, batch * self.devices, prompt, new, self.repeats)
        return dict(batch=batch, prompt=prompt, new=new, ms_per_step=parts,
                    text="ms per step alone: " + ", ".join(f"{name} {ms:.3f}" for name, ms in parts.items()))

    def _slots(self, batch, slots):
        from bench_rollout import chat_lengths, compare_rollouts

        prompt, new = (16, 32) if self.small else (48, 256)
        if self.small:
            batch, slots = 8, 2
        _, module, params, _ = self._policy("smollm2")
        rng = np.random.default_rng(0)
        ids = jnp.asarray(rng.integers(3, module.config.vocab_size, (batch, prompt)), jnp.int32)
        out = compare_rollouts(module, params, ids, jnp.ones_like(ids), slots=slots, new=new, key=jax.random.key(0),
                               temperature=0.8, top_k=50, eos=module.config.eos_token_id[0],
                               pad=module.config.pad_token_id, repeats=self.repeats,
                               max_lengths=jnp.asarray(chat_lengths(batch, new, 0)))
        bound = out["chunk_steps"] / out["slot_iterations"]
        out.update(prompt=prompt, fifo_bound=bound,
                   text=f"same memory: static {out['static_chunks_s']:.3f} s ({out['chunk_steps']} steps of {slots} "
                        f"rows) vs slots {out['slots_s']:.3f} s ({out['slot_iterations']} iterations): "
                        f"{out['same_memory_speedup']:.2f}x (first-in first-out bound {bound:.2f}x); an iteration "
                        f"costs {out['iteration_vs_step']:.2f}x a static {slots}-row step; whole static batch "
                        f"{out['static_s']:.3f} s; tokens agree at {100 * out['agreement']:.1f}% of positions; "
                        f"compile + first call: slots {out['slots_first_s']:.1f} s, static "
                        f"{out['static_first_s']:.1f} s")
        out.pop("lengths")
        return out

    def slots_chat_b32_s8(self):
        return self._slots(32, 8)

    def slots_chat_b256_s64(self):
        return self._slots(256, 64)

    def _ppo(self, shape: str, repeats: int):
        import bench_ppo

        row = bench_ppo.measure(bench_ppo.setup_of(shape, self.small, self.dtype),
                                3 if self.small else repeats)
        row["last_line"] = bench_ppo.last_line(row)
        return row

    def ppo_w1(self):
        return self._ppo("w1", 6)

    def ppo_w2(self):
        return self._ppo("w2", 1)

    def ppo_async_w1(self):
        import bench_async
        import bench_ppo

        # --small (a smoke test of the row) times k = 1 alone.
        return bench_async.measure(bench_ppo.setup_of("w1", self.small, self.dtype),
                                   3 if self.small else 6, (1,) if self.small else (1, 2))

    def mismatch_f32(self):
        from marl_jax import rollout
        from marl_jax.train import phases

        batch, prompt, new = (4, 16, 16) if self.small else (16, 64, 64)
        _, module, params, _ = self._policy("smollm2", dtype="float32")
        rng = np.random.default_rng(2)
        ids = jnp.asarray(rng.integers(3, module.config.vocab_size, (batch, prompt)), jnp.int32)
        mask = jnp.ones_like(ids)
        out = jax.jit(lambda p: rollout.generate(
            module, p, ids, mask, key=jax.random.key(3), max_new_tokens=new, temperature=0.8, top_k=0,
            eos_id=module.config.eos_token_id, pad_id=module.config.pad_token_id))(params)
        response_mask = out.mask.astype(jnp.int32)
        trainer = jax.jit(lambda p: phases.score.token_logprobs(module, p, ids, mask, out.tokens, response_mask, 0.8)[0])(
            params)
        diff = np.abs(np.asarray((trainer - out.logprobs) * response_mask))
        valid = np.asarray(response_mask).astype(bool)
        return dict(precision=module.config.precision, diff_mean=float(diff[valid].mean()),
                    diff_max=float(diff[valid].max()), tokens=int(valid.sum()),
                    text=f"float32 at {module.config.precision} precision: |sampler - trainer| logprob mean "
                         f"{diff[valid].mean():.2e}, max {diff[valid].max():.2e} over {int(valid.sum())} tokens "
                         "(target: max < 1e-4)")


def run_suite(args):
    from marl_jax import xla_flags
    from marl_jax.train import compile_cache

    # Rows that build the same program (the small model's shapes repeat) compile it once.
    compile_cache.use_run_cache()

    suite = Suite(args.small, args.unrolled, args.repeats or (2 if args.small else 4), args.scan_unroll)
    rows = SUITE_ROWS if not args.only else tuple(args.only.split(","))
    unknown = [r for r in rows if r not in SUITE_ROWS]
    if unknown:
        raise SystemExit(f"--only: unknown rows {unknown}; rows: {', '.join(SUITE_ROWS)}")
    kind = jax.devices()[0].device_kind
    print(f"devices: {suite.devices} x {kind} ({suite.backend}); compute {suite.dtype}, params float32; layers "
          f"{'in one scan' if suite.scan else 'unrolled'}"
          f"{f' ({suite.scan_unroll} per iteration)' if suite.scan and suite.scan_unroll > 1 else ''}; peak {suite.bounds['flops'] / 1e12:.1f} TFLOP/s, HBM "
          f"{suite.bounds['bandwidth'] / 1e12:.2f} TB/s per device ({suite.bounds['source']}); XLA flags: "
          f"{xla_flags.current() or '(none)'}", flush=True)
    results = {}
    for name in rows:
        start = time.perf_counter()
        try:
            row = getattr(suite, name)()
        except Exception as error:  # one row's failure (a kernel, memory) must not hide the others
            row = dict(error=f"{type(error).__name__}: {str(error).splitlines()[0][:300]}")
            print(f"{name}: FAILED {row['error']}", flush=True)
        else:
            print(f"{name}: {row.pop('text')}", flush=True)
        row["wall_s"] = time.perf_counter() - start
        results[name] = row
        print(f"row {json.dumps({name: row})}", flush=True)
        jax.clear_caches()
    print(json.dumps(dict(backend=suite.backend, device_kind=kind, devices=suite.devices, dtype=suite.dtype,
                          scan_layers=suite.scan, bounds=suite.bounds, xla_flags=xla_flags.current(),
                          rows=results)))


def main(argv):
    parser = argparse.ArgumentParser(prog="bench.py device", description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a tiny model (smoke test)")
    parser.add_argument("--suite", action="store_true", help="every row of the suite (see the module docstring)")
    parser.add_argument("--only", default="", help="with --suite: a comma-separated subset of its rows")
    parser.add_argument("--unrolled", action="store_true", help="with --suite: unrolled layers instead of a scan")
    parser.add_argument("--scan-unroll", type=int, default=1,
                        help="with --suite: layers per iteration of the layer scan (ModelConfig.scan_unroll)")
    parser.add_argument("--dtype", default="auto", help="compute dtype: auto, bfloat16, float32")
    parser.add_argument("--batch-per-device", type=int)
    parser.add_argument("--length", type=int, help="train sequence length")
    parser.add_argument("--sample-batch", type=int, help="sampler rows per device")
    parser.add_argument("--prompt", type=int, help="sampler prompt length")
    parser.add_argument("--new", type=int, help="sampler new tokens")
    parser.add_argument("--repeats", type=int)
    args = parser.parse_args(argv)
    if args.suite:
        return run_suite(args)

    from marl_jax.train import sharding

    backend = jax.default_backend()
    preset = dict(PRESETS["small" if args.small else "cpu" if backend == "cpu" else "accelerator"])
    for field in ("batch_per_device", "length", "sample_batch", "prompt", "new", "repeats"):
        if getattr(args, field) is not None:
            preset[field] = getattr(args, field)
    for field in ("batch_per_device", "length", "sample_batch", "prompt", "new", "repeats"):
        if preset[field] < 1 or (field == "length" and preset[field] < 2):
            raise SystemExit(f"--{field.replace('_', '-')}={preset[field]} must be positive "
                             f"(length >= 2)")

    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if backend in ("gpu", "tpu") else "float32")
    config = model_settings(preset["shape"], dtype, remat=preset["remat"], scan_layers=False)
    module, params, num_params = random_policy(config)
    module_config = module.config
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    devices = jax.device_count()
    batch, length = preset["batch_per_device"] * devices, preset["length"]
    sample_batch = preset["sample_batch"] * devices
    if preset["prompt"] + preset["new"] > module_config.max_position_embeddings:
        raise SystemExit(f"--prompt + --new = {preset['prompt'] + preset['new']} exceeds the "
                         f"model's {module_config.max_position_embeddings} positions")

    kind = jax.devices()[0].device_kind
    peak_per_device = table_peak(kind, module_config.dtype, module_config.precision)
    peak_source = f"table ({kind}, {module_config.dtype} at {module_config.precision} precision)"
    if peak_per_device is None:
        from bench_hardware import timed_matmul_peak

        size = 512 if args.small else 2048
        peak_per_device = timed_matmul_peak(jnp.dtype(module_config.dtype), size)
        peak_source = f"best timed {size}^3 {module_config.dtype} matmul"

    train_seconds, _ = bench_train(config, module, params, mesh, batch, length, preset["repeats"])
    train_tokens_per_s = batch * length / train_seconds
    mfu = 6 * num_params * train_tokens_per_s / (peak_per_device * devices)
    sample_seconds, sample_tokens, _ = bench_sampler(module, params, mesh, sample_batch, preset["prompt"],
                                                     preset["new"], preset["repeats"])
    sample_tokens_per_s = sample_tokens / sample_seconds

    c = module_config
    print(f"devices: {devices} x {kind} ({backend}), compute {c.dtype}, params {c.param_dtype}")
    print(f"model: {c.family}, {c.num_layers} layers, width {c.hidden_size}, {c.num_heads} heads / "
          f"{c.num_kv_heads} kv, mlp {c.intermediate_size}, vocabulary {c.vocab_size}, "
          f"{num_params / 1e6:.2f}M params, remat {c.remat}")
    print(f"train step: {batch} x {length} tokens in {train_seconds * 1e3:.1f} ms = "
          f"{train_tokens_per_s:,.0f} tokens/s (best of {preset['repeats']})")
    print(f"peak: {peak_per_device / 1e12:.3f} TFLOP/s per device from {peak_source}")
    print(f"MFU (6 * params * tokens/s / peak of all {devices} device(s)): {100 * mfu:.2f}%")
    print(f"sampler: {sample_batch} rows x {sample_tokens // sample_batch} new tokens after "
          f"{preset['prompt']} prompt tokens in {sample_seconds * 1e3:.1f} ms = "
          f"{sample_tokens_per_s:,.0f} tokens/s")
    model = dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_layers=c.num_layers,
                 num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, vocab_size=c.vocab_size)
    print(json.dumps(dict(
        backend=backend, device_kind=kind, devices=devices, dtype=c.dtype,
        params=num_params, model=model, remat=c.remat, train_batch=batch,
        train_length=length, train_step_s=train_seconds, train_tokens_per_s=train_tokens_per_s,
        peak_flops_per_device=peak_per_device, peak_source=peak_source, mfu=mfu,
        sample_batch=sample_batch, prompt=preset["prompt"], new=preset["new"],
        sample_tokens=sample_tokens, sample_s=sample_seconds,
        sample_tokens_per_s=sample_tokens_per_s)))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
