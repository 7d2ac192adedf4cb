"""Train-step and sampler throughput of the policy on the accelerator present (TPU, GPU or CPU).

`python experiments/bench.py device [--small] [--batch-per-device 8] [--length 1024] ...`

Measures, with every device of the host in one data-parallel mesh:
  train step   tokens/s of one jitted SFT step (forward, backward and AdamW update of the
               policy, `marl_jax.train.supervised.make_train_step`) on `[batch, length]` tokens,
               and MFU = 6 * params * tokens/s / peak FLOP/s of all devices;
  sampler      new tokens/s of `marl_jax.sampling.generate` (KV-cache decoding, top-k 50).
The peak comes from a table of bf16 dense peaks per device kind (TPU v2 to v6e, NVIDIA V100 to
B200); for other devices (CPUs) it is the best of timed square matmuls in the compute dtype.

Sizes: on GPUs and TPUs the SmolLM2-135M shape (30 layers, width 576, vocabulary 49152) with
rematerialisation; on CPUs a 4-layer width-256 model; `--small` a 2-layer width-64 model that runs
in seconds (smoke test). The compute dtype is `--dtype` (default "auto": bfloat16 on GPU/TPU,
float32 on CPU, as `config.model.dtype`); parameters stay float32. The last line of the output
is the whole result as JSON.
"""
import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench_timing import best_time

# bf16 dense peak FLOP/s of one JAX device, by lower-cased `device_kind` substring (first match).
# TPU v2 / v3 expose each TensorCore as a device (half a chip); v4 and later one device per chip.
PEAK_FLOPS = (
    ("tpu v6 lite", 918e12),  # v6e (Trillium)
    ("tpu v6e", 918e12),
    ("tpu v5 lite", 197e12),  # v5e
    ("tpu v5e", 197e12),
    ("tpu v5p", 459e12),
    ("tpu v5", 459e12),  # v5p reports "TPU v5"
    ("tpu v4", 275e12),
    ("tpu v3", 61.5e12),
    ("tpu v2", 22.5e12),
    ("gb200", 2.5e15),
    ("b200", 2.25e15),
    ("h200", 989e12),
    ("gh200", 989e12),
    ("h100 pcie", 756e12),
    ("h100", 989e12),  # SXM
    ("h800", 989e12),
    ("a100", 312e12),
    ("a800", 312e12),
    ("l40s", 362e12),
    ("l4", 121e12),
    ("a10", 125e12),
    ("v100", 125e12),  # fp16 tensor cores (no bf16)
)

PRESETS = {
    "small": dict(model=dict(hidden_size=64, intermediate_size=192, num_layers=2, num_heads=2,
                             num_kv_heads=2, head_dim=32, vocab_size=512,
                             max_position_embeddings=128),
                  remat=False, batch_per_device=2, length=64, sample_batch=4, prompt=16, new=16,
                  repeats=2),
    "cpu": dict(model=dict(hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                           num_kv_heads=4, head_dim=64, vocab_size=8192,
                           max_position_embeddings=512),
                remat=False, batch_per_device=4, length=256, sample_batch=8, prompt=64, new=64,
                repeats=3),
    # SmolLM2-135M's shape.
    "accelerator": dict(model=dict(hidden_size=576, intermediate_size=1536, num_layers=30,
                                   num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152,
                                   max_position_embeddings=2048),
                        remat=True, batch_per_device=8, length=1024, sample_batch=32, prompt=128,
                        new=128, repeats=5),
}


class _Vocabulary:
    """What `build.model_config` reads from a tokenizer, for a model without one."""

    def __init__(self, size: int):
        self.size, self.eos_token_id, self.pad_token_id, self.bos_token_id = size, 1, 0, 2

    def __len__(self):
        return self.size


def table_peak(device_kind: str):
    kind = device_kind.lower()
    for name, flops in PEAK_FLOPS:
        if name in kind:
            return flops
    return None


def timed_matmul_peak(dtype, size: int, repeats: int = 10) -> float:
    """FLOP/s of the best of `repeats` `[size, size] @ [size, size]` matmuls on one device."""
    a = jax.random.normal(jax.random.key(0), (size, size), dtype)
    matmul = jax.jit(lambda x: x @ x)
    return 2 * size ** 3 / best_time(lambda: matmul(a), repeats)


