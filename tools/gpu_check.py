"""The decisive first GPU run: one prepared script (at most ~8 minutes on one GPU) for the CUDA paths
the CPU suite cannot reach.

    python -m kvtier.tools.gpu_check [--cache-dir DIR] [--skip-vllm] [--only NAME[,NAME...]]

Every check prints ``PASS``/``FAIL``/``SKIP name: numbers``; the checks that prove an order also run
a *control* (the same copy without the order) that must show the race, so a pass means something.

CPU checks (run everywhere): ``staged_path`` (the CUDA code path on CPU: bitwise round trip, one
host copy per chunk), ``headroom`` (a reserved pool at 92% reads as room, an allocation leaving no
room for staging backs off).

CUDA checks: ``bandwidth`` (raw pinned vs pageable copies), ``throughput`` (the view's store and
load at 256 KiB / 1 MiB / 4 MiB chunks over 32 layers as a ratio of the raw pinned copy; goal
>= 0.85 at 1-4 MiB), ``order_d2h`` / ``order_h2d`` (a compute stream writing, or reading, the blocks
while the copy is queued; control: an unordered copy must see the race), ``other_thread`` (a store
whose KV is written on another thread's stream, ordered by its ``ready_event``),
``overwrite_after_release`` (blocks overwritten right after ``wait_released``), ``own_streams``
(kvtier's copy streams are not torch's pooled ones; control: 33 pooled streams repeat one),
``register_error`` (a failed ``cudaHostRegister`` leaves no error for the next kernel; control: one
left uncleared does break it), ``register_4gib`` (time to pre-fault and pin 4 GiB), ``nvml``
(NVML by UUID and torch agree on the GPU), ``store_at_92`` (the engine stores with the device 92%
used), ``engine`` (a store/load round trip, host and disk), ``vllm`` (a real ``vllm.LLM`` with
``KvtierTier``: the second request's ``num_cached_tokens`` and records in the cache directory),
``sglang`` (a real ``sglang.Engine`` with kvtier as its HiCache L3 backend: kvtier's CPU test host
pool against SGLang's real one, then greedy outputs with and without the prefix restored from
kvtier after a flush). The serving checks live in ``_gpu_serving.py``; ``--skip-vllm`` leaves both out.

Exit 0: every check passed; 1: a FAIL; 3: no CUDA device (the CPU checks ran and passed, every
CUDA check said SKIP).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

if TYPE_CHECKING:
    from kvtier.engine import EngineConfig

EXIT_NO_GPU = 3
MiB, GiB = 1 << 20, 1 << 30


class CheckFailed(AssertionError):
    """A check's condition did not hold; the message carries the numbers."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


# -- checks that run on CPU too ---------------------------------------------------------------------


def check_staged_path() -> str:
    import torch

    from kvtier.policy import AttentionGroup, ModelLayout
    from kvtier.tiers.device import DeviceKVView
    from kvtier.tools.testing.device import RecordingBackend

    layout = ModelLayout(groups=(AttentionGroup(16, blocks_per_chunk=4),))
    layers = [torch.randint(0, 256, (64, 16, 2, 8), dtype=torch.uint8).view(torch.bfloat16) for _ in range(32)]
    backend = RecordingBackend()
    view = DeviceKVView(layout, [layers], backend=backend)
    chunks = [[(7 * c + 3 * i) % 64 for i in range(4)] for c in range(8)]
    slots = [torch.empty(view.chunk_nbytes(0), dtype=torch.uint8) for _ in chunks]
    view.gather_many_groups([(0, ids, slot) for ids, slot in zip(chunks, slots)])
    for ids, slot in zip(chunks, slots):
        expected = torch.cat([layer[ids].contiguous().view(torch.uint8).reshape(-1) for layer in layers])
        _require(torch.equal(slot, expected), f"gathered bytes differ for blocks {ids}")
    _require(backend.copies == len(chunks), f"{backend.copies} host copies for {len(chunks)} chunks")
    return f"{len(chunks)} chunks x 32 layers gathered bitwise in {backend.copies} host copies (1 per chunk)"


