"""Fault suite, other processes on one cache directory: a reader killed -9 while this process keeps
writing (its stale reader slot is cleared and the data file stops growing); a warmup-like writer
process writing while this process serves reads from the same directory; a forked child with an
open tier (every call raises ``ForkedProcessError``) and a spawned one (opens its own tier)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path
from typing import Dict, List, Set

import pytest

from kvtier.errors import ForkedProcessError
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tools.testing.children import check_cache, chunk_content, make_batch, parse_key, read_line, run_child
from kvtier.tools.testing.fault_child import spawn_reader
from kvtier.tools.testing.faults import corrupt_stored_record

CHUNK = 64 << 10


def data_size(cache: Path) -> int:
    return (cache / "data.mdb").stat().st_size


def segment_bytes(cache: Path) -> int:
    total = 0
    for path in cache.glob("seg-*.kvs"):
        try:
            total += path.stat().st_size
        except FileNotFoundError:
            pass  # deleted since the listing
    return total


def reader_pids(tier: LmdbTier) -> Set[int]:
    """Pids in the environment's reader table (``mdb_reader_list``: "pid thread txnid" lines)."""
    pids = set()
    for line in tier._db.env.readers().splitlines()[1:]:
        parts = line.split()
        if parts and parts[0].isdigit():
            pids.add(int(parts[0]))
    return pids


async def write_delete_cycles(tier: LmdbTier, cycles: int, first_batch: int) -> None:
    for i in range(cycles):
        items = make_batch(7, first_batch + i, [CHUNK] * 4)
        await tier.put_many(items)
        await tier.delete_many([k for k, _, _ in items])


@pytest.mark.asyncio
async def test_a_reader_killed_mid_transaction_is_cleared_and_the_file_stops_growing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    async with await LmdbTier.open(cache, map_size_bytes=1 << 20, reader_check_interval_s=0.1) as tier:
        keep = make_batch(7, 0, [CHUNK] * 2)
        await tier.put_many(keep)
        proc = run_child(["hold-reader", "--dir", str(cache)], tmp_path / "stderr")
        try:
            words = (await asyncio.to_thread(read_line, proc, 60)).split()
            assert words[0] == "holding" and int(words[2]) == 2, words
            pid = int(words[1])
            assert pid in reader_pids(tier)
            start = data_size(cache)
            # The reader's snapshot pins every page freed after it: the file must grow meanwhile.
            await write_delete_cycles(tier, 40, 1)
            grown_with_reader = data_size(cache) - start
        finally:
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait)
        # The tier's timer runs reader_check(): the dead pid's slot goes.
        deadline = time.monotonic() + 10
        while tier.statistics().as_dict()["stale_readers_cleared"] < 1 and time.monotonic() < deadline:
            await write_delete_cycles(tier, 1, 1000)
            await asyncio.sleep(0.05)
        assert tier.statistics().as_dict()["stale_readers_cleared"] >= 1
        assert pid not in reader_pids(tier)
        # The writer keeps going; freed pages are reused again, so the file stays put.
        cleared = data_size(cache)
        await write_delete_cycles(tier, 200, 2000)
        grown_after = data_size(cache) - cleared
        assert grown_with_reader >= 20 * 4 * CHUNK, grown_with_reader  # the stale slot did pin pages
        assert grown_after <= 8 * CHUNK, f"the file grew {grown_after} bytes in 200 cycles after the clear"
        await tier.flush()
        assert await tier.check() == []
        bufs = [bytearray(CHUNK) for _ in keep]
        assert await tier.get_many_into([(k, memoryview(b)) for (k, _, _), b in zip(keep, bufs)]) == [m for _, m, _ in keep]
        assert [bytes(b) for b in bufs] == [bytes(r) for _, _, r in keep]
        stats = tier.statistics().as_dict()
    print(
        f"fault-suite: reader kill -9: stale slot of pid {pid} cleared ({int(stats['stale_readers_cleared'])}); "
        f"data file grew {grown_with_reader >> 10} KiB in 40 write/delete cycles behind the live reader, "
        f"{grown_after >> 10} KiB in 200 cycles after the clear"
    )