def build_config(preset: dict, dtype: str):
    from marl_jax.config import base_config

    config = base_config()
    config.model.config.update(dict(family="llama", tie_word_embeddings=True, **preset["model"]))
    config.model.dtype = dtype
    config.model.remat = preset["remat"]
    return config


def bench_train(config, module, params, mesh, batch: int, length: int, repeats: int) -> float:
    """Seconds of the best train step on `[batch, length]` tokens (half prompt, half response)."""
    from marl_jax.train import build, sft, sharding, supervised
    from marl_jax.train.optim import make_optimizer

    optimizer = make_optimizer(config.sft, 1000)
    shardings = build.train_state_shardings(module, optimizer, mesh, params)
    step = jax.jit(supervised.make_train_step(
        lambda p, b: sft.sft_loss(module, p, b), optimizer),
        in_shardings=(shardings, sharding.batch_sharding(mesh)),
        out_shardings=(shardings, sharding.replicated(mesh)), donate_argnums=0)
    rng = np.random.default_rng(0)
    half = length // 2
    ids = rng.integers(3, module.config.vocab_size, size=(batch, length)).astype(np.int32)
    data = dict(prompt_ids=ids[:, :half], prompt_mask=np.ones((batch, half), np.int32),
                response_ids=ids[:, half:], response_mask=np.ones((batch, length - half), np.int32))
    data = sharding.put_global(data, mesh)
    state = [build.new_train_state(params, optimizer, shardings)]

    def run():
        state[0], metrics = step(state[0], data)
        return metrics["loss"]

    with sharding.mesh_context(mesh, sharding.logical_rules(mesh, build.model_dims(
            module.config))):
        return best_time(run, repeats)


def bench_sampler(module, params, mesh, batch: int, prompt: int, new: int, repeats: int):
    """(seconds, tokens) of the best `generate` of `new` tokens after `[batch, prompt]` prompts."""
    from marl_jax import distributed, sampling
    from marl_jax.train import build, sharding

    rng = np.random.default_rng(1)
    ids = rng.integers(3, module.config.vocab_size, size=(batch, prompt)).astype(np.int32)
    prompts = sharding.put_global(dict(ids=ids, mask=np.ones_like(ids)), mesh)
    params = jax.device_put(params, build.param_shardings(module, mesh, build.abstract(params)))
    top_k = min(50, module.config.vocab_size)
    generate = jax.jit(lambda p, i, m, k: sampling.generate(
        module, p, i, m, key=jax.random.wrap_key_data(k), max_new_tokens=new, temperature=0.8,
        top_k=top_k, eos_id=module.config.eos_token_id, pad_id=module.config.pad_token_id))
    keys = iter(range(1_000_000))
    best, tokens = float("inf"), 0
    with sharding.mesh_context(mesh, sharding.logical_rules(mesh, build.model_dims(
            module.config))):
        for attempt in range(repeats + 1):
            key = sharding.put_global(jax.random.key_data(jax.random.key(next(keys))), mesh,
                                      axis=None)
            start = time.perf_counter()
            out = jax.block_until_ready(generate(params, prompts["ids"], prompts["mask"], key))
            seconds = time.perf_counter() - start
            # Decoding runs until every row has stopped: count the steps actually taken.
            steps = int(distributed.global_to_host(out.mask).sum(axis=1).max())
            if attempt and seconds < best:  # attempt 0 compiles
                best, tokens = seconds, batch * steps
    return best, tokens