def check_headroom() -> str:
    from kvtier.engine.pressure import PressureMonitor, nvml_device_headroom_source
    from kvtier.tools.testing.pressure import FakeNvmlLibrary

    total, need = 141 * GiB, 128 * MiB
    nvml = FakeNvmlLibrary(total, [int(0.92 * total)] * 3 + [total - 100 * MiB, total - 150 * MiB, total - 2 * GiB])
    monitor = PressureMonitor({"device": nvml_device_headroom_source(need, uuid="GPU-fake-0", nvml=nvml)})
    states = [monitor.poll_once() for _ in range(6)]
    _require(states == ["normal"] * 3 + ["high", "high", "normal"], f"states {states}")
    return "92% reserved: normal; 100 MiB free: high; 150 MiB: still high (band); 2 GiB: normal"


# -- CUDA checks ------------------------------------------------------------------------------------


def _timed(fn: Callable[[], object], repeat: int) -> float:
    """Seconds per call of ``fn`` (which queues GPU work), after one warm-up call."""
    import torch

    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeat


def _raw_bandwidth() -> Dict[str, float]:
    import torch

    from kvtier.tiers.device_backend import DeviceBackend

    nbytes = 256 * MiB
    backend = DeviceBackend("cuda")
    pinned = backend.host_buffer(nbytes)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.zero_()
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, host in (("pinned", pinned), ("pageable", pageable)):
        out[f"{name}_d2h"] = nbytes / _timed(lambda: host.copy_(device, non_blocking=True), 4) / 1e9
        out[f"{name}_h2d"] = nbytes / _timed(lambda: device.copy_(host, non_blocking=True), 4) / 1e9
    backend.release_host_buffer(pinned)
    return out


_BANDWIDTH: Dict[str, float] = {}


def check_bandwidth() -> str:
    _BANDWIDTH.update(_raw_bandwidth())
    b = _BANDWIDTH
    text = ", ".join(f"{k} {v:.1f} GB/s" for k, v in b.items())
    _require(b["pinned_d2h"] > b["pageable_d2h"] and b["pinned_h2d"] > b["pageable_h2d"],
             f"pinned is not faster than pageable: {text}")
    return text


def _view_of(chunk_bytes: int, num_layers: int = 32, per: int = 16, num_blocks: int = 1024):
    import torch

    from kvtier.policy import AttentionGroup, ModelLayout
    from kvtier.tiers.device import DeviceKVView

    block_bytes = chunk_bytes // (num_layers * per)  # one block of one layer
    layout = ModelLayout(groups=(AttentionGroup(16, blocks_per_chunk=per),))
    layers = [torch.randint(0, 256, (num_blocks, block_bytes), dtype=torch.uint8, device="cuda").view(torch.bfloat16)
              for _ in range(num_layers)]
    return DeviceKVView(layout, [layers]), layers


def check_throughput() -> str:
    import torch

    from kvtier.tiers.device_backend import DeviceBackend

    if not _BANDWIDTH:
        _BANDWIDTH.update(_raw_bandwidth())
    backend = DeviceBackend("cuda")
    results, failures = [], []
    for chunk_bytes, goal in ((256 << 10, 0.5), (1 * MiB, 0.85), (4 * MiB, 0.85)):
        view, _ = _view_of(chunk_bytes)
        count = 64  # chunks per batch: 16 MiB, 64 MiB, 256 MiB
        host = backend.host_buffer(count * chunk_bytes)
        slots = [host[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(count)]
        order = torch.randperm(count * 16).tolist()  # scattered blocks, as a real block table
        chunks = [order[i * 16 : (i + 1) * 16] for i in range(count)]
        store = _timed(lambda: view.gather_many_groups([(0, c, s) for c, s in zip(chunks, slots)]), 5)
        load = _timed(lambda: view.scatter_many_groups([(0, s, c) for c, s in zip(chunks, slots)]), 5)
        total = count * chunk_bytes
        store_ratio = total / store / 1e9 / _BANDWIDTH["pinned_d2h"]
        load_ratio = total / load / 1e9 / _BANDWIDTH["pinned_h2d"]
        results.append(f"{chunk_bytes >> 10} KiB: store {total / store / 1e9:.1f} GB/s ({store_ratio:.2f}x), "
                       f"load {total / load / 1e9:.1f} GB/s ({load_ratio:.2f}x)")
        if min(store_ratio, load_ratio) < goal:
            failures.append(f"{chunk_bytes >> 10} KiB below {goal}x")
        backend.release_host_buffer(host)
        del view
    text = "; ".join(results)
    _require(not failures, f"{', '.join(failures)}: {text}")
    return text


def _race_setup(chunk_bytes: int = 1 * MiB):
    import torch

    from kvtier.tiers.device_backend import DeviceBackend

    view, layers = _view_of(chunk_bytes, num_blocks=256)
    backend = DeviceBackend("cuda")
    host = backend.host_buffer(chunk_bytes)
    compute = torch.cuda.Stream()
    return view, layers, backend, host, compute


def _busy(stream, milliseconds: float = 50.0) -> None:
    """Keep ``stream`` busy for about ``milliseconds`` (a spin kernel, ~2 GHz) before its next work."""
    import torch

    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(2e6 * milliseconds))


