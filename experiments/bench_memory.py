"""Per-device memory of every stage's programs, compiled for a target but never run.

    python experiments/bench.py memory --config=configs/tldr_gemma2b_tpu.py [--topology=v4-16]
        [--programs=sft,rm,rollout,update,ppo_step,generate,score,experiment,experiment_eval,
         experiment_phases]
        [--json=FILE]
        [--capacity_gib=G] [--config.size=<preset>] [--config.<section>.<field>=<value> ...]

The config is resolved as `experiments/run.py` resolves it: `--config.size` applies its preset
(`marl_jax.config.resolve_size`; a field also set on the command line keeps that value), then
`marl_jax.config_check.validate_config`. A config error (a bad field, a batch that does not
split over the mesh's data-parallel shards) ends with one line `error: <message>` and exit
status 2.

Targets (`--topology`, default `config.tpu_topology`):
  Cloud TPU slices: v2-N, v3-N, v4-N, v5p-N (N TensorCores, two per chip), v5e-N (also
    v5litepod-N), v6e-N (N chips). The real TPU compiler (libtpu, `pip install -e ".[memory]"`)
    compiles for every chip of the slice, multi-host slices included, on a machine without TPUs.
  cpu:N: N host-platform CPU devices (the bench re-runs itself with
    XLA_FLAGS=--xla_force_host_platform_device_count=N); capacity `--capacity_gib` per device,
    default the host's RAM / N.
The mesh is `config.mesh` over the target's devices; `config.model.dtype=auto` computes in
bfloat16 on TPUs and float32 on CPUs, as the trainers do there.

Programs, each jitted as the trainers jit it (`marl_jax.train.programs`: same in / out
shardings and donation) and lowered with abstract arguments (nothing is allocated, a 7B model
included): sft and rm (the train steps), and for ppo the step `run_ppo` runs (`ppo_step`) and
its two halves, `rollout` (generation and scoring) and `update` (termination, macro GAE, the
actor and critic updates), to show which half sets the peak, and the two parts of the first
half as a phase-timed run runs them (`programs.phase_programs`): `generate` (the rollout
phase) and `score`. The experiment stage
(`config.stage=experiment`) runs its PPO step vmapped over the runs of a program
(`experiment.runs_per_program`, else every run of a group): `experiment` is that step for the
largest program of each group of runs, `experiment_eval` its vmapped held-out evaluation
(`task.num_eval_prompts` x `ppo.eval_samples_per_prompt` responses a run); a phase-timed
experiment runs that step as its four phases vmapped (`programs.experiment_phase_programs`),
each a part of `experiment` with the same arguments and the experience between them:
`experiment_phases` compiles them (`experiment_rollout`, `_score`, `_advantages`, `_update`;
not by default). Default programs:
sft, rm, experiment and experiment_eval for the experiment stage; sft, rm, rollout, update,
ppo_step, generate and score otherwise. Stages with 0 steps are skipped.

The model: `config.model.path` is a local HF directory (its config.json), a .gguf file (read
in full to learn its config), or a hub name: its config.json from the hub cache, else from
`marl_jax.models.architectures.HUB_CONFIGS`; empty, the fields of `config.model.config`.

Memory per device, from the compiler's `compiled.memory_analysis()`:
  args      the program's argument buffers (parameters, optimizer states, batch)
  out       its results;  alias: results that reuse donated argument buffers (held once)
  temp      temporaries (activations, gradients, KV cache, collective buffers): the sum of the
            temporary allocations, whether or not they are live at the same time
  code      the generated executable
  xla peak  `peak_memory_in_bytes`: the compiler's simulation of the buffers live at the worst
            point of the program, arguments and outputs included
  peak      TPU: xla peak + code + resident. The TPU compiler's peak is the number it checks
            against HBM (it refuses to compile a program above it); its `temp` can overstate
            (allocations that are never live together) or understate (0 for temporaries it
            keeps in its heap) what the program needs.
            CPU: args + out - alias + temp + code + resident. The CPU compiler's peak leaves
            the temporaries out; its `temp` is the one block they share.
  resident  state on the devices that the program does not take: arguments it never reads
            (jit drops them: the rollout reads no optimizer state) and, while `update` runs,
            the frozen reference and reward model
A program the TPU compiler rejects as too large (above what the TPU runtime leaves it, e.g.
30.75 of a v4 chip's 32 GiB) reports the size from the compiler's message instead.
`weights` counts what the state arguments must hold (trained weights, optimizer states,
frozen weights: the sum of their per-device shard bytes), a lower bound of every peak.
Headroom = 1 - peak / capacity; the configs ask for at least 10%.

A roofline per program, from the compiler's `compiled.cost_analysis()` per device: FLOPs and
HBM bytes accessed (XLA's count: work inside Pallas kernels, such as the splash attention, is
not in it), the roofline bound on the step time, max(FLOPs / peak, bytes / HBM bandwidth), with
the peak bf16 FLOP/s and HBM bandwidth of the device kind (`marl_jax.train.perf.DEVICE_KINDS`), and the share of
peak FLOP/s that bound allows (roofline MFU = FLOPs / peak / bound; 1 when compute-bound).

With generate, score and update compiled for a TPU, the sum of their roofline seconds is the
recipe's predicted iteration (a line `predicted iteration by the roofline: ...`). XLA's cost
analysis counts the body of a loop once (the layer scan, the decode loop, the minibatch and
micro-batch scans), so those seconds are a lower bound, far below the work for these programs;
a second line predicts the iteration by the model count, every loop counted
(`model_count_iteration`: `perf.ppo_step_flops` at peak FLOP/s, the rollout at least its
decode's weight and KV-cache reads at HBM bandwidth).

The last line is `devices=N peak_gib=X capacity_gib=Y fits=True|False flops=F hbm_bytes=B
roofline_step_s=S roofline_mfu=M` (X the largest peak, fits = X <= Y; F, B, S, M those of the
PPO step program, `ppo_step` or `experiment`, when it was compiled).
"""
import dataclasses
import json
import math
import os
import pathlib
import re
import sys
import time
import types
import typing

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

