"""The multi-turn tasks, registered by name in `marl_jax.data.task_registry` like the single-turn
ones (`marl_jax.envs` imports this module, so importing the package registers them).

`calculator` (configs/multiturn_synthetic.py): the calculator environment's word problems
(`marl_jax.envs.calculator`). SFT trains on its demonstrations as whole trajectories
(`marl_jax.envs.transcripts`: the first prompt, then the assistant turns and tool observations
in chat-template tokens, with the action mask and turn ids); PPO and the evaluation start from
the first prompts of fresh problems and play them against the environment
`TaskData.environment` names, whose task rows are `info["rl_rows"]` / `info["eval_rows"]` in the
order of the prompt arrays. There is no reward model: the environment's answer check is the
reward (`TaskData.rm` is None).

`reasoning_gym` (configs/rlvr_smollm2.py): a reasoning-gym dataset's problems
(`marl_jax.envs.reasoning_gym`), `config.task.dataset` with its `options`, played for
`config.task.max_turns` attempts (1: reinforcement learning with verifiable rewards on single
answers); the dataset's checker is the reward. SFT trains on the library's reference answers in
the answer format (`num_sft` of them, 0 for none). Its tokenizer is a pretrained one ("model" or
a path).

`game` (configs/game_smollm2.py): a single-player game of GEM or TextArena,
`config.task.environment` ("gem:<id>" or "textarena:<id>", `marl_jax.envs.games`), through the
library's own API. A task row is one game, {"seed": s}: the seeds of the PPO prompts' games and of
the held-out games are drawn without replacement from [0, 2**32) by `default_rng(data_seed)`, so
no held-out game's seed is a training game's. No demonstrations (config.sft.steps is 0) and no
reward model: the game's rewards are the reward. Its tokenizer is a pretrained one, and
`config.task.prompt_length=0` pads the first prompts to the longest (each game writes its own).

`config.task.tokenizer` chooses how text becomes tokens: "word" (the default, also when the
section has no such field) is the task's own word-level tokenizer, written to
`<workdir>/tokenizer` for a fresh model of `config.model.config`; "model" is the tokenizer of
the pretrained `config.model.path` (configs/multiturn_smollm2.py: SmolLM2's BPE and its chat
template); any other value is the path of a tokenizer (an HF directory or a GGUF file). The
environment is the same under every tokenizer: its text is the same words and numbers.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np

from marl_jax.data.task_data import TaskData
from marl_jax.data.task_registry import register_task
from marl_jax.envs import calculator, games
from marl_jax.envs.chat_turns import end_of_turn_ids, observation_span, prompt_ids
from marl_jax.envs.reasoning_gym import problem_rows
from marl_jax.envs.registry import environment
from marl_jax.envs.transcripts import left_padded, pad_id, transcript_arrays
from marl_jax.envs.turn_callback import turn_callback
from marl_jax.models.tokenizer import load_tokenizer

# The problems' sizes a calculator task section sets (`calculator.CalculatorTask`).
CALCULATOR_SIZES = ("min_a", "max_a", "max_bc", "max_value")
# `config.task.tokenizer` values besides a path: the task's word-level tokenizer (the default)
# and the pretrained model's own.
WORD_TOKENIZER, MODEL_TOKENIZER = "word", "model"
GAME_TASK = "game"


@functools.lru_cache(maxsize=4)
def _pretrained_tokenizer(path: str):
    """The tokenizer at `path`, read once per process: a process may build a task more than
    once (a GGUF file's vocabulary takes seconds to read), and nothing edits it."""
    return load_tokenizer(path)


def tokenizer_path(config) -> str:
    """The path of the tokenizer `config.task.tokenizer` names ("" for the task's word-level
    tokenizer, which is built rather than loaded)."""
    choice = config.task.get("tokenizer", WORD_TOKENIZER)
    if choice == WORD_TOKENIZER:
        return ""
    return config.model.path if choice == MODEL_TOKENIZER else choice


def tokenizer_problem(config) -> str | None:
    """Why `config.task.tokenizer` cannot name the task's tokenizer, from the config alone (the
    config check reads no file), or None: not a name or a path, the word-level tokenizer with a
    pretrained model (whose ids mean other words), or "model" without a model path. Whether the
    tokenizer loads and writes the environment's turns is checked where the task is built
    (`task_tokenizer`)."""
    choice = config.task.get("tokenizer", WORD_TOKENIZER)
    if not isinstance(choice, str) or not choice:
        return (f"must be {WORD_TOKENIZER} (the task's word-level tokenizer), {MODEL_TOKENIZER} "
                "(config.model.path's) or the path of a tokenizer")
    if choice == WORD_TOKENIZER:
        return None if not config.model.path else (
            f"the task's word-level tokenizer needs a fresh model, not config.model.path="
            f"{config.model.path!r}: use {MODEL_TOKENIZER} (the model's own tokenizer)")
    if not tokenizer_path(config):
        return f"{MODEL_TOKENIZER} is the tokenizer of config.model.path, which is empty"
    return None


def task_tokenizer(config):
    """The pretrained tokenizer `config.task.tokenizer` names, loaded where the task is built: a
    ValueError of one line naming the field (run.py: exit 2, before anything compiles) when it
    does not load, or has no chat template that writes the environment's turns token by token
    (`chat_turns`)."""
    field = f"config.task.tokenizer={config.task.get('tokenizer', WORD_TOKENIZER)!r}"
    path = tokenizer_path(config)
    try:
        tokenizer = _pretrained_tokenizer(path)
    except Exception as error:  # a missing file or a directory that holds no tokenizer
        raise ValueError(f"{field}: no tokenizer loads from {path}: "
                         f"{str(error).strip().splitlines()[0]}") from None
    role = ("user" if config.task.name in (GAME_TASK, "reasoning_gym") else
            calculator.CalculatorEnvironment.observation_role)
    try:
        end_of_turn_ids(tokenizer)
        observation_span(tokenizer, [{"role": "user", "content": "2 + 3 ?"},
                                     {"role": "assistant", "content": "calc ( 2 + 3 )"}],
                         "5", role=role)
    except ValueError as error:
        raise ValueError(f"{field}: the {config.task.name} environment writes its turns through "
                         f"a chat template: {error}") from None
    return tokenizer


def calculator_task_from_config(t) -> calculator.CalculatorTask:
    """The `CalculatorTask` of a task section (its `CALCULATOR_SIZES` fields and the share of
    demonstrations that stop early, `demo_shortcut`)."""
    return calculator.CalculatorTask(**{k: int(t[k]) for k in CALCULATOR_SIZES},
                                     demo_shortcut=float(t.demo_shortcut))


def first_prompts(env, tokenizer, rows, prompt_length: int) -> dict:
    """{"ids", "mask"} [K, P] of the first prompts of the environment's episodes of `rows`
    (chat template and generation prompt, left-padded): what the multi-turn rollout starts
    from."""
    _, conversations = env.reset(rows, range(len(rows)))
    ids, mask = left_padded([prompt_ids(tokenizer, m) for m in conversations], prompt_length,
                            pad_id(tokenizer), field="config.task.prompt_length")
    return dict(ids=ids, mask=mask)


@register_task("calculator")
def calculator_task_data(config, workdir: str) -> TaskData:
    """The calculator task (see the module); deterministic in `config.task`. SFT demonstrations
    come from seed `data_seed`, the PPO prompts' problems from `data_seed + 1` and the held-out
    evaluation's from `data_seed + 2`."""
    t = config.task
    task = calculator_task_from_config(t)
    path = tokenizer_path(config)
    tokenizer = (task_tokenizer(config) if path else
                 calculator.build_tokenizer(task, os.path.join(workdir, "tokenizer")))
    p, r = int(t.prompt_length), int(config.ppo.response_length)
    seed = int(t.data_seed)
    demos = calculator.demonstrations(task, seed, int(t.num_sft))
    turns = max((len(d["messages"]) // 2 for d in demos), default=0)
    if int(t.max_turns) < turns:
        raise ValueError(f"config.task.max_turns={t.max_turns}: the demonstrations take {turns} "
                         "assistant turns; raise it")
    env_kwargs = dict(max_turns=int(t.max_turns), max_value=task.max_value)
    env = environment("calculator", **env_kwargs)
    sft = transcript_arrays(tokenizer, [d["messages"] for d in demos], p, r)
    rl_rows = calculator.problems(task, seed + 1, int(t.num_rl_prompts))
    eval_rows = calculator.problems(task, seed + 2, int(t.num_eval_prompts))
    return TaskData(
        tokenizer=tokenizer, prompt_length=p, response_length=r, sft=sft, rm=None,
        rl=first_prompts(env, tokenizer, rl_rows, p),
        eval=first_prompts(env, tokenizer, eval_rows, p),
        environment=dict(name="calculator", kwargs=env_kwargs),
        turn_callback=lambda rows, seeds: turn_callback(
            env, tokenizer, rows, seeds,
            max_observation_tokens=int(t.max_observation_tokens))[1],
        end_of_turn=tuple(end_of_turn_ids(tokenizer)),
        info=dict(task="calculator", calculator=dataclasses.asdict(task), rl_rows=rl_rows,
                  eval_rows=eval_rows),
    )


def reasoning_gym_environment_kwargs(t) -> dict:
    """The `reasoning_gym` environment's arguments from a task section."""
    return dict(dataset=t.dataset, options=dict(t.options), max_attempts=int(t.max_turns),
                answer_format=t.answer_format)


@register_task("reasoning_gym")
def reasoning_gym_task_data(config, workdir: str) -> TaskData:
    """The reasoning-gym task (see the module); deterministic in `config.task`. The SFT, PPO and
    held-out problems come from `reasoning_gym.problem_rows` (disjoint seeds from `data_seed`,
    no held-out question in a training part)."""
    t = config.task
    path = tokenizer_path(config)
    if not path:
        raise ValueError(f"config.task.tokenizer={t.tokenizer!r}: reasoning-gym problems are "
                         f"text for a pretrained tokenizer: use {MODEL_TOKENIZER} or a path")
    tokenizer = task_tokenizer(config)
    p, r = int(t.prompt_length), int(config.ppo.response_length)
    env_kwargs = reasoning_gym_environment_kwargs(t)
    env = environment("reasoning_gym", **env_kwargs)
    problems = env.problems
    rows = problem_rows(problems, int(t.data_seed),
                        dict(sft=t.num_sft, rl=t.num_rl_prompts, eval=t.num_eval_prompts))
    demos = []
    for row in rows["sft"]:
        entry = problems.entry(row)
        demos.append([{"role": "user", "content": problems.prompt(entry)},
                      {"role": "assistant", "content": problems.demonstration(entry)}])
    return TaskData(
        tokenizer=tokenizer, prompt_length=p, response_length=r,
        sft=transcript_arrays(tokenizer, demos, p, r), rm=None,
        rl=first_prompts(env, tokenizer, rows["rl"], p),
        eval=first_prompts(env, tokenizer, rows["eval"], p),
        environment=dict(name="reasoning_gym", kwargs=env_kwargs),
        turn_callback=lambda task_rows, seeds: turn_callback(
            env, tokenizer, task_rows, seeds,
            max_observation_tokens=int(t.max_observation_tokens))[1],
        end_of_turn=tuple(end_of_turn_ids(tokenizer)),
        info=dict(task="reasoning_gym", dataset=t.dataset, options=dict(t.options),
                  rl_rows=rows["rl"], eval_rows=rows["eval"]),
    )


def game_problem(config) -> tuple[str, str] | None:
    """(field, why) the game task's section cannot be played, or None (and None for any other
    task): the game (`games.game_problem`: it builds the environment and starts one episode), a
    pretrained tokenizer, and no SFT stage (a game has no demonstrations)."""
    t = config.task
    if t.name != GAME_TASK:
        return None
    problem = games.game_problem(t.environment)
    if problem is not None:
        return "task.environment", problem
    if t.get("tokenizer", WORD_TOKENIZER) == WORD_TOKENIZER:
        return "task.tokenizer", (f"a game's text needs a pretrained tokenizer: use "
                                  f"{MODEL_TOKENIZER} or a path")
    if not isinstance(t.prompt_length, int) or t.prompt_length < 0:
        return "task.prompt_length", ("must be an int >= 0 (0: the longest first prompt of the "
                                      "task's games)")
    if config.sft.steps:
        return "sft.steps", "a game has no demonstrations to fine-tune on: use 0"
    return None


def game_rows(data_seed: int, num_rl: int, num_eval: int) -> tuple[list, list]:
    """(PPO rows, held-out rows) of the game task: {"seed"} each, the seeds drawn without
    replacement from [0, 2**32) by `default_rng(data_seed)` (disjoint parts)."""
    seeds = np.random.default_rng(data_seed).choice(2 ** 32, size=num_rl + num_eval,
                                                    replace=False)
    rows = [{"seed": int(s)} for s in seeds]
    return rows[:num_rl], rows[num_rl:]


@register_task(GAME_TASK)
def game_task_data(config, workdir: str) -> TaskData:
    """The game task (see the module); deterministic in `config.task`."""
    t = config.task
    tokenizer = task_tokenizer(config)
    env_kwargs = dict(environment=t.environment)
    env = environment(GAME_TASK, **env_kwargs)
    rl_rows, eval_rows = game_rows(int(t.data_seed), int(t.num_rl_prompts),
                                   int(t.num_eval_prompts))
    prompts = {part: [prompt_ids(tokenizer, messages)
                      for messages in env.reset(rows, range(len(rows)))[1]]
               for part, rows in (("rl", rl_rows), ("eval", eval_rows))}
    p = int(t.prompt_length) or max(len(ids) for part in prompts.values() for ids in part)
    arrays = {part: dict(zip(("ids", "mask"), left_padded(
        ids, p, pad_id(tokenizer), field="config.task.prompt_length")))
        for part, ids in prompts.items()}
    return TaskData(
        tokenizer=tokenizer, prompt_length=p, response_length=int(config.ppo.response_length),
        sft={}, rm=None, rl=arrays["rl"], eval=arrays["eval"],
        environment=dict(name=GAME_TASK, kwargs=env_kwargs),
        turn_callback=lambda task_rows, seeds: turn_callback(
            env, tokenizer, task_rows, seeds,
            max_observation_tokens=int(t.max_observation_tokens))[1],
        end_of_turn=tuple(end_of_turn_ids(tokenizer)),
        info=dict(task=GAME_TASK, environment=t.environment, rl_rows=rl_rows,
                  eval_rows=eval_rows),
    )
