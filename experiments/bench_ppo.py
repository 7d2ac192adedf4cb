"""One whole PPO / MA-PPO iteration on random weights, timed whole and phase by phase, beside
verl's reference iteration.

`python experiments/bench.py ppo --shape=w1|w2 [--small] [--repeats N] [--dtype auto]
[--capacity-gib G]`

An iteration is what a run's step does: the rollout of 256 prompts by the actor, scoring by
the actor (its old logprobs), the reference, the critic and the reward model, termination and
(macro) GAE, one epoch of actor and critic updates (4 minibatches of 64 rows, as verl's
quickstart), on four models of one shape with random weights (the policy's EOS row zeroed in
its head, so every response runs its whole budget: fixed lengths):
  w1   SmolLM2-135M shape, 256 x (128 prompt + 128 new) tokens, remat full, one micro-batch;
  w2   Gemma-2B shape, 256 x (512 + 128), remat full, the micro-batches (and rollout chunks)
       the device's memory needs: the largest micro-batch (halving from a whole minibatch per
       device) whose update program, by the compiler's memory analysis with the weights,
       optimizer states and frozen models held beside it, fits 85% of the device, then the
       fewest rollout chunks whose scoring does (the bench prints what it chose and the peaks;
       on a GPU also the runtime's measured peak).
The reference and the reward model are held in the compute dtype (`ppo.frozen_models`), the
actor and critic in float32 with AdamW states; one state steps through every timed iteration.
Compute in bfloat16 with float32 master weights on accelerators (`--dtype auto`), float32 on
CPUs; `--small` runs the structure of either on the smoke-test model (2 layers, width 64,
vocabulary 512) on 64 prompts x (16 or 32 + 16) tokens (a CPU, well under a minute).

Timed: the iteration as the four phase programs, each waited on (`train.phased_step`, what
`ppo.phase_timing=True` runs), for token PPO (n = 1) and MA-PPO (fixed 5-grams); and MA-PPO as
one fused program (`ppo.phase_timing=False`), whose time is the iteration's. Printed: the
iteration's seconds, the phase split, tokens/s, model TFLOP/s (`train.perf`), MFU where the
device's peak is known, each phase's TFLOP/s, MA-PPO / token PPO (they must cost the same
within 5%), the phase-timing overhead (phased over fused), both as medians of paired ratios with
their 95% intervals (`bench_timing.median_ratio`; 6 pairs at least), and verl's anchor in the
same units.
Then one JSON line of every number, and last `iteration_s= rollout_s= score_s= update_s=
tokens_per_s= tflops_per_s=` (and `mfu=` where the peak is known) of MA-PPO: the fused
iteration, the phases of the phased one (`update_s` the advantages and the updates).

A `--shape` other than w1 / w2, or w2 on a device whose memory cannot hold its weights and
optimizer states, or its update at one row per micro-batch: one line, exit status 2.
"""
import argparse
import dataclasses
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench_timing import median_ratio, ratio_line

SHAPES = {
    "w1": dict(model="smollm2", title="four SmolLM2-135M-shaped models", prompts=256, prompt=128,
               new=128, search_memory=False),
    "w2": dict(model="gemma2b", title="four Gemma-2B-shaped models", prompts=256, prompt=512,
               new=128, search_memory=True),
}
SMALL = {"w1": dict(prompts=64, prompt=16, new=16), "w2": dict(prompts=64, prompt=32, new=16)}
MINIBATCHES = 4
REMAT = "full"  # the faster of full and none for the SmolLM2 shape on an H200 (the suite)
MA_NGRAM = 5
SAME_COST = 0.05  # MA-PPO within 5% of token PPO
PHASE_TIMING_CLAIM = 0.03  # phase timing on by default where it costs under 3%
MEMORY_SHARE = 0.85  # of a device's memory the chosen settings may fill
# verl's reference PPO on one GPU: Qwen2.5-0.5B actor and critic, 256 prompts of ~100 tokens,
# ~300 response tokens, ~67 s an iteration.
VERL = dict(iteration_s=67.0, tokens=256 * (100 + 300), tflops_per_s=12.0,
            split=(("rollout", 0.28), ("reference + values", 0.17), ("critic update", 0.25),
                   ("actor update", 0.31)))
PHASES = ("rollout", "score", "advantages", "update")