PROGRAMS = ("sft", "rm", "rollout", "update", "ppo_step", "generate", "score", "experiment",
            "experiment_eval", "experiment_phases")
# `experiment_phases` stands for the four phase programs of the experiment's step.
EXPERIMENT_PHASES = ("experiment_rollout", "experiment_score", "experiment_advantages",
                     "experiment_update")
EXPERIMENT_PROGRAMS = ("sft", "rm", "experiment", "experiment_eval")
DEFAULT_PROGRAMS = PROGRAMS[:7]
# The programs whose roofline seconds add up to a PPO iteration's: the rollout phase, the score
# phase, and termination, advantages and the updates.
ITERATION_PROGRAMS = ("generate", "score", "update")
STAGE_OF = {"sft": "sft", "rm": "rm", "rollout": "ppo", "update": "ppo", "ppo_step": "ppo",
            "generate": "ppo", "score": "ppo", "experiment": "experiment",
            "experiment_eval": "experiment", "experiment_phases": "experiment",
            **{name: "experiment" for name in EXPERIMENT_PHASES}}
GIB = 2 ** 30
HEADROOM_NEEDED = 0.10

FLAGS = flags.FlagValues()
config_flags.DEFINE_config_file("config", None, "Config file.", flag_values=FLAGS)
flags.DEFINE_string("topology", None, "v4-16, v5e-16, v5p-32, v6e-8, ... or cpu:N "
                    "(default: config.tpu_topology)", flag_values=FLAGS)
flags.DEFINE_list("programs", None, f"Programs to compile, of {PROGRAMS} (default: the "
                  "stage's programs).", flag_values=FLAGS)
flags.DEFINE_string("json", None, "Write the numbers to this JSON file.", flag_values=FLAGS)
flags.DEFINE_float("capacity_gib", None, "cpu:N: memory per device (default host RAM / N).",
                   flag_values=FLAGS)

class Generation(typing.NamedTuple):
    """How a slice name `<generation>-N` maps onto libtpu's topology names."""

    prefix: str  # of libtpu's topology name, "v4:2x2x2"
    counts_cores: bool  # N counts TensorCores (two per chip), not chips
    three_d: bool  # chips on a 3-D torus
    megacore: bool  # one JAX device per chip, its two TensorCores fused


GENERATIONS = {"v2": Generation("v2", True, False, False),
               "v3": Generation("v3", True, False, False),
               "v4": Generation("v4", True, True, True),
               "v5p": Generation("v5p", True, True, True),
               "v5e": Generation("v5e", False, False, False),
               "v5litepod": Generation("v5e", False, False, False),
               "v6e": Generation("v6e", False, False, False)}


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    platform: str  # "tpu" or "cpu"
    devices: list
    capacity_bytes: int  # per device
    capacity_source: str


# ---- targets --------------------------------------------------------------------------------
def chip_grid(chips: int, three_d: bool) -> tuple[int, ...]:
    """The chip layout of a slice of `chips` (a power of two), as Cloud TPU builds them:
    2-D 1x1, 2x2, 2x4, 4x4, 4x8, ...; 3-D 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ..."""
    if chips < 1 or chips & (chips - 1):
        raise ValueError(f"{chips} chips: only power-of-two slices are supported")
    if not three_d:
        short = 2 ** (int(math.log2(chips)) // 2)
        return short, chips // short
    if chips < 8:
        return {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1)}[chips]
    dims = [2, 2, 2]
    while math.prod(dims) < chips:
        smallest = min(dims)
        dims[max(i for i, d in enumerate(dims) if d == smallest)] *= 2
    return tuple(dims)


