"""The advantage-quality probe on multi-turn trajectories (`credit/turn_truth.py`,
`credit/turn_probe.py`) on the calculator task's word tokenizer with a tiny random policy:
continuations from states inside trajectories play the environment on as an independent
reference does (a fresh episode replayed through the completed turns by hand, then full forward
passes token by token with the same keys, the environment stepped at each turn's end); with a
trajectory's own key they give the trajectory back from any state; the values are the mean
discounted returns over action tokens (0 at terminal states); a short multi-turn run with the
probe writes its npz, whose token GAE is a textbook loop over the action tokens and whose turn
macros are the turns."""
import functools

import jax
import jax.numpy as jnp
import macro_oracle
import numpy as np
import pytest
from test_multiturn_task import tiny_calculator_config

import marl_jax.models as M
from marl_jax import stages
from marl_jax.config_check import validate_config
from marl_jax.data.tasks import build_task
from marl_jax.envs.transcripts import pad_id
from marl_jax.credit import turn_truth as ct
from marl_jax.rollout import turns
from marl_jax.train.metrics import read_metrics
from marl_jax.train.turn_step import episode_seeds

GAMMA = 0.9
MAX_TURNS, TURN_TOKENS, TOTAL = 3, 6, 32
EOT_SCALE = 12.0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    config = tiny_calculator_config(max_turns=MAX_TURNS, max_turn_tokens=TURN_TOKENS,
                                   max_observation_tokens=14)
    config.ppo.response_length = TOTAL
    task = build_task(config, str(tmp_path_factory.mktemp("calculator")))
    vocab = len(task.tokenizer)
    model = M.CausalLM(M.ModelConfig.for_family(
        "llama", vocab_size=vocab, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=8, max_position_embeddings=80, initializer_range=0.1))
    params = M.init_params(model, jax.random.key(0))
    # A large end-of-turn column: the random policy ends its turns after a varying number of
    # tokens (the sign of one projection of the context) instead of always at the turn budget.
    end = list(task.end_of_turn)
    params["lm_head"] = params["lm_head"].at[:, end].multiply(EOT_SCALE)
    rows = task.info["eval_rows"][:3]
    seeds = episode_seeds(0, 0, range(3), held_out=True)
    settings = {"max_turns": MAX_TURNS, "max_turn_tokens": TURN_TOKENS, "end_of_turn": tuple(task.end_of_turn),
                    "temperature": 1.0, "top_k": 0, "top_p": 1.0, "pad_id": pad_id(task.tokenizer)}
    return task, model, params, rows, seeds, settings


@pytest.fixture(scope="module")
def played(setup):
    """Three trajectories of the random policy (`run_turns`, the cache-based driver), one of
    them cut by the trajectory budget."""
    task, model, params, rows, seeds, settings = setup
    ids, mask = np.asarray(task.eval["ids"][:3]), np.asarray(task.eval["mask"][:3])
    row_keys = jax.random.split(jax.random.key(2), 3)
    traj = turns.run_turns(model, params, ids, mask, step_turns=task.turn_callback(rows, seeds),
                           row_keys=row_keys, max_total_tokens=TOTAL, **settings)
    return ids, mask, row_keys, traj


def reward_fn(prompt_ids, prompt_mask, trajectory):
    """The environment's turn rewards plus a reward of each action token's id and of the
    prompt's last token (a stand-in for KL terms): depends on columns 0..u only."""
    actions = np.asarray(trajectory["kinds"]) == turns.ACTION
    tokens = np.asarray(trajectory["tokens"])
    per_token = 0.01 * (tokens % 7) - 0.02 + 0.001 * np.asarray(prompt_ids)[:, -1:]
    return np.where(actions, per_token + np.asarray(trajectory["turn_rewards"]), 0.0)


@functools.lru_cache(maxsize=1)
def _forward(model):
    return jax.jit(lambda params, ids, mask: M.forward_logits(model, params, ids, mask))


