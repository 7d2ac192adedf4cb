"""Real-dataset loaders on fixture files in each public schema (jsonl and parquet), the paper's
split, chat templates and length filtering."""
import gzip
import json
import logging

import datasets
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from marl_jax import data
from marl_jax.data import splits
import data_util

P_CAT = ("SUBREDDIT: r/pets\n\nTITLE: Cat trouble\n\nPOST: My cat ignores me.\nWhat do I do?"
         "\n\nTL;DR:")
P_KEYS = "SUBREDDIT: r/self\n\nTITLE: Keys\n\nPOST: I lost my keys twice.\n\nTL;DR:"
P_BODY = "SUBREDDIT: r/self\n\nTITLE: Empty summary\n\nPOST: Body\n\nTL;DR:"
HH_TWO_TURNS = "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Name a fruit.\n\nAssistant:"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every fixture dataset written once as jsonl and once as parquet (hub-like layouts)."""
    root = tmp_path_factory.mktemp("data")
    layout = {
        "tldr": ("comparisons/train", data_util.tldr_rows()),
        "tldr_sft": ("valid", data_util.tldr_sft_rows()),
        "hh_rlhf": ("test", data_util.hh_rows()),
        "webgpt": ("train", data_util.webgpt_rows()),
        "apps": ("train", data_util.apps_rows()),
    }
    paths = {}
    for fmt, writer in data_util.WRITERS.items():
        for name, (stem, rows) in layout.items():
            writer(rows, root / fmt / name / f"{stem}.{fmt}")
            paths[fmt, name] = root / fmt / name
    return paths


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf_cache"))


FORMATS = ["jsonl", "parquet"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_tldr_pairs_follow_choice_and_skip_bad_rows(files, cache, fmt, caplog):
    with caplog.at_level(logging.WARNING, logger="marl_jax.data"):
        pairs = data.load_preference_pairs("tldr", files[fmt, "tldr"], cache_dir=cache)
    assert [dict(p) for p in pairs] == [
        {"prompt": P_CAT, "chosen": " cat ignores me", "rejected": " I have a cat", "id": "t3_a"},
        {"prompt": P_KEYS, "chosen": " lost my keys twice, need advice", "rejected": " keys lost",
         "id": "t3_b"},
        {"prompt": P_CAT, "chosen": " cat ignores me", "rejected": " my cat is aloof",
         "id": "t3_a"},
    ]
    stats = pairs.load_stats
    assert stats["rows"] == 6 and stats["kept"] == 3
    assert stats["skipped"] == {"missing field info.post": 1, "empty summaries[1].text": 1}
    assert stats["dropped"] == {"CNN/DailyMail row (include_cnndm=False)": 1}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "skipped 2 of 6 rows" in warnings[0].getMessage()
    assert "missing field info.post: 1" in warnings[0].getMessage()


def test_tldr_prompts_are_distinct_and_sft_uses_chosen(files, cache):
    prompts = data.load_prompts("tldr", files["jsonl", "tldr"], cache_dir=cache)
    assert [p["prompt"] for p in prompts] == [P_CAT, P_KEYS, P_BODY]
    assert [p["id"] for p in prompts] == ["t3_a", "t3_b", "t3_d"]
    assert prompts.load_stats["dropped"] == {"duplicate prompt": 1,
                                            "CNN/DailyMail row (include_cnndm=False)": 1}
    sft = data.load_sft_examples("tldr", files["parquet", "tldr"], cache_dir=cache)
    assert [(e["prompt"], e["response"]) for e in sft] == [
        (P_CAT, " cat ignores me"), (P_KEYS, " lost my keys twice, need advice"),
        (P_CAT, " cat ignores me")]


def test_tldr_cnndm_rows_on_request(files, cache):
    pairs = data.load_preference_pairs("tldr", files["jsonl", "tldr"], include_cnndm=True,
                                       cache_dir=cache)
    assert pairs[2] == {"prompt": "Article:\nA storm hit the coast on Monday.\n\nTL;DR:",
                        "chosen": " A storm.", "rejected": " Rain.", "id": "c1"}


def test_tldr_sft_set_and_split_alias(files, cache):
    for split in ("valid", "validation", "val"):
        sft = data.load_sft_examples("tldr_sft", files["jsonl", "tldr_sft"], split=split,
                                     cache_dir=cache)
        assert [dict(e) for e in sft] == [
            {"prompt": "SUBREDDIT: r/pets\nTITLE: Cat\nPOST: My cat.\nTL;DR:",
             "response": " cat is fine"}]
        assert sft.load_stats["skipped"] == {"empty label": 1}
        assert sft.load_stats["split"] == "validation"


@pytest.mark.parametrize("fmt", FORMATS)
def test_hh_rlhf_pairs_and_messages(files, cache, fmt):
    pairs = data.load_preference_pairs("hh_rlhf", files[fmt, "hh_rlhf"], split="test",
                                       cache_dir=cache)
    assert [dict(p) for p in pairs] == [{
        "prompt": HH_TWO_TURNS, "chosen": " An apple.", "rejected": " No.",
        "messages": [{"role": "user", "content": "Hi there"},
                     {"role": "assistant", "content": "Hello!"},
                     {"role": "user", "content": "Name a fruit."}]}]
    assert pairs.load_stats["skipped"] == {"missing field rejected": 1, "empty prompt": 1}
    assert pairs.load_stats["dropped"] == {"identical chosen and rejected": 1}
    sft = data.load_sft_examples("hh_rlhf", files[fmt, "hh_rlhf"], split="test", cache_dir=cache)
    assert [e["response"] for e in sft] == [" An apple.", " Yes.", " Same."]


@pytest.mark.parametrize("fmt", FORMATS)
def test_webgpt_higher_score_chosen_ties_dropped(files, cache, fmt):
    pairs = data.load_preference_pairs("webgpt", files[fmt, "webgpt"], cache_dir=cache)
    assert [dict(p) for p in pairs] == [
        {"prompt": " Human: Why is the sky blue? Assistant:", "chosen": " Rayleigh scattering.",
         "rejected": " Because it is.", "id": "q1"},
        {"prompt": " Human: Why do cats purr? Assistant:",
         "chosen": " Purring comes from the larynx (mostly).", "rejected": " Nobody knows.",
         "id": "q2"},
    ]
    assert pairs.load_stats["dropped"] == {"tie (score_0 == score_1)": 1}
    assert pairs.load_stats["skipped"] == {"missing field question.full_text": 1}


@pytest.mark.parametrize("fmt", FORMATS)
def test_apps_prompts_tests_and_solutions(files, cache, fmt):
    prompts = data.load_prompts("apps", files[fmt, "apps"], cache_dir=cache)
    assert [p["problem_id"] for p in prompts] == [0, 1, 4]
    standard, call_based = prompts[0], prompts[1]
    assert standard["prompt"] == ("\nQUESTION:\nAdd two numbers.\nUse Standard Input format"
                                  "\nANSWER:\n")
    assert standard["input_output"] == {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    assert standard["fn_name"] is None and standard["difficulty"] == "introductory"
    assert call_based["prompt"] == (
        "\nQUESTION:\nReturn the double of x.\nclass Solution:\n    def double(self, x):"
        "\nUse Call-Based format\nANSWER:\n")
    assert call_based["fn_name"] == "double"
    assert call_based["input_output"]["outputs"] == [2, 4]
    assert prompts.load_stats["skipped"] == {"input_output is not valid JSON": 1,
                                             "empty input_output": 1}
    sft = data.load_sft_examples("apps", files[fmt, "apps"], cache_dir=cache)
    assert [e["response"] for e in sft] == [
        "a, b = map(int, input().split())\nprint(a + b)\n",
        "class Solution:\n    def double(self, x):\n        return 2 * x\n"]
    assert sft.load_stats["skipped"]["empty solutions"] == 1


def test_apps_difficulty_filter_and_no_pairs(files, cache):
    prompts = data.load_prompts("apps", files["jsonl", "apps"], difficulties=["interview"],
                                cache_dir=cache)
    assert [p["problem_id"] for p in prompts] == [1]
    with pytest.raises(ValueError, match="difficulties"):
        data.load_prompts("apps", files["jsonl", "apps"], difficulties=["easy"], cache_dir=cache)
    with pytest.raises(ValueError, match="no preference_pair records"):
        data.load_preference_pairs("apps", files["jsonl", "apps"], cache_dir=cache)


def test_single_file_path_and_max_rows(files, cache):
    file = files["parquet", "webgpt"] / "train.parquet"
    pairs = data.load_preference_pairs("webgpt", file, split="test", max_rows=1, cache_dir=cache)
    assert [p["id"] for p in pairs] == ["q1"]
    assert pairs.load_stats["rows"] == 1


def _sft_line(i):
    return json.dumps({"prompt": f"POST {i}\nTL;DR:", "label": f"summary {i}"})


# Lines 3 (truncated JSON) and 6 (JSON, but not an object) are malformed; line 8 is blank.
MIXED_LINES = [_sft_line(1), _sft_line(2), '{"prompt": "POST x", "lab', _sft_line(3),
               _sft_line(4), "[1, 2]", _sft_line(5), ""]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_malformed_json_lines_are_skipped_and_reported(tmp_path, suffix, caplog):
    raw = ("\n".join(MIXED_LINES) + "\n").encode()
    file = tmp_path / "data" / f"valid{suffix}"
    file.parent.mkdir()
    file.write_bytes(gzip.compress(raw) if suffix.endswith(".gz") else raw)
    cache = tmp_path / "cache"
    with caplog.at_level(logging.WARNING, logger="marl_jax.data"):
        sft = data.load_sft_examples("tldr_sft", file.parent, split="validation",
                                     cache_dir=str(cache))
    assert [dict(e) for e in sft] == [{"prompt": f"POST {i}\nTL;DR:", "response": f" summary {i}"}
                                      for i in range(1, 6)]
    reason = "malformed JSON lines of valid.jsonl (lines 3, 6)".replace(".jsonl", suffix)
    assert sft.load_stats["rows"] == 7 and sft.load_stats["kept"] == 5
    assert sft.load_stats["skipped"] == {reason: 2}
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"skipped 2 of 7 rows ({reason}: 2)" in warning
    # `datasets` read a copy of the good lines, kept for the next load.
    [copy] = (cache / "marl_jax_json_lines").glob("*.jsonl")
    good = [line for i, line in enumerate(MIXED_LINES) if i not in (2, 5, 7)]
    assert copy.read_text() == "".join(line + "\n" for line in good)
    written = copy.stat().st_mtime_ns
    again = data.load_sft_examples("tldr_sft", file, split="validation", cache_dir=str(cache),
                                   max_rows=3)
    assert copy.stat().st_mtime_ns == written
    # The first 3 rows end at line 4: line 3 was read, line 6 was not.
    assert [e["prompt"] for e in again] == [f"POST {i}\nTL;DR:" for i in (1, 2, 3)]
    assert again.load_stats["rows"] == 4
    assert again.load_stats["skipped"] == {reason.replace("lines 3, 6", "line 3"): 1}


def test_malformed_lines_after_a_json_array_file(tmp_path):
    """Rows of a JSON array file (read by `datasets` as it is) come before a later file's."""
    (tmp_path / "valid-0.json").write_text(
        json.dumps([json.loads(_sft_line(1)), json.loads(_sft_line(2))]))
    (tmp_path / "valid-1.jsonl").write_text("\n".join(["{bad", _sft_line(3)] + [
        f"not json {i}" for i in range(6)]) + "\n")
    cache = str(tmp_path / "cache")  # inside the data directory: its copies are not data files
    read = {rows: data.load_sft_examples("tldr_sft", tmp_path, split="validation",
                                         cache_dir=cache, max_rows=rows) for rows in (2, 3)}
    assert [[e["prompt"] for e in r] for r in read.values()] == [
        [f"POST {i}\nTL;DR:" for i in (1, 2)], [f"POST {i}\nTL;DR:" for i in (1, 2, 3)]]
    # Line 1 of valid-1.jsonl comes after the 2 rows of valid-0.json: read only with 3 rows.
    assert read[2].load_stats["skipped"] == {}
    assert read[3].load_stats["skipped"] == {"malformed JSON lines of valid-1.jsonl (line 1)": 1}
    every = data.load_sft_examples("tldr_sft", tmp_path, split="validation", cache_dir=cache)
    assert len(every) == 3 and every.load_stats["rows"] == 10
    assert every.load_stats["skipped"] == {
        "malformed JSON lines of valid-1.jsonl (lines 1, 3, 4, 5, 6, ... (2 more))": 7}

    (tmp_path / "valid-1.jsonl").write_text("{bad\n[1]\n")
    with pytest.raises(ValueError, match="no line of .*valid-1.jsonl is a JSON object"):
        data.load_sft_examples("tldr_sft", tmp_path, split="validation", cache_dir=cache)


