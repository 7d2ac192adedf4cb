"""Multi-turn rollout over one KV cache (`rollout.turns.run_turns`): the tokens of a reference that
prefills the whole history again at every turn (`reprefill_turns`, i.e. `continue_responses` per
turn), greedy and sampled, on random checkpoints (a Llama; a sliding-window Mistral with scanned
layers and observations split over several prefill chunks); the trajectory's layout rebuilt from
what the callback saw (kinds, turn ids, rewards on each turn's last action); the prefill tokens
counted by hand; truncation by max_turns and by the token budget; one turn is `generate` to the
bit; decode slots (rows waiting for a slot play as in one batch); the bench's comparison; bad
input."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import marl_jax.models as M
from marl_jax import rollout
from marl_jax.rollout import turns
from models_util import padded_batch, random_hf_model, write_checkpoint

# End-of-turn ids: 6 of the 96 ids, so a random model ends its turns after a few tokens, at
# different lengths per row and turn.
END_OF_TURN = (1, 2, 3, 4, 5, 6)
OBS_MARKERS = (7, 8)
TURN_TOKENS = 10


@functools.lru_cache(maxsize=None)
def _checkpoint(case: str, scan_layers: bool, directory: str):
    return M.load_pretrained(write_checkpoint(random_hf_model(case, seed=2), directory), scan_layers=scan_layers)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _checkpoint("llama_gqa_llama3_untied", False, str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def mistral_scanned(tmp_path_factory):
    return _checkpoint("mistral_window_mqa", True, str(tmp_path_factory.mktemp("mistral")))


def _prompts():
    ids, mask = padded_batch([3, 7, 5, 1], 7, seed=3)
    return jnp.asarray(ids), jnp.asarray(mask)


class ScriptedEnv:
    """A deterministic environment: row 0 is done after its third turn, row 1 goes on until the
    rollout stops it, row 2 fails at its second turn, row 3 is done after its first; the
    observation after turn t of row r is `[7, 10 + (first action token) % 50, 8]` cut to 1 + (r + t) % 3
    tokens; the reward of turn t of row r is 10 r + t. Records every call."""

    def __init__(self, done_after=(2, 99, 99, 0), fail_at=(99, 99, 1, 99)):
        self.done_after, self.fail_at = done_after, fail_at
        self.calls = []  # (row, turn, action, observation or None)
        self.steps = []  # the rows of each call of the callback

    def turn_of(self, row) -> int:
        return sum(1 for call in self.calls if call[0] == row)

    def __call__(self, rows, actions):
        observations, rewards, done, failed = [], [], [], []
        self.steps.append(rows.tolist())
        for row, action in zip(rows.tolist(), actions):
            turn = self.turn_of(row)
            is_done, is_failed = turn >= self.done_after[row], turn >= self.fail_at[row]
            obs = None if is_done or is_failed else np.array(
                [OBS_MARKERS[0], 10 + int(action[0]) % 50, OBS_MARKERS[1]], np.int32)[:1 + (row + turn) % 3]
            self.calls.append((row, turn, np.asarray(action).tolist(), obs))
            observations.append(obs)
            rewards.append(10.0 * row + turn)
            done.append(is_done)
            failed.append(is_failed)
        return observations, np.asarray(rewards, np.float32), np.asarray(done), np.asarray(failed)


def _run(driver, model, params, env, **settings):
    ids, mask = _prompts()
    settings = dict(dict(row_keys=jax.random.split(jax.random.key(5), 4), max_turns=4, max_total_tokens=40,
                         max_turn_tokens=TURN_TOKENS, end_of_turn=END_OF_TURN, temperature=0.0, pad_id=0),
                    **settings)
    return driver(model, params, ids, mask, step_turns=env, **settings)


@pytest.fixture(scope="module")
def greedy_run(llama):
    env = ScriptedEnv()
    return _run(turns.run_turns, *llama, env), env


# The logprobs and entropies: float32 sums of the same terms in another order (a one-token decode
# step and a multi-token prefill over the same cache contents, against a prefill of the whole
# history), measured within 2e-6 on these models; 1e-5 is well below any gap that could change
# a token.
ATOL = 1e-5


@pytest.mark.parametrize("case", ["greedy_llama", "sampled_window_scanned_chunked"])
def test_cache_reuse_gives_the_tokens_of_reprefilling_every_turn(case, llama, mistral_scanned):
    if case == "greedy_llama":
        model, params = llama
        settings = dict(temperature=0.0)
        chunk = turns.OBSERVATION_CHUNK
    else:
        # Observations of up to 3 tokens in chunks of 2; positions beyond the window of 4.
        model, params = mistral_scanned
        settings = dict(temperature=1.0, top_p=0.9)
        chunk = 2
    ours_env, reference_env = ScriptedEnv(), ScriptedEnv()
    ours = _run(turns.run_turns, model, params, ours_env, chunk=chunk, **settings)
    reference = _run(turns.reprefill_turns, model, params, reference_env, **settings)
    np.testing.assert_array_equal(ours.tokens, reference.tokens)
    np.testing.assert_array_equal(ours.kinds, reference.kinds)
    np.testing.assert_array_equal(ours.turn_ids, reference.turn_ids)
    np.testing.assert_array_equal(ours.turn_rewards, reference.turn_rewards)
    np.testing.assert_allclose(ours.logprobs, reference.logprobs, atol=ATOL, rtol=0)
    np.testing.assert_allclose(ours.entropy, reference.entropy, atol=ATOL, rtol=0)
    assert ours_env.calls and [c[:3] for c in ours_env.calls] == [c[:3] for c in reference_env.calls]
    # Rows end at different turns, and an action is sampled wherever a logprob is recorded.
    assert len(set(ours.num_turns.tolist())) >= 3
    assert (ours.logprobs[ours.kinds != turns.ACTION] == 0).all()
    assert (ours.logprobs[ours.kinds == turns.ACTION] < 0).all()


@pytest.mark.parametrize("case", ["greedy_llama", "sampled_window_scanned"])
def test_one_turn_is_generate_bit_for_bit(case, llama, mistral_scanned):
    """max_turns=1 over a budget of one turn: generate's tokens, logprobs and entropies to the
    bit (the same prefill, decode steps and cache reads), the mask as the ACTION columns."""
    model, params = llama if case == "greedy_llama" else mistral_scanned
    temperature = 0.0 if case == "greedy_llama" else 1.0
    ids, mask = _prompts()
    keys = jax.random.split(jax.random.key(5), 4)
    env = ScriptedEnv()
    one = turns.run_turns(model, params, ids, mask, step_turns=env, row_keys=keys, max_turns=1,
                          max_total_tokens=TURN_TOKENS, max_turn_tokens=TURN_TOKENS, end_of_turn=END_OF_TURN,
                          temperature=temperature, pad_id=0)
    single = rollout.generate(model, params, ids, mask, row_keys=keys, max_new_tokens=TURN_TOKENS,
                              temperature=temperature, eos_id=END_OF_TURN, pad_id=0)
    np.testing.assert_array_equal(one.tokens, single.tokens)
    np.testing.assert_array_equal(one.logprobs, single.logprobs)
    np.testing.assert_array_equal(one.entropy, single.entropy)
    np.testing.assert_array_equal(one.kinds == turns.ACTION, np.asarray(single.mask, bool))
    assert (one.turn_ids == 0).all() and (one.num_turns == 1).all()


def test_decode_slots_give_the_trajectories_of_one_batch(mistral_scanned):
    """Two slots for four rows (scanned layers: the seated prompts' cache rows go in along axis
    1): rows 2 and 3 wait for rows 0 and 1 to end, and every row plays as in one batch."""
    settings = dict(temperature=1.0, top_p=0.9, chunk=2)
    batch_env, slots_env = ScriptedEnv(), ScriptedEnv()
    one_batch = _run(turns.run_turns, *mistral_scanned, batch_env, **settings)
    slotted = _run(turns.run_turns, *mistral_scanned, slots_env, decode_slots=2, **settings)
    for name in ("tokens", "kinds", "turn_ids", "turn_rewards", "num_turns", "truncated", "failed"):
        np.testing.assert_array_equal(getattr(slotted, name), getattr(one_batch, name), err_msg=name)
    # Two-row and four-row programs round their matmuls differently (measured: 1e-6).
    np.testing.assert_allclose(slotted.logprobs, one_batch.logprobs, atol=ATOL, rtol=0)
    assert slotted.prefill_tokens == one_batch.prefill_tokens
    assert sorted(c[:3] for c in slots_env.calls) == sorted(c[:3] for c in batch_env.calls)
    assert all(len(rows) <= 2 for rows in slots_env.steps)
    # A row plays one turn per round from the round it is seated in (its first step) and ends
    # after num_turns rounds (row 0 done after 3, row 1 after 4, the last maybe cut by the
    # budget and not stepped): row 2 takes row 0's slot the round after, row 3 row 1's.
    first = lambda row: next(i for i, rows in enumerate(slots_env.steps) if row in rows)
    end = lambda row: first(row) + slotted.num_turns[row] - 1
    assert slotted.num_turns[0] < slotted.num_turns[1]
    assert slots_env.steps[:3] == [[0, 1]] * 3
    assert first(2) == end(0) + 1 and first(3) == end(1) + 1


def test_the_trajectory_is_what_the_callback_saw(greedy_run):
    """Actions, observations, turn ids, rewards and flags rebuilt from the callback's calls."""
    trajectory, env = greedy_run
    batch, total = trajectory.tokens.shape
    for row in range(batch):
        calls = [call for call in env.calls if call[0] == row]
        tokens, kinds, turn_ids, rewards = [], [], [], []
        for _, turn, action, obs in calls:
            assert action[-1] in END_OF_TURN or len(action) == TURN_TOKENS
            tokens += action
            kinds += [turns.ACTION] * len(action)
            turn_ids += [turn] * len(action)
            rewards += [0.0] * (len(action) - 1) + [10.0 * row + turn]
            if obs is not None and turn + 1 < 4:
                tokens += obs.tolist()
                kinds += [turns.OBSERVATION] * len(obs)
                turn_ids += [turn] * len(obs)
                rewards += [0.0] * len(obs)
        pad = total - len(tokens)
        np.testing.assert_array_equal(trajectory.tokens[row], tokens + [0] * pad)
        np.testing.assert_array_equal(trajectory.kinds[row], kinds + [turns.PAD] * pad)
        np.testing.assert_array_equal(trajectory.turn_ids[row], turn_ids + [calls[-1][1]] * pad)
        np.testing.assert_array_equal(trajectory.turn_rewards[row], rewards + [0.0] * pad)
    assert trajectory.turn_ids.dtype == np.int32 and trajectory.kinds.dtype == np.int8
    np.testing.assert_array_equal(trajectory.num_turns, [3, 4, 2, 1])
    np.testing.assert_array_equal(trajectory.failed, [False, False, True, False])
    # Row 1 is never done: the fourth turn (max_turns) truncates it.
    np.testing.assert_array_equal(trajectory.truncated, [False, True, False, False])


