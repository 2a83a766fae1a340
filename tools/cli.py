"""The ``kvtier`` command: demo, warmup, inspect, verify, gc, bench, replay.

Primitives: ``main(argv)`` (the console entry point), ``build_parser``.

Exit codes: 0 done; 1 the command ran and found a problem (a bad record, a failed check); 2 a user
mistake or an environment problem (a bad option, a missing or unwritable path, a full disk, a file
that is not what it should be), said in one line ``kvtier: error: ...`` that names the file or
option; 130 interrupted (Ctrl-C); 143 terminated (SIGTERM; the demo cleans up as for Ctrl-C); 141 the reader of stdout went away (``| head``), silently, as a
shell tool killed by SIGPIPE would. Only a real kvtier bug shows a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from typing import List, NoReturn, Optional, Sequence

from kvtier.errors import CorruptCacheError
from kvtier.errors import KvtierError
from kvtier.tools._argtypes import int_option

__all__ = ["main", "build_parser", "user_error_message"]


# Exit codes (see the module docstring).
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
EXIT_BROKEN_PIPE = 141
# The demo keeps every producer's prompt and expected bytes in memory (~0.3 MB each): 4096 is
# ~1.3 GB and ~15 minutes here; more is a typo, not a demo.
MAX_DEMO_PRODUCERS = 4096
# MTP and EAGLE re-prefill as many tokens as they speculate, a handful; more than this is a typo that
# would keep a second window's worth of every sliding-window chunk.
MAX_EXTRA_RETAINED_TOKENS = 1024
# Options whose value may start with "-" (a negative size is a mistake to name, not a missing value).
_SIGNED_VALUE_OPTIONS = ("--max-bytes",)


class _Parser(argparse.ArgumentParser):
    """argparse with kvtier's one-line error: ``kvtier: error: <what>  (see kvtier gc --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"kvtier: error: {message} (see `{self.prog} --help`)\n")


