"""The real RLHF tasks as `TaskData`: TL;DR (tldr), HH-RLHF (hh_rlhf), WebGPT (webgpt), APPS (apps).

How a dataset becomes the arrays of the stages (all knobs in `config.task`):

1. The training split is read by the loaders of `marl_jax.data`: `path` is a local file or
   directory in the dataset's public schema (required offline), empty reads the hub copy.
   Malformed rows are skipped and counted by the loaders.
2. Its records are split 20 / 40 / 40 into SFT / RM / RL parts by `paper_split` (seed 1234, the
   DeepSpeed-Chat rule of the official code). Preference datasets split their preference pairs:
   the SFT part trains on the chosen responses, the RM part on the pairs, and the RL part
   samples from its distinct prompts. APPS splits its problems: the SFT part trains on the first
   reference solution of each problem, the RM part is unused (the reward is the unit tests), the
   RL part holds the problems PPO samples.
3. Held-out evaluation prompts come from the validation / test split (tldr: validation, hh_rlhf
   and apps: test); webgpt has a train split only, so the last prompts of its RL part are held
   out instead (`num_eval_prompts` of them, or a tenth when that is 0).
4. Prompts are wrapped in the tokenizer's chat template when `use_chat_template`; records whose
   prompt is longer than `max_prompt_length` tokens or whose response is longer than
   `ppo.response_length - 1` tokens (the EOS must fit) are dropped; each part is then capped
   (`num_sft`, `num_pairs`, `num_rl_prompts`, `num_eval_prompts`; 0 = all).
5. Everything is tokenised by `marl_jax.data.collate` like the synthetic task: prompts
   left-padded to `max_prompt_length`, responses left-aligned to `ppo.response_length` with EOS.

APPS carries the unit tests of its RL problems (`TaskData.rl_unit_tests`); the caller turns them
into the host-side reward of `config.ppo.reward_source="host"` (`marl_jax.eval.unit_test_reward`).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from typing import Sequence

import jax
import numpy as np

from marl_jax import models
from marl_jax.data import collate
from marl_jax.data.chat import filter_by_length, format_records
from marl_jax.data.loaders import load_preference_pairs, load_prompts, load_sft_examples
from marl_jax.data.splits import paper_split
from marl_jax.data.task_data import TaskData, supervised_arrays
from marl_jax.data.task_registry import register_task

logger = logging.getLogger("marl_jax.data")

REAL_TASKS = ("tldr", "hh_rlhf", "webgpt", "apps")
# Where held-out prompts come from when `config.task.eval_split` is empty, in order of preference.
EVAL_SPLITS = {"tldr": ("validation",), "hh_rlhf": ("test",), "webgpt": (), "apps": ("test",)}
EVAL_SPLIT_CHOICES = ("", "validation", "test", "heldout")
HELD_OUT_FRACTION = 0.1
STATS_FILE = "task_stats.json"
# The fields of a prompt record the evaluation stage and the APPS reward read.
_EVAL_FIELDS = ("prompt", "raw_prompt", "input_output", "fn_name", "problem_id", "difficulty",
                "id")


@register_task(*REAL_TASKS)
def build_real_task(config, workdir: str, *, tokenizer=None) -> TaskData:
    """The real task named by `config.task.name`, tokenised (deterministic in the config).

    Args:
      config: the full config (`task`, `model.path`, `ppo.response_length`, `rm.steps`).
      workdir: the run directory; `<workdir>/task_stats.json` records what was loaded, skipped,
        dropped and kept.
      tokenizer: a tokenizer to use instead of loading `config.task.tokenizer` (or
        `config.model.path`).
    """
    t = config.task
    _check_task_config(config)
    if tokenizer is None:
        tokenizer = load_task_tokenizer(config)
    prompt_length, response_length = int(t.max_prompt_length), int(config.ppo.response_length)
    prepare = _Preparer(tokenizer, t, response_length)
    parts, eval_records, loads = _load_parts(config)

    sft = prepare("sft", parts["sft"], t.num_sft)
    rm = prepare("rm", parts["rm"], t.num_pairs)
    if eval_records is None:
        rl, evals = _hold_out(prepare, parts["rl"], t.num_rl_prompts, t.num_eval_prompts)
    else:
        rl = prepare("rl", parts["rl"], t.num_rl_prompts)
        evals = prepare("eval", eval_records, t.num_eval_prompts)
    _check_sizes(config, sft, rm, rl, evals)

    def prompts(records):
        if not records:  # APPS has no preference pairs
            return dict(ids=np.zeros((0, prompt_length), np.int32),
                        mask=np.zeros((0, prompt_length), np.int32))
        ids, mask = collate.encode_prompts(tokenizer, [r["prompt"] for r in records],
                                           prompt_length)
        return dict(ids=ids, mask=mask)

    def responses(texts):
        if not texts:
            empty = np.zeros((0, response_length), np.int32)
            return empty, empty.copy()
        return collate.encode_responses(tokenizer, texts, response_length)

    counts = {"sft": len(sft), "rm": len(rm), "rl": len(rl), "eval": len(evals)}
    info = dict(task=t.name, counts=counts, loads=loads, dropped=prepare.dropped,
                eval_records=[_eval_fields(r) for r in evals])
    _report(t.name, counts, loads, prepare.dropped, workdir)
    sft_arrays, rm_arrays = supervised_arrays(prompts, responses, sft, rm)
    return TaskData(
        tokenizer=tokenizer, prompt_length=prompt_length, response_length=response_length,
        sft=sft_arrays, rm=rm_arrays,
        rl=prompts(rl), eval=prompts(evals), info=info,
        rl_unit_tests=[r["input_output"] for r in rl] if t.name == "apps" else None)


def load_task_tokenizer(config):
    """The tokenizer of `config.task.tokenizer`, else of `config.model.path` (left padding, EOS
    as pad when the tokenizer has no pad token)."""
    path = config.task.tokenizer or config.model.path
    if not path:
        raise ValueError(f"config.task.name={config.task.name!r} needs a tokenizer: set "
                         "config.model.path (or config.task.tokenizer)")
    return models.load_tokenizer(path)


# ---- configuration -------------------------------------------------------------------------
def _check_task_config(config):
    t = config.task
    if t.name not in REAL_TASKS:
        raise ValueError(f"config.task.name={t.name!r}: must be 'synthetic' or one of {REAL_TASKS}")
    if t.eval_split not in EVAL_SPLIT_CHOICES:
        raise ValueError(f"config.task.eval_split={t.eval_split!r}: must be one of "
                         f"{EVAL_SPLIT_CHOICES}")
    fractions = tuple(t.split_fractions)
    if len(fractions) != 3 or min(fractions) < 0 or sum(fractions) <= 0:
        raise ValueError(f"config.task.split_fractions={fractions}: need three non-negative "
                         "fractions (sft, rm, rl) with a positive sum")
    for field in ("num_sft", "num_pairs", "num_rl_prompts", "num_eval_prompts", "max_rows"):
        if not isinstance(t[field], int) or t[field] < 0:
            raise ValueError(f"config.task.{field}={t[field]!r}: must be an int >= 0 (0 = all)")
    if not isinstance(t.max_prompt_length, int) or t.max_prompt_length < 1:
        raise ValueError(f"config.task.max_prompt_length={t.max_prompt_length!r}: must be >= 1")
    if config.ppo.response_length < 2:
        raise ValueError(f"config.ppo.response_length={config.ppo.response_length}: a real task "
                         "needs room for at least one token and the EOS")
    if t.unit_test_timeout_s <= 0:
        raise ValueError(f"config.task.unit_test_timeout_s={t.unit_test_timeout_s}: must be > 0")
    if t.name == "apps" and config.rm.steps > 0:
        raise ValueError(f"config.rm.steps={config.rm.steps}: apps has no preference pairs (its "
                         "reward is the unit tests); set config.rm.steps=0 and "
                         "config.ppo.reward_source='host'")


def _options(config) -> dict:
    t = config.task
    options = {}
    if t.cache_dir:
        options["cache_dir"] = t.cache_dir
    if t.max_rows:
        options["max_rows"] = int(t.max_rows)
    if t.name == "tldr":
        options["include_cnndm"] = bool(t.include_cnndm)
    if t.name == "apps" and t.difficulties:
        options["difficulties"] = tuple(t.difficulties)
    return options


# ---- loading and splitting -----------------------------------------------------------------
def _load_parts(config):
    """({"sft", "rm", "rl"} record lists, eval records or None for a held-out slice, load stats)."""
    t = config.task
    path, options = t.path or None, _options(config)
    split = dict(seed=int(t.split_seed), fractions=tuple(t.split_fractions))
    if t.name == "apps":
        problems = load_prompts("apps", path, "train", **options)
        with _quiet(logger):  # the same rows again: their skips are reported once, above
            solutions = load_sft_examples("apps", path, "train", **options)
        loads = [problems.load_stats]
        parts = paper_split(problems, **split)
        by_id = {r["problem_id"]: r["response"] for r in solutions}
        # The SFT part keeps its problems that have a reference solution; the RM part is unused.
        sft = [dict(r, response=by_id[r["problem_id"]]) for r in parts["sft"]
               if r["problem_id"] in by_id]
        parts = {"sft": sft, "rm": [], "rl": parts["rl"]}
    else:
        pairs = load_preference_pairs(t.name, path, "train", **options)
        loads = [pairs.load_stats]
        parts = paper_split(pairs, **split)
        parts["sft"] = [dict(r, response=r["chosen"]) for r in parts["sft"]]
        parts["rl"] = _distinct_prompts(parts["rl"])
    eval_records = None
    for eval_split in _eval_split_candidates(t):
        try:
            eval_records = load_prompts(t.name, path, eval_split, **options)
        except FileNotFoundError:
            if t.eval_split:
                raise
            logger.info("%s: no local %s split under %s; holding out RL prompts instead",
                        t.name, eval_split, path)
            continue
        loads.append(eval_records.load_stats)
        break
    return parts, eval_records, loads


@contextlib.contextmanager
def _quiet(log):
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _eval_split_candidates(t) -> Sequence[str]:
    if t.eval_split == "heldout":
        return ()
    if t.eval_split:
        return (t.eval_split,)
    return EVAL_SPLITS[t.name]


def _distinct_prompts(records):
    """Prompt records `{"prompt", ...}` of `records`, first occurrence of each prompt kept."""
    seen, out = set(), []
    for r in records:
        if r["prompt"] not in seen:
            seen.add(r["prompt"])
            out.append({k: v for k, v in r.items() if k not in ("chosen", "rejected")})
    return out


def _hold_out(prepare, records, num_rl, num_eval):
    """(RL prompts, held-out prompts): the last prompts of the prepared RL part are held out."""
    if num_eval == 0:
        num_eval = max(1, int(round(HELD_OUT_FRACTION * len(records))))
    prepared = prepare("rl", records, num_rl + num_eval if num_rl else 0)
    if len(prepared) <= num_eval:
        raise ValueError(f"the RL part has {len(prepared)} usable prompts, too few to hold out "
                         f"config.task.num_eval_prompts={num_eval} of them")
    return prepared[:-num_eval], prepared[-num_eval:]


class _Preparer:
    """Formats (chat template), length-filters and caps record lists, counting what it drops."""

    def __init__(self, tokenizer, task_config, response_length: int):
        self.tokenizer = tokenizer
        self.use_chat_template = bool(task_config.use_chat_template)
        self.max_prompt = int(task_config.max_prompt_length)
        self.max_response = response_length - 1
        self.dropped = {}
        # Without a chat template (which writes its own), prompts start with BOS when the
        # tokenizer adds one by default (Gemma, Llama): encoding adds no special tokens.
        probe = tokenizer("a")["input_ids"]
        bos = tokenizer.bos_token_id
        self.bos_text = (tokenizer.bos_token if not self.use_chat_template and bos is not None
                         and probe and probe[0] == bos else "")

    def __call__(self, part: str, records, cap: int):
        """Up to `cap` (0 = all) records of `records` that fit, formatted, in order."""
        kept, dropped = [], 0
        chunk = max(2 * cap, 256) if cap else max(len(records), 1)
        for start in range(0, len(records), chunk):
            batch = [dict(r, raw_prompt=r["prompt"]) for r in records[start:start + chunk]]
            batch = format_records(batch, self.tokenizer, self.use_chat_template)
            fitting = filter_by_length(batch, self.tokenizer, self.max_prompt, self.max_response)
            dropped += len(batch) - len(fitting)
            kept.extend(fitting)
            if cap and len(kept) >= cap:
                break
        if dropped:
            self.dropped[part] = self.dropped.get(part, 0) + dropped
        kept = kept[:cap] if cap else kept
        for r in kept:
            r["prompt"] = self.bos_text + r["prompt"]
        return kept


def _check_sizes(config, sft, rm, rl, evals):
    t = config.task
    why = (f"after the split and dropping records over config.task.max_prompt_length="
           f"{t.max_prompt_length} / config.ppo.response_length={config.ppo.response_length} "
           f"tokens")
    if config.sft.steps > 0 and not sft:
        raise ValueError(f"no SFT examples of {t.name!r} are left {why}")
    if config.rm.steps > 0 and not rm:
        raise ValueError(f"no preference pairs of {t.name!r} are left {why}")
    if not rl:
        raise ValueError(f"no RL prompts of {t.name!r} are left {why}")
    if not evals:
        raise ValueError(f"no evaluation prompts of {t.name!r} are left {why}")


def _eval_fields(record) -> dict:
    return {k: record[k] for k in _EVAL_FIELDS if k in record}


def _report(name, counts, loads, dropped, workdir):
    """One log line with what was kept, skipped and dropped; the details in task_stats.json."""
    skipped = sum(sum(s.get("skipped", {}).values()) for s in loads)
    by_design = sum(sum(s.get("dropped", {}).values()) for s in loads)
    logger.warning(
        "%s: %s; loading skipped %d malformed rows and dropped %d by design, length filtering "
        "dropped %s (details in %s)", name,
        ", ".join(f"{k} {v}" for k, v in counts.items()), skipped, by_design,
        dropped or "nothing", STATS_FILE)
    if jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, STATS_FILE), "w") as f:
            json.dump(dict(task=name, counts=counts, loads=loads, too_long=dropped), f, indent=2)


# ---- decoded responses, APPS programs ----------------------------------------------------
_FENCE = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text: str) -> str:
    """The program in a response: the body of its first markdown code fence (an unclosed fence
    runs to the end), else the whole text."""
    match = _FENCE.search(text)
    return match.group(1) if match else text


def decode_responses(tokenizer, response_ids, response_mask) -> list:
    """Texts of left-aligned responses `[B, R]`, special tokens (EOS) removed."""
    ids, mask = np.asarray(response_ids), np.asarray(response_mask)
    if ids.shape != mask.shape or ids.ndim != 2:
        raise ValueError(f"response_ids {ids.shape} and response_mask {mask.shape} must be "
                         "equal [B, R] shapes")
    lengths = mask.sum(axis=1)
    return tokenizer.batch_decode([row[:n].tolist() for row, n in zip(ids, lengths)],
                                  skip_special_tokens=True)
