"""One "host" of the fleet tests: an engine process over its own cache directory and a shared
remote tier. Run as ``python remote_fleet_child.py MODE URL CACHE_DIR NAMESPACE BYTES_FILE``.

``store``: produce a fixed prompt, wait until durable, close (which lands the write-behind), and
write the producer's chunk bytes to BYTES_FILE (raw bytes + a JSON index; no pickle).
``load``: for each directory in CACHE_DIR (comma-separated), start an engine over it (a restart
of this host's engine: nothing carried over but the directory), look up the prompt + 1 token, load
it, check every loaded byte against BYTES_FILE, close. Prints one JSON line: the result per start.
"""

import asyncio
import json
import sys

import torch

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.tools.testing.scenario import DEFAULT_TEST_LAYOUT, OffloadScenario, make_cpu_device

PROMPT = list(range(1000, 1033))  # 33 tokens: FA chunks {0, 1}, SWA chunks up to block 7


async def main(mode: str, url: str, cache_dir: str, namespace: str, bytes_file: str) -> dict:
    layout = DEFAULT_TEST_LAYOUT
    config = EngineConfig(cache_dir=cache_dir, host_capacity_bytes=1 << 20, remote_url=url,
                          remote_namespace=namespace, remote_timeout_s=2.0)
    async with OffloadEngine(layout, make_cpu_device(layout), config, fingerprint=b"fleet-model") as engine:
        scenario = OffloadScenario(engine)
        if mode == "store":
            record = await scenario.produce(PROMPT)
            assert record.durable
            await engine.flush()
            index = []
            with open(bytes_file, "wb") as f:
                for key, blocks in scenario.producer_bytes.items():
                    shapes = [[list(t.shape) for t in layers] for layers in blocks]
                    index.append({"key": key.hex(), "shapes": shapes})
                    for layers in blocks:
                        for t in layers:
                            f.write(t.contiguous().numpy().tobytes())
            with open(bytes_file + ".json", "w") as f:
                json.dump(index, f)
            out = {"stored": {g: sorted(b) for g, b in record.stored.items()}}
        else:
            with open(bytes_file + ".json") as f:
                index = json.load(f)
            with open(bytes_file, "rb") as f:
                data = f.read()
            pos = 0
            for entry in index:
                blocks = []
                for shapes in entry["shapes"]:
                    layers = []
                    for shape in shapes:
                        n = 1
                        for d in shape:
                            n *= d
                        layers.append(torch.frombuffer(bytearray(data[pos:pos + n]), dtype=torch.uint8).view(shape))
                        pos += n
                    blocks.append(layers)
                scenario.producer_bytes[bytes.fromhex(entry["key"])] = blocks
            chunks_indexed = len(engine.disk_index)
            record = await scenario.consume(PROMPT + [7])  # checks every loaded byte
            out = {"hit": record.hit, "ok": record.ok,
                   "loaded": {g: sorted(b) for g, b in record.loaded.items()},
                   "indexed": chunks_indexed}
        await engine.flush()
        await engine.disk_tier.flush()  # promotions and write-behind copies in flight
        disk = engine.disk_tier.statistics()
        extra = disk.extra if hasattr(disk, "extra") else {}
        out["remote_puts"] = extra.get("remote.puts", 0)
        out["remote_hits"] = extra.get("hits.remote", 0)
        out["lmdb_hits"] = extra.get("hits.lmdb", 0)
        out["writebehind_chunks"] = extra.get("writebehind_chunks", 0)
        out["promotions"] = extra.get("promotions", 0)
    return out


async def run(mode: str, url: str, cache_dirs: str, namespace: str, bytes_file: str) -> list:
    return [await main(mode, url, d, namespace, bytes_file) for d in cache_dirs.split(",")]


if __name__ == "__main__":
    print(json.dumps(asyncio.run(run(*sys.argv[1:6]))))