def _size(text: str) -> int:
    from kvtier.engine.config_values import parse_size

    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"must be a size >= 0, got {text!r}")
    try:
        return parse_size(text, "--max-bytes")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _join_signed_values(argv: Sequence[str]) -> List[str]:
    """``--max-bytes -1GiB`` -> ``--max-bytes=-1GiB``: argparse reads a value starting with "-" as
    an option (it only knows plain negative numbers) and would say "expected one argument"."""
    out: List[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        if args[i] in _SIGNED_VALUE_OPTIONS and i + 1 < len(args) and args[i + 1].startswith("-") \
                and not args[i + 1].startswith("--"):
            out.append(f"{args[i]}={args[i + 1]}")
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvtier")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _unknown_leading_option(parser: argparse.ArgumentParser, argv: Sequence[str]) -> Optional[str]:
    """The first option before the COMMAND that ``kvtier`` itself does not know: argparse would
    only say that a COMMAND is required (``kvtier --frob``)."""
    known = set(parser._option_string_actions)
    for arg in argv:
        if not arg.startswith("-"):
            return None
        if arg.split("=", 1)[0] not in known:
            return arg
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvtier",
        description="Keep an LLM server's KV cache beyond GPU memory: host slabs, LMDB on NVMe, exact SWA/MTP coverage.",
    )
    parser.add_argument("--version", action="version", version=f"kvtier {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)

    demo = sub.add_parser("demo", help="store and restore KV through the engine on a built-in hybrid layout, checking every byte")
    demo.add_argument("--cache-dir", help="cache directory (default: a fresh temporary directory, removed afterwards)")
    demo.add_argument("--keep", action="store_true", help="keep the temporary cache directory")
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    demo.add_argument("--producers", type=int, default=12, help=f"producer requests (default 12, at most {MAX_DEMO_PRODUCERS})")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--remote", metavar="URL|embedded",
        help="chain a remote tier behind LMDB: 'embedded' starts a local Valkey on 127.0.0.1, or "
        "redis://host:port / redis+cluster://h1:p1,h2:p2; a second host then loads from it",
    )

    warmup = sub.add_parser("warmup", help="run a local transformers model over prompts and fill the disk tier")
    warmup.add_argument("--model", help="directory of a Hugging Face causal LM (no downloads); required but with --key-scheme vllm")
    warmup.add_argument("--prompts", required=True, help="JSONL file; each line has 'text' or 'token_ids'")
    warmup.add_argument("--cache-dir", required=True)
    warmup.add_argument("--salt", help="tenant salt bound into every key")
    warmup.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    warmup.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    warmup.add_argument("--block-size", type=int, default=16)
    warmup.add_argument("--blocks-per-chunk", type=int, default=1)
    warmup.add_argument("--extra-retained-tokens", type=_extra_retained, default=0,
                        help=f"MTP extra retained tokens R (0 to {MAX_EXTRA_RETAINED_TOKENS})")
    warmup.add_argument("--json", action="store_true")
    warmup.add_argument("--no-progress", action="store_true")
    warmup.add_argument(
        "--key-scheme", choices=("kvtier", "vllm"), default="kvtier",
        help="vllm: compute the keys a vLLM server with KvtierTier computes (vLLM's hashing, block size, "
        "cache_salt); with --model, first fill the cache with the model's KV in vLLM's row layout; then report "
        "per prompt how many chunks the cache holds under them",
    )
    warmup.add_argument("--vllm-layout", help="the vllm-layout-*.json the server's KvtierTier left (default: the one in --cache-dir)")
    warmup.add_argument("--cache-salt", help="vLLM's per-request cache_salt (with --key-scheme vllm)")
    warmup.add_argument(
        "--retention-interval", type=_retention_interval, default=0,
        help="with --key-scheme vllm --model: the server's prefix_cache_retention_interval (vLLM's default 0; "
        "'none' for every boundary): which sliding-window chunks vLLM would store",
    )
    warmup.add_argument(
        "--vllm-kv-cache-layout",
        help="with --key-scheme vllm --model: the server's resolved KV cache layout (LBNHC/NHD or LBHNC/HND) "
        "when the layout file does not record it",
    )

    inspect = sub.add_parser("inspect", help="records per group, bytes raw and stored, compression, age")
    inspect.add_argument("--cache-dir", required=True)
    inspect.add_argument("--json", action="store_true")

    verify = sub.add_parser(
        "verify",
        help="read and check every record; exit 1 when any is bad (moved to quarantine), 2 when the file "
        "itself is damaged (nothing checked; the message says what to do)",
    )
    verify.add_argument("--cache-dir", required=True)
    verify.add_argument("--no-quarantine", action="store_true", help="only report bad records, move nothing")
    verify.add_argument("--json", action="store_true")

    gc = sub.add_parser("gc", help="evict least-recently-used records down to a bound on their stored bytes, "
                                    "then compact mostly-dead segment files; reports the bytes on disk before and after")
    gc.add_argument("--cache-dir", required=True)
    gc.add_argument(
        "--max-bytes", required=True, type=_size,
        help="bound on the records' stored bytes (`kvtier inspect`'s 'stored'), e.g. 1073741824 or 1GiB; not a bound "
        "on the directory's size: data.mdb keeps its size (LMDB reuses its free pages) and a segment file is "
        "compacted only once less than half of it is live",
    )
    gc.add_argument("--json", action="store_true")

    bench = sub.add_parser("bench", help="benchmark tiers and engine against raw baselines measured in the same run")
    bench.add_argument("--quick", action="store_true", help="fewer paired rounds (3 of the full run's 4, same length, same subjects), quiet only")
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--cache-dir", help="directory on the filesystem to measure (default: a temporary one)")
    bench.add_argument("--busy", metavar="KINDS", help="also run the disk rounds beside 2 CPU-bound workers of each "
                       "kind: threads (they hold the GIL too), processes, both as 'threads,processes', or 'none' "
                       "(default: threads in a full run, none with --quick)")

    from .replay.command import add_arguments as add_replay_arguments

    replay = sub.add_parser(
        "replay", help="replay a request trace (Mooncake, Azure, your prompts) through the engine or its fast model: "
        "hit rate per tier against host and disk budgets, with a reference LRU and the offline bound beside it")
    add_replay_arguments(replay)
    return parser


