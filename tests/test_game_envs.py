"""The environment libraries' games through their adapters (marl_jax/envs/gem_env.py,
textarena_env.py, games.py): a GEM and a TextArena game played from recorded actions give what
the library gives when driven directly, step by step (episodes stepped in turn, each as if alone,
the process's random state untouched); a replay from the rows' seeds in another order
reproduces the trajectories token for token; observation spans of a game's trajectories take no
GAE step; a library environment that raises or answers malformed fails its row only; bad specs
are one line at config time (exit 2 from the command line); configs/game_smollm2.py trains two
steps of its arms on a tiny random model."""
import random
import subprocess
import sys

import jax
import numpy as np
import pytest
import process_util
from test_envs import SMOLLM2_TEMPLATE, _byte_bpe

from marl_jax import envs
from marl_jax.config_check import validate_config
from marl_jax.envs import gem_env, textarena_env
from marl_jax.macro import advantage, termination
from marl_jax.rollout.turns import ACTION, OBSERVATION
from marl_jax.train.metrics import read_metrics

from train_util import ROOT  # noqa: F401  (puts the repository root, and `configs`, on sys.path)
from configs import game_smollm2  # noqa: E402

GEM_MINESWEEPER = "game:Minesweeper-v0-easy"
TEXTARENA_GUESS = "GuessTheNumber-v0"


def _gem_direct(env_id, seed, actions):
    """(first observation, [(observation or None, reward, done)]) of GEM's environment driven
    directly, one episode alone, through GEM's own `ObservationWrapper` (no actions, no chat
    template): each observation is the text the wrapper adds for the turn, its whole text less
    the history it held before (its previous text without that turn's suffix, the board then);
    rewards in float32, as the protocol's steps hold them."""
    from gem.wrappers.observation_wrapper import ObservationWrapper

    env = ObservationWrapper(gem_env.library().make(env_id), include_action=False,
                             include_chat_template=False)
    first, info = env.reset(seed=seed)
    history = first[:len(first) - len(info.get("suffix", ""))]
    steps = []
    for action in actions:
        whole, reward, terminated, truncated, info = env.step(action)
        done = terminated or truncated
        assert whole.startswith(history)
        steps.append((None if done else whole[len(history):], float(np.float32(reward)), done))
        if done:
            break
        history = whole[:len(whole) - len(info.get("suffix", ""))]
    return first, steps


def _textarena_direct(env_id, seed, actions):
    """The same of TextArena's game: the reward is close()'s at the end, and each observation is
    the text TextArena's wrapper adds to the history it rewrites every turn."""
    env = textarena_env.library().make(env_id)
    env.reset(num_players=1, seed=seed)
    _, text = env.get_observation()
    first, steps = text.strip(), []
    for action in actions:
        done, _ = env.step(action)
        if done:
            rewards, _ = env.close()
            steps.append((None, float(rewards[0]), True))
            break
        _, whole = env.get_observation()
        assert whole.startswith(text)
        steps.append((whole[len(text):].strip(), 0.0, False))
        text = whole
    return first, steps


def _textarena_secret(seed):
    env = textarena_env.library().make(TEXTARENA_GUESS)
    env.reset(num_players=1, seed=seed)
    return env.game_number


# GEM's Minesweeper places its mines at the first reveal, from Python's global `random`.
GEM_ACTIONS = ["\\boxed{reveal 0 0}", "\\boxed{flag 4 4}", "\\boxed{reveal 2 2}",
               "\\boxed{reveal 9 9}", "\\boxed{reveal 4 0}", "\\boxed{reveal 0 4}",
               "\\boxed{reveal 4 4}", "no move"]


def _textarena_actions(seed):
    """A guess, the same guess again (an invalid move: TextArena lets a player resubmit once), a
    bare number (TextArena's action wrapper brackets it), then the secret inside a sentence."""
    secret = _textarena_secret(seed)
    guess = 1 if secret > 2 else 20
    return ["[%d]" % guess, "[%d]" % guess, "2" if secret != 2 else "3", "I think [%d]" % secret]