def reference_continuation(setup, ids, mask, traj, b, start, key):
    """Trajectory row b continued from column `start` with `key`, one token at a time: a fresh
    episode stepped by hand through the turns before `start`, then full forward passes over
    prompt + history, the token at column u drawn as categorical(fold_in(key, u), logits), a
    turn ending at an end-of-turn id or its token budget, the environment stepped on the whole
    turn. Returns (tokens, kinds, turn_rewards) `[T]`."""
    task, model, params, rows, seeds, settings = setup
    eos = set(task.end_of_turn)
    step = task.turn_callback([rows[b]], [seeds[b]])
    tokens = [int(x) for x in traj.tokens[b, :start]]
    kinds = [int(x) for x in traj.kinds[b, :start]]
    rewards = [float(x) for x in traj.turn_rewards[b, :start]]
    turn_ids = traj.turn_ids[b, :start]
    turn = int(traj.turn_ids[b, start])
    for t in range(turn):
        action = traj.tokens[b, :start][(traj.kinds[b, :start] == turns.ACTION) & (turn_ids == t)]
        step(np.array([0]), [action])
    current = [tok for tok, k, t in zip(tokens, kinds, turn_ids) if k == turns.ACTION and t == turn]
    forward = _forward(model)
    width = ids.shape[1]
    while True:
        u = len(tokens)
        if u == TOTAL:
            break
        # Right-padded to one width (one program); the padding is masked and causally after.
        seq = np.concatenate([ids[b], tokens, np.zeros(TOTAL - u, int)])[None].astype(np.int32)
        full_mask = np.concatenate([mask[b], np.ones(u, np.int32), np.zeros(TOTAL - u, np.int32)])[None]
        logits = forward(params, jnp.asarray(seq), jnp.asarray(full_mask))[0, width + u - 1]
        token = int(jax.random.categorical(jax.random.fold_in(key, u), logits))
        tokens.append(token), kinds.append(turns.ACTION), rewards.append(0.0)
        current.append(token)
        if token not in eos and len(current) < TURN_TOKENS:
            continue
        observations, reward, done, failed = step(np.array([0]), [np.array(current, np.int32)])
        rewards[-1] = float(reward[0])
        turn += 1
        if done[0] or failed[0] or turn == MAX_TURNS:
            break
        obs = list(observations[0])
        if len(tokens) + len(obs) + 1 > TOTAL:
            break
        tokens += obs
        kinds += [turns.OBSERVATION] * len(obs)
        rewards += [0.0] * len(obs)
        current = []
    fill = TOTAL - len(tokens)
    return (np.array(tokens + [settings["pad_id"]] * fill), np.array(kinds + [turns.PAD] * fill),
            np.array(rewards + [0.0] * fill, np.float32))


def _states(traj):
    """A few states of every kind: the first action, inside a turn, right after an
    observation, the last action token."""
    columns, lengths = ct.action_columns(traj.kinds)
    chosen = []
    for b in range(len(lengths)):
        after_obs = [a for a in range(1, lengths[b])
                     if traj.kinds[b, columns[b, a] - 1] == turns.OBSERVATION]
        chosen += [(b, 0), (b, 1), (b, int(lengths[b]) - 1)] + [(b, a) for a in after_obs[:1]]
    rows, positions = (np.array(x) for x in zip(*chosen))
    return rows, positions, columns


def test_continuations_play_the_environment_on_as_a_reference_does(setup, played):
    task, model, params, rows, seeds, settings = setup
    ids, mask, _, traj = played
    assert (traj.kinds == turns.OBSERVATION).any() and traj.num_turns.max() >= 2
    state_rows, positions, columns = _states(traj)
    keys = jax.random.split(jax.random.key(9), (len(state_rows), 2))
    out = ct.continue_trajectories(model, params, ids, mask, traj, state_rows, positions, keys,
                                   make_step_turns=task.turn_callback, task_rows=rows, seeds=seeds,
                                   **settings)
    # The continuations cover turns ended by the end-of-turn id and by the turn's budget, and
    # episodes cut by the trajectory's budget.
    turn_lengths = [np.sum((out.kinds[n] == turns.ACTION) & (out.turn_ids[n] == t))
                    for n in range(len(out.kinds)) for t in range(out.num_turns[n])]
    assert {1, 2, TURN_TOKENS} <= set(turn_lengths) and 0 < out.truncated.sum() < len(out.kinds)
    for i, (b, a) in enumerate(zip(state_rows, positions)):
        for j in range(2):
            want = reference_continuation(setup, ids, mask, traj, b, columns[b, a], keys[i, j])
            got = (out.tokens[2 * i + j], out.kinds[2 * i + j], out.turn_rewards[2 * i + j])
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w, err_msg=f"state ({b}, {a}), continuation {j}")


def test_a_trajectorys_own_key_continues_it_into_itself(setup, played):
    """The truth's continuations play the engine's turn rules (`turns.end_turns`): from each
    row's first state with the row's own key they give `run_turns`' trajectory back, here one
    with a turn ended by its token budget, one ended by the end-of-turn id and an episode cut
    by the trajectory budget."""
    task, model, params, rows, seeds, settings = setup
    ids, mask, row_keys, traj = played
    endings = set()
    for b in range(len(traj.kinds)):
        for t in range(traj.num_turns[b]):
            actions = traj.tokens[b][(traj.kinds[b] == turns.ACTION) & (traj.turn_ids[b] == t)]
            endings.add("end of turn" if actions[-1] in task.end_of_turn else
                        "turn budget" if len(actions) == TURN_TOKENS else "trajectory budget")
    assert endings == {"end of turn", "turn budget", "trajectory budget"}
    state_rows, positions, _ = _states(traj)
    assert {(b, 0) for b in range(len(traj.kinds))} <= set(zip(state_rows, positions))
    out = ct.continue_trajectories(model, params, ids, mask, traj, state_rows, positions,
                                   row_keys[state_rows][:, None],
                                   make_step_turns=task.turn_callback, task_rows=rows, seeds=seeds,
                                   **settings)
    for name in ("tokens", "kinds", "turn_ids", "turn_rewards", "num_turns", "truncated", "failed"):
        np.testing.assert_array_equal(getattr(out, name), getattr(traj, name)[state_rows], err_msg=name)
    np.testing.assert_allclose(out.logprobs, traj.logprobs[state_rows], atol=1e-5)