def _cmd_demo(args) -> int:
    from tqdm import tqdm

    from ._demo import format_summary, run_demo
    from .testing.valkey import remote_server

    if not 1 <= args.producers <= MAX_DEMO_PRODUCERS:
        raise ValueError(f"--producers must be in [1, {MAX_DEMO_PRODUCERS}], got {args.producers}")
    if args.cache_dir is not None and not args.cache_dir.strip():
        # An empty value is a mistake (an unset shell variable), not a request for a temporary dir.
        raise ValueError("--cache-dir must not be empty (leave the option out for a temporary directory)")
    temporary = args.cache_dir is None
    previous_sigterm = _terminate_as_interrupt()  # unwinds like Ctrl-C: the engine closes, the temporary directory goes
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="kvtier-demo-")
    removed = False
    try:
        total = (3 if args.remote is None else 4) * args.producers
        with remote_server(args.remote) as remote_url, tqdm(
            total=total, desc="kvtier demo", unit="req", disable=args.json or None, file=sys.stderr
        ) as bar:
            summary = asyncio.run(
                run_demo(cache_dir, producers=args.producers, seed=args.seed, progress=bar.update, remote_url=remote_url)
            )
    finally:
        if temporary and not args.keep:
            shutil.rmtree(cache_dir, ignore_errors=True)
            removed = True
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
    if removed:
        summary.cache_dir = None  # never point at a directory that no longer exists
    if args.json:
        print(json.dumps(summary.to_dict(), sort_keys=True))
    else:
        print(format_summary(summary))
        if temporary and args.keep:
            print(f"  cache kept at        {cache_dir}")
    return 0 if summary.verified else 1


_terminated = False  # SIGTERM arrived (reported as "terminated", exit 143, instead of 130)