def tpu_target(name: str) -> Target:
    """A compile-only TPU slice: every device of `name` (e.g. "v4-16": 8 chips, 2x2x2)."""
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)", name)
    if not match or match.group(1) not in GENERATIONS:
        raise SystemExit(f"--topology={name!r}: expected a Cloud TPU slice "
                         f"({', '.join(f'{g}-N' for g in GENERATIONS)}) or cpu:N")
    generation, n = GENERATIONS[match.group(1)], int(match.group(2))
    chips = n // 2 if generation.counts_cores else n
    if generation.counts_cores and n % 2:
        raise SystemExit(f"--topology={name!r}: {match.group(1)} slices count TensorCores, "
                         "two per chip (an even number)")
    try:
        grid = chip_grid(chips, generation.three_d)
    except ValueError as error:
        raise SystemExit(f"--topology={name!r}: {error}") from None
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        raise SystemExit(f"--topology={name}: the TPU compiler (libtpu) is not installed; "
                         "pip install -e \".[memory]\"")
    # libtpu locks /tmp/libtpu_lockfile against a second process driving the same chips; a
    # compile-only topology drives none, and any JAX process of the machine may hold the lock.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    # Hosts of 4 chips (2x2), 8 on single-host v5e / v6e slices; only the process count
    # depends on it.
    host = (2, 4, 1) if chips == 8 and not generation.three_d else (2, 2, 1)
    devices = topologies.get_topology_desc(
        platform="tpu", topology_name=f"{generation.prefix}:{'x'.join(map(str, grid))}",
        chip_config_name="megacore" if generation.megacore else "default",
        chips_per_host_bounds=tuple(min(h, g) for h, g in zip(host, (*grid, 1)))).devices
    from marl_jax.train import perf

    # HBM per JAX device (cloud.google.com/tpu/docs/<version>: per chip v2 16 GiB, v3 32 GiB, v4
    # 32 GiB, v5e 16 GiB, v5p 95 GiB, v6e 32 GiB; v2 and v3 expose each of a chip's two
    # TensorCores as a device, v4 and v5p one device per chip).
    kind = devices[0].device_kind
    row = perf.device_kind(kind)
    if row is None or row.hbm_bytes is None:
        raise SystemExit(f"--topology={name}: no HBM size known for device kind {kind!r}")
    return Target(name, "tpu", list(devices), row.hbm_bytes,
                  f"{kind}: {row.hbm_bytes // GIB} GiB HBM per device (table)")