@pytest.mark.asyncio
@pytest.mark.parametrize("store", ["inline", "segments"])
async def test_a_warmup_process_writes_while_this_process_serves_reads(tmp_path: Path, store: str) -> None:
    cache = tmp_path / "cache"
    window = 8
    # segments: records of 8 KiB and more in segment files of 1 MiB, so that the writer's deletes
    # empty and delete whole segment files while this process reads from them
    threshold = 0 if store == "inline" else 8 << 10
    proc = run_child(["warmup-writer", "--dir", str(cache), "--seed", "11", "--duration-s", "3", "--window", str(window),
                      "--segment-threshold-bytes", str(threshold)],
                     tmp_path / "stderr")
    lines: List[str] = []
    try:
        assert await asyncio.to_thread(read_line, proc, 60) == "ready"
        collector = asyncio.create_task(asyncio.to_thread(lambda: [l.decode().rstrip("\n") for l in proc.stdout]))
        rng = random.Random(11)
        reads = hits = 0
        missed: Set[bytes] = set()
        peak_size = peak_segments = 0
        async with await LmdbTier.open(cache, readonly=True) as reader:
            while not collector.done():
                keys = await reader.list_keys()
                sample = rng.sample(keys, min(16, len(keys)))
                bufs = [bytearray(parse_key(k).nbytes) for k in sample]
                metas = await reader.get_many_into([(k, memoryview(b)) for k, b in zip(sample, bufs)])
                for key, meta, buf in zip(sample, metas, bufs):
                    reads += 1
                    if meta is None:
                        missed.add(key)  # deleted between the listing and the read, checked below
                    else:
                        hits += 1
                        assert bytes(buf) == chunk_content(key), "the reader got wrong bytes"
                peak_size = max(peak_size, data_size(cache))
                peak_segments = max(peak_segments, segment_bytes(cache))
                await asyncio.sleep(0.005)
            stats = reader.statistics().as_dict()
            final_keys = set(await reader.list_keys())
        lines = await collector
    finally:
        if proc.poll() is None:
            proc.kill()
        await asyncio.to_thread(proc.wait)
    assert proc.returncode == 0, (tmp_path / "stderr").read_text()[-2000:]
    assert stats["errors"] == stats["corrupt"] == stats["mismatched"] == 0, stats
    acked: Dict[int, List[bytes]] = {}
    deleted: Set[int] = set()
    done = {}
    for line in lines:
        word, _, rest = line.partition(" ")
        if word == "ack":
            batch, *keys = rest.split()
            acked[int(batch)] = [bytes.fromhex(k) for k in keys]
        elif word == "del":
            deleted.add(int(rest))
        elif word == "done":
            done = json.loads(rest)
    assert done and done["errors"] == 0 and done["batches"] == len(acked)
    for key in missed:  # a miss is only ever a chunk the writer deleted
        assert parse_key(key).batch in deleted, f"missed a live chunk of batch {parse_key(key).batch}"
    live = {k for b, keys in acked.items() if b not in deleted for k in keys}
    assert final_keys == live and len(deleted) == len(acked) - window
    written = done["written_bytes"]
    # Bounded growth: the file holds the window (~8 batches of <= 6 x 64 KiB) plus LMDB's copy-on-write
    # slack, however much went through it.
    assert peak_size <= 16 << 20 and written >= 4 * peak_size, (peak_size, written)
    # Segment files too: emptied ones are deleted, so they hold about the window, not what went through.
    assert peak_segments <= 16 << 20 and written >= 4 * peak_segments, (peak_segments, written)
    assert (peak_segments > 0) == (store == "segments"), peak_segments  # not vacuous
    check = await asyncio.to_thread(check_cache, str(cache))
    assert check.problems == [] and check.records == len(live)
    print(
        f"fault-suite: second process ({store}): warmup writer wrote {len(acked)} batches ({written >> 20} MiB, "
        f"{len(deleted)} deleted, {int(done['map_growths'])} map growths) while this process made {reads} reads "
        f"({hits} hits, {len(missed)} misses of deleted chunks), 0 errors; data file peaked at {peak_size >> 20} MiB, "
        f"segment files at {peak_segments >> 20} MiB"
    )