def test_prefill_and_generated_tokens_by_hand(greedy_run, llama):
    """Cache reuse prefills the prompts once and each observation once; re-prefilling runs the
    prompt and the whole history of every row at every turn it plays."""
    trajectory, env = greedy_run
    prompt_lengths = [3, 7, 5, 1]
    observations = [len(obs) for row, turn, _, obs in env.calls if obs is not None and turn + 1 < 4]
    assert trajectory.prefill_tokens == sum(prompt_lengths) + sum(observations)
    assert trajectory.generated_tokens == sum(len(action) for _, _, action, _ in env.calls)
    history = 0
    for row in range(4):
        before = 0  # trajectory columns before the turn
        for _, turn, action, obs in (call for call in env.calls if call[0] == row):
            history += prompt_lengths[row] + before
            before += len(action) + (0 if obs is None else len(obs))
    reference = _run(turns.reprefill_turns, *llama, ScriptedEnv())
    assert reference.prefill_tokens == history
    assert reference.generated_tokens == trajectory.generated_tokens


def test_the_budget_truncates_a_row_and_a_cut_turn_is_not_stepped(llama):
    """A budget of 14 columns, turns of at most 5 tokens, 3-token observations, never done:
    every row ends truncated at the budget, either inside a turn (not stepped) or when an
    observation and one more action would not fit."""
    env = ScriptedEnv(done_after=(99,) * 4, fail_at=(99,) * 4)
    env_obs = lambda rows, actions: (
        [np.array([7, 11, 8], np.int32)] * len(rows), *env(rows, actions)[1:])
    budget = 14
    trajectory = _run(turns.run_turns, *llama, env_obs, max_turns=9, max_total_tokens=budget, max_turn_tokens=5)
    assert trajectory.truncated.all() and not trajectory.failed.any()
    for row in range(4):
        kinds = trajectory.kinds[row]
        used = int((kinds != turns.PAD).sum())
        stepped = [call for call in env.calls if call[0] == row]
        columns = sum(len(action) + 3 for _, _, action, _ in stepped)
        if used == columns - 3:
            # Its last turn was stepped, and the observation plus one action did not fit.
            assert used + 3 + 1 > budget
            assert trajectory.num_turns[row] == len(stepped)
        else:
            # Cut inside its last turn at the budget: the actions after the last observation,
            # fewer than a whole turn and without an end of turn, were not stepped.
            assert used == budget and 0 < budget - columns < 5
            assert trajectory.tokens[row, -1] not in END_OF_TURN
            assert trajectory.num_turns[row] == len(stepped) + 1
        assert (kinds[:used] != turns.PAD).all() and kinds[used - 1] == turns.ACTION