def _terminate_as_interrupt():
    """SIGTERM (``kill``, a CI timeout) unwinds as Ctrl-C does: asyncio.run cancels the main task,
    every ``finally`` runs. Python's default for SIGTERM kills the process on the spot, leaving a
    temporary cache directory behind. Returns the handler it replaced (``None`` off the main
    thread, where signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def on_term(signum, frame) -> None:
        global _terminated
        _terminated = True
        signal.raise_signal(signal.SIGINT)

    return signal.signal(signal.SIGTERM, on_term)


_retention_interval = int_option(0, none=("none",))  # --retention-interval
_extra_retained = int_option(0, MAX_EXTRA_RETAINED_TOKENS)  # --extra-retained-tokens


def _cmd_warmup(args) -> int:
    from ._warmup import run_warmup, vllm_key_coverage, vllm_warm_from_model

    if args.key_scheme != "vllm":
        ignored = [name for name, value in (("--cache-salt", args.cache_salt), ("--vllm-layout", args.vllm_layout),
                                            ("--vllm-kv-cache-layout", args.vllm_kv_cache_layout)) if value is not None]
        if ignored:
            # kvtier's own keys would silently leave them out: every key would differ from the server's.
            raise ValueError(f"{ignored[0]} needs --key-scheme vllm (kvtier's own keys take --salt)")

    if args.key_scheme == "vllm":
        if args.model:
            warmed = vllm_warm_from_model(
                args.model, args.prompts, args.cache_dir, args.vllm_layout, cache_salt=args.cache_salt,
                retention_interval=args.retention_interval, kv_cache_layout=args.vllm_kv_cache_layout,
                extra_retained_tokens=args.extra_retained_tokens, dtype=args.dtype, device=args.device,
            )
            print(f"warmed {warmed.prompts} prompts: {warmed.chunks_stored} chunks stored, "
                  f"{warmed.chunks_present} already present")
        report = vllm_key_coverage(args.prompts, args.cache_dir, args.vllm_layout, cache_salt=args.cache_salt)
        for number, groups in enumerate(report, 1):
            print(f"prompt {number}: " + ", ".join(
                f"group {g}: {v['present']}/{v['chunks']} chunks ({v['leading']} leading)" for g, v in sorted(groups.items())))
        return 0
    if not args.model:
        print("kvtier: error: warmup needs --model (unless --key-scheme vllm)", file=sys.stderr)
        return EXIT_USER_ERROR

    summary = asyncio.run(
        run_warmup(
            args.model,
            args.prompts,
            args.cache_dir,
            salt=args.salt,
            device=args.device,
            dtype=args.dtype,
            block_size=args.block_size,
            blocks_per_chunk=args.blocks_per_chunk,
            extra_retained_tokens=args.extra_retained_tokens,
            progress=not args.no_progress and not args.json,
        )
    )
    if args.json:
        print(json.dumps(summary.to_dict() if hasattr(summary, "to_dict") else vars(summary), sort_keys=True, default=str))
    else:
        print(summary.format() if hasattr(summary, "format") else summary)
    missing = summary.chunks_dropped + summary.chunks_not_durable
    if missing:
        # A CI step that runs warmup must fail when the cache it promised is not all there.
        sys.stdout.flush()
        print(f"kvtier: error: {missing} chunks did not reach the disk in {args.cache_dir} "
              f"({summary.chunks_dropped} dropped, {summary.chunks_not_durable} failed to write: see the "
              "warnings above; a full disk?); the cache is incomplete: fix it and run warmup again "
              "(it resumes)", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


def _cmd_inspect(args) -> int:
    from ._maintenance import inspect_cache

    report = inspect_cache(args.cache_dir)
    if args.json:
        print(json.dumps(report.to_dict(), sort_keys=True))
        return 0
    mib = 1 << 20
    print(f"kvtier cache {report.cache_dir} ({report.tier}): {report.records} records, "
          f"{report.raw_bytes / mib:.1f} MiB raw, {report.stored_bytes / mib:.1f} MiB stored "
          f"({report.compression_ratio:.2f}x), data file {report.file_bytes / mib:.1f} MiB")
    for group, g in sorted(report.groups.items()):
        age = "never read" if g.oldest_access_age_s is None else (
            f"last access {g.newest_access_age_s:.0f}-{g.oldest_access_age_s:.0f} s ago")
        print(f"  group {group}: {g.records} records, {g.raw_bytes / mib:.1f} MiB raw, "
              f"{g.stored_bytes / mib:.1f} MiB stored ({g.compression_ratio:.2f}x, "
              f"{g.compressed_records} compressed), {age}")
    if report.segment_files or report.segment_records:
        print(f"  segment files: {report.segment_files}, {report.segment_file_bytes / mib:.1f} MiB on disk, "
              f"{report.segment_records} records, {report.segment_live_bytes / mib:.1f} MiB live "
              f"({report.segment_live_fraction:.0%} live)")
    if report.unreadable_headers:
        print(f"  {report.unreadable_headers} records have unreadable headers: run `kvtier verify`")
    return 0


def _cmd_verify(args) -> int:
    from ._maintenance import verify_cache

    try:
        report = verify_cache(args.cache_dir, quarantine=not args.no_quarantine)
    except CorruptCacheError as exc:
        # The file itself, not a record: nothing can be checked or quarantined record by record.
        raise CorruptCacheError(
            f"{exc}; no record was checked, quarantined or deleted: move {args.cache_dir}'s data.mdb and "
            "seg-*.kvs files aside (or delete them) and warm the cache again; an engine started with "
            "quarantine_corrupt_cache_dir on (the default) moves them aside itself"
        ) from exc
    bad = [(key.hex(), reason) for key, reason in report.corrupt]
    if args.json:
        print(json.dumps({"checked": report.checked, "ok": report.ok, "bad": [{"key": k, "reason": r} for k, r in bad],
                          "quarantined": report.quarantined}, sort_keys=True))
    else:
        print(f"kvtier verify: {report.checked} records checked, {report.ok} ok, {len(bad)} bad")
        for key, reason in bad:
            print(f"  bad {key}: {reason}")
    return 1 if bad else 0


def _cmd_gc(args) -> int:
    from ._maintenance import gc_cache

    result = gc_cache(args.cache_dir, args.max_bytes)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(f"kvtier gc: evicted {result['evicted_records']} records: stored bytes {result['bytes_before']} -> "
              f"{result['bytes_after']} (--max-bytes {args.max_bytes}); compacted {result['compacted_records']} records; "
              f"segment files {result['segment_files_before']} -> {result['segment_files_after']} "
              f"({result['segment_bytes_before']} -> {result['segment_bytes_after']} bytes); on disk "
              f"{result['disk_bytes_before']} -> {result['disk_bytes_after']} bytes (data.mdb keeps its size: "
              "LMDB reuses its freed pages)")
    return 0


def _cmd_bench(args) -> int:
    from .bench import run_bench_command

    if args.cache_dir is not None:
        _require_writable_dir("--cache-dir", args.cache_dir)
    busy = None if args.busy is None else [k for k in args.busy.split(",") if k and k != "none"]
    return run_bench_command(quick=args.quick, as_json=args.json, cache_dir=args.cache_dir, busy_kinds=busy)


def _cmd_replay(args) -> int:
    from .replay.command import run

    if args.cache_dir is not None:
        _require_writable_dir("--cache-dir", args.cache_dir)
    return run(args)


def _require_writable_dir(option: str, path: str) -> None:
    """A directory the command will write into: it exists as a directory (or its parent does, and it
    is made) and a file can be created in it. Checked before any work, so the error names the option."""
    if not path.strip():
        raise ValueError(f"{option} must not be empty")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{option} {path} is not a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(path) and not os.path.isdir(parent):
        # As for every cache directory: only the last component is made (a missing parent is most
        # often a disk that is not mounted).
        raise ValueError(f"{option} {path}: its parent {parent} does not exist (kvtier creates only the last "
                         "component; mount or create the parent first)")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"{option} {path} is not writable: {exc.strerror or exc}") from None


_COMMANDS = {
    "demo": _cmd_demo,
    "warmup": _cmd_warmup,
    "inspect": _cmd_inspect,
    "verify": _cmd_verify,
    "gc": _cmd_gc,
    "bench": _cmd_bench,
    "replay": _cmd_replay,
}


class _OncePerMessage(logging.Filter):
    """Print each distinct warning once per command: the demo runs two engines, and each would
    say "pressure unknown: NVML unavailable" again."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self._seen:
            return False
        self._seen.add(message)
        return True