def test_values_are_mean_discounted_returns_over_action_tokens(setup, played):
    task, model, params, rows, seeds, settings = setup
    ids, mask, _, traj = played
    _, lengths = ct.action_columns(traj.kinds)
    state_rows = np.array([0, 0, 1, 2, 1, 2])
    positions = np.array([lengths[0], 3, lengths[1] - 1, 0, lengths[1], 5])
    k = 3
    values = ct.state_values(model, params, ids, mask, traj, state_rows, positions,
                             reward_fn=reward_fn, key=jax.random.key(4), num_continuations=k,
                             gamma=GAMMA, chunk_states=3, make_step_turns=task.turn_callback,
                             task_rows=rows, seeds=seeds, **settings)
    terminal = positions == lengths[state_rows]
    assert terminal.sum() == 2
    np.testing.assert_array_equal(values.mean[terminal], 0.0)
    np.testing.assert_array_equal(values.se[terminal], 0.0)
    keys = jax.random.split(jax.random.key(4), (len(state_rows), k))
    live = np.flatnonzero(~terminal)
    out = ct.continue_trajectories(model, params, ids, mask, traj, state_rows[live], positions[live],
                                   keys[live], make_step_turns=task.turn_callback, task_rows=rows,
                                   seeds=seeds, **settings)
    for i, s in enumerate(live):
        for j in range(k):
            n = i * k + j
            r = reward_fn(ids[state_rows[s]][None], mask[state_rows[s]][None],
                          {key: getattr(out, key)[n][None] for key in ("tokens", "kinds", "turn_rewards")})[0]
            action_cols = np.flatnonzero(out.kinds[n] == turns.ACTION)
            # The a-th action token onward, one discount step per action token.
            ret = sum(GAMMA ** m * r[c] for m, c in enumerate(action_cols[positions[s]:]))
            np.testing.assert_allclose(values.returns[s, j], ret, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(values.mean, values.returns.mean(axis=1))


def _run_config():
    config = tiny_calculator_config(max_turns=MAX_TURNS, max_turn_tokens=TURN_TOKENS,
                                    max_observation_tokens=14)
    config.stage = "all"
    config.sft.steps = 1
    config.ppo.update({"steps": 1, "eval_every": 0, "batch_size": 8, "num_minibatches": 1,
                           "response_length": TOTAL, "gamma": GAMMA, "lam": 0.8})
    config.credit.update({"every": 1, "prompts": 2, "group_size": 2, "continuations": 2, "chunk_states": 2,
                              "rules": ("fixed", "turn"), "weightings": ("equal",)})
    return config


def test_a_multi_turn_run_probes_its_trajectories(tmp_path):
    config = _run_config()
    validate_config(config)
    stages.run(config, str(tmp_path))
    row = next(r for r in read_metrics(str(tmp_path)) if r["stage"] == "credit" and r["step"] == 0)
    assert {"credit/token/token_gae/pearson", "credit/macro/turn/macro_gae/turn/equal/pearson",
            "credit/token/turn_rloo/pearson", "credit/token/grpo/pearson"} <= set(row)
    d = np.load(tmp_path / "credit" / "step_0.npz")
    kinds, tokens = d["trajectory/kinds"], d["trajectory/tokens"]
    columns, lengths = ct.action_columns(kinds)
    np.testing.assert_array_equal(d["action_columns"], columns)
    for b, n in enumerate(lengths):
        cols = np.flatnonzero(kinds[b] == turns.ACTION)
        np.testing.assert_array_equal(d["response_ids"][b, :n], tokens[b, cols])
        assert d["response_mask"][b, :n].all() and not d["response_mask"][b, n:].any()
        # A turn macro is a turn: its ids change exactly where the turn does.
        seg, turn = d["segments/turn"][b, :n], d["trajectory/turn_ids"][b, cols]
        np.testing.assert_array_equal(np.diff(seg) != 0, np.diff(turn) != 0)
        want = macro_oracle.gae_row(d["values"][b], d["rewards"][b], n, GAMMA, 0.8)
        np.testing.assert_allclose(d["advantages/token_gae"][b, :n], want, rtol=1e-4, atol=1e-5)
    assert (kinds == turns.OBSERVATION).any()
    # Every action state and each row's terminal state, the terminal ones worth 0.
    assert d["state_rows"].size == (lengths + 1).sum()
    terminal = d["state_positions"] == lengths[d["state_rows"]]
    np.testing.assert_array_equal(d["state_mean"][terminal], 0.0)
    assert np.any(d["state_mean"][~terminal] != 0)


@pytest.mark.parametrize("rules, message", [
    (("parsing",), "config.credit.rules=('parsing',): "),
])
def test_bad_multi_turn_probe_settings_are_one_line(rules, message):
    config = _run_config()
    config.credit.rules = rules
    with pytest.raises(ValueError) as error:
        validate_config(config)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), error.value