def cpu_target(n: int, capacity_gib: float | None) -> Target:
    import jax

    devices = jax.devices("cpu")
    if len(devices) != n:
        raise SystemExit(f"--topology=cpu:{n} needs {n} CPU devices, this process has "
                         f"{len(devices)}: set XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={n} before JAX starts")
    if capacity_gib is not None:
        return Target(f"cpu:{n}", "cpu", devices, int(capacity_gib * GIB), "--capacity_gib")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Target(f"cpu:{n}", "cpu", devices, ram // n, f"host RAM {ram / GIB:.1f} GiB / {n}")


def _cpu_count(topology: str) -> int | None:
    match = re.fullmatch(r"cpu:(\d+)", topology)
    if topology.startswith("cpu") and not match:
        raise SystemExit(f"--topology={topology!r}: expected cpu:N")
    return int(match.group(1)) if match else None


def _rerun_with_cpu_devices(n: int) -> None:
    """`--xla_force_host_platform_device_count` is read once, when JAX starts its CPU backend:
    re-run this command with it set."""
    flag = f"--xla_force_host_platform_device_count={n}"
    current = os.environ.get("XLA_FLAGS", "")
    if flag in current.split():
        return
    others = [f for f in current.split() if not f.startswith(
        "--xla_force_host_platform_device_count=")]
    os.environ["XLA_FLAGS"] = " ".join([*others, flag])
    os.execv(sys.executable, [sys.executable, *sys.argv])


# ---- the model -----------------------------------------------------------------------------
def resolve_model(config, platform: str):
    """(ModelConfig, where its architecture came from, token ids for the PPO step): the policy
    the trainers would build from `config.model` on `platform`."""
    from marl_jax import config as config_lib
    from marl_jax import models
    from marl_jax.models import architectures
    from marl_jax.train import build

    m = config.model
    tokenizer = None
    if m.path and str(m.path).endswith(".gguf"):
        from marl_jax.models.loading import gguf_config

        cfg, source = models.ModelConfig.from_hf(gguf_config(m.path)), str(m.path)
    elif m.path:
        hf, source = architectures.hf_config(m.path)
        cfg = models.ModelConfig.from_hf(hf)
    else:
        tokenizer = _pathless_tokenizer(config)
        cfg, source = build.model_config(config, tokenizer), "config.model.config"
    dtype = m.dtype if m.dtype != "auto" else ("bfloat16" if platform == "tpu" else "float32")
    precision = m.get("matmul_precision", "auto")
    cfg = build.with_lora(cfg.replace(dtype=dtype, param_dtype=m.param_dtype, remat=config_lib.remat_policy(m.remat),
                                      scan_layers=bool(m.get("scan_layers", False)),
                                      attention=m.get("attention", "auto"),
                                      matmul_precision=None if precision == "auto" else precision,
                                      sampler_layout=m.get("sampler_layout", "auto")), config)
    if not cfg.eos_token_id:
        raise SystemExit(f"{source}: the model has no eos_token_id; the sampler needs one")
    eos = cfg.eos_token_id[0]
    token_ids = types.SimpleNamespace(
        eos_token_id=eos, pad_token_id=eos if cfg.pad_token_id is None else cfg.pad_token_id)
    if _cuts_at_steps(config):  # the step termination's tables read the vocabulary's texts
        token_ids.backend_tokenizer = (tokenizer or models.load_tokenizer(m.path)).backend_tokenizer
    return cfg, source, token_ids


def _cuts_at_steps(config) -> bool:
    """Whether the run or an arm of the experiment cuts macros at reasoning steps."""
    from marl_jax import experiment

    if config.stage != "experiment":
        return config.ppo.termination == "step"
    return any(experiment.resolve_arm(arm, config.ppo)["termination"] == "step"
               for arm in experiment.experiment_arms(config))


def _pathless_tokenizer(config):
    """The tokenizer a model without a checkpoint is sized by (its vocabulary)."""
    import tempfile

    from marl_jax.data import real_tasks, synthetic, tasks

    if config.task.name == "synthetic":
        with tempfile.TemporaryDirectory() as tmp:
            return synthetic.build_tokenizer(tasks.synthetic_task_from_config(config.task),
                                             os.path.join(tmp, "tokenizer"))
    return real_tasks.load_task_tokenizer(config)


# ---- measuring -----------------------------------------------------------------------------
def per_device_bytes(tree) -> int:
    """Bytes one device holds of `tree`'s sharded ShapeDtypeStructs (the largest shard)."""
    import jax

    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(tree))


_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
# How XLA:TPU reports a program that does not fit (sizes in GiB-based units): "Ran out of memory
# on HBM, the total memory required for HLO temporaries (20.00G) exceeds available HBM
# (15.75G)", or "... Used 63.80G of 30.75G hbm. ... Total hbm usage >= 65.05G: ...".
_EXHAUSTED = (r"Total hbm usage >= ([\d.]+)([KMGT]?)", r"required for [^(]*\(([\d.]+)([KMGT]?)\)",
              r"Used ([\d.]+)([KMGT]?) of [\d.]+[KMGT]? hbm")


def exhausted_bytes(message: str) -> int | None:
    """The HBM an XLA:TPU out-of-memory compile error says the program needs, or None."""
    for pattern in _EXHAUSTED:
        match = re.search(pattern, message)
        if match:
            return int(float(match.group(1)) * _UNITS[match.group(2)])
    return None


def program_peak(platform: str, fields: dict) -> int:
    """Bytes per device the compiled program needs (see the module docstring)."""
    if platform == "tpu":
        return fields["xla_peak"] + fields["code"]
    return fields["args"] + fields["out"] - fields["alias"] + fields["temp"] + fields["code"]


def unread_bytes(compiled, args, argnums) -> int:
    """Bytes per device of `args[argnums]` the compiled program does not take: jit drops the
    arguments a program never reads (the rollout reads no optimizer state), which stay on the
    devices all the same. Their input sharding is None."""
    import jax

    shardings = compiled.in_tree.flatten_up_to(compiled.input_shardings)
    unread = 0
    for i, arg in enumerate(args):
        leaves = jax.tree.leaves(arg)
        taken, shardings = shardings[:len(leaves)], shardings[len(leaves):]
        if i in argnums:
            unread += per_device_bytes([x for x, s in zip(leaves, taken) if s is None])
    return unread