def _configure_logging() -> None:
    # kvtier's warnings (pressure unknown, a quarantined cache directory) as one readable line each.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("kvtier: %(levelname)s: %(message)s"))
    handler.addFilter(_OncePerMessage())
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(handler)
        root.setLevel(logging.WARNING)


def user_error_message(exc: BaseException) -> Optional[str]:
    """The one-line message for a user mistake or an environment problem; ``None`` for a bug.

    kvtier's own errors, bad values (``ValueError``) and operating-system errors (missing, not a
    directory, read-only, full disk, permission) are the user's to fix; anything else (a
    ``TypeError``, an ``AssertionError`` inside kvtier) is a bug and keeps its traceback.
    """
    from kvtier.errors import EngineInvariantError

    if isinstance(exc, EngineInvariantError):
        return None
    if isinstance(exc, (KvtierError, ValueError)):
        return str(exc) or type(exc).__name__
    if isinstance(exc, OSError):
        text = exc.strerror or str(exc) or type(exc).__name__
        names = [n for n in (exc.filename, exc.filename2) if n is not None]
        return f"{': '.join(map(str, names))}: {text}" if names else text
    return None


def main(argv: Optional[List[str]] = None) -> int:
    try:
        # Parsing imports (the --max-bytes converter's parse_size pulls in the engine): a Ctrl-C
        # there is an interrupt like any other, not a traceback.
        parser = build_parser()
        argv = _join_signed_values(sys.argv[1:] if argv is None else argv)
        unknown = _unknown_leading_option(parser, argv)
        if unknown is not None:
            parser.error(f"unrecognized option {unknown}")
        args = parser.parse_args(argv)
        _configure_logging()
        code = _COMMANDS[args.command](args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return code
    except KeyboardInterrupt:
        if _terminated:
            print("kvtier: terminated", file=sys.stderr)
            return EXIT_TERMINATED
        print("kvtier: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`kvtier verify | head`): nothing left to say to it. Point stdout
        # at /dev/null so the interpreter's final flush does not raise again.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_BROKEN_PIPE
    except Exception as exc:
        message = user_error_message(exc)
        if message is None:
            raise
        print(f"kvtier: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
