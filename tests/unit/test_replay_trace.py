"""kvtier replay's trace readers: formats, synthesised tokens, and one-line errors naming the line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvtier.tools.replay.trace import TraceFormatError, block_tokens, read_trace


def _write(tmp_path, name: str, lines) -> str:
    path = tmp_path / name
    path.write_text("".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_mooncake_lines_become_requests_with_their_block_ids(tmp_path):
    path = _write(tmp_path, "t.jsonl", [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]},
        "\n",  # blank lines are skipped
        {"timestamp": 7, "input_length": 512, "output_length": 0, "hash_ids": [1]},
    ])
    trace = read_trace(path)
    assert trace.format == "mooncake" and trace.prefix_sharing
    assert [r.input_length for r in trace.requests] == [1000, 512]
    assert [r.timestamp_ms for r in trace.requests] == [0.0, 7.0]
    assert trace.requests[0].block_ids.tolist() == [1, 2]
    assert trace.input_tokens == 1512
    cut = trace.limited(1, 600)
    assert len(cut) == 1 and cut.requests[0].input_length == 600 and cut.requests[0].block_ids.tolist() == [1, 2]
    assert trace.limited(None, 512).requests[0].block_ids.tolist() == [1]


def test_synthesised_tokens_depend_on_the_block_id_and_position_only():
    a = block_tokens([5, 9], 700)
    b = block_tokens([5, 11], 1024)
    assert a.shape == (700,) and b.shape == (1024,)
    assert np.array_equal(a[:512], b[:512])  # the same id, the same tokens
    assert not np.array_equal(a[512:700], b[512:700])  # another id, other tokens
    assert np.array_equal(block_tokens([5, 9], 700), a)  # deterministic
    assert np.array_equal(block_tokens([9], 100), a[512:612])  # wherever the id occurs
    assert a.min() >= 0 and a.max() < 32000
    assert len(set(a[:512].tolist())) > 400  # not a constant
    with pytest.raises(ValueError, match="need 3 blocks"):
        block_tokens([1, 2], 1025)


def test_prompt_jsonl_and_azure_csv(tmp_path):
    prompts = read_trace(_write(tmp_path, "p.jsonl", [{"token_ids": [1, 2, 3]}, {"token_ids": [1, 2]}]))
    assert prompts.format == "prompts" and [r.token_ids.tolist() for r in prompts.requests] == [[1, 2, 3], [1, 2]]
    csv = tmp_path / "a.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:17:03.9799600,1030,10\n2023-11-16 18:17:04.0319600,5,8\n")
    azure = read_trace(str(csv))
    assert azure.format == "azure" and not azure.prefix_sharing
    assert [r.input_length for r in azure.requests] == [1030, 5]
    assert azure.requests[1].timestamp_ms == pytest.approx(52.0)
    # Arrivals and lengths only: each request's block ids are its own.
    first, second = (set(r.block_ids.tolist()) for r in azure.requests)
    assert len(first) == 3 and not first & second


@pytest.mark.parametrize("lines, message", [
    (['{"input_length": 10, "hash_ids": [1]}\n', "{not json\n"], r"t\.jsonl:2: not JSON"),
    # json raises a plain ValueError (no position) for an integer past Python's digit limit.
    (['{"input_length": 1' + "0" * 5000 + ', "hash_ids": [1]}\n'], r"t\.jsonl:1: not JSON \(Exceeds the limit"),
    (['[1, 2]\n'], r"t\.jsonl:1: expected a JSON object, got list"),
    (['{"input_length": 10}\n'], r"t\.jsonl:1: a line needs 'hash_ids' \(Mooncake\) or 'token_ids'"),
    (['{"input_length": 10, "hash_ids": [1]}\n', '{"input_length": 600, "hash_ids": [1]}\n'],
     r"t\.jsonl:2: input_length 600 needs 2 hash_ids of 512 tokens, got 1"),
    (['{"input_length": 0, "hash_ids": [1]}\n'], r"t\.jsonl:1: 'input_length' must be an int >= 1, got 0"),
    (['{"input_length": true, "hash_ids": [1]}\n'], r"t\.jsonl:1: 'input_length' must be an int >= 1, got True"),
    (['{"input_length": 3, "hash_ids": [-4]}\n'], r"t\.jsonl:1: 'hash_ids' must hold ints >= 0, found -4"),
    (['{"input_length": 3, "hash_ids": [1], "timestamp": "x"}\n'], r"t\.jsonl:1: 'timestamp' must be a number"),
    (['{"input_length": 3, "hash_ids": [1]}\n', '{"token_ids": [1]}\n'], r"t\.jsonl:2: a prompts line in a mooncake trace"),
    (['{"token_ids": []}\n'], r"t\.jsonl:1: 'token_ids' must be a non-empty list of ints"),
    (["\n"], r"t\.jsonl: no requests"),
])
def test_a_malformed_line_is_one_typed_error_naming_the_line(tmp_path, lines, message):
    path = _write(tmp_path, "t.jsonl", lines)
    with pytest.raises(TraceFormatError, match=message) as info:
        read_trace(path)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)  # the command's exit code 2


def test_azure_errors_name_the_line(tmp_path):
    csv = tmp_path / "a.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,10,1\n2023-11-16 18:17:04,x,1\n")
    with pytest.raises(TraceFormatError, match=r"a\.csv:3: bad value"):
        read_trace(str(csv))
    csv.write_text("time,tokens\n")
    with pytest.raises(TraceFormatError, match=r"a\.csv:1: expected the header TIMESTAMP,ContextTokens,GeneratedTokens"):
        read_trace(str(csv))
    with pytest.raises(TraceFormatError, match="no such file"):
        read_trace(str(tmp_path / "missing.jsonl"))