def _race_both_ways(host_fill, on_compute, copy, measure):
    """One copy-ordering race, run "ordered" (the copy waits on the compute stream's event) and as
    a "control" (it waits on an unrelated stream's, so the race shows): the first 16 blocks of every
    layer hold 1 (the host buffer ``host_fill`` when given), the compute stream is kept busy and then
    runs ``on_compute(layers)``, then ``copy(view, blocks, host, ready_event)`` is queued.
    ``(outcomes, backend, host)``: ``outcomes[mode] = measure(host, what on_compute returned)``."""
    import torch

    view, layers, backend, host, compute = _race_setup()
    blocks = list(range(16))
    outcomes = {}
    for mode in ("ordered", "control"):
        for layer in layers:
            layer[:16].view(torch.uint8).fill_(1)
        if host_fill is not None:
            host.fill_(host_fill)
        torch.cuda.synchronize()
        _busy(compute)
        with torch.cuda.stream(compute):
            seen = on_compute(layers)
        ready = backend.ready_event(compute) if mode == "ordered" else backend.ready_event(torch.cuda.Stream())
        copy(view, blocks, host, ready)
        outcomes[mode] = measure(host, seen)
    return outcomes, backend, host


def check_order_d2h() -> str:
    import torch

    def forward_writes(layers):
        for layer in layers:
            layer[:16].view(torch.uint8).fill_(7)  # the forward pass writing the KV

    def store(view, blocks, host, ready):
        view.gather_many_groups([(0, blocks, host)], ready_event=ready)

    outcomes, backend, host = _race_both_ways(
        None, forward_writes, store, lambda host, _: (int((host == 7).sum()), int((host == 1).sum()))
    )
    _require(outcomes["ordered"][0] == host.numel(), f"ordered store read stale KV: {outcomes}")
    _require(outcomes["control"][1] > 0, f"control (unordered) saw no race, the check proves nothing: {outcomes}")
    backend.release_host_buffer(host)
    return f"ordered: {outcomes['ordered'][0]}/{host.numel()} bytes new; control: {outcomes['control'][1]} stale"


def check_order_h2d() -> str:
    import torch

    def forward_reads(layers):
        return [layer[:16].clone() for layer in layers]  # the forward pass still reading old KV

    def load(view, blocks, host, ready):
        view.scatter_many_groups([(0, host, blocks)], ready_event=ready)
        torch.cuda.synchronize()

    outcomes, backend, host = _race_both_ways(
        9, forward_reads, load, lambda host, seen: sum(int((s.view(torch.uint8) == 9).sum()) for s in seen)
    )
    _require(outcomes["ordered"] == 0, f"ordered load overwrote blocks still being read: {outcomes}")
    _require(outcomes["control"] > 0, f"control (unordered) saw no race, the check proves nothing: {outcomes}")
    backend.release_host_buffer(host)
    return f"ordered: reader saw 0 new bytes; control: reader saw {outcomes['control']} overwritten bytes"


