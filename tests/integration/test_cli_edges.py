"""The `kvtier` command at its edges: every user mistake and environment problem is one
line ``kvtier: error: ...`` naming the file or option, exit 2; an interrupted command exits 130; a
closed stdout exits 141 without a word; a demo on a warm directory verifies; warmup fails when its
chunks never reached the disk.

The table runs ``main()`` in this process (one import of torch and transformers for every case);
what only a real process shows (signals, pipes, exit codes) runs the command as a subprocess. Full and
read-only disks are real tmpfs mounts (root only; skipped with the reason elsewhere).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest

from kvtier.tools.cli import main
from mounts import tmpfs

transformers = pytest.importorskip("transformers")


def run_cli(*args: str, timeout: float = 120, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "kvtier.tools.cli", *args], capture_output=True, text=True, timeout=timeout, **kwargs
    )


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny saved model, a model directory whose weights are garbage, and prompt files."""
    import torch

    from kvtier.integrations.transformers import tiny_hybrid_config

    root = tmp_path_factory.mktemp("cli-edges")
    torch.manual_seed(0)
    config = tiny_hybrid_config()
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(root / "model")
    config.save_pretrained(root / "garbage")
    (root / "garbage" / "model.safetensors").write_bytes(os.urandom(1000))
    (root / "prompts.jsonl").write_text(json.dumps({"token_ids": list(range(1, 40))}) + "\n")
    (root / "junk.jsonl").write_bytes(b"\xa8\xff\x00\x17" * 64)
    (root / "null.jsonl").write_text('{"token_ids": null}\n')
    (root / "empty.jsonl").write_text("")
    (root / "blank.jsonl").write_text("\n  \n\t\n")
    (root / "no-tokens.jsonl").write_text('{"token_ids": []}\n')
    (root / "a-file").write_text("not a directory\n")
    (root / "damaged").mkdir(mode=0o700)
    (root / "damaged" / "data.mdb").write_bytes(b"not an LMDB file " * 512)
    return root


def _cases(root: Path, readonly: Path):
    model, cache = str(root / "model"), str(root / "cache")
    warmup = ["warmup", "--model", model, "--cache-dir", cache, "--no-progress"]
    return [
        (["gc", "--cache-dir", cache, "--max-bytes", "-1GiB"], "argument --max-bytes: must be a size >= 0, got '-1GiB'"),
        (["gc", "--cache-dir", cache, "--max-bytes", "lots"], "argument --max-bytes: --max-bytes must be a size like"),
        (["demo", "--cache-dir", ""], "--cache-dir must not be empty"),
        (["warmup", "--model", str(root / "garbage"), "--prompts", str(root / "prompts.jsonl"), "--cache-dir", cache],
         f"cannot load the model in '{root / 'garbage'}' (SafetensorError"),
        (warmup + ["--prompts", str(root)], f"prompts file '{root}' is a directory"),
        (warmup + ["--prompts", str(root / "junk.jsonl")], f"prompts file '{root / 'junk.jsonl'}' is not UTF-8 text"),
        (warmup + ["--prompts", str(root / "null.jsonl")], f"{root / 'null.jsonl'}:1: 'token_ids' must be a list of non-negative ints, got null"),
        (warmup + ["--prompts", str(root / "prompts.jsonl"), "--device", "cuda"], "device 'cuda' requested but torch.cuda.is_available() is False"),
        (["bench", "--quick", "--cache-dir", str(root / "a-file")], f"--cache-dir {root / 'a-file'} is not a directory"),
        (["bench", "--quick", "--cache-dir", str(readonly)], f"--cache-dir {readonly} is not writable: Read-only file system"),
        (["inspect", "--cache-dir", str(root / "nothing-here")], "no kvtier cache at"),
        (["demo", "--cache-dir", str(root / "unmounted" / "kvtier")],
         f"cache_dir '{root / 'unmounted' / 'kvtier'}': its parent {root / 'unmounted'} does not exist"),
        (["verify", "--cache-dir", str(root / "damaged")],
         f"no record was checked, quarantined or deleted: move {root / 'damaged'}'s data.mdb and seg-*.kvs files aside"),
        # round two
        (["--frob"], "unrecognized option --frob"),
        (["demo", "--producers", "1000000000"], "--producers must be in [1, 4096], got 1000000000"),
        (["bench", "--quick", "--cache-dir", str(root / "no" / "such" / "dir")],
         f"--cache-dir {root / 'no' / 'such' / 'dir'}: its parent {root / 'no' / 'such'} does not exist"),
        (warmup + ["--prompts", str(root / "prompts.jsonl"), "--cache-salt", "tenant"],
         "--cache-salt needs --key-scheme vllm (kvtier's own keys take --salt)"),
        (warmup + ["--prompts", str(root / "empty.jsonl")], f"prompts file '{root / 'empty.jsonl'}' holds no prompts"),
        (warmup + ["--prompts", str(root / "blank.jsonl")], f"prompts file '{root / 'blank.jsonl'}' holds no prompts"),
        (warmup + ["--prompts", str(root / "no-tokens.jsonl")], f"{root / 'no-tokens.jsonl'}:1: the prompt is empty"),
        (warmup + ["--prompts", str(root / "prompts.jsonl"), "--block-size", "1000000"],
         "a chunk is 1000000 tokens (--block-size x --blocks-per-chunk), longer than the longest prompt (39 tokens)"),
        (warmup + ["--prompts", str(root / "prompts.jsonl"), "--extra-retained-tokens", "1000000000"],
         "argument --extra-retained-tokens: must be an int in [0, 1024], got '1000000000'"),
        (["warmup", "--model", str(root / "a-file"), "--prompts", str(root / "prompts.jsonl"), "--cache-dir", cache],
         f"model directory '{root / 'a-file'}' is not a directory"),
    ]


