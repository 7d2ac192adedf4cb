"""reasoning-gym through its own API (marl_jax/envs/reasoning_gym.py): the reward of a response is
the dataset's own `score_answer` of the answer written in it (right, wrong, partly right, with
extra text; math-verify's LaTeX parsing where the checker reads sympy), a response with no
answer earns 0 and is counted; the SFT, PPO and held-out problems are disjoint (seeds whose
generators never meet, no held-out question in a training part); an episode of the multi-turn
environment replays from its row and seed, its rewards the rises of its best score; and a bad
dataset, bad options or a missing library are one line."""
import dataclasses
import importlib.util

import pytest
import reasoning_gym
import sympy

from marl_jax.config_check import validate_config
from marl_jax.envs import environment
from marl_jax.envs import reasoning_gym as rg

from test_cli import run_cli
from train_util import ROOT  # noqa: F401  (puts the repository root, and `configs`, on sys.path)
from configs import rlvr_smollm2  # noqa: E402

ROW = dict(seed=7, size=8, index=3)


def library_entry(name, options, row=ROW):
    """The library's own dataset and entry of `row`, built here without the adapter."""
    dataset = reasoning_gym.create_dataset(name, seed=row["seed"], size=row["size"], **options)
    return dataset, dataset[row["index"]]


def one_attempt(env, text):
    """(reward, done, unparsed share) of one answer `text` to the episode of `ROW`."""
    states, _ = env.reset([ROW], [0])
    result = env.step(states, [text], [[0]])
    return (float(result.rewards[0]), bool(result.done[0]),
            env.episode_metrics(result.states)["reward/unparsed_frac"])


@pytest.mark.parametrize("name, options", [
    ("chain_sum", dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2)),
    ("gsm_symbolic", {}),
], ids=["chain_sum", "gsm_symbolic"])
def test_the_reward_is_the_datasets_own_score_of_the_answer_in_the_response(name, options):
    dataset, entry = library_entry(name, options)
    gold = entry["answer"]
    wrong = str(int(float(gold)) + 3)
    env = environment("reasoning_gym", dataset=name, options=options)
    # (response, the answer written in it by hand: None where it has none)
    cases = [
        (f"First I add the numbers.\n<answer>{gold}</answer>", gold),
        (f"<answer>{wrong}</answer>", wrong),
        (f"<answer>The total is {gold}.</answer> Thanks!", f"The total is {gold}."),
        (f"<answer>{wrong}</answer> no, wait: <answer> {gold} </answer>", gold),
        (f"The answer is {gold}.", None),
        (f"<answer>{gold}", None),
    ]
    rewards = [one_attempt(env, text) for text, _ in cases]
    for (text, answer), (reward, done, unparsed) in zip(cases, rewards):
        expected = 0.0 if answer is None else dataset.score_answer(answer, entry)
        assert reward == pytest.approx(expected, abs=1e-7), text
        assert done and unparsed == float(answer is None)
    assert rewards[0][0] == 1.0 and rewards[1][0] < 1.0 and rewards[3][0] == 1.0


def test_a_latex_answer_goes_through_math_verify_where_the_checker_reads_sympy():
    options = dict(min_terms=2, max_terms=2)
    dataset, entry = library_entry("polynomial_multiplication", options)
    right = sympy.latex(sympy.parse_expr(entry["answer"]))
    wrong = sympy.latex(sympy.parse_expr(entry["answer"]) + 1)
    assert "^{" in right and dataset.score_answer(right, entry) == 0.0  # the checker alone
    env = environment("reasoning_gym", dataset="polynomial_multiplication", options=options,
                      answer_format="boxed")
    assert one_attempt(env, f"So the product is \\boxed{{{right}}}.")[0] == 1.0
    assert one_attempt(env, f"\\boxed{{{wrong}}}")[0] == 0.0
    # Not LaTeX: the checker reads the answer as written.
    assert one_attempt(env, f"\\boxed{{{entry['answer']}}}")[0] == 1.0
    # A dataset whose checker compares strings gets the answer untouched.
    chain = environment("reasoning_gym", dataset="chain_sum", answer_format="boxed")
    assert chain.problems.answer("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"


def test_extract_answer_takes_the_last_answer_of_the_format():
    assert rg.extract_answer("<answer>1</answer> <answer> 2 </answer>", "tags") == "2"
    assert rg.extract_answer("<answer>1", "tags") is None
    assert rg.extract_answer("\\boxed{1} then \\boxed{\\frac{a}{b}} end", "boxed") == \
        "\\frac{a}{b}"
    assert rg.extract_answer("\\boxed{\\frac{a}{b}", "boxed") is None
    assert rg.extract_answer("<answer>3</answer>", "boxed") is None


def test_sft_ppo_and_held_out_problems_are_disjoint():
    # One-digit sums: few distinct problems, so held-out draws repeat training questions and
    # must be left out.
    options = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+",),
                   allow_parentheses=False, allow_negation=False)
    problems = rg.Problems("basic_arithmetic", options)
    rows = rg.problem_rows(problems, 5, dict(sft=40, rl=60, eval=12))
    assert [len(rows[k]) for k in ("sft", "rl", "eval")] == [40, 60, 12]
    # reasoning-gym draws entry i of seed s from Random(s + i): the parts' ranges never meet.
    ranges = {k: {r["seed"] + r["index"] for r in v} for k, v in rows.items()}
    assert not (ranges["sft"] & ranges["rl"] or ranges["sft"] & ranges["eval"]
                or ranges["rl"] & ranges["eval"])
    questions = {k: [library_entry("basic_arithmetic", options, r)[1]["question"] for r in v]
                 for k, v in rows.items()}
    assert not set(questions["eval"]) & (set(questions["sft"]) | set(questions["rl"]))
    assert len(set(questions["eval"])) == 12
    # The draws that repeated a training question were skipped, not the first 12 taken.
    assert max(r["index"] for r in rows["eval"]) >= 12
    with pytest.raises(ValueError, match="gave 5. held-out problems|held-out problems that no"):
        rg.problem_rows(problems, 5, dict(sft=40, rl=60, eval=90))