def roofline(compiled, example_arg, platform: str) -> dict:
    """FLOPs and HBM bytes per device of a compiled program (its cost analysis), and the roofline
    step time and MFU on the device kind it was compiled for (empty for kinds without a table
    entry, and when the compiler gives no cost analysis)."""
    import jax

    from bench_hardware import table_entry

    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, (list, tuple)) else costs
    if not costs or "flops" not in costs:
        return {}
    device = next(iter(jax.tree.leaves(example_arg)[0].sharding.device_set))
    entry = table_entry(device.device_kind) if platform == "tpu" else None
    out = dict(flops=float(costs["flops"]), hbm_bytes=float(costs.get("bytes accessed", 0.0)))
    if entry is not None:
        peak, bandwidth = entry
        bound = max(out["flops"] / peak, out["hbm_bytes"] / bandwidth)
        out.update(roofline_step_s=bound, roofline_mfu=out["flops"] / peak / bound if bound else 0.0)
    return out


def measure(name, program, args, weight_argnums, outside: int, *, platform: str,
            capacity: int) -> dict:
    """Compiles `program.fn` for `args`; one table row (bytes per device). `weight_argnums`:
    the state arguments; `outside`: bytes the devices hold beside the program's arguments."""
    start = time.perf_counter()
    lowered = program.fn.lower(*args)
    row = dict(stage=STAGE_OF.get(name, name), program=name, lower_s=time.perf_counter() - start,
               weights=per_device_bytes([args[i] for i in weight_argnums]))
    try:
        compiled = lowered.compile()
    except Exception as error:  # the TPU compiler refuses a program that cannot fit
        used = exhausted_bytes(str(error))
        if used is None:
            raise
        row.update(compile_s=time.perf_counter() - start, resident=outside,
                   peak=used + outside, error=str(error).splitlines()[0][:300])
    else:
        row.update(roofline(compiled, args[0], platform))
        stats = compiled.memory_analysis()
        fields = dict(args=stats.argument_size_in_bytes, out=stats.output_size_in_bytes,
                      alias=stats.alias_size_in_bytes, temp=stats.temp_size_in_bytes,
                      code=stats.generated_code_size_in_bytes,
                      xla_peak=stats.peak_memory_in_bytes)
        unread = unread_bytes(compiled, args, weight_argnums)
        row.update(fields, compile_s=time.perf_counter() - start, unread=unread,
                   resident=outside + unread,
                   peak=program_peak(platform, fields) + outside + unread)
    row["headroom"] = 1.0 - row["peak"] / capacity
    return row


def stage_programs(config, cfg, token_ids, mesh, wanted) -> list:
    """[(name, Program, args, indices of the state arguments, bytes held outside the
    arguments)] of the wanted programs of the stages that run (steps > 0)."""
    from marl_jax.train import aot, build

    policy, critic, reward_model = (build.policy_module(cfg), build.critic_module(cfg),
                                    build.reward_module(cfg))
    inputs = aot.task_inputs(config)
    entries = []
    # The state, and with LoRA the frozen base after the batch.
    state_args = lambda program, args: (program, args, (0, *range(2, len(args))), 0)
    if "sft" in wanted and config.sft.steps > 0:
        entries.append(("sft", *state_args(*aot.sft_program(config, policy, mesh, inputs))))
    if "rm" in wanted and config.rm.steps > 0:
        entries.append(("rm", *state_args(*aot.rm_program(config, reward_model, mesh, inputs))))
    entries += experiment_entries(config, token_ids, policy, critic, reward_model, mesh,
                                  inputs, wanted)
    ppo_wanted = [n for n in ("rollout", "update", "ppo_step", "generate", "score") if n in wanted]
    if ppo_wanted and config.ppo.steps > 0:
        ppo = aot.ppo_programs(config, token_ids, policy, critic, reward_model, mesh, inputs)
        frozen = per_device_bytes(ppo["rollout"][1][1])
        for name in ppo_wanted:
            # The update takes the state only; the frozen models wait on the devices beside it.
            # With LoRA it reads the frozen base, an argument (5) like the state.
            weight_args, outside = ((0,), frozen) if name == "update" else ((0, 1), 0)
            if name == "update" and cfg.lora_rank:
                weight_args, outside = (0, 5), 0
            entries.append((name, *ppo[name], weight_args, outside))
    return entries