CASES = {
    "gem": (f"gem:{GEM_MINESWEEPER}", _gem_direct, GEM_MINESWEEPER, lambda seed: GEM_ACTIONS),
    "textarena": (f"textarena:{TEXTARENA_GUESS}", _textarena_direct, TEXTARENA_GUESS,
                  _textarena_actions),
}


@pytest.mark.parametrize("library", CASES)
def test_a_game_played_from_recorded_actions_gives_the_librarys_own_steps(library):
    spec, direct, env_id, actions_of = CASES[library]
    seeds = (11, 12, 13)
    actions = [actions_of(s) for s in seeds]
    expected = [direct(env_id, s, a) for s, a in zip(seeds, actions)]
    random.seed(5)
    np.random.seed(5)
    before = random.getstate(), np.random.get_state()[1].copy()
    env = envs.environment("game", environment=spec)
    states, prompts = env.reset([{"seed": s} for s in seeds], [0, 1, 2])
    assert prompts == [[{"role": "user", "content": first}] for first, _ in expected]
    got = [[] for _ in seeds]
    live = list(range(len(seeds)))
    for turn in range(max(len(steps) for _, steps in expected)):
        # The rows still playing, stepped in turn (their games draw from one global stream).
        result = env.step([states[i] for i in live], [actions[i][turn] for i in live],
                          [[]] * len(live))
        assert not result.failed.any()
        for j, i in enumerate(live):
            got[i].append((result.observations[j], float(result.rewards[j]),
                           bool(result.done[j])))
        live = [i for j, i in enumerate(live) if not result.done[j]]
    assert got == [steps for _, steps in expected]
    assert random.getstate() == before[0]
    np.testing.assert_array_equal(np.random.get_state()[1], before[1])
    finals = [steps[-1] for _, steps in expected]
    if library == "gem":
        # GEM's board is its info's suffix: every observation shows it (after the first reveal,
        # with the cells that reveal opened).
        assert all("current board" in first for first, _ in expected)
        assert all("current board" in o and "0  0" in o.split("current board")[1]
                   for _, steps in expected for o in [steps[0][0]] if o is not None)
        # The seeds lay different mines: different rewards, two mines hit and a last move
        # that is not one.
        assert len({tuple(r for _, r, _ in steps) for _, steps in expected}) == 3
        assert sorted(r for _, r, _ in finals) == [np.float32(-0.1), 0.0, 0.0]
    else:
        assert finals == [(None, 1.0, True)] * 3  # each won on its last guess
        assert any("invalid move" in (o or "") for _, steps in expected for o, _, _ in steps)


@pytest.fixture(scope="module")
def bpe_chatml():
    return _byte_bpe(SMOLLM2_TEMPLATE)