# ----------------------------------------------------------------------------------- fork, spawn


def _forked_child_calls(tier: LmdbTier, key: bytes, item) -> Dict[str, str]:
    """In the forked child: every call on the parent's tier; what each did instead of raising
    ForkedProcessError (empty: all refused)."""
    loop = asyncio.new_event_loop()
    calls = {
        "put_many": lambda: loop.run_until_complete(tier.put_many([item])),
        "get_many_into": lambda: loop.run_until_complete(tier.get_many_into([(key, memoryview(bytearray(16)))])),
        "delete_many": lambda: loop.run_until_complete(tier.delete_many([key])),
        "contains_many": lambda: loop.run_until_complete(tier.contains_many([key])),
        "list_keys": lambda: loop.run_until_complete(tier.list_keys()),
        "flush": lambda: loop.run_until_complete(tier.flush()),
        "check": lambda: loop.run_until_complete(tier.check()),
        "close": lambda: loop.run_until_complete(tier.close()),
        "close_sync": tier.close_sync,
        "iter_records": lambda: next(tier.iter_records()),
        "verify": tier.verify,
        "gc": lambda: tier.gc(0),
        "corrupt_stored_record": lambda: corrupt_stored_record(tier, key),
        "quarantined_keys": tier.quarantined_keys,
        "statistics": tier.statistics,
        "context manager": lambda: tier.__exit__(None, None, None),
    }
    wrong = {}
    for name, call in calls.items():
        try:
            call()
        except ForkedProcessError:
            continue
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            wrong[name] = f"{type(exc).__name__}: {exc}"
        else:
            wrong[name] = "returned"
    return wrong


@pytest.mark.asyncio
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
async def test_a_forked_child_cannot_touch_the_parent_environment(tmp_path: Path) -> None:
    items = make_batch(5, 0, [4096, 30000])
    async with await LmdbTier.open(tmp_path / "cache") as tier:
        await tier.put_many(items)
        key = items[0][0]
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, then leave without running any cleanup of the parent's
            code = 3
            try:
                signal.alarm(20)  # a call that blocks instead of raising must not hang the test
                os.close(r)
                wrong = _forked_child_calls(tier, key, items[1])
                os.write(w, json.dumps(wrong).encode())
                code = 0 if not wrong else 1
            finally:
                os._exit(code)
        os.close(w)
        report = await asyncio.to_thread(lambda: os.read(r, 1 << 16))
        os.close(r)
        _, status = await asyncio.to_thread(os.waitpid, pid, 0)
        assert os.WIFEXITED(status), f"the forked child died of signal {os.WTERMSIG(status)}"
        assert os.WEXITSTATUS(status) == 0, f"calls in the forked child that did not raise ForkedProcessError: {report.decode()}"
        # The parent's tier is untouched and works.
        assert await tier.contains_many([k for k, _, _ in items]) == [True, True]
        await tier.put_many(make_batch(5, 1, [100]))
        assert (await asyncio.to_thread(tier.verify)).ok == 3


@pytest.mark.asyncio
async def test_a_spawned_process_opens_its_own_tier(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    items = make_batch(6, 0, [700, 4096, 65536])
    async with await LmdbTier.open(cache) as tier:
        await tier.put_many(items)
        keys = [k.hex() for k, _, _ in items]
        ctx = multiprocessing.get_context("spawn")
        codes = []
        for readonly in (True, False):
            child = ctx.Process(target=spawn_reader, args=(str(cache), keys, readonly))
            child.start()
            await asyncio.to_thread(child.join, 120)
            codes.append(child.exitcode)
        assert codes == [0, 0], codes
        assert await tier.contains_many([k for k, _, _ in items]) == [True] * 3