@dataclasses.dataclass(frozen=True)
class Setup:
    shape: str
    small: bool
    dtype: str
    prompts: int
    prompt: int
    new: int
    grad_accum: int = 1
    rollout_chunks: int = 1

    @property
    def rows_per_minibatch(self) -> int:
        return self.prompts // MINIBATCHES


class Refused(ValueError):
    """What was asked cannot run here (the message names it and what can)."""


def config_of(setup: Setup):
    """The run config (`config.base_config()`) of the iteration."""
    from bench_models import model_settings

    model = "small" if setup.small else SHAPES[setup.shape]["model"]
    config = model_settings(model, setup.dtype, remat=REMAT, scan_layers=True)
    config.ppo.update(dict(
        batch_size=setup.prompts, response_length=setup.new, ppo_epochs=1,
        num_minibatches=MINIBATCHES, grad_accum_steps=setup.grad_accum, temperature=0.8,
        top_k=50, estimator="gae", reward_source="rm", critic_init="rm", normalize_reward=False,
        termination="fixed", ngram=MA_NGRAM, rollout_chunks=setup.rollout_chunks, steps=1000))
    return config


def modules(config):
    from bench_models import Vocabulary
    from marl_jax.train import build

    cfg = build.model_config(config, Vocabulary(config.model.config.vocab_size))
    return build.policy_module(cfg), build.critic_module(cfg), build.reward_module(cfg)


# ---- the iteration --------------------------------------------------------------------------
def without_eos(params, cfg, eos: int):
    """The policy's params with the head's EOS row zeroed: its logit is 0 while the top-50 of a
    random head's logits lie far above 0, so no row stops early."""
    if cfg.tie_word_embeddings:
        table = params["backbone"]["embed"]["embedding"]
        return {**params, "backbone": {**params["backbone"], "embed": {
            "embedding": table.at[eos].set(0)}}}
    return {**params, "lm_head": params["lm_head"].at[:, eos].set(0)}