def test_bad_names_paths_and_options(files, cache, tmp_path):
    with pytest.raises(ValueError) as error:
        data.load_prompts("tl;dr")
    for name in ("apps", "hh_rlhf", "tldr", "webgpt"):
        assert name in str(error.value)
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        data.load_prompts("tldr", missing)
    with pytest.raises(FileNotFoundError, match="no test files"):
        data.load_prompts("webgpt", files["jsonl", "webgpt"], split="test", cache_dir=cache)
    with pytest.raises(ValueError, match="split must be one of"):
        data.load_prompts("webgpt", files["jsonl", "webgpt"], split="training")
    with pytest.raises(ValueError, match="no 'validation' split on the hub"):
        data.load_prompts("webgpt", split="validation")
    with pytest.raises(TypeError, match="include_cnndm"):
        data.load_prompts("webgpt", files["jsonl", "webgpt"], include_cnndm=True)
    assert set(data.DATASETS) == {"tldr", "tldr_sft", "hh_rlhf", "webgpt", "apps"}


def test_hub_names_configs_and_splits_reach_datasets(monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        rows = {"openai/summarize_from_feedback": data_util.tldr_rows(),
                "CarperAI/openai_summarize_tldr": data_util.tldr_sft_rows()}.get(
                    path, data_util.apps_rows())
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    pairs = data.load_preference_pairs("tldr", split="valid")
    assert calls[-1] == ("openai/summarize_from_feedback", "comparisons",
                         {"split": "validation", "cache_dir": None})
    assert len(pairs) == 3 and pairs.load_stats["source"] == "openai/summarize_from_feedback"
    data.load_sft_examples("tldr_sft", split="validation")
    assert calls[-1] == ("CarperAI/openai_summarize_tldr", None,
                         {"split": "valid", "cache_dir": None})
    # codeparrot/apps ships a loading script, so its raw jsonl files are read instead.
    prompts = data.load_prompts("apps", split="test")
    assert calls[-1] == ("json", None, {
        "data_files": {"test": "hf://datasets/codeparrot/apps/test.jsonl"}, "split": "test",
        "cache_dir": None})
    assert len(prompts) == 3


def test_paper_split_deterministic_disjoint_sizes():
    records = [{"i": i} for i in range(37)]
    parts = data.paper_split(records)
    assert {k: len(v) for k, v in parts.items()} == {"sft": 7, "rm": 15, "rl": 15}
    ids = [r["i"] for part in ("sft", "rm", "rl") for r in parts[part]]
    assert sorted(ids) == list(range(37))
    # Independent reference: RandomState(seed).permutation gives the same shuffle as shuffling
    # an arange in place; parts are consecutive slices of it.
    order = np.random.RandomState(1234).permutation(37)
    assert ids == order.tolist()
    assert data.paper_split(records) == parts
    assert data.paper_split(records, seed=1) != parts
    # Rounding overshoot (2 + 2 + 2 > 5) moves every inner boundary down by one.
    assert splits.split_boundaries(5, (1, 1, 1)) == [0, 1, 3, 5]
    assert {k: len(v) for k, v in data.paper_split(records[:5], fractions=(1, 1, 1)).items()} == {
        "sft": 1, "rm": 2, "rl": 2}
    with pytest.raises(ValueError, match="fractions"):
        data.paper_split(records, fractions=(0.5, 0.5))


@pytest.fixture(scope="module")
def word_tokenizer():
    """Word-level tokenizer with BOS added to encodings and a simple chat template."""
    words = "[UNK] <bos> <eos> <|user|> <|assistant|> a b c d e".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                       special_tokens=[("<bos>", 1)])
    template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   unk_token="[UNK]", chat_template=template)


