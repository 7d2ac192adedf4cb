"""Memory of lean scoring against the full-logits path, compiled for a target but never run.

    python experiments/bench.py scoring [--topology=v4-16] [--model=google/gemma-2b]
        [--prompt=512] [--response=512] [--per_device=8] [--layers=0]

Both programs compute the logprob of every response token and the entropy of the distribution it
was sampled from, and their gradient with respect to the policy's params, for `per_device`
sequences of `prompt` + `response` tokens per device (the batch split over all devices, params
sharded fsdp over all of them, bfloat16 compute on TPUs, rematerialised scanned layers):

  lean   `marl_jax.train.phases.score.token_logprobs`: the decoder to hidden states, the LM head over
         response positions only, in chunks (what every PPO stage runs);
  full   the path it replaced: logits `[B, P + R, V]` float32, scaled by the temperature, a
         log-softmax over the vocabulary, the gather, the entropy of the same array.

It prints the compiler's per-device memory of each (as `bench.py memory`: temporaries and the
peak) and their ratio, then, on a small random model on this host, the largest differences of
values and gradients between the two paths. The last line is
`lean_temp_gib=X full_temp_gib=Y temp_ratio=Y/X max_value_diff=D max_grad_diff=G`.
`--layers=N` keeps only N decoder layers (a quicker compile; the head's share then dominates).
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from absl import flags  # noqa: E402

import bench_memory  # noqa: E402

FLAGS = flags.FlagValues()
flags.DEFINE_string("topology", "v4-16", "v4-16, v5e-16, ... or cpu:N", flag_values=FLAGS)
flags.DEFINE_string("model", "google/gemma-2b", "A hub name of the architecture table, a local "
                    "HF directory or a .gguf file.", flag_values=FLAGS)
flags.DEFINE_integer("prompt", 512, "Prompt tokens.", flag_values=FLAGS)
flags.DEFINE_integer("response", 512, "Response tokens.", flag_values=FLAGS)
flags.DEFINE_integer("per_device", 8, "Sequences per device.", flag_values=FLAGS)
flags.DEFINE_integer("layers", 0, "Keep only this many decoder layers (0 = all).",
                     flag_values=FLAGS)
flags.DEFINE_float("temperature", 0.8, "Sampling temperature.", flag_values=FLAGS)
flags.DEFINE_float("capacity_gib", None, "cpu:N: memory per device.", flag_values=FLAGS)


def full_logits_scores(policy, params, prompt_ids, prompt_mask, response_ids, response_mask,
                       temperature):
    """(logprobs, entropy) `[B, R]` through the full `[B, P + R, V]` logits."""
    import jax
    import jax.numpy as jnp

    ids = jnp.concatenate([prompt_ids, response_ids], axis=1)
    mask = jnp.concatenate([prompt_mask, response_mask], axis=1)
    logits = policy.apply({"params": params}, ids, mask)
    p = prompt_ids.shape[1]
    logp = jax.nn.log_softmax(logits[:, p - 1:-1] / temperature, axis=-1)
    token = jnp.take_along_axis(logp, response_ids[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return token * response_mask, entropy * response_mask


def loss_and_grad(score_fn, policy, temperature):
    """A jittable (params, batch) -> (loss, grads) of sum(logprobs + entropy)."""
    import jax
    import jax.numpy as jnp

    def loss(params, batch):
        logprobs, entropy = score_fn(policy, params, *batch, temperature)
        return jnp.sum(logprobs) + jnp.sum(entropy)

    return jax.value_and_grad(loss)


def compile_both(cfg, mesh, target, batch: int):
    import jax
    import jax.numpy as jnp

    from marl_jax.train import aot, build, sharding
    from marl_jax.train import phases
    from marl_jax.train.programs import jit_program

    policy = build.policy_module(cfg)
    params = aot.abstract_params(policy)
    params_sh = build.param_shardings(policy, mesh, params)
    batch_sh = sharding.batch_sharding(mesh)
    ids = lambda length: jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=batch_sh)
    args = (aot.with_shardings(params, params_sh),
            (ids(FLAGS.prompt), ids(FLAGS.prompt), ids(FLAGS.response), ids(FLAGS.response)))
    rows = {}
    with sharding.mesh_context(mesh, sharding.logical_rules(mesh, build.model_dims(cfg))):
        for name, fn in (("lean", phases.score.token_logprobs), ("full", full_logits_scores)):
            program = jit_program(loss_and_grad(fn, policy, FLAGS.temperature),
                                  (params_sh, (batch_sh,) * 4),
                                  (sharding.replicated(mesh), params_sh))
            rows[name] = bench_memory.measure(name, program, args, (0,), 0,
                                              platform=target.platform,
                                              capacity=target.capacity_bytes)
            print(f"compiled {name} in {rows[name]['compile_s']:.1f} s", flush=True)
    return rows


def small_model_differences():
    """Largest |lean - full| of values and gradients on a small random model (float32)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marl_jax import models
    from marl_jax.train import phases

    jax.config.update("jax_default_matmul_precision", "highest")
    cfg = models.ModelConfig(family="gemma", vocab_size=512, hidden_size=64, intermediate_size=128,
                             num_layers=2, num_heads=4, num_kv_heads=1, head_dim=16,
                             max_position_embeddings=128)
    policy = models.CausalLM(cfg)
    params = models.init_params(policy, jax.random.key(0))
    rng = np.random.default_rng(0)
    mask = lambda shape, lengths: (np.arange(shape[1])[None] < lengths[:, None]).astype(np.int32)
    r_mask = mask((4, 24), np.array([24, 17, 5, 1]))
    batch = (jnp.asarray(rng.integers(0, 512, (4, 16)), jnp.int32),
             jnp.asarray(mask((4, 16), np.array([16, 16, 9, 3]))[:, ::-1]),
             jnp.asarray(rng.integers(0, 512, (4, 24)) * r_mask, jnp.int32), jnp.asarray(r_mask))
    values, grads = [], []
    for fn in (phases.score.token_logprobs, full_logits_scores):
        values.append(jax.jit(lambda p, b, fn=fn: fn(policy, p, *b, FLAGS.temperature))(
            params, batch))
        grads.append(jax.jit(loss_and_grad(fn, policy, FLAGS.temperature))(params, batch)[1])
    value_diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(*values))
    grad_diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])))
    return value_diff, grad_diff