class Iteration:
    """The programs, state and prompts of one setup's iteration on `mesh`; with `abstract`
    only their shapes and shardings (nothing allocated), to ask the compiler for memory."""

    def __init__(self, setup: Setup, mesh, *, abstract: bool = False):
        from marl_jax import models
        from marl_jax.train import aot, build, perf, phased_step, programs, sharding
        from marl_jax.train import ppo as ppo_lib
        from marl_jax.train.ppo_types import RunHparams

        self.setup, self.mesh = setup, mesh
        config = config_of(setup)
        policy, critic, reward = modules(config)
        eos = policy.config.eos_token_id[0]
        tokens = type("Tokens", (), dict(eos_token_id=eos, pad_token_id=policy.config.pad_token_id))
        self.static = static = ppo_lib.static_from_config(config, tokens)
        self.mods = mods = ppo_lib.make_models(config, policy, critic, reward)
        self.rules = sharding.logical_rules(mesh, build.model_dims(policy.config))
        build_fn = jax.eval_shape if abstract else lambda f, *a: f(*a)
        init = lambda module, seed: build_fn(jax.jit(lambda key: models.init_params(module, key)),
                                              jax.random.key(seed))
        actor, rm_params = init(policy, 0), init(reward, 1)
        if not abstract:
            actor = without_eos(actor, policy.config, eos)
        critic_params = build_fn(jax.jit(lambda a, r: ppo_lib.initial_critic_params(
            config, critic, a, r, jax.random.key(2))), actor, rm_params)
        self.state_sh = state_sh = ppo_lib.state_shardings(mods, mesh, actor, critic_params)
        self.frozen_sh = frozen_sh = programs.frozen_shardings(mods, mesh, state_sh, rm_params)
        rep, batch_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh)
        # A copy: the state is donated at every call and must not share the reference's buffers.
        start = jax.jit(lambda a, c: ppo_lib.initial_state(
            config, mods, *jax.tree.map(jnp.copy, (a, c)), seed=0), out_shardings=state_sh)
        frozen = jax.jit(lambda a, r: ppo_lib.frozen_models(mods, a, r, {"mean": 0.0, "std": 1.0}),
                         out_shardings=frozen_sh)
        hparams = {name: RunHparams(lam=jnp.float32(0.95), gamma=jnp.float32(1.0),
                                    ngram=jnp.int32(n), variant=jnp.int32(0))
                   for name, n in (("ppo", 1), ("ma_ppo", MA_NGRAM))}
        assert static.variants == (("fixed", "equal", "weighted"),)
        if abstract:
            self.state = aot.with_shardings(jax.eval_shape(start, actor, critic_params), state_sh)
            self.frozen = aot.with_shardings(jax.eval_shape(frozen, actor, rm_params), frozen_sh)
            self.hparams = aot.with_shardings(build.abstract(hparams), rep)
            ids = jax.ShapeDtypeStruct((setup.prompts, setup.prompt), jnp.int32, sharding=batch_sh)
            self.prompts = dict(ids=ids, mask=ids)
            return
        self.state, self.frozen = start(actor, critic_params), frozen(actor, rm_params)
        del actor, critic_params, rm_params
        self.hparams = jax.device_put(hparams, rep)
        rng = np.random.default_rng(0)
        ids = rng.integers(3, policy.config.vocab_size, (setup.prompts, setup.prompt))
        self.prompts = sharding.put_global(dict(ids=ids.astype(np.int32),
                                                mask=np.ones_like(ids, np.int32)), mesh)
        self.fused = programs.ppo_step_program(static, mods, state_sh, frozen_sh, mesh).fn
        self.phased = phased_step.PhasedStep(config, None, static, mods, state_sh, frozen_sh,
                                             mesh, timed=True)
        self.flops = [perf.model_flops(m) for m in (policy, critic, reward)]
        self.peak = perf.devices_peak_flops(policy.config.dtype, policy.config.precision)

    def resident_bytes(self) -> int:
        """Bytes per device of the state (actor, critic, their optimizer states) and the frozen
        models (reference and reward model, in the compute dtype)."""
        return _per_device((self.state, self.frozen))

    def memory(self, names) -> dict:
        """{phase: bytes per device while its program runs} for the phases `names`, by the
        compiler's memory analysis: the state and frozen models, the program's temporaries and
        its outputs that reuse no donated buffer (the programs the iteration then runs, so
        compiled once through the persistent cache)."""
        from marl_jax.train import aot, programs, sharding

        fns = {k: p.fn for k, p in programs.phase_programs(
            self.static, self.mods, self.state_sh, self.frozen_sh, self.mesh).items()}
        rep, batch_sh = sharding.replicated(self.mesh), sharding.batch_sharding(self.mesh)
        batch, replicated = (lambda t: aot.with_shardings(t, batch_sh),
                             lambda t: aot.with_shardings(t, rep))
        state, frozen, ids = self.state, self.frozen, self.prompts["ids"]
        out = {}
        with sharding.mesh_context(self.mesh, self.rules):
            sample = batch(jax.eval_shape(fns["rollout"], state, frozen, ids, ids))
            exp, roll = jax.eval_shape(fns["score"], state, frozen, ids, ids, sample, None, None)
            exp, roll = batch(exp), replicated(roll)
            adv, adv_m = jax.eval_shape(fns["advantages"], state, frozen,
                                        self.hparams["ma_ppo"], exp, None)
            args = dict(rollout=(state, frozen, ids, ids),
                        score=(state, frozen, ids, ids, sample, None, None),
                        advantages=(state, frozen, self.hparams["ma_ppo"], exp, None),
                        update=(state, exp, batch(adv), roll, replicated(adv_m), frozen))
            for name in names:
                stats = fns[name].lower(*args[name]).compile().memory_analysis()
                out[name] = self.resident_bytes() + stats.temp_size_in_bytes + max(
                    stats.output_size_in_bytes - stats.alias_size_in_bytes, 0)
        return out

    def run(self, mode: str, arm: str) -> tuple[float, dict]:
        """(wall seconds, metrics) of one iteration of `arm` ("ppo" or "ma_ppo") as `mode`
        ("phases" or "fused"), from the state the previous iteration left."""
        from marl_jax.train import sharding

        with sharding.mesh_context(self.mesh, self.rules):
            start = time.perf_counter()
            if mode == "phases":
                state, metrics = self.phased(self.state, self.frozen, self.hparams[arm],
                                             self.prompts, None)
            else:
                state, metrics = self.fused(self.state, self.frozen, self.hparams[arm],
                                            self.prompts["ids"], self.prompts["mask"], None)
            jax.block_until_ready((state, metrics))
            seconds = time.perf_counter() - start
        self.state = state
        return seconds, jax.device_get(metrics)

    def flops_of(self, metrics) -> dict:
        from marl_jax.train import perf

        return perf.ppo_step_flops(self.static, *self.flops, self.setup.prompt,
                                   float(metrics["budget/generated_tokens"]),
                                   float(metrics["val/response_length"]))