def _engine_parts(num_layers: int = 8):
    import torch

    from kvtier.policy import AttentionGroup, ModelLayout
    from kvtier.tiers.device import DeviceKVView

    layout = ModelLayout(groups=(AttentionGroup(16),))
    layers = [torch.zeros(256, 2, 16, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(num_layers)]
    return layout, layers, DeviceKVView(layout, [layers])


def _engine_config(cache_dir: Optional[Path] = None, **overrides: Any) -> EngineConfig:
    from kvtier.engine import EngineConfig

    config = EngineConfig(host_capacity_bytes=256 * MiB, pressure_poll_interval_s=3600.0,
                          cache_dir=None if cache_dir is None else str(cache_dir))
    return dataclasses.replace(config, **overrides)


def check_other_thread() -> str:
    import torch

    from kvtier.engine import OffloadEngine

    layout, layers, view = _engine_parts()
    tokens = list(range(1, 65))  # 4 blocks of 16: one chunk per block

    async def run() -> Tuple[int, int]:
        async with OffloadEngine(layout, view, _engine_config(), fingerprint=b"gpu-check-thread") as engine:
            loop = asyncio.get_running_loop()
            stored = loop.create_future()

            def store_on_loop(event) -> None:
                try:
                    stored.set_result(engine.store(tokens, [[0, 1, 2, 3]], ready_event=event))
                except Exception as exc:  # reported by the check, not lost in a callback
                    stored.set_exception(exc)

            def server_thread() -> None:
                try:
                    stream = torch.cuda.Stream()
                    _busy(stream)
                    with torch.cuda.stream(stream):
                        for layer in layers:
                            layer[:4].fill_(3.0)
                    event = torch.cuda.Event()
                    event.record(stream)
                    loop.call_soon_threadsafe(store_on_loop, event)
                except Exception as exc:
                    loop.call_soon_threadsafe(stored.set_exception, exc)

            threading.Thread(target=server_thread, name="gpu-check-server").start()
            handle = await asyncio.wait_for(stored, 60)
            await handle.wait_released()
            for layer in layers:
                layer[:8].zero_()
            result = await engine.load(tokens + [1], 64, [[4, 5, 6, 7]])
            torch.cuda.synchronize()
            good = sum(int((layer[4:8] == 3.0).sum()) for layer in layers)
            return good, sum(layer[4:8].numel() for layer in layers) if result.ok else -1

    good, total = asyncio.run(run())
    _require(good == total, f"{good} of {total} restored values are the other thread's writes")
    return f"{good}/{total} values written on another thread's stream stored and restored"


def check_overwrite_after_release() -> str:
    import torch

    from kvtier.engine import OffloadEngine

    layout, layers, view = _engine_parts()
    tokens = list(range(1, 65))

    async def run() -> Tuple[int, int]:
        async with OffloadEngine(layout, view, _engine_config(), fingerprint=b"gpu-check-release") as engine:
            for layer in layers:
                layer[:4].fill_(5.0)
            handle = engine.store(tokens, [[0, 1, 2, 3]])
            await handle.wait_released()
            for layer in layers:
                layer[:4].fill_(-1.0)  # the server reuses the blocks at once
            result = await engine.load(tokens + [1], 64, [[8, 9, 10, 11]])
            torch.cuda.synchronize()
            good = sum(int((layer[8:12] == 5.0).sum()) for layer in layers)
            return good, (sum(layer[8:12].numel() for layer in layers) if result.ok else -1)

    good, total = asyncio.run(run())
    _require(good == total, f"{good} of {total} restored values predate the overwrite")
    return f"{good}/{total} restored values are the stored ones, not the overwrite"


def check_own_streams() -> str:
    import torch

    _, _, view = _engine_parts(num_layers=1)
    pooled = [torch.cuda.Stream() for _ in range(33)]
    handles = [s.cuda_stream for s in pooled]
    own = {view._d2h_stream.cuda_stream, view._h2d_stream.cuda_stream}
    _require(len(set(handles)) < len(handles), "control: 33 torch.cuda.Stream() were all distinct (no pool?)")
    _require(not own & set(handles) and len(own) == 2, f"kvtier's copy streams {own} are among torch's pooled ones")
    return f"33 pooled streams give {len(set(handles))} distinct; kvtier's two are outside the pool"


def check_register_error() -> str:
    import torch

    from kvtier.errors import DeviceError
    from kvtier.tiers.cuda_runtime import cuda_runtime
    from kvtier.tiers.device_backend import DeviceBackend, register_host_range

    runtime = cuda_runtime()
    if runtime is None:
        raise CheckFailed("libcudart not found in this process")
    backend = DeviceBackend("cuda")
    buffer = backend.host_buffer(4 * MiB)  # registered: registering it again fails
    cudart = torch.cuda.cudart()
    try:
        register_host_range(cudart, runtime, buffer.data_ptr(), 4 * MiB)
        raise CheckFailed("registering a registered range succeeded")
    except DeviceError as exc:
        cleared = "(error cleared)" in str(exc)
    (torch.ones(16, device="cuda") * 2).sum().item()  # a kernel launch: must not see the old error
    code = int(cudart.cudaHostRegister(buffer.data_ptr(), 4 * MiB, 1))  # control: left pending
    try:
        (torch.ones(16, device="cuda") * 2).sum().item()
        control = "the next kernel passed (the runtime kept no error)"
    except RuntimeError as exc:
        control = f"the next kernel failed: {str(exc).splitlines()[0]}"
    runtime.get_last_error()
    backend.release_host_buffer(buffer)
    _require(cleared, "the failed registration's error was not cleared")
    _require(control.startswith("the next kernel failed"), f"control did not fail, the check proves nothing: {control}")
    return f"cleared, next kernel ran; control (cudaError {code} left pending): {control}"


def check_register_4gib() -> str:
    from kvtier.tiers.device_backend import DeviceBackend

    backend = DeviceBackend("cuda")
    started = time.perf_counter()
    buffer = backend.host_buffer(4 * GiB)
    seconds = time.perf_counter() - started
    pinned = backend.is_pinned(buffer)
    backend.release_host_buffer(buffer)
    _require(pinned, "4 GiB not page-locked")
    return f"4 GiB pre-faulted and registered in {seconds:.2f} s ({4 / seconds:.1f} GiB/s)"


def check_nvml() -> str:
    import torch

    import pynvml

    from kvtier.tiers.device_backend import DeviceBackend

    backend = DeviceBackend("cuda")
    uuid = backend.device_uuid()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    torch_total = torch.cuda.get_device_properties(backend.device).total_memory
    free, total = torch.cuda.mem_get_info(backend.device)
    _require(abs(int(info.total) - int(total)) <= 64 * MiB, f"NVML total {info.total} vs CUDA total {total}")
    return (f"{uuid}: NVML total {info.total / GiB:.1f} GiB, CUDA {total / GiB:.1f} GiB (props "
            f"{torch_total / GiB:.1f}), NVML free {info.free / GiB:.1f} vs CUDA free {free / GiB:.1f} GiB")


def check_store_at_92() -> str:
    import torch

    import pynvml

    from kvtier.engine import OffloadEngine

    layout, layers, view = _engine_parts()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByUUID(view.backend.device_uuid())
    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    hog_bytes = max(0, int(0.92 * info.total) - int(info.used))
    hog = torch.empty(hog_bytes, dtype=torch.uint8, device="cuda")
    used = pynvml.nvmlDeviceGetMemoryInfo(handle).used / info.total

    async def run():
        async with OffloadEngine(layout, view, _engine_config(), fingerprint=b"gpu-check-92") as engine:
            engine.pressure.poll_once()
            record = engine.store(list(range(1, 65)), [[0, 1, 2, 3]])
            await record.wait_released()
            return engine.pressure.state, dict(engine.pressure.readings), len(record.scheduled), len(record.dropped)

    state, readings, scheduled, dropped = asyncio.run(run())
    del hog
    torch.cuda.empty_cache()
    _require(dropped == 0 and scheduled == 4, f"at {used:.1%} used: {scheduled} stored, {dropped} dropped ({state})")
    return f"device {used:.1%} used: state {state}, readings {readings}, 4/4 chunks stored"


def check_engine(cache_dir: Path) -> str:
    import torch

    from kvtier.engine import EngineConfig, OffloadEngine
    from kvtier.policy import AttentionGroup, ModelLayout
    from kvtier.tiers.device import DeviceKVView
    from kvtier.tools.testing.scenario import OffloadScenario

    layout = ModelLayout(groups=(AttentionGroup(16), AttentionGroup(4, sliding_window=8, extra_retained_tokens=3)))
    caches = [[torch.zeros(256, 2, g.block_size, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
              for g in layout.groups]
    config = EngineConfig(cache_dir=str(cache_dir / "engine"), host_capacity_bytes=64 << 20)

    async def run() -> Tuple[int, bool]:
        async with OffloadEngine(layout, DeviceKVView(layout, caches), config, fingerprint=b"gpu-check") as engine:
            pinned = all(pool.pinned for pool in engine.host.pools)
            scenario = OffloadScenario(engine)
            prompt = scenario.tokens(33)
            await scenario.produce(prompt, expect_stored={0: {0, 1}, 1: {1, 2, 3, 5, 6, 7}})
            await scenario.consume(prompt + [5], expect_hit=32)
            produced = scenario.producer_bytes
        async with OffloadEngine(layout, DeviceKVView(layout, caches), config, fingerprint=b"gpu-check") as engine:
            scenario = OffloadScenario(engine)
            scenario.producer_bytes = produced
            await scenario.consume(prompt + [5], expect_hit=32)
        return len(produced), pinned

    chunks, pinned = asyncio.run(run())
    _require(pinned, "the engine's host pools are not page-locked on CUDA")
    return f"{chunks} chunks restored bitwise from host and, after a restart, from disk; pools pinned"


CPU_CHECKS = ("staged_path", "headroom")
CUDA_CHECKS = ("bandwidth", "throughput", "order_d2h", "order_h2d", "other_thread", "overwrite_after_release",
               "own_streams", "register_error", "register_4gib", "nvml", "store_at_92", "engine", "vllm", "sglang")
SERVING_CHECKS = ("vllm", "sglang")


def _checks(cache_dir: Path) -> Dict[str, Callable[[], str]]:
    table: Dict[str, Callable[[], str]] = {name: globals()[f"check_{name}"] for name in CPU_CHECKS + CUDA_CHECKS
                                           if name not in SERVING_CHECKS and name != "engine"}
    table["engine"] = lambda: check_engine(cache_dir)
    from . import _gpu_serving as serving

    table["vllm"] = lambda: serving.check_vllm(cache_dir, _require)
    table["sglang"] = lambda: serving.check_sglang(cache_dir, _require)
    return table


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", help="directory for the checks' caches (default: a temporary one)")
    parser.add_argument("--skip-vllm", action="store_true", help="leave out the serving engines' checks (vllm, sglang)")
    parser.add_argument("--only", help="comma-separated check names")
    args = parser.parse_args(argv)
    import torch

    has_cuda = torch.cuda.is_available()
    cache_dir = Path(args.cache_dir or tempfile.mkdtemp(prefix="kvtier-gpu-check-"))
    table = _checks(cache_dir)
    names = list(CPU_CHECKS + CUDA_CHECKS)
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            parser.error(f"unknown check(s) {', '.join(unknown)}; known: {', '.join(names)}")
        names = [n for n in names if n in wanted]
    if args.skip_vllm:
        names = [n for n in names if n not in SERVING_CHECKS]
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    for name in names:
        if name in CUDA_CHECKS and not has_cuda:
            print(f"SKIP {name}: no CUDA device (torch {torch.__version__}, cuda available: False)", flush=True)
            counts["SKIP"] += 1
            continue
        started = time.perf_counter()
        try:
            verdict, text = "PASS", table[name]()
        except Exception as exc:  # each check reports its own failure; the rest still run
            verdict, text = "FAIL", f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, CheckFailed):
                traceback.print_exc()
        counts[verdict] += 1
        print(f"{verdict} {name}: {text} [{time.perf_counter() - started:.1f} s]", flush=True)
    device = torch.cuda.get_device_name(0) if has_cuda else "none"
    print(json.dumps({"passed": counts["PASS"], "failed": counts["FAIL"], "skipped": counts["SKIP"], "device": device}))
    if counts["FAIL"]:
        return 1
    if not has_cuda and counts["SKIP"]:
        print("gpu_check: no CUDA device here: the CPU checks ran, every CUDA check was skipped; "
              "run this on a GPU machine", file=sys.stderr)
        return EXIT_NO_GPU
    return 0


if __name__ == "__main__":
    sys.exit(main())