def main(argv):
    rest = FLAGS(["bench.py scoring", *argv])
    if len(rest) > 1:
        raise SystemExit(f"unexpected arguments: {rest[1:]}")
    cpus = bench_memory._cpu_count(FLAGS.topology)
    if cpus is not None:
        bench_memory._rerun_with_cpu_devices(cpus)
    import ml_collections

    from marl_jax.train import sharding

    target = (bench_memory.cpu_target(cpus, FLAGS.capacity_gib) if cpus is not None
              else bench_memory.tpu_target(FLAGS.topology))
    mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1}, devices=target.devices)
    config = ml_collections.ConfigDict(dict(model=dict(
        path=FLAGS.model, dtype="auto", param_dtype="float32", remat=True, scan_layers=True)))
    cfg, source, _ = bench_memory.resolve_model(config, target.platform)
    if FLAGS.layers:
        cfg = cfg.replace(num_layers=FLAGS.layers)
    batch = FLAGS.per_device * len(target.devices)
    print(f"target {target.name}: {len(target.devices)} x {target.devices[0].device_kind}; "
          f"model {source}: {cfg.num_layers} layers, vocabulary {cfg.vocab_size}, {cfg.dtype}; "
          f"batch {batch} x ({FLAGS.prompt} + {FLAGS.response}) tokens", flush=True)
    rows = compile_both(cfg, mesh, target, batch)
    print(bench_memory.table(rows.values()))
    value_diff, grad_diff = small_model_differences()
    gib = bench_memory.GIB
    lean, full = rows["lean"], rows["full"]
    temp = lambda row: row.get("temp", row["peak"])  # a refused program: its required size
    print(f"lean_temp_gib={temp(lean) / gib:.3f} full_temp_gib={temp(full) / gib:.3f} "
          f"temp_ratio={temp(full) / temp(lean):.2f} lean_peak_gib={lean['peak'] / gib:.3f} "
          f"full_peak_gib={full['peak'] / gib:.3f} max_value_diff={value_diff:.2e} "
          f"max_grad_diff={grad_diff:.2e}")


if __name__ == "__main__":
    main(sys.argv[1:])
