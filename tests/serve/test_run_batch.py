"""``iterserve run-batch``: an OpenAI batch file through the offline engine, one answer
per line in the input's order, errors per line, never a lost line, a clean exit."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from iterserve.cluster.serve import batch
from tests.conftest import USER_ENV
from tests.serve.conftest import MODEL
from tests.stand_ins import stand_in
from tests.test_quickstart import BIN

# The fake executor's engine, as flags (tests/serve/conftest.py's fake_engine).
FAKE_FLAGS = [
    "--num-gpu-blocks-override", "256", "--max-num-seqs", "16", "--max-num-batched-tokens",
    "256", "--block-size", "4", "--num-cpus-per-worker", "0.1",
]  # fmt: skip


def chat(custom_id: str, model: str = MODEL, **body) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def completion(custom_id: str, **body) -> dict:
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 3, **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_answers(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_line_gets_its_answer_in_order_errors_included(
    ray_session, tokenizer_dir, vocab_size, tmp_path, capsys
):
    lines = [
        chat("a", max_tokens=4),
        completion("b"),
        "{not json",
        {"method": "POST", "url": "/v1/completions", "body": {"model": MODEL, "prompt": "x"}},
        {"custom_id": "e", "url": "/v1/images/generations", "body": {}},
        {"custom_id": "f", "url": "/v1/embeddings", "body": {"model": MODEL, "input": "hi"}},
        chat("g", stream=True),
        chat("h", model="no-such-model"),
        completion("i", max_tokens=10_000),
        "",
        *[completion(f"many-{k}", max_tokens=2) for k in range(40)],
    ]
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    fake = stand_in("fake", output_len=12, max_model_len=128, vocab_size=vocab_size)
    argv = ["-i", str(src), "-o", str(out), "--model", str(tokenizer_dir), *FAKE_FLAGS]
    assert batch.main(argv, executor=fake) == 0

    answers = read_answers(out)
    assert len(answers) == len(lines) - 1  # the blank line is no request
    by_id = {a["custom_id"]: a for a in answers if a["custom_id"]}
    assert [a["custom_id"] for a in answers[:2]] == ["a", "b"]
    assert [a["custom_id"] for a in answers[-40:]] == [f"many-{k}" for k in range(40)]
    ok = by_id["a"]["response"]
    assert ok["status_code"] == 200 and by_id["a"]["error"] is None
    assert ok["body"]["object"] == "chat.completion" and ok["body"]["usage"]["completion_tokens"]
    assert by_id["b"]["response"]["body"]["choices"][0]["text"] is not None
    assert all(a["id"].startswith("batch_req_") for a in answers)
    statuses = {a["custom_id"]: a["response"]["status_code"] for a in answers[2:9]}
    assert statuses == {None: 400, "e": 404, "f": 404, "g": 400, "h": 404, "i": 400}
    errors = [a["error"] for a in answers[2:9]]
    assert all(e and e["message"] for e in errors)
    assert "line 3" in answers[2]["error"]["message"]  # the bad JSON, by its line
    assert "custom_id" in answers[3]["error"]["message"]
    assert "/v1/embeddings" in by_id["f"]["error"]["message"]  # refused by name
    assert by_id["g"]["error"]["param"] == "stream"
    assert by_id["h"]["error"]["code"] == "model_not_found"
    assert by_id["i"]["error"]["code"] == "context_length_exceeded"
    assert "Running batch: 49/49" in capsys.readouterr().err


def test_a_batch_that_cannot_be_read_is_refused_before_the_engine_starts(tmp_path, capsys):
    code = batch.main(["-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing.jsonl" in err


def test_run_batch_end_to_end_on_the_tiny_model_exits_cleanly(tiny_model_dir, tmp_path):
    """The real command, as a user runs it: the real model, Ray started and stopped by
    the command, every line answered, exit 0, no traceback on the way out."""
    lines = [
        chat("c1", model=tiny_model_dir.name, max_tokens=4, temperature=0),
        completion("c2", model=tiny_model_dir.name, max_tokens=4, temperature=0),
        chat("c3", model=tiny_model_dir.name, max_tokens=4, n=2, seed=3),
        {"custom_id": "c4", "url": "/v1/embeddings", "body": {"input": "x"}},
    ]
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    done = subprocess.run(
        [str(BIN / "iterserve"), "run-batch", "-i", str(src), "-o", str(out),
         "--model", str(tiny_model_dir), "--max-model-len", "128", "--dtype", "float32",
         "--enforce-eager"],
        cwd=tmp_path, env=USER_ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr
    answers = read_answers(out)
    assert [a["custom_id"] for a in answers] == ["c1", "c2", "c3", "c4"]
    assert [a["response"]["status_code"] for a in answers] == [200, 200, 200, 404]
    assert len(answers[2]["response"]["body"]["choices"]) == 2
    assert "Running batch: 4/4" in done.stderr
    assert "4 lines answered" in done.stderr


def test_embedding_lines_on_a_pooling_runner(ray_session, tokenizer_dir, vocab_size, tmp_path):
    lines = [
        {"custom_id": "e1", "url": "/v1/embeddings", "body": {"model": MODEL, "input": "hello"}},
        {"custom_id": "e2", "url": "/v1/embeddings",
         "body": {"model": MODEL, "input": ["hello", "world"], "encoding_format": "float"}},
        completion("c1"),  # a pooling runner serves no completions: refused by name
    ]  # fmt: skip
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    fake = stand_in("fake", output_len=12, max_model_len=128, vocab_size=vocab_size)
    argv = ["-i", str(src), "-o", str(out), "--model", str(tokenizer_dir), "--runner", "pooling",
            *FAKE_FLAGS]  # fmt: skip
    assert batch.main(argv, executor=fake) == 0
    e1, e2, c1 = read_answers(out)
    assert e1["response"]["status_code"] == 200 and e1["error"] is None
    assert e1["response"]["body"]["object"] == "list"
    assert len(e2["response"]["body"]["data"]) == 2
    assert all(isinstance(x, float) for x in e2["response"]["body"]["data"][1]["embedding"])
    assert c1["response"]["status_code"] == 404 and "pooling" in c1["error"]["message"]
