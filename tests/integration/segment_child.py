"""A second OS process holding an ``LmdbTier`` open on a cache directory, driven step by step by a
test (test_lmdb_segment_files.py): one JSON command per line on stdin, one JSON answer per line on
stdout, so the test chooses exactly where its steps fall between the other process's.

    python segment_child.py CACHE_DIR '{"segment_threshold_bytes": 16384, ...}'

Commands: ``{"op": "put", "seed": s, "batch": b, "sizes": [...]}`` (answers the sequence once the
batch is acknowledged), ``{"op": "read", ...same...}`` (answers, per chunk, whether it came back
bitwise, and the tier's corrupt and quarantined counts), ``{"op": "close"}`` (closes and exits).
Keyword arguments of the tier come as JSON; ``"codec": "raw"`` means ``CodecConfig(compress=False)``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Dict

from kvtier.tiers.lmdb import LmdbTier
from kvtier.tiers.record_format import CodecConfig
from kvtier.tools.testing.children import chunk_content, make_batch


async def _serve(path: str, kwargs: Dict[str, object]) -> None:
    if kwargs.pop("codec", None) == "raw":
        kwargs["codec"] = CodecConfig(compress=False)
    loop = asyncio.get_running_loop()
    tier = await LmdbTier.open(path, **kwargs)
    print(json.dumps({"ok": True, "opened": path}), flush=True)
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        command = json.loads(line)
        op = command["op"]
        if op == "close":
            await tier.close()
            print(json.dumps({"ok": True}), flush=True)
            return
        items = make_batch(command["seed"], command["batch"], command["sizes"])
        if op == "put":
            sequence = await tier.put_many(items)
            print(json.dumps({"ok": True, "sequence": sequence}), flush=True)
        elif op == "read":
            bufs = [bytearray(it[2].nbytes) for it in items]
            metas = await tier.get_many_into([(it[0], memoryview(b)) for it, b in zip(items, bufs)])
            bitwise = [m is not None and bytes(b) == chunk_content(it[0]) for m, b, it in zip(metas, bufs, items)]
            await tier.flush()  # a quarantine the read queued is committed before the answer
            stats = tier.statistics()
            print(json.dumps({"ok": True, "bitwise": bitwise, "corrupt": stats.corrupt,
                              "quarantined": stats.quarantined}), flush=True)
        else:
            raise ValueError(f"unknown op {op!r}")
    await tier.close()


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}))