def _play(spec, tokenizer, rows, seeds, actions, order):
    """Each row's (first prompt ids, [observation span ids or None], [reward]) played through
    the rollout's callback, the rows stepped in `order` (a list of lists of rows, one per
    callback call, until every row is done)."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    env = envs.environment("game", environment=spec)
    prompts, step_turns = envs.turn_callback(env, tokenizer, rows, seeds,
                                             max_observation_tokens=400)
    spans, rewards, turn = [[] for _ in rows], [[] for _ in rows], [0] * len(rows)
    for call in order:
        action_ids = [tokenizer(actions[r][turn[r]], add_special_tokens=False)["input_ids"]
                      + [end] for r in call]
        step = step_turns(call, action_ids)
        assert not step.failed.any()
        for j, r in enumerate(call):
            spans[r].append(step.observation_ids[j])
            rewards[r].append(float(step.rewards[j]))
            turn[r] += 1
    return prompts, spans, rewards


def test_a_replay_from_the_rows_seeds_reproduces_the_trajectories(bpe_chatml):
    """Three Minesweeper games played together, then replayed from fresh episodes of the same
    rows one after another in the reverse order (as the credit probe's continuations replay
    the turns before their state): the same first prompts, observation tokens and rewards. The
    first prompt is the game's first observation through the chat template."""
    rows = [{"seed": s} for s in (11, 12, 13)]
    actions = [GEM_ACTIONS] * 3
    lengths = [len(_gem_direct(GEM_MINESWEEPER, r["seed"], GEM_ACTIONS)[1]) for r in rows]
    together = []
    for turn in range(max(lengths)):
        together.append([r for r in range(3) if turn < lengths[r]])
    alone = [[r] for r in (2, 1, 0) for _ in range(lengths[r])]
    first = _play(f"gem:{GEM_MINESWEEPER}", bpe_chatml, rows, [7, 8, 9], actions, together)
    again = _play(f"gem:{GEM_MINESWEEPER}", bpe_chatml, rows, [0, 0, 0], actions, alone)
    assert first == again
    prompts, spans, _ = first
    for r, row in enumerate(rows):
        text, _ = _gem_direct(GEM_MINESWEEPER, row["seed"], [])
        assert prompts[r] == list(bpe_chatml.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=True, return_dict=False,
            add_generation_prompt=True))
        assert spans[r][-1] is None and all(s for s in spans[r][:-1])


def test_observation_spans_of_a_games_trajectories_take_no_gae_step(bpe_chatml):
    """Trajectories of TextArena's Guess The Number (actions and the game's observation spans,
    as the rollout lays them out): token GAE, and macro GAE under fixed n-grams within turns and
    under turn macros, give every action token what they give the same actions with the
    observations taken out, and the observation tokens 0."""
    seeds = (11, 12, 13)
    actions = [_textarena_actions(s) for s in seeds]
    rows = [{"seed": s} for s in seeds]
    _, spans, _ = _play(f"textarena:{TEXTARENA_GUESS}", bpe_chatml, rows, [0, 1, 2], actions,
                        [[0, 1, 2]] * 4)
    layouts = []
    for r in range(3):
        kinds, turn_ids = [], []
        for turn, (action, span) in enumerate(zip(actions[r], spans[r])):
            n = len(bpe_chatml(action, add_special_tokens=False)["input_ids"]) + 1
            kinds += [ACTION] * n + [OBSERVATION] * len(span or [])
            turn_ids += [turn] * (n + len(span or []))
        layouts.append((kinds, turn_ids))
    width = max(len(k) for k, _ in layouts)
    kinds = np.zeros((3, width), np.int32)
    turn_ids = np.zeros((3, width), np.int32)
    for r, (k, t) in enumerate(layouts):
        kinds[r, :len(k)], turn_ids[r, :len(t)] = k, t
        turn_ids[r, len(t):] = t[-1]
    mask = (kinds == ACTION).astype(np.int32)
    # The same actions left-aligned, the observations taken out.
    lengths = mask.sum(1)
    places = np.argsort(mask == 0, axis=1, kind="stable")
    packed_mask = (np.arange(width)[None] < lengths[:, None]).astype(np.int32)
    packed_turns = np.where(packed_mask == 1, np.take_along_axis(turn_ids, places, 1),
                            turn_ids[:, -1:])
    rng = np.random.default_rng(0)
    values, rewards = (rng.normal(size=(3, width)).astype(np.float32) for _ in range(2))

    def packed(x):
        return np.where(packed_mask == 1, np.take_along_axis(x, places, 1), 0)

    def unpacked(x):
        out = np.zeros_like(np.asarray(x))
        np.put_along_axis(out, places, np.asarray(x), 1)
        return out * mask

    cases = [(advantage.gae(values, rewards, mask, gamma=0.97, lam=0.9),
              advantage.gae(packed(values), packed(rewards), packed_mask, gamma=0.97, lam=0.9))]
    for strategy, kw in (("fixed", dict(n=3)), (termination.TURN, {})):
        cut = termination.segment(strategy, mask, turn_ids=turn_ids, key=jax.random.key(0), **kw)
        cut_packed = termination.segment(strategy, packed_mask, turn_ids=packed_turns,
                                         key=jax.random.key(0), **kw)
        np.testing.assert_array_equal(packed(np.asarray(cut)), np.asarray(cut_packed) * packed_mask)
        cases.append((advantage.macro_gae(values, rewards, mask, cut, gamma=0.97, lam=0.9),
                      advantage.macro_gae(packed(values), packed(rewards), packed_mask,
                                          cut_packed, gamma=0.97, lam=0.9)))
    for with_spans, without in cases:
        for a, b in zip(with_spans, without):
            np.testing.assert_array_equal(np.asarray(a), unpacked(b))