def _bad_env(result):
    return lambda rows, actions: result(len(rows))


@pytest.mark.parametrize("change, message", [
    (dict(max_turns=0), "max_turns must be an int >= 1"),
    (dict(max_total_tokens=9), "max_total_tokens .* >= max_turn_tokens=10"),
    (dict(decode_slots=-1), "decode_slots must be None or a non-negative int"),
    (dict(step_turns=_bad_env(lambda n: ([None] * n, np.zeros(n), np.ones(n, bool)))),
     r"must return \(observations, rewards, done, failed\), got tuple of 3 items"),
    (dict(step_turns=_bad_env(lambda n: ([np.array([7])] * (n + 1), np.zeros(n), np.zeros(n, bool),
                                         np.zeros(n, bool)))), "returned 5 observations for 4 rows"),
    (dict(step_turns=_bad_env(lambda n: ([np.array([7.0, 8.0])] * n, np.zeros(n), np.zeros(n, bool),
                                         np.zeros(n, bool)))), "non-empty 1-D array of int ids as the observation of row 0"),
    (dict(step_turns=_bad_env(lambda n: ([np.array([7])] * n, np.zeros(n), np.zeros(n), np.zeros(n, bool)))),
     "done of dtype float64, expected bool"),
])
def test_bad_input_is_one_clear_error(change, message, llama):
    with pytest.raises(ValueError, match=message):
        _run(turns.run_turns, *llama, change.pop("step_turns", ScriptedEnv()), **change)


def test_the_turns_bench_compares_both_drivers_on_one_batch(llama):
    """bench.py rollout --turns: the same tokens from both drivers; the cache driver's prefill
    tokens are the prompts plus one observation after every turn but each row's last."""
    import sys
    from train_util import ROOT
    sys.path.insert(0, str(ROOT / "experiments"))
    from bench_turns import compare_turns

    ids, mask = _prompts()
    out = compare_turns(*llama, ids, mask, turns=3, turn_tokens=6, observation=4, temperature=0.8, seed=1,
                        repeats=0)
    assert out["same_tokens"]
    assert out["num_turns"] == [3, 2, 3, 2]  # row b is done after turn 2 - b % 2
    assert out["cache_prefill"] == (3 + 7 + 5 + 1) + 4 * (2 + 1 + 2 + 1)
    assert out["reprefill_prefill"] > out["cache_prefill"]