# ---- memory ---------------------------------------------------------------------------------
def device_capacity() -> tuple[int, str]:
    """(bytes one device may hold, where that comes from)."""
    from marl_jax.train import perf

    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind}: the runtime's limit"
    row = perf.device_kind(device.device_kind)
    if row is not None and row.hbm_bytes:
        return row.hbm_bytes, f"{device.device_kind}: table"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // jax.device_count(), f"host RAM / {jax.device_count()} device(s)"


def _per_device(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.tree.leaves(tree))


def choose_memory(setup: Setup, mesh, capacity: int) -> tuple[Setup, dict]:
    """(`setup` with the largest micro-batch, then the fewest rollout chunks, whose update and
    scoring fit `MEMORY_SHARE` of `capacity`; {phase: bytes per device}). Raises `Refused` when
    the weights, or the update at one row per micro-batch, do not fit."""
    room, gib = MEMORY_SHARE * capacity, 2 ** 30

    def refuse(what: str):
        hint = ""
        if jax.default_backend() == "gpu":
            hint = " (JAX takes 75% of a GPU unless XLA_PYTHON_CLIENT_MEM_FRACTION says more)"
        raise Refused(f"--shape={setup.shape} ({describe(setup)}) does not fit this device: "
                      f"{what}, of {capacity / gib:.1f} GiB per device{hint}, "
                      f"{MEMORY_SHARE:.0%} usable; what fits: --shape=w1, or --small")

    resident = Iteration(setup, mesh, abstract=True).resident_bytes()
    if resident > room:
        refuse(f"its weights and optimizer states alone take {resident / gib:.1f} GiB")
    rows = setup.rows_per_minibatch // jax.device_count()  # a minibatch's rows per device
    micro = rows
    while True:  # halving the micro-batch until the update fits
        candidate = dataclasses.replace(setup, grad_accum=rows // micro)
        peaks = Iteration(candidate, mesh, abstract=True).memory(("update",))
        if peaks["update"] <= room:
            break
        if micro == 1:
            refuse(f"its update takes {peaks['update'] / gib:.1f} GiB at one row per "
                   "micro-batch")
        micro //= 2
    while True:  # doubling the rollout chunks until the scoring fits
        peaks.update(Iteration(candidate, mesh, abstract=True).memory(("rollout", "score")))
        if max(peaks.values()) <= room:
            return candidate, peaks
        chunks = candidate.rollout_chunks
        if setup.prompts % (2 * chunks * jax.device_count()):
            refuse(f"its scoring takes {peaks['score'] / gib:.1f} GiB in {chunks} rollout "
                   "chunk(s)")
        candidate = dataclasses.replace(candidate, rollout_chunks=2 * chunks)


def describe(setup: Setup) -> str:
    shape = SHAPES[setup.shape]
    model = "the smoke-test model (2 layers, width 64, vocabulary 512)" if setup.small \
        else shape["title"]
    return (f"{model}, {setup.prompts} x ({setup.prompt} prompt + {setup.new} new) tokens, "
            f"{setup.dtype} compute, float32 master weights")


def measure(setup: Setup, repeats: int, capacity=None) -> dict:
    """Every number the bench prints, as a dict (also the suite's `ppo_w1` / `ppo_w2` rows)."""
    from marl_jax.train import sharding

    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    capacity, capacity_source = capacity or device_capacity()
    peaks = {}
    if SHAPES[setup.shape]["search_memory"]:
        setup, peaks = choose_memory(setup, mesh, capacity)
    it = Iteration(setup, mesh)
    compile_start = time.perf_counter()
    it.run("phases", "ppo")  # compiles the programs both arms run (the arm is traced)
    it.run("fused", "ma_ppo")
    first_s = time.perf_counter() - compile_start
    walls = {k: [] for k in ("ppo_phases", "ma_ppo_phases", "ma_ppo_fused")}
    phases = {arm: {p: [] for p in PHASES} for arm in ("ppo", "ma_ppo")}
    metrics = None
    for i in range(repeats):
        # Alternated, so a change of the machine's load lands on both arms alike.
        for arm in ("ppo", "ma_ppo") if i % 2 == 0 else ("ma_ppo", "ppo"):
            seconds, metrics = it.run("phases", arm)
            walls[f"{arm}_phases"].append(seconds)
            for p in PHASES:
                phases[arm][p].append(float(metrics[f"timing/{p}_s"]))
        seconds, _ = it.run("fused", "ma_ppo")
        walls["ma_ppo_fused"].append(seconds)
    median = lambda xs: float(np.median(xs))
    generated = float(metrics["budget/generated_tokens"])
    flops = it.flops_of(metrics)
    tokens = setup.prompts * setup.prompt + generated
    out = dict(shape=setup.shape, small=setup.small, model=describe(setup), dtype=setup.dtype,
               prompts=setup.prompts, prompt=setup.prompt, new=setup.new,
               generated_tokens=generated, full_lengths=generated == setup.prompts * setup.new,
               minibatches=MINIBATCHES, grad_accum_steps=setup.grad_accum,
               micro_batch_rows=setup.rows_per_minibatch // setup.grad_accum,
               rollout_chunks=setup.rollout_chunks, remat="full", repeats=repeats,
               compile_and_first_s=first_s, capacity_bytes=capacity,
               capacity_source=capacity_source, compiled_peak_bytes=peaks,
               flops={k: float(v) for k, v in flops.items()}, peak_flops=it.peak)
    stats = jax.devices()[0].memory_stats() or {}
    if stats.get("peak_bytes_in_use"):
        out["measured_peak_bytes"] = int(stats["peak_bytes_in_use"])
    for arm in ("ppo", "ma_ppo"):
        split = {p: median(phases[arm][p]) for p in PHASES}
        out[arm] = dict(phases_iteration_s=median(walls[f"{arm}_phases"]), phase_s=split,
                        phases_sum_s=sum(split.values()))
    iteration = median(walls["ma_ppo_fused"])
    ma = out["ma_ppo"]
    out.update(
        iteration_s=iteration, tokens_per_s=tokens / iteration,
        tflops_per_s=flops["total"] / iteration / 1e12,
        phase_tflops_per_s={p: flops[p] / ma["phase_s"][p] / 1e12 for p in PHASES if flops[p]},
        ma_vs_ppo=median_ratio(walls["ma_ppo_phases"], walls["ppo_phases"]),
        phases_vs_fused=median_ratio(walls["ma_ppo_phases"], walls["ma_ppo_fused"]),
        phases_vs_iteration=ma["phases_sum_s"] / iteration)
    out.update(ma_over_ppo=out["ma_vs_ppo"]["median"],
               phase_timing_overhead=out["phases_vs_fused"]["median"] - 1)
    if it.peak:
        out["mfu"] = flops["total"] / iteration / it.peak
        out["phase_mfu"] = {p: flops[p] / ma["phase_s"][p] / it.peak for p in PHASES if flops[p]}
    out["text"] = report(out)
    return out


def report(r: dict) -> str:
    gib = 2 ** 30
    lines = [f"{r['shape']}: {r['model']}; {r['minibatches']} minibatches of "
             f"{r['prompts'] // r['minibatches']} rows, {r['grad_accum_steps']} micro-batch(es) "
             f"of {r['micro_batch_rows']} rows each, rollout in {r['rollout_chunks']} chunk(s), "
             f"remat {r['remat']}; {r['generated_tokens']:.0f} tokens generated"
             f"{' (every row its whole budget)' if r['full_lengths'] else ''}; compile and first "
             f"iterations {r['compile_and_first_s']:.1f} s"]
    if r["compiled_peak_bytes"]:
        lines.append("memory per device by the compiler: " + ", ".join(
            f"{n} {b / gib:.2f} GiB" for n, b in r["compiled_peak_bytes"].items())
            + f" of {r['capacity_bytes'] / gib:.1f} GiB ({r['capacity_source']})")
    if "measured_peak_bytes" in r:
        lines.append(f"measured peak in use: {r['measured_peak_bytes'] / gib:.2f} GiB")
    for arm, name in (("ppo", "token PPO"), ("ma_ppo", f"MA-PPO (n = {MA_NGRAM})")):
        a = r[arm]
        total = a["phases_sum_s"]
        lines.append(f"{name}: phases {a['phases_iteration_s']:.3f} s an iteration: " + ", ".join(
            f"{p} {a['phase_s'][p]:.3f} s ({100 * a['phase_s'][p] / total:.0f}%)"
            for p in PHASES))
    mfu = f", MFU {100 * r['mfu']:.1f}%" if "mfu" in r else ", MFU - (no peak known for this device)"
    lines.append(f"MA-PPO iteration (one program): {r['iteration_s']:.3f} s, "
                 f"{r['tokens_per_s']:,.0f} tokens/s, {r['tflops_per_s']:.3g} model TFLOP/s{mfu}")
    lines.append("model TFLOP/s per phase: " + ", ".join(
        f"{p} {v:.3g}" + (f" ({100 * r['phase_mfu'][p]:.1f}% MFU)" if "phase_mfu" in r else "")
        for p, v in r["phase_tflops_per_s"].items()))
    lines.append(ratio_line(r["ma_vs_ppo"], "MA-PPO / token PPO iteration (phases)",
                            claim=SAME_COST))
    lines.append(ratio_line(r["phases_vs_fused"], "phase-timed / fused iteration (the cost of "
                            "phase timing)", claim=PHASE_TIMING_CLAIM))
    lines.append(f"the phases add up to {r['phases_vs_iteration']:.3f} x the fused iteration")
    lines.append(f"verl's anchor (Qwen2.5-0.5B actor and critic, one GPU, 256 prompts x ~(100 + "
                 f"300) tokens): {VERL['iteration_s']:.0f} s an iteration, "
                 f"{VERL['tokens'] / VERL['iteration_s']:,.0f} tokens/s, ~"
                 f"{VERL['tflops_per_s']:.0f} TFLOP/s; " + ", ".join(
                     f"{n} {100 * share:.0f}%" for n, share in VERL["split"]))
    return "\n".join(lines)


def last_line(r: dict) -> str:
    split = r["ma_ppo"]["phase_s"]
    line = (f"iteration_s={r['iteration_s']:.4g} rollout_s={split['rollout']:.4g} "
            f"score_s={split['score']:.4g} update_s={split['advantages'] + split['update']:.4g} "
            f"tokens_per_s={r['tokens_per_s']:.4g} tflops_per_s={r['tflops_per_s']:.4g}")
    return line + (f" mfu={r['mfu']:.4f}" if "mfu" in r else "")


def setup_of(shape: str, small: bool, dtype: str = "auto") -> Setup:
    if shape not in SHAPES:
        raise Refused(f"--shape={shape!r}: the shapes are {', '.join(SHAPES)}")
    if dtype == "auto":
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    sizes = SMALL[shape] if small else {k: SHAPES[shape][k] for k in ("prompts", "prompt", "new")}
    return Setup(shape, small, dtype, **sizes)


def arguments(argv):
    """The parsed flags of `bench.py ppo` (with `--async`, `experiments/bench_async.py`'s)."""
    parser = argparse.ArgumentParser(prog="bench.py ppo", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", required=True, help="w1 or w2")
    parser.add_argument("--small", action="store_true", help="the smoke-test model (a CPU)")
    parser.add_argument("--repeats", type=int, help="timed iterations of each kind (default 3, "
                        "10 with --small)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--capacity-gib", type=float,
                        help="memory per device to fit (default: the device's)")
    parser.add_argument("--async", dest="asynchronous", action="store_true",
                        help="the synchronous loop beside asynchronous PPO at k = 1, 2 "
                        "(experiments/bench_async.py)")
    return parser.parse_args(argv)


def main(argv):
    args = arguments(argv)
    repeats = args.repeats or (10 if args.small else 3)
    try:
        if args.asynchronous:  # bench.py runs experiments/bench_async.py for --async
            raise Refused("--async is bench.py's: python experiments/bench.py ppo --async ...")
        if repeats < 1:
            raise Refused(f"--repeats={repeats} must be >= 1")
        setup = setup_of(args.shape, args.small, args.dtype)
        from marl_jax.train import compile_cache

        # The memory search compiles programs the iteration then runs: compiled once.
        compile_cache.use_run_cache()
        print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind} "
              f"({jax.default_backend()})", flush=True)
        capacity = None if args.capacity_gib is None else (
            int(args.capacity_gib * 2 ** 30), "--capacity-gib")
        result = measure(setup, repeats, capacity)
    except Refused as error:
        print(f"bench.py ppo: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(result.pop("text"))
    print(json.dumps(result))
    print(last_line(result))