def test_a_library_environment_that_breaks_fails_its_row_only(monkeypatch):
    """GEM's step raising on one row and answering malformed on another, and TextArena's step
    answering a done flag that is not a bool: those rows are flagged failed and done, the
    others step as the library says."""
    env = envs.environment("game", environment=f"gem:{GEM_MINESWEEPER}")
    seeds = (11, 12, 13)
    states, _ = env.reset([{"seed": s} for s in seeds], [0, 1, 2])

    def raises(action):
        raise RuntimeError("the game broke")

    monkeypatch.setattr(states[1].env, "step", raises)
    monkeypatch.setattr(states[2].env, "step", lambda action: ("board", 0.5, False))
    result = env.step(states, [GEM_ACTIONS[0]] * 3, [[]] * 3)
    assert result.failed.tolist() == [False, True, True]
    assert result.done.tolist() == [False, True, True]
    _, alone = _gem_direct(GEM_MINESWEEPER, 11, GEM_ACTIONS[:1])
    assert result.rewards.tolist() == [alone[0][1], 0.0, 0.0]
    assert result.observations == [alone[0][0], None, None]
    arena = envs.environment("game", environment=f"textarena:{TEXTARENA_GUESS}")
    states, _ = arena.reset([{"seed": 11}, {"seed": 12}], [0, 1])
    monkeypatch.setattr(states[0].env, "step", lambda action: ("yes", {}))
    result = arena.step(states, ["[3]", "[3]"], [[], []])
    assert result.failed.tolist() == [True, False] and result.done.tolist() == [True, False]


def _config(environment):
    c = game_smollm2.get_config()
    c.task.environment = environment
    return c


@pytest.mark.parametrize("environment, line", [
    ("gem:game:Minesweeper-v0-eazy",
     "unknown GEM environment 'game:Minesweeper-v0-eazy'; close names: game:Minesweeper-v0-easy, "
     "game:Minesweeper-v0-hard, game:Minesweeper-v0-random, game:Mastermind-v0-easy"),
    ("textarena:GuessTheNumber-v1",
     "unknown TextArena environment 'GuessTheNumber-v1'; close names: GuessTheNumber-v0, "
     "GuessTheNumber-v0-raw, GuessTheNumber-v0-train, GuessTheNumber-v0-hardcore"),
    ("textarena:TicTacToe-v0",
     "TextArena game 'TicTacToe-v0' does not start as a single-player game: "
     "reset(num_players=1) raises AssertionError: The number of players has to be 2, "
     "received 1"),
    ("textarena:QuantumTicTacToe-v0",
     "TextArena game 'QuantumTicTacToe-v0' is a multi-player game (its state is a "
     "TwoPlayerState); only single-player games play here"),
    ("chess:Chess-v0",
     "must be gem:<id> or textarena:<id> (the id of a game the library registers, e.g. "
     "gem:game:Sudoku-v0-easy, textarena:TowerOfHanoi-v0)"),
])
def test_a_spec_that_cannot_play_is_one_line_at_config_time(environment, line):
    with pytest.raises(ValueError) as error:
        validate_config(_config(environment))
    assert str(error.value) == f"config.task.environment={environment!r}: {line}"


