"""Pairwise judges: score judge, OpenAI-compatible judge against a local fake server, win rate."""
import http.server
import json
import re
import threading

import numpy as np
import pytest

from marl_jax.eval import judges

_SHOWN = re.compile(r"(?:Summary|Response) A:\n(.*?)\n\n(?:Summary|Response) B:\n(.*?)\n\nFIRST",
                    re.DOTALL)


class _FakeChatServer(http.server.ThreadingHTTPServer):
    """Answers chat completions by a known rule: the longer response is better, equal lengths
    tie. Responses containing FAIL always get HTTP 500, FLAKY gets one 503 before a normal
    answer, MUMBLE gets a reply without a verdict."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests = []
        self.flaky_seen = set()
        self.lock = threading.Lock()


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append({"path": self.path, "headers": dict(self.headers),
                                         "body": body})
        content = body["messages"][-1]["content"]
        first, second = _SHOWN.search(content).groups()
        if "FAIL" in content:
            return self._reply(500, {"error": "boom"})
        if "FLAKY" in content:
            with self.server.lock:
                fresh = content not in self.server.flaky_seen
                self.server.flaky_seen.add(content)
            if fresh:
                return self._reply(503, {"error": "busy"})
        if "MUMBLE" in content:
            answer = "Both have merits and I cannot decide."
        else:
            longer = len(first) - len(second)
            verdict = "A" if longer > 0 else "B" if longer < 0 else "tie"
            label = "More helpful" if "Response A:" in content else "Preferred"
            answer = f"Comparison: one is longer than the other.\n{label}: {verdict}"
        self._reply(200, {"choices": [{"index": 0, "message": {"role": "assistant",
                                                                "content": answer}}]})


@pytest.fixture(scope="module")
def server():
    fake = _FakeChatServer()
    thread = threading.Thread(target=fake.serve_forever, daemon=True)
    thread.start()
    yield fake
    fake.shutdown()
    fake.server_close()


def _url(server):
    return f"http://127.0.0.1:{server.server_address[1]}/v1"


def _truth(ours, theirs):
    return np.array([1.0 if len(a) > len(b) else 0.0 if len(a) < len(b) else 0.5
                     for a, b in zip(ours, theirs)])


@pytest.mark.parametrize("text, verdict", [
    ("Comparison: A is tighter.\nPreferred: A", 1.0),
    ("Comparison: B covers more. More helpful: B", 0.0),
    ("Comparison: both fine\nPreferred: tie", 0.5),
    ("Comparison: x\n**Preferred:** \"B\"", 0.0),
    ("Preferred: A\nOn reflection...\nPreferred: B", 0.0),
    ("B", 0.0),
    ("Comparison: A rambles.\nSummary B.", 0.0),
    ("Tie.", 0.5),
    ("More helpful: Response A", 1.0),
    ("I like the first one", None),
    ("Comparison: A is a bit vague, Bob agrees", None),
])
def test_parse_verdict(text, verdict):
    assert judges.parse_verdict(text) == verdict


def test_openai_judge_request_format(server):
    server.requests.clear()
    judge = judges.OpenAIJudge(_url(server), "judge-model", "test-key", template="tldr", seed=3,
                               max_workers=2)
    prefs = judge(["post about cats"], ["short"], ["a much longer summary"])
    assert prefs.tolist() == [0.0]
    (request,) = server.requests
    assert request["path"] == "/v1/chat/completions"
    assert request["headers"]["Authorization"] == "Bearer test-key"
    assert request["headers"]["Content-Type"] == "application/json"
    body = request["body"]
    assert body["model"] == "judge-model" and body["seed"] == 3 and body["temperature"] == 0.0
    assert [m["role"] for m in body["messages"]] == ["user"]
    content = body["messages"][0]["content"]
    assert "post about cats" in content and "Preferred:" in content
    assert all(word in content for word in ("relevance", "coherence", "consistency", "fluency"))


def test_openai_judge_unswaps_verdicts(server):
    rng = np.random.default_rng(0)
    n = 40
    ours = ["x" * int(k) for k in rng.integers(1, 12, size=n)]
    theirs = ["y" * int(k) for k in rng.integers(1, 12, size=n)]
    prompts = [f"question {i}" for i in range(n)]
    server.requests.clear()
    judge = judges.OpenAIJudge(_url(server), "m", template="hh", seed=1, max_workers=4)
    prefs = judge(prompts, ours, theirs)
    truth = _truth(ours, theirs)
    np.testing.assert_array_equal(prefs, truth)
    assert 0 < judge.last_stats["swapped"] < n  # both orders were shown
    assert judge.last_stats["failed"] == judge.last_stats["unparsed"] == 0
    assert all("Authorization" not in r["headers"] for r in server.requests)  # no key, no header
    shown_first = [_SHOWN.search(r["body"]["messages"][0]["content"]).group(1)
                   for r in server.requests]
    assert {s[0] for s in shown_first} == {"x", "y"}
    result = judges.win_rate(judge, prompts, ours, theirs)
    expected = (np.sum(truth == 1) + 0.5 * np.sum(truth == 0.5)) / n
    assert result["win_rate"] == pytest.approx(expected)
    assert (result["wins"], result["losses"], result["ties"], result["n"]) == (
        int(np.sum(truth == 1)), int(np.sum(truth == 0)), int(np.sum(truth == 0.5)), n)


def test_openai_judge_failures_count_as_ties(server):
    judge = judges.OpenAIJudge(_url(server), "m", seed=0, retries=2, backoff_s=0.01,
                               max_workers=3)
    ours = ["long answer FAIL", "short MUMBLE", "much longer FLAKY", "tiny"]
    theirs = ["x", "a much longer one", "s", "tiny"]
    prefs = judge(["p"] * 4, ours, theirs)
    assert prefs.tolist() == [0.5, 0.5, 1.0, 0.5]
    assert judge.last_stats["failed"] == 1 and judge.last_stats["unparsed"] == 1
    result = judges.win_rate(judge, ["p"] * 4, ours, theirs)
    assert result["failed"] == 1 and result["unparsed"] == 1
    assert result["win_rate"] == pytest.approx((1 + 0.5 * 3) / 4)


def test_openai_judge_unreachable_server_counts_failures():
    judge = judges.OpenAIJudge("http://127.0.0.1:9/v1", "m", retries=1, backoff_s=0.01,
                               timeout_s=2.0)
    assert judge(["p", "q"], ["a", "b"], ["c", "d"]).tolist() == [0.5, 0.5]
    assert judge.last_stats["failed"] == 2


def test_openai_judge_reads_environment(server, monkeypatch):
    monkeypatch.setenv("MARL_JUDGE_BASE_URL", _url(server))
    monkeypatch.setenv("MARL_JUDGE_MODEL", "env-model")
    monkeypatch.setenv("OPENAI_API_KEY", "env-key")
    server.requests.clear()
    judge = judges.OpenAIJudge(template="Q: {prompt}\nResponse A:\n{response_a}\n\n"
                                        "Response B:\n{response_b}\n\nFIRST answer.")
    assert judge(["p"], ["ab"], ["abc"]).tolist() == [0.0]
    (request,) = server.requests
    assert request["body"]["model"] == "env-model"
    assert request["headers"]["Authorization"] == "Bearer env-key"
    monkeypatch.delenv("MARL_JUDGE_MODEL")
    with pytest.raises(ValueError, match="MARL_JUDGE_MODEL"):
        judges.OpenAIJudge()
    with pytest.raises(ValueError, match="template"):
        judges.OpenAIJudge(model="m", template="no placeholders")


def test_score_judge_and_win_rate():
    table = {"a": 1.0, "b": 2.0, "c": 2.05, "d": -1.0}
    judge = judges.ScoreJudge(lambda prompts, responses: [table[r] for r in responses],
                              tie_margin=0.1)
    ours, theirs = ["b", "a", "c", "d", "a"], ["a", "b", "b", "d", "d"]
    prefs = judge(["p"] * 5, ours, theirs)
    assert prefs.tolist() == [1.0, 0.0, 0.5, 0.5, 1.0]
    result = judges.win_rate(judge, ["p"] * 5, ours, theirs)
    assert result["win_rate"] == pytest.approx(3.0 / 5.0)
    assert (result["wins"], result["losses"], result["ties"]) == (2, 1, 2)
    assert result["stderr"] == pytest.approx(np.std([1, 0, 0.5, 0.5, 1], ddof=1) / np.sqrt(5))
    with pytest.raises(ValueError, match="responses_b"):
        judge(["p"], ["a"], ["a", "b"])
    bad = judges.ScoreJudge(lambda p, r: np.zeros((len(r), 2)))
    with pytest.raises(ValueError, match="shape"):
        bad(["p"], ["a"], ["b"])