def lora_weights_line(entries) -> str | None:
    """With LoRA, what the PPO programs hold per device: the one frozen base of the four roles,
    and their adapters and heads (and those's optimizer states); None without LoRA."""
    from marl_jax.models import lora

    for name, _, args, *_ in entries:
        if name in ("rollout", "ppo_step") and lora.has_adapters(args[0].actor_params):
            state, frozen = args[0], args[1]
            trained = per_device_bytes([state.actor_params, state.critic_params, frozen.rm_params])
            moments = per_device_bytes([state.actor_opt_state, state.critic_opt_state])
            return (f"weights: one frozen base {per_device_bytes(frozen.ref_params) / GIB:.3f} GiB "
                    "per device (actor, reference, critic and reward model); adapters and heads "
                    f"{trained / GIB:.3f} GiB, their optimizer states {moments / GIB:.3f} GiB")
    return None


def experiment_entries(config, token_ids, policy, critic, reward_model, mesh, inputs,
                       wanted) -> list:
    """The entries of `experiment` / `experiment_eval`: for every group of runs of different
    static fields (`marl_jax.experiment.run_groups`), its largest program of vmapped runs."""
    from marl_jax import experiment
    from marl_jax.train import aot

    names = [n for n in ("experiment", "experiment_eval") if n in wanted]
    if "experiment_phases" in wanted:
        names += list(EXPERIMENT_PHASES)
    if not names or config.ppo.steps <= 0:
        return []
    groups = experiment.run_groups(experiment.plan_runs(config),
                                   config.experiment.get("runs_per_program", 0))
    largest = {}
    for group in groups:
        if len(group) > len(largest.get(group[0].group, ())):
            largest[group[0].group] = group
    entries = []
    for runs in largest.values():
        suffix = "" if len(largest) == 1 else "[" + ",".join(
            f"{k}={v}" for k, v in zip(experiment.STATIC_FIELDS, runs[0].group)) + "]"
        group_config = experiment.group_config(config, runs[0])
        programs = aot.experiment_programs(
            group_config, token_ids, policy, critic, reward_model, mesh, len(runs),
            tuple(sorted({r.variant for r in runs})), inputs,
            eval_samples_per_prompt=int(config.ppo.eval_samples_per_prompt),
            num_eval_prompts=int(config.task.num_eval_prompts) if "experiment_eval" in names
            else 0, phases="experiment_phases" in wanted)
        state = programs["experiment"][1][0]
        for name in names:
            # The evaluation takes the actors only; the critics and optimizer states wait
            # on the devices beside it. The update phase takes the state (its first argument)
            # and the frozen models (its last).
            outside = (per_device_bytes(state) - per_device_bytes(state.actor_params)
                       if name == "experiment_eval" else 0)
            weights = (0, 5) if name == "experiment_update" else (0, 1)
            entries.append((f"{name}{suffix}", *programs[name], weights, outside))
    return entries


# ---- output --------------------------------------------------------------------------------
COLUMNS = (("stage", "stage", "{}"), ("program", "program", "{}"),
           ("compile s", "compile_s", "{:.1f}"), ("weights GiB", "weights", "{:.4f}"),
           ("args GiB", "args", "{:.4f}"), ("out GiB", "out", "{:.4f}"),
           ("alias GiB", "alias", "{:.4f}"), ("temp GiB", "temp", "{:.4f}"),
           ("code GiB", "code", "{:.4f}"), ("xla peak GiB", "xla_peak", "{:.4f}"),
           ("resident GiB", "resident", "{:.4f}"),
           ("peak GiB", "peak", "{:.4f}"), ("headroom %", "headroom", "{:.1f}"),
           ("TFLOP", "flops", "{:.2f}"), ("HBM GB", "hbm_bytes", "{:.2f}"),
           ("roofline ms", "roofline_step_s", "{:.1f}"), ("roofline MFU %", "roofline_mfu", "{:.1f}"))
BYTE_COLUMNS = {"weights", "args", "out", "alias", "temp", "code", "xla_peak", "resident",
                "peak"}


def _cell(row, key, fmt):
    if key not in row:
        return "-"
    value = row[key]
    if key in BYTE_COLUMNS:
        value = value / GIB
    elif key in ("headroom", "roofline_mfu"):
        value = 100 * value
    elif key == "flops":
        value = value / 1e12
    elif key == "hbm_bytes":
        value = value / 1e9
    elif key == "roofline_step_s":
        value = 1e3 * value
    return fmt.format(value)


def table(rows) -> str:
    cells = [[title for title, _, _ in COLUMNS]]
    cells += [[_cell(row, key, fmt) for _, key, fmt in COLUMNS] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in
                       enumerate(zip(r, widths))) for r in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def predicted_iteration(rows) -> dict | None:
    """{"seconds": the sum of the roofline seconds of `ITERATION_PROGRAMS`, "text"}, or None
    unless each of them was compiled with a roofline (a TPU target)."""
    bound = {row["program"]: row.get("roofline_step_s") for row in rows}
    if any(bound.get(name) is None for name in ITERATION_PROGRAMS):
        return None
    return _sum_line({name: bound[name] for name in ITERATION_PROGRAMS})