def test_format_prompt_with_chat_template(word_tokenizer):
    assert data.format_prompt(word_tokenizer, "a b", False) == "a b"
    assert data.format_prompt(word_tokenizer, "a b", True) == "<|user|> a b\n<|assistant|>"
    records = data.LoadedRecords(
        [{"prompt": HH_TWO_TURNS, "chosen": " c", "rejected": " d",
          "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                       {"role": "user", "content": "c"}]},
         {"prompt": "plain", "response": " e"}], {"dataset": "x"})
    formatted = data.format_records(records, word_tokenizer, True)
    assert formatted[0]["prompt"] == "<|user|> a\n<|assistant|> b\n<|user|> c\n<|assistant|>"
    assert (formatted[0]["chosen"], formatted[0]["rejected"]) == ("c", "d")
    assert formatted[1] == {"prompt": "<|user|> plain\n<|assistant|>", "response": "e"}
    assert formatted.load_stats == {"dataset": "x"}
    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0},
                                                                                unk_token="[UNK]")))
    with pytest.raises(ValueError, match="chat_template"):
        data.format_prompt(plain, "a", True)


def test_filter_by_length(word_tokenizer):
    records = data.LoadedRecords([
        {"prompt": "a b", "chosen": " a b c", "rejected": " a"},      # prompt 3 with BOS
        {"prompt": "a b c", "chosen": " a", "rejected": " b"},        # prompt 4: too long
        {"prompt": "a", "chosen": " a", "rejected": " a b c d"},      # rejected 4: too long
        {"prompt": "zebra b", "response": " c c c"},                  # unknown word: 1 token
    ], {"kept": 4, "dropped": {"tie": 2}})
    kept = data.filter_by_length(records, word_tokenizer, max_prompt_tokens=3,
                                 max_response_tokens=3)
    assert [r["prompt"] for r in kept] == ["a b", "zebra b"]
    assert kept.load_stats == {"kept": 2, "dropped": {"tie": 2, "too long": 2}}
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        data.filter_by_length(records, word_tokenizer, 0, 3)