def test_the_multi_turn_episode_replays_from_its_row_and_seed():
    options = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2)
    dataset, entry = library_entry("chain_sum", options)
    gold = int(entry["answer"])
    actions = ["I do not know.", f"<answer>{gold + 10}</answer>", f"<answer>{gold}</answer>"]

    def play():
        env = environment("reasoning_gym", dataset="chain_sum", options=options, max_attempts=4)
        states, prompts = env.reset([dict(ROW)], [11])
        steps = []
        for action in actions:
            result = env.step(states, [action], [[0]])
            states = result.states
            steps.append((result.observations[0], float(result.rewards[0]),
                          bool(result.done[0])))
        return prompts, steps, env.episode_metrics(states)

    first, again = play(), play()
    assert first == again
    prompts, steps, metrics = first
    assert prompts == [[{"role": "user", "content": f"{entry['question'].rstrip()}\n\n"
                                                    f"{rg.ANSWER_FORMATS['tags']}"}]]
    partial = dataset.score_answer(str(gold + 10), entry)
    assert steps[0] == (f"No final answer found. {rg.ANSWER_FORMATS['tags']} Try again.", 0.0,
                        False)
    assert steps[1][1:] == (pytest.approx(partial), False) and "not right" in steps[1][0]
    # The right answer ends the episode; the rewards sum to the best score.
    assert steps[2][1:] == (pytest.approx(1.0 - partial), True) and steps[2][0] is None
    assert metrics == {"reward/unparsed_frac": pytest.approx(1 / 3)}


def test_an_episode_ends_after_its_attempts_and_keeps_its_best_score():
    options = dict(min_terms=2, max_terms=2, min_digits=2, max_digits=2)
    dataset, entry = library_entry("chain_sum", options)
    gold = entry["answer"]
    env = environment("reasoning_gym", dataset="chain_sum", options=options, max_attempts=2)
    states, _ = env.reset([ROW], [0])
    texts = [f"<answer>{gold}0</answer>", "<answer>0.5</answer>"]
    scores = [dataset.score_answer(f"{gold}0", entry), dataset.score_answer("0.5", entry)]
    assert 0 < scores[0] < 1  # partial credit for holding the answer
    rewards = []
    for text in texts:
        result = env.step(states, [text], [[0]])
        states = result.states
        rewards.append(float(result.rewards[0]))
    assert result.done[0] and rewards == pytest.approx([scores[0], max(0.0, scores[1] - scores[0])])
    assert dataclasses.asdict(states[0])["best"] == pytest.approx(max(scores))


def test_bad_datasets_and_options_are_one_line_at_config_time():
    c = rlvr_smollm2.get_config()
    c.task.dataset = "basic_arithmatic"
    with pytest.raises(ValueError) as error:
        validate_config(c)
    assert str(error.value) == (
        "config.task.dataset='basic_arithmatic': not a reasoning-gym dataset (104 registered; "
        "closest: basic_arithmetic, bitwise_arithmetic, decimal_arithmetic, complex_arithmetic)")
    c = rlvr_smollm2.get_config()
    c.task.dataset = "basic_arithmetic"
    c.task.options = dict(max_term=3)
    with pytest.raises(ValueError) as error:
        validate_config(c)
    assert str(error.value) == (
        "config.task.options={'max_term': 3}: basic_arithmetic has no option 'max_term' "
        "(closest: max_terms, min_terms, max_digits); its options: allow_negation, "
        "allow_parentheses, format_style, max_digits, max_terms, min_digits, min_terms, "
        "operators, whitespace (seed and size are the task's)")
    # A dataset whose problems carry no reference answer (its checker scores any solution)
    # has nothing to fine-tune on: refused with an SFT stage, accepted without one.
    c = rlvr_smollm2.get_config()
    c.task.dataset, c.task.options = "graph_color", {}
    assert c.sft.steps > 0
    with pytest.raises(ValueError) as error:
        validate_config(c)
    assert str(error.value) == (
        "config.sft.steps=48: graph_color's problems carry no reference answer (its checker "
        "scores any valid solution), so it has no demonstrations to fine-tune on: use "
        "--config.sft.steps=0")
    c.sft.steps = 0
    validate_config(c)


def test_a_missing_library_is_one_line_naming_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "reasoning_gym" else real(name, *a))
    with pytest.raises(ValueError) as error:
        validate_config(rlvr_smollm2.get_config())
    assert str(error.value) == ("config.task.name='reasoning_gym': the reasoning-gym library is "
                                'not installed: pip install -e ".[envs]"')


def test_an_unknown_dataset_stops_the_run_in_one_line_with_status_2(tmp_path):
    workdir = tmp_path / "run"
    result = run_cli("--config", str(ROOT / "configs" / "rlvr_smollm2.py"),
                     "--config.task.dataset=chain_summ", f"--workdir={workdir}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == (
        "error: config.task.dataset='chain_summ': not a reasoning-gym dataset (104 registered; "
        "closest: chain_sum, decimal_chain_sum)")
    assert not workdir.exists()