def _sum_line(seconds: dict) -> dict:
    total = sum(seconds.values())
    return {"seconds": total, "text": " + ".join(
        f"{name} {s:.3f} s" for name, s in seconds.items()) + f" = {total:.3f} s"}


def model_count_iteration(config, cfg, token_ids, mesh, device_kind: str) -> dict | None:
    """The iteration's seconds per device by the model count, every loop counted (XLA's cost
    analysis counts a loop's body once: the layer scan, the decode loop, the minibatches):
    `perf.ppo_step_flops` of each phase over all devices at the kind's peak FLOP/s, the rollout
    at least its decode's reads at HBM bandwidth (every weight in the compute dtype and the live
    KV cache once per decoded token, `bench_device.decode_bytes`, a tensor-parallel share of
    them per device), every response its whole budget. None for kinds without a peak."""
    from bench_device import decode_bytes
    from marl_jax.train import aot, build, perf, ppo

    row = perf.device_kind(device_kind)
    peak = perf.peak_flops(device_kind, cfg.dtype, cfg.precision)
    if row is None or peak is None:
        return None
    p = config.ppo
    static = ppo.static_from_config(config, token_ids)
    prompt = aot.task_inputs(config).prompt_length
    modules = (build.policy_module(cfg), build.critic_module(cfg), build.reward_module(cfg))
    flops = perf.ppo_step_flops(static, *(perf.model_flops(m) for m in modules), prompt,
                                p.batch_size * p.response_length, p.response_length)
    devices = mesh.devices.size
    rows = static.prompts_per_step * static.group_size // (mesh.shape["data"]
                                                           * mesh.shape["fsdp"])
    reads = decode_bytes(cfg, rows, prompt, p.response_length) / mesh.shape["tensor"]
    at_peak = {name: flops[name] / devices / peak for name in ("rollout", "score", "update")}
    seconds = {"generate": max(at_peak["rollout"], reads / row.hbm_bandwidth),
               "score": at_peak["score"], "update": at_peak["update"]}
    return _sum_line(seconds)


def config_error(message) -> typing.NoReturn:
    """A configuration error: one line on stderr, exit status 2 (as experiments/run.py)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_batches(config, mesh, wanted) -> None:
    """Every batch the wanted programs take splits over the mesh's data-parallel shards (the
    trainers' own check, before anything compiles)."""
    from marl_jax.train import sharding

    checks = {"sft": [("sft.batch_size", config.sft.batch_size)],
              "rm": [("rm.batch_size", config.rm.batch_size)]}
    ppo = [("ppo.batch_size", config.ppo.batch_size)]
    checks.update(rollout=ppo, update=ppo, ppo_step=ppo, generate=ppo, score=ppo, experiment=ppo,
                  experiment_phases=ppo,
                  experiment_eval=[("task.num_eval_prompts", config.task.num_eval_prompts)])
    for name in wanted:
        stage = STAGE_OF[name]
        if config[stage if stage != "experiment" else "ppo"].steps <= 0:
            continue
        for field, value in checks[name]:
            sharding.validate_batch(value, mesh, f"config.{field}")


