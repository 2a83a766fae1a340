"""The ``kvtier`` command: demo, warmup, inspect, verify, gc, bench.

Primitives: ``main(argv)`` (the console entry point), ``build_parser``. User mistakes (bad paths,
bad values, kvtier's own errors) print one line ``kvtier: error: ...`` and exit 2; everything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import sys
import tempfile
from typing import List, Optional

from kvtier.policy import KvtierError

__all__ = ["main", "build_parser"]


def _size(text: str) -> int:
    from kvtier.engine.config import parse_size

    try:
        return parse_size(text, "--max-bytes")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="Keep an LLM server's KV cache beyond GPU memory: host slabs, LMDB on NVMe, exact SWA/MTP coverage.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser("demo", help="store and restore KV through the engine on a built-in hybrid layout, checking every byte")
    demo.add_argument("--cache-dir", help="cache directory (default: a fresh temporary directory, removed afterwards)")
    demo.add_argument("--keep", action="store_true", help="keep the temporary cache directory")
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    demo.add_argument("--producers", type=int, default=12, help="producer requests (default 12)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--remote", metavar="URL|embedded",
        help="chain a remote tier behind LMDB: 'embedded' starts a local Valkey on 127.0.0.1, or "
        "redis://host:port / redis+cluster://h1:p1,h2:p2; a second host then loads from it",
    )

    warmup = sub.add_parser("warmup", help="run a local transformers model over prompts and fill the disk tier")
    warmup.add_argument("--model", required=True, help="directory of a Hugging Face causal LM (no downloads)")
    warmup.add_argument("--prompts", required=True, help="JSONL file; each line has 'text' or 'token_ids'")
    warmup.add_argument("--cache-dir", required=True)
    warmup.add_argument("--salt", help="tenant salt bound into every key")
    warmup.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    warmup.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    warmup.add_argument("--block-size", type=int, default=16)
    warmup.add_argument("--blocks-per-chunk", type=int, default=1)
    warmup.add_argument("--extra-retained-tokens", type=int, default=0, help="MTP extra retained tokens R")
    warmup.add_argument("--json", action="store_true")
    warmup.add_argument("--no-progress", action="store_true")

    inspect = sub.add_parser("inspect", help="records per group, bytes raw and stored, compression, age")
    inspect.add_argument("--cache-dir", required=True)
    inspect.add_argument("--json", action="store_true")

    verify = sub.add_parser("verify", help="read and check every record; exit 1 when any is bad")
    verify.add_argument("--cache-dir", required=True)
    verify.add_argument("--no-quarantine", action="store_true", help="only report bad records, move nothing")
    verify.add_argument("--json", action="store_true")

    gc = sub.add_parser("gc", help="evict least-recently-used records down to a byte bound")
    gc.add_argument("--cache-dir", required=True)
    gc.add_argument("--max-bytes", required=True, type=_size, help="bound, e.g. 1073741824 or 1GiB")
    gc.add_argument("--json", action="store_true")

    bench = sub.add_parser("bench", help="benchmark tiers and engine against raw baselines measured in the same run")
    bench.add_argument("--quick", action="store_true", help="a smaller run, under a minute")
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--cache-dir", help="directory on the filesystem to measure (default: a temporary one)")
    return parser


def _cmd_demo(args) -> int:
    from tqdm import tqdm

    from .demo import format_summary, run_demo
    from .valkey import remote_server

    if args.producers < 1:
        raise ValueError(f"--producers must be >= 1, got {args.producers}")
    temporary = args.cache_dir is None
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="kvtier-demo-")
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
    if args.json:
        print(json.dumps(summary.to_dict(), sort_keys=True))
    else:
        print(format_summary(summary))
        if temporary and args.keep:
            print(f"  cache kept at        {cache_dir}")
    return 0 if summary.verified else 1


def _cmd_warmup(args) -> int:
    from .warmup import run_warmup

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
    return 0


def _cmd_inspect(args) -> int:
    from .maintenance import inspect_cache

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
    if report.unreadable_headers:
        print(f"  {report.unreadable_headers} records have unreadable headers: run `kvtier verify`")
    return 0


def _cmd_verify(args) -> int:
    from .maintenance import verify_cache

    report = verify_cache(args.cache_dir, quarantine=not args.no_quarantine)
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
    from .maintenance import gc_cache

    result = gc_cache(args.cache_dir, args.max_bytes)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(f"kvtier gc: evicted {result['evicted_records']} records, "
              f"{result['bytes_before']} -> {result['bytes_after']} bytes")
    return 0


def _cmd_bench(args) -> int:
    from .bench import run_bench_command

    return run_bench_command(quick=args.quick, as_json=args.json, cache_dir=args.cache_dir)


_COMMANDS = {
    "demo": _cmd_demo,
    "warmup": _cmd_warmup,
    "inspect": _cmd_inspect,
    "verify": _cmd_verify,
    "gc": _cmd_gc,
    "bench": _cmd_bench,
}


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # kvtier's warnings (pressure unknown, a quarantined cache directory) as one readable line each.
    logging.basicConfig(level=logging.WARNING, format="kvtier: %(levelname)s: %(message)s", stream=sys.stderr)
    try:
        return _COMMANDS[args.command](args)
    except (KvtierError, ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