def test_every_user_mistake_is_one_line_naming_the_file_or_option(inputs, tmp_path, capsys):
    with tmpfs(tmp_path / "ro", "size=1m,ro") as readonly:
        for argv, message in _cases(inputs, readonly):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse's own errors leave through SystemExit
                code = exc.code
            err = capsys.readouterr().err
            lines = [line for line in err.splitlines() if "WARNING" not in line]
            assert code == 2, (argv, err)
            assert len(lines) == 1 and lines[0].startswith("kvtier: error: "), (argv, err)
            assert message in lines[0], (argv, message, lines[0])
    assert not (inputs / "cache").exists()  # no case created the cache directory
    assert not (inputs / "unmounted").exists()
    assert not (inputs / "no").exists()


def test_version_names_the_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"kvtier {version('kvtier')}\n"


def test_ctrl_c_while_the_options_are_parsed_is_an_interrupt(tmp_path):
    # A real SIGINT at the moment parsing imports the --max-bytes converter's module (the first
    # ~1.5 s of `kvtier gc`): it must end as every interrupt does, not as a traceback.
    script = (
        "import os, signal, sys\n"
        "def hook(event, args):\n"
        "    if event == 'import' and args[0] == 'kvtier.engine.config':\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "sys.addaudithook(hook)\n"
        "from kvtier.tools.cli import main\n"
        f"sys.exit(main(['gc', '--cache-dir', {str(tmp_path)!r}, '--max-bytes', '40MiB']))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (130, "kvtier: interrupted\n")


def _demo_dirs(root: Path):
    return sorted(p.name for p in root.iterdir())


def test_a_terminated_demo_removes_its_temporary_directory(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.tools.cli", "demo", "--producers", "400"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(tmp_path.glob("kvtier-demo-*/data.mdb")):
        time.sleep(0.05)
    assert list(tmp_path.glob("kvtier-demo-*/data.mdb")), "the demo never started writing"
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "kvtier: terminated" and "Traceback" not in err
    assert _demo_dirs(tmp_path) == []


def _error_lines(stderr: str):
    return [line for line in stderr.splitlines() if "WARNING" not in line]


def test_demo_environment_problems_exit_2_in_one_line(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    # Nothing listens on port 1: connection refused at once.
    result = run_cli("demo", "--producers", "2", "--remote", "redis://127.0.0.1:1", env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert _error_lines(result.stderr) == [
        "kvtier: error: --remote redis://127.0.0.1:1 is unreachable; start it, fix the URL, or leave --remote out"
    ]
    assert result.stdout == "" and _demo_dirs(tmp_path) == []
    with tmpfs(tmp_path / "small", "size=3m,mode=0700") as small:
        cache = small / "cache"
        result = run_cli("demo", "--producers", "6", "--cache-dir", str(cache))
        lines = _error_lines(result.stderr)
        assert result.returncode == 2, result.stdout + result.stderr
        assert len(lines) == 1 and lines[0].startswith(f"kvtier: error: {cache}: No space left on device ("), lines
        assert "VERIFICATION FAILED" not in result.stdout


def test_a_demo_over_corrupt_records_stores_them_again_and_verifies(tmp_path):
    from kvtier.tiers.lmdb.segments import SegmentPointer, is_pointer

    cache = tmp_path / "cache"
    first = run_cli("demo", "--json", "--cache-dir", str(cache), "--producers", "4")
    assert first.returncode == 0, first.stderr
    # Flip the last payload byte of three records in their segment files (the full-attention
    # chunks every consumer loads).
    env = lmdb.open(str(cache), max_dbs=8, map_size=1 << 30)
    with env.begin(db=env.open_db(b"chunks")) as txn:
        pointers = [SegmentPointer.unpack(bytes(v)) for _, v in txn.cursor() if is_pointer(bytes(v))][:3]
    env.close()
    assert len(pointers) == 3, "not vacuous: the demo cache has segment records"
    for pointer in pointers:
        with open(cache / pointer.name, "r+b") as f:
            f.seek(pointer.offset + pointer.length - 1)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x5A]))
    second = run_cli("demo", "--json", "--cache-dir", str(cache), "--producers", "4")
    assert second.returncode == 0, second.stdout + second.stderr
    summary = json.loads(second.stdout)
    assert summary["verified"] is True and summary["failures"] == []
    assert summary["corrupt_blocks_restored"] > 0
    # Stored again, the chunks serve the restart: as many hit tokens as the clean first run.
    assert summary["hit_tokens"] == json.loads(first.stdout)["hit_tokens"]


def test_a_closed_stdout_exits_quietly_and_an_interrupt_exits_130(tmp_path):
    cache = tmp_path / "cache"
    # Interrupt a long demo once its cache holds data: 130, "interrupted", no traceback.
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.tools.cli", "demo", "--cache-dir", str(cache), "--producers", "400"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (cache / "data.mdb").exists():
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "kvtier: interrupted"
    assert "Traceback" not in err and out == ""

    # `kvtier verify ... | head` where head is already gone: exit 141, nothing on stderr.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "-m", "kvtier.tools.cli", "verify", "--cache-dir", str(cache)],
                                stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert result.returncode == 141, result.stderr
    assert result.stderr == ""


def test_a_demo_after_an_interrupted_one_and_a_second_demo_verify_their_warm_hits(tmp_path):
    cache = tmp_path / "cache"
    # What an interrupted demo leaves: the chunks of its first producers (same seed, same prompts).
    first = run_cli("demo", "--json", "--cache-dir", str(cache), "--producers", "2")
    assert first.returncode == 0, first.stderr
    partial = json.loads(first.stdout)
    assert partial["warm_chunks"] == 0 and partial["stored_chunks"] > 0
    second = run_cli("demo", "--cache-dir", str(cache), "--producers", "4")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "every loaded byte matched its producer" in second.stdout
    # Producers 1 and 2 find their chunks cached; 3 and 4 store new ones (a shared system prompt's).
    line = next(line for line in second.stdout.splitlines() if "producer chunks" in line)
    stored_now = int(line.split()[2])
    assert f"{stored_now} stored now, {partial['stored_chunks']} already in the cache directory (warm" in line
    assert stored_now > 0
    assert second.stderr.count("pressure unknown") <= 1  # each warning once per command


def test_warmup_fails_when_chunks_never_reached_the_disk(inputs, tmp_path, capsys):
    prompts = tmp_path / "many.jsonl"
    with prompts.open("w") as f:
        for i in range(12):
            f.write(json.dumps({"token_ids": [(i * 7 + t) % 120 + 3 for t in range(250)]}) + "\n")
    with tmpfs(tmp_path / "small", "size=400k,mode=0700") as small:
        cache = small / "cache"
        code = main(["warmup", "--model", str(inputs / "model"), "--prompts", str(prompts),
                     "--cache-dir", str(cache), "--json", "--no-progress"])
        captured = capsys.readouterr()
        summary = json.loads(captured.out)
        errors = [line for line in captured.err.splitlines() if line.startswith("kvtier: error:")]
        assert code == 2, captured.err
        assert summary["chunks_not_durable"] + summary["chunks_dropped"] > 0
        assert errors and f"did not reach the disk in {cache}" in errors[0]
        # The summary counts as stored only what is on disk: every stored chunk is a record there.
        env = lmdb.open(str(cache), readonly=True, lock=False, max_dbs=8)
        try:
            with env.begin() as txn:
                records = txn.stat(env.open_db(b"chunks", txn=txn, create=False))["entries"]
        finally:
            env.close()
        assert records >= summary["chunks_stored"]