def main(argv):
    try:
        rest = FLAGS(["bench.py memory", *argv])
    except flags.Error as error:
        config_error(error)
    except (AttributeError, KeyError) as error:  # ml_collections: an override of no field
        text = str(error).strip("'").replace("\\n", " ").replace("\\'", "'")
        config_error(f"a --config field does not exist: {text}")
    if len(rest) > 1:
        raise SystemExit(f"unexpected arguments: {rest[1:]}")
    config = FLAGS.config
    if config is None:
        raise SystemExit("--config=FILE is required")
    config_file = FLAGS["config"].config_filename
    topology = FLAGS.topology or config.get("tpu_topology", "")
    if not topology:
        raise SystemExit(f"{config_file} has no tpu_topology: pass "
                         "--topology (e.g. v4-16, v5e-16, v5p-32, v6e-8 or cpu:8)")
    wanted = FLAGS.programs or list(
        EXPERIMENT_PROGRAMS if config.get("stage", "") == "experiment" else DEFAULT_PROGRAMS)
    unknown = [p for p in wanted if p not in PROGRAMS]
    if unknown:
        raise SystemExit(f"--programs: unknown {unknown}; choose from {PROGRAMS}")
    cpus = _cpu_count(topology)
    if cpus is not None:
        _rerun_with_cpu_devices(cpus)

    from marl_jax import config as config_lib, config_check
    from marl_jax.models import attention, decode_layout
    from marl_jax.train import build, sharding

    target = cpu_target(cpus, FLAGS.capacity_gib) if cpus is not None else tpu_target(topology)
    try:
        config_lib.resolve_size(config, overridden=config_lib.command_line_fields(
            ["bench.py memory", *argv])[1])
        config_check.validate_config(config, config_file=config_file)
        mesh = sharding.make_mesh(config.mesh, devices=target.devices)
        check_batches(config, mesh, wanted)
    except ValueError as error:
        config_error(error)
    cfg, source, token_ids = resolve_model(config, target.platform)
    size = f" (size {config.size})" if "size" in config else ""
    print(f"config {config_file}{size}; stage {config.stage}")
    print(f"target {target.name}: {len(target.devices)} x {target.devices[0].device_kind}, "
          f"{target.capacity_source}; mesh {dict(mesh.shape)}")
    print(f"model {source}: {cfg.family}, {cfg.num_layers} layers, width {cfg.hidden_size}, "
          f"vocabulary {cfg.vocab_size}; compute {cfg.dtype}, params {cfg.param_dtype}, "
          f"remat={cfg.remat}, scan_layers={cfg.scan_layers}", flush=True)
    p = config.ppo
    if p.termination == "parsing" or p.reward_source == "host":
        print("note: parsing termination / host rewards run generate, score and update as "
              "separate programs; ppo_step here is the on-device step")

    rows = []
    with attention.target_platform(target.platform):
        layout = decode_layout.resolve(cfg, sharding.logical_rules(mesh, build.model_dims(cfg)))
        print(f"{attention.describe(cfg)}; sampler layout {layout}", flush=True)
        entries = stage_programs(config, cfg, token_ids, mesh, set(wanted))
    with sharding.mesh_context(mesh, sharding.logical_rules(mesh, build.model_dims(cfg))), \
            attention.target_platform(target.platform):
        for name, *entry in entries:
            rows.append(measure(name, *entry, platform=target.platform,
                                capacity=target.capacity_bytes))
            print(f"compiled {name} in {rows[-1]['compile_s']:.1f} s", flush=True)
    if not rows:
        raise SystemExit("nothing to compile: every selected stage has 0 steps")
    print(table(rows))
    if (line := lora_weights_line(entries)) is not None:
        print(line)
    for row in rows:
        if "error" in row:
            print(f"{row['program']}: {row['error']}")
        elif row["headroom"] < HEADROOM_NEEDED:
            print(f"{row['program']}: headroom {100 * row['headroom']:.1f}% is below "
                  f"{100 * HEADROOM_NEEDED:.0f}%")
    predicted = predicted_iteration(rows)
    modelled = None
    if predicted is not None:
        print(f"predicted iteration by the roofline: {predicted['text']} (XLA's count: each "
              "loop's body once, a lower bound)")
        modelled = model_count_iteration(config, cfg, token_ids, mesh,
                                         target.devices[0].device_kind)
    if modelled is not None:
        print(f"predicted iteration by the model count: {modelled['text']} (every loop "
              "counted; the decode's reads at HBM bandwidth, the rest at peak FLOP/s)")
    peak = max(row["peak"] for row in rows)
    fits = peak <= target.capacity_bytes
    if FLAGS.json:
        pathlib.Path(FLAGS.json).write_text(json.dumps(dict(
            target=target.name, devices=len(target.devices),
            device_kind=target.devices[0].device_kind, capacity_bytes=target.capacity_bytes,
            capacity_source=target.capacity_source, mesh=dict(mesh.shape), model_source=source,
            size=config.get("size", None),
            model=dict(family=cfg.family, num_layers=cfg.num_layers, dtype=cfg.dtype,
                       param_dtype=cfg.param_dtype, remat=cfg.remat,
                       scan_layers=cfg.scan_layers),
            programs=rows, peak_bytes=peak, fits=fits,
            predicted_iteration_s=None if predicted is None else predicted["seconds"],
            model_count_iteration_s=None if modelled is None else modelled["seconds"]),
            indent=2))
    step = next((row for row in rows if row["program"] in ("ppo_step", "experiment") and "flops" in row), None)
    roof = ""
    if step is not None:
        roof = f" flops={step['flops']:.4g} hbm_bytes={step['hbm_bytes']:.4g}"
        if "roofline_step_s" in step:
            roof += f" roofline_step_s={step['roofline_step_s']:.4g} roofline_mfu={step['roofline_mfu']:.4f}"
    print(f"devices={len(target.devices)} peak_gib={peak / GIB:.3f} "
          f"capacity_gib={target.capacity_bytes / GIB:.3f} fits={fits}{roof}")


if __name__ == "__main__":
    main(sys.argv[1:])