def main(argv):
    parser = argparse.ArgumentParser(prog="bench.py device", description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a tiny model (smoke test)")
    parser.add_argument("--dtype", default="auto", help="compute dtype: auto, bfloat16, float32")
    parser.add_argument("--batch-per-device", type=int)
    parser.add_argument("--length", type=int, help="train sequence length")
    parser.add_argument("--sample-batch", type=int, help="sampler rows per device")
    parser.add_argument("--prompt", type=int, help="sampler prompt length")
    parser.add_argument("--new", type=int, help="sampler new tokens")
    parser.add_argument("--repeats", type=int)
    args = parser.parse_args(argv)

    from marl_jax import models
    from marl_jax.train import build, sharding

    backend = jax.default_backend()
    preset = dict(PRESETS["small" if args.small else "cpu" if backend == "cpu" else "accelerator"])
    for field in ("batch_per_device", "length", "sample_batch", "prompt", "new", "repeats"):
        if getattr(args, field) is not None:
            preset[field] = getattr(args, field)
    for field in ("batch_per_device", "length", "sample_batch", "prompt", "new", "repeats"):
        if preset[field] < 1 or (field == "length" and preset[field] < 2):
            raise SystemExit(f"--{field.replace('_', '-')}={preset[field]} must be positive "
                             f"(length >= 2)")

    config = build_config(preset, args.dtype)
    module_config = build.model_config(config, _Vocabulary(preset["model"]["vocab_size"]))
    module = build.policy_module(module_config)
    params = models.init_params(module, jax.random.key(0))
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    devices = jax.device_count()
    batch, length = preset["batch_per_device"] * devices, preset["length"]
    sample_batch = preset["sample_batch"] * devices
    if preset["prompt"] + preset["new"] > module_config.max_position_embeddings:
        raise SystemExit(f"--prompt + --new = {preset['prompt'] + preset['new']} exceeds the "
                         f"model's {module_config.max_position_embeddings} positions")

    kind = jax.devices()[0].device_kind
    peak_per_device = table_peak(kind)
    peak_source = f"table ({kind})"
    if peak_per_device is None:
        size = 512 if args.small else 2048
        peak_per_device = timed_matmul_peak(jnp.dtype(module_config.dtype), size)
        peak_source = f"best timed {size}^3 {module_config.dtype} matmul"

    train_seconds = bench_train(config, module, params, mesh, batch, length, preset["repeats"])
    train_tokens_per_s = batch * length / train_seconds
    mfu = 6 * num_params * train_tokens_per_s / (peak_per_device * devices)
    sample_seconds, sample_tokens = bench_sampler(module, params, mesh, sample_batch,
                                                  preset["prompt"], preset["new"],
                                                  preset["repeats"])
    sample_tokens_per_s = sample_tokens / sample_seconds

    m = preset["model"]
    print(f"devices: {devices} x {kind} ({backend}), compute {module_config.dtype}, params "
          f"{module_config.param_dtype}")
    print(f"model: llama, {m['num_layers']} layers, width {m['hidden_size']}, {m['num_heads']} "
          f"heads / {m['num_kv_heads']} kv, mlp {m['intermediate_size']}, vocabulary "
          f"{m['vocab_size']}, {num_params / 1e6:.2f}M params, remat {preset['remat']}")
    print(f"train step: {batch} x {length} tokens in {train_seconds * 1e3:.1f} ms = "
          f"{train_tokens_per_s:,.0f} tokens/s (best of {preset['repeats']})")
    print(f"peak: {peak_per_device / 1e12:.3f} TFLOP/s per device from {peak_source}")
    print(f"MFU (6 * params * tokens/s / peak of all {devices} device(s)): {100 * mfu:.2f}%")
    print(f"sampler: {sample_batch} rows x {sample_tokens // sample_batch} new tokens after "
          f"{preset['prompt']} prompt tokens in {sample_seconds * 1e3:.1f} ms = "
          f"{sample_tokens_per_s:,.0f} tokens/s")
    print(json.dumps(dict(
        backend=backend, device_kind=kind, devices=devices, dtype=module_config.dtype,
        params=num_params, model=m, remat=preset["remat"], train_batch=batch,
        train_length=length, train_step_s=train_seconds, train_tokens_per_s=train_tokens_per_s,
        peak_flops_per_device=peak_per_device, peak_source=peak_source, mfu=mfu,
        sample_batch=sample_batch, prompt=preset["prompt"], new=preset["new"],
        sample_tokens=sample_tokens, sample_s=sample_seconds,
        sample_tokens_per_s=sample_tokens_per_s)))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