def test_a_library_that_is_not_installed_names_the_extra(monkeypatch):
    for module in (gem_env, textarena_env):
        module.library.cache_clear()
    monkeypatch.setitem(sys.modules, "gem", None)
    monkeypatch.setitem(sys.modules, "textarena", None)
    try:
        for environment, name in (("gem:game:Sudoku-v0-easy", "GEM (the gem-llm package)"),
                                  ("textarena:Sudoku-v0", "TextArena (the textarena package)")):
            module = environment.split(":")[0]
            with pytest.raises(ValueError) as error:
                validate_config(_config(environment))
            assert str(error.value) == (
                f"config.task.environment={environment!r}: {name} is not installed (import of "
                f"{module} halted; None in sys.modules): pip install -e \".[envs]\"")
    finally:
        for module in (gem_env, textarena_env):
            module.library.cache_clear()


def test_the_command_line_refuses_an_unknown_game_in_one_line_before_compiling(tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "run.py"), "--config=configs/game_smollm2.py",
         "--config.task.environment=textarena:Wordle-v9", f"--workdir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert lines == ["error: config.task.environment='textarena:Wordle-v9': unknown TextArena "
                     "environment 'Wordle-v9'; close names: Wordle-v0, Wordle-v0-raw, "
                     "Wordle-v0-long, Wordle-v0-train"], run.stderr
    assert not (tmp_path / "run").exists()


# configs/game_smollm2.py on a 2-layer random model in SmolLM2's tokenizer and chat template: its
# game, turn budgets and arms, 8 games a step of turns of at most 8 tokens, 2 held-out games.
TWO_STEPS = """
import sys, ml_collections
sys.path[:0] = [{tests!r}, {root!r}]
from test_multiturn_smollm2 import TINY_MODEL
from configs import game_smollm2
from marl_jax import stages
from marl_jax.config_check import validate_config
c = game_smollm2.get_config()
c.model.path = ""
c.model.config = ml_collections.ConfigDict(dict(TINY_MODEL, max_position_embeddings=512))
c.task.update(dict(tokenizer={tokenizer!r}, num_rl_prompts=8, num_eval_prompts=2,
                   max_turn_tokens=8))
c.ppo.update(dict(steps=2, eval_every=2, batch_size=8, response_length=96,
                  num_layers_unfrozen=1, learning_rate=1e-4))
validate_config(c)
stages.run(c, {workdir!r})
"""


def test_two_steps_of_the_configs_arms_play_the_game_and_are_scored_by_it(smollm2_gguf,
                                                                         tmp_path):
    """Both arms train two steps from the same first games, none failed, and the held-out
    evaluation is the game's own: a random policy writes no bracketed guess, and TextArena ends
    its game with the reward for no guess, 0. One CPU device, in a process of its own: the
    experiment runner's update holds every row on every device of a mesh, which the suite's 8
    fake devices would multiply by 8."""
    workdir = tmp_path / "run"
    script = TWO_STEPS.format(tests=str(ROOT / "tests"), root=str(ROOT),
                              tokenizer=str(smollm2_gguf), workdir=str(workdir))
    run = subprocess.run([sys.executable, "-c", script], env=process_util.cpu_env(1),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    c = game_smollm2.get_config()
    rows = read_metrics(str(workdir))
    first = {r["arm"]: r for r in rows if r["stage"] == "ppo" and r["step"] == 1}
    assert set(first) == set(c.experiment.arms)
    assert len({r["budget/generated_tokens"] for r in first.values()}) == 1
    for r in first.values():
        assert r["multiturn/failed_frac"] == 0.0 and r["multiturn/turns_avg"] >= 1.0, r
    last = [r for r in rows if r["stage"] == "ppo" and r["step"] == 2]
    assert len(last) == 2 and all(np.isfinite(r["loss/policy_avg"]) for r in last)
    evals = [r for r in rows if r["stage"] == "eval"]
    assert {(r["arm"], r["step"]) for r in evals} == {(a, s) for a in c.experiment.arms
                                                       for s in (0, 2)}
    for r in evals:
        assert r["gold"] == r["rm_score"] == 0.0 and r["length"] > 0, r
