"""Bench rows for the SGLang backend: kvtier's ``KvtierHiCacheStorage`` beside SGLang's ``HiCacheFile``.

``python -m kvtier.tools.bench.sglang [--dir DIR] [--mib 64]``: per page size (256 KiB, 1 MiB,
4 MiB), ``--mib`` MiB of random pages written and read back through each backend the way SGLang's
cache controller calls it: kvtier through the zero-copy v1 calls (``interface_v1``, raw records,
durable when acknowledged), ``HiCacheFile`` through ``batch_set`` / ``batch_get`` of flat pages,
with an ``fsync`` of each file added to its write (the same durability; as shipped it does not
sync). Reads follow the writes, so they come from the page cache for both. Every byte read back is
compared with what was written. Needs SGLang (``requirements-sglang.txt``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch

from kvtier.integrations.sglang.testing import PageHostPool

__all__ = ["run", "main"]

PAGE_TOKENS = 16
HEADS, HEAD_DIM = 8, 128  # bf16: 4 KiB of K+V per token and layer
BATCH_PAGES = 32
SIZES = {"256 KiB": 4, "1 MiB": 16, "4 MiB": 64}  # label -> layers (a page is 64 KiB per layer)


def _config(extra: Dict):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="kvtier-bench", extra_config=extra)


def _fsync_file_backend(path: Path):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    class SyncedHiCacheFile(HiCacheFile):
        """HiCacheFile, each page file fsynced once written (as durable as kvtier's acknowledged pages)."""

        def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
            ok = super().set(key, value, target_location, target_sizes)
            if ok:
                fd = os.open(os.path.join(self.file_path, f"{self._get_suffixed_key(key)}.bin"), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            return ok

    return SyncedHiCacheFile(_config({"file_storage_path": str(path)}))


def _row(pages: int, layers: int, root: Path) -> Dict[str, float]:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    pool = PageHostPool(num_pages=pages, page_size=PAGE_TOKENS, layer_num=layers, head_num=HEADS, head_dim=HEAD_DIM)
    written = [pool.fill_page(i * PAGE_TOKENS, i) for i in range(pages)]
    page_bytes = len(written[0])
    hashes = [f"bench-{layers}-{i}" for i in range(pages)]
    batches = [range(i, min(i + BATCH_PAGES, pages)) for i in range(0, pages, BATCH_PAGES)]
    total = pages * page_bytes
    out: Dict[str, float] = {}

    kvtier = StorageBackendFactory.create_backend("dynamic", _config({
        "backend_name": "kvtier", "module_path": "kvtier.integrations.sglang", "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1, "cache_dir": str(root / "kvtier"), "compression": 0}), None)
    kvtier.register_mem_pool_host(pool)
    indices = [torch.arange(b.start * PAGE_TOKENS, b.stop * PAGE_TOKENS) for b in batches]
    started = time.perf_counter()
    ok = all(all(kvtier.batch_set_v1([hashes[i] for i in b], idx)) for b, idx in zip(batches, indices))
    out["kvtier write MB/s"] = total / (time.perf_counter() - started) / 1e6
    pool.kv_buffer.zero_()
    started = time.perf_counter()
    ok = ok and all(all(kvtier.batch_get_v1([hashes[i] for i in b], idx)) for b, idx in zip(batches, indices))
    out["kvtier read MB/s"] = total / (time.perf_counter() - started) / 1e6
    ok = ok and [pool.page_bytes(i * PAGE_TOKENS) for i in range(pages)] == written
    kvtier.close()

    file = _fsync_file_backend(root / "file")
    file.register_mem_pool_host(pool)
    started = time.perf_counter()
    for b in batches:  # SGLang's generic page path: flat pages out of the host pool
        ok = ok and file.batch_set([hashes[i] for i in b], [pool.get_data_page(i * PAGE_TOKENS) for i in b])
    out["file+fsync write MB/s"] = total / (time.perf_counter() - started) / 1e6
    pool.kv_buffer.zero_()
    started = time.perf_counter()
    for b in batches:
        got = file.batch_get([hashes[i] for i in b], [pool.get_dummy_flat_data_page() for _ in b])
        for i, page in zip(b, got):
            ok = ok and page is not None
            pool.set_from_flat_data_page(i * PAGE_TOKENS, page)
    out["file read MB/s"] = total / (time.perf_counter() - started) / 1e6
    ok = ok and [pool.page_bytes(i * PAGE_TOKENS) for i in range(pages)] == written
    if not ok:
        raise RuntimeError("bench: a page was not stored or did not read back bitwise")
    return out


def run(directory: Path, mib: int) -> List[Dict[str, object]]:
    """One row per page size: MB/s of kvtier's backend and of HiCacheFile + fsync."""
    rows: List[Dict[str, object]] = []
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # --dir names a place that may not exist yet
    for label, layers in SIZES.items():
        page_bytes = PAGE_TOKENS * layers * 2 * HEADS * HEAD_DIM * 2
        root = Path(tempfile.mkdtemp(prefix="kvtier-bench-sglang-", dir=directory))
        try:
            rows.append({"page": label, **_row(max(BATCH_PAGES, (mib << 20) // page_bytes), layers, root)})
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def main(argv: "List[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the backends' directories go")
    parser.add_argument("--mib", type=int, default=64, help="MiB written and read per page size")
    args = parser.parse_args(argv)
    rows = run(Path(args.dir), args.mib)
    columns = list(rows[0])
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(f"{row[c]:.0f}" if isinstance(row[c], float) else str(row[c]) for c in columns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
