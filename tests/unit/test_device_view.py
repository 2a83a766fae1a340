"""Device view: bitwise gather -> host slot -> scatter round trips, and every DeviceError.

Runs the CPU path of the same code the CUDA path uses (no GPU on the test machines): the copies are
plain and every handle is done at once.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import pytest
import torch

from kvtier.errors import DeviceError
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.errors import InjectedFault
from kvtier.tiers.device import DeviceKVView
from kvtier.tiers.device_backend import CopyHandle, DeviceBackend, register_host_range
from kvtier.tiers.host import HostSlabPool
from kvtier.tools.testing.device import RecordingBackend, TokenEvent

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


def random_layers(
    num_layers: int, num_blocks: int, block_shape: Tuple[int, ...], dtype: torch.dtype, seed: int
) -> List[torch.Tensor]:
    """Layer tensors with arbitrary bit patterns (NaN payloads, denormals, -0 included): built as
    random bytes and reinterpreted, so a lossy copy anywhere shows up as a byte difference."""
    generator = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    layers = []
    for _ in range(num_layers):
        raw = torch.randint(
            0, 256, (num_blocks, *block_shape[:-1], block_shape[-1] * itemsize),
            dtype=torch.uint8, generator=generator,
        )
        layers.append(raw.view(dtype))
    return layers


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def layout_of(*blocks_per_chunk: int) -> ModelLayout:
    groups = tuple(AttentionGroup(block_size=16, blocks_per_chunk=p) for p in blocks_per_chunk)
    return ModelLayout(groups)


@pytest.fixture(params=["numpy", "staged"])
def make_view(request):
    """Views on the CPU fast path (numpy, inline) and on the CUDA code path run on CPU (staging
    per layer over the batch, one copy per chunk, streams and events as logged tokens)."""

    def make(layout, caches):
        return DeviceKVView(layout, caches, backend=RecordingBackend() if request.param == "staged" else None)

    return make


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
@pytest.mark.parametrize(
    "block_shape", [(3, 5, 7), (1, 9), (13,)], ids=lambda s: "x".join(map(str, s))
)
def test_gather_scatter_round_trip_is_bitwise(
    make_view, dtype: torch.dtype, blocks_per_chunk: int, block_shape: Tuple[int, ...]
) -> None:
    num_layers, num_blocks = 3, 11
    layout = layout_of(blocks_per_chunk)
    src_layers = random_layers(num_layers, num_blocks, block_shape, dtype, seed=1)
    dst_layers = random_layers(num_layers, num_blocks, block_shape, dtype, seed=2)
    dst_before = [as_bytes(t).clone() for t in dst_layers]
    src = make_view(layout, [src_layers])
    dst = make_view(layout, [dst_layers])

    nbytes = src.chunk_nbytes(0)
    itemsize = torch.empty((), dtype=dtype).element_size()
    block_elems = 1
    for d in block_shape:
        block_elems *= d
    assert nbytes == num_layers * blocks_per_chunk * block_elems * itemsize
    assert src.chunk_shape(0) == (num_layers, blocks_per_chunk, *block_shape)
    assert src.chunk_dtype(0) == dtype and src.num_blocks(0) == num_blocks

    # Non-contiguous, unordered source blocks; a consecutive run in the middle of the destination.
    src_ids = [9, 2, 5][:blocks_per_chunk]
    dst_ids = [4, 5, 0][:blocks_per_chunk]
    with HostSlabPool(nbytes, 2) as pool:
        (slot,) = pool.allocate().slots
        handle = src.gather(0, src_ids, pool.view(slot))
        assert isinstance(handle, CopyHandle) and handle.done()
        handle.wait()

        # The slot is layer-major: layer 0's blocks, then layer 1's, ...
        expected = torch.cat([as_bytes(layer[src_ids]).reshape(-1) for layer in src_layers])
        assert torch.equal(pool.view(slot), expected)

        dst.scatter(0, pool.view(slot), dst_ids).wait()
    for layer_index, (s, d) in enumerate(zip(src_layers, dst_layers)):
        for s_id, d_id in zip(src_ids, dst_ids):
            assert torch.equal(as_bytes(d[d_id]), as_bytes(s[s_id])), (layer_index, d_id)
        untouched = [b for b in range(num_blocks) if b not in dst_ids]
        assert torch.equal(as_bytes(d[untouched]), dst_before[layer_index][untouched])


def test_none_block_ids_are_skipped(make_view) -> None:
    layout = layout_of(4)
    src_layers = random_layers(2, 8, (4, 6), torch.bfloat16, seed=3)
    dst_layers = [torch.zeros_like(t) for t in src_layers]
    src, dst = make_view(layout, [src_layers]), make_view(layout, [dst_layers])
    slot = torch.empty(src.chunk_nbytes(0), dtype=torch.uint8)
    src.gather(0, [0, 1, 2, 3], slot)
    # A sliding-window consumer restores only the last two blocks of the chunk.
    dst.scatter(0, slot, [None, None, 6, 7])
    for s, d in zip(src_layers, dst_layers):
        assert torch.equal(as_bytes(d[6:8]), as_bytes(s[2:4]))
        assert int(as_bytes(d[:6]).count_nonzero()) == 0
    # All None: nothing is written at all.
    before = [as_bytes(d).clone() for d in dst_layers]
    dst.scatter(0, slot, [None] * 4).wait()
    assert all(torch.equal(as_bytes(d), b) for d, b in zip(dst_layers, before))


def test_batches_and_groups(make_view) -> None:
    # Two groups with different chunk geometry and dtype; batch variants move several chunks.
    layout = layout_of(2, 1)
    g0 = random_layers(4, 10, (2, 3), torch.float16, seed=4)
    g1 = random_layers(2, 6, (5,), torch.float32, seed=5)
    view = make_view(layout, [g0, g1])
    assert view.num_groups == 2 and view.num_layers(0) == 4 and view.num_layers(1) == 2
    assert view.chunk_nbytes(0) == 4 * 2 * 6 * 2 and view.chunk_nbytes(1) == 2 * 1 * 5 * 4
    slots = [torch.empty(view.chunk_nbytes(0), dtype=torch.uint8) for _ in range(3)]
    chunks = [[0, 1], [7, 3], [3, 4]]  # the same block in two chunks of one gather is fine
    assert view.gather_many(0, list(zip(chunks, slots))).done()
    targets = [[9, 8], [2, None], [5, 6]]
    view.scatter_many(0, list(zip(slots, targets))).wait()
    # Scattered bytes equal the gathered copies (the gathered slots are the ground truth).
    for slot, target in zip(slots, targets):
        typed = slot.view(torch.float16).view(view.chunk_shape(0))
        for layer_index, layer in enumerate(g0):
            for pos, block in enumerate(target):
                if block is not None:
                    assert torch.equal(as_bytes(layer[block]), as_bytes(typed[layer_index, pos]))
    slot1 = torch.empty(view.chunk_nbytes(1), dtype=torch.uint8)
    view.gather(1, [5], slot1)
    assert torch.equal(slot1, torch.cat([as_bytes(layer[5]).reshape(-1) for layer in g1]))


def test_batches_across_groups(make_view) -> None:
    # The engine's copy threads move chunks of every group in one call that blocks until done.
    layout = layout_of(2, 1)
    g0 = random_layers(2, 6, (3, 2), torch.bfloat16, seed=10)
    g1 = random_layers(3, 5, (4,), torch.float8_e4m3fn, seed=11)
    view = make_view(layout, [g0, g1])
    assert view.device_index() is None  # CPU
    a = torch.empty(view.chunk_nbytes(0), dtype=torch.uint8)
    b = torch.empty(view.chunk_nbytes(1), dtype=torch.uint8)
    c = torch.empty(view.chunk_nbytes(1), dtype=torch.uint8)
    handle = view.gather_many_groups([(0, [4, 1], a), (1, [2], b), (1, [0], c)])
    assert handle.done()
    assert torch.equal(a, torch.cat([as_bytes(t[[4, 1]]).reshape(-1) for t in g0]))
    assert torch.equal(b, torch.cat([as_bytes(t[2]).reshape(-1) for t in g1]))
    expected = [as_bytes(t).clone() for t in g0 + g1]
    # Block 3 in both groups is fine: different tensors. Swap g1's blocks 0 and 2 via the slots.
    view.scatter_many_groups([(0, a, [None, 3]), (1, b, [0]), (1, c, [2])])
    for t, before in zip(g0, expected[:2]):
        assert torch.equal(as_bytes(t[3]), before[1])
    assert all(torch.equal(as_bytes(t[0]), before[2]) for t, before in zip(g1, expected[2:]))
    assert all(torch.equal(as_bytes(t[2]), before[0]) for t, before in zip(g1, expected[2:]))
    with pytest.raises(DeviceError, match="group 1: block id 0 .* appears twice"):
        view.scatter_many_groups([(1, b, [0]), (0, a, [0, 1]), (1, c, [0])])
    with pytest.raises(DeviceError, match=r"group 1: out \(item 1\) holds"):
        view.gather_many_groups([(0, [0, 1], a), (1, [0], a)])


def test_strided_layers_copy_exactly(make_view) -> None:
    # vLLM's flash-attention cache is [2, num_blocks, ...]; a permuted view puts blocks first but
    # is not contiguous. The copy must still be exact.
    layout = layout_of(2)
    base = random_layers(2, 2, (7, 4, 3), torch.bfloat16, seed=6)  # [2(K/V), 7 blocks, 4, 3]
    layers = [t.permute(1, 0, 2, 3) for t in base]
    assert not layers[0].is_contiguous()
    view = make_view(layout, [layers])
    slot = torch.empty(view.chunk_nbytes(0), dtype=torch.uint8)
    view.gather(0, [6, 1], slot)
    expected = torch.cat([as_bytes(layer[[6, 1]]).reshape(-1) for layer in layers])
    assert torch.equal(slot, expected)


# -- errors -----------------------------------------------------------------------------------


@pytest.fixture
def view() -> DeviceKVView:
    return DeviceKVView(layout_of(2), [random_layers(2, 8, (3, 4), torch.float16, seed=7)])


def test_bad_block_ids(view: DeviceKVView) -> None:
    slot = torch.empty(view.chunk_nbytes(0), dtype=torch.uint8)
    expected = r"group 0: block id 8 \(block_ids\[1\]\) out of range \[0, 8\)"
    with pytest.raises(DeviceError, match=expected):
        view.gather(0, [0, 8], slot)
    with pytest.raises(DeviceError, match=r"group 0: block id -1 \(block_ids\[0\]\) out of range"):
        view.scatter(0, slot, [-1, 2])
    expected = r"group 0: a chunk has 2 block\(s\), got 3 block id\(s\)"
    with pytest.raises(DeviceError, match=expected):
        view.gather(0, [0, 1, 2], slot)
    with pytest.raises(DeviceError, match=r"group 0: block_ids\[1\] = 'x' is not an int"):
        view.gather(0, [0, "x"], slot)
    expected = r"group 0: block_ids\[0\] is None; gather needs every block"
    with pytest.raises(DeviceError, match=expected):
        view.gather(0, [None, 1], slot)
    with pytest.raises(DeviceError, match="group 0: block id 3 .* appears twice"):
        view.scatter_many(0, [(slot, [2, 3]), (slot, [3, 4])])
    with pytest.raises(DeviceError, match=r"group index 1 out of range \[0, 1\)"):
        view.gather(1, [0, 1], slot)


def test_bad_block_ids_queue_nothing() -> None:
    # A batch is validated in full before any copy: a bad second item leaves the first unwritten.
    layers = random_layers(2, 8, (3, 4), torch.float16, seed=7)
    view = DeviceKVView(layout_of(2), [layers])
    before = [as_bytes(t).clone() for t in layers]
    slot = torch.zeros(view.chunk_nbytes(0), dtype=torch.uint8)
    with pytest.raises(DeviceError, match="block id 99"):
        view.scatter_many(0, [(slot, [0, 1]), (slot, [2, 99])])
    assert all(torch.equal(as_bytes(t), b) for t, b in zip(layers, before))


def test_wrong_out_buffer(view: DeviceKVView) -> None:
    nbytes = view.chunk_nbytes(0)
    expected = rf"group 0: out \(item 0\) holds {nbytes - 1} bytes but a chunk is {nbytes} bytes"
    with pytest.raises(DeviceError, match=expected):
        view.gather(0, [0, 1], torch.empty(nbytes - 1, dtype=torch.uint8))
    with pytest.raises(DeviceError, match=r"group 0: src \(item 0\) holds 3 bytes"):
        view.scatter(0, torch.empty(3, dtype=torch.uint8), [0, 1])
    with pytest.raises(DeviceError, match="must have dtype torch.uint8, got torch.float16"):
        view.gather(0, [0, 1], torch.empty(nbytes // 2, dtype=torch.float16))
    with pytest.raises(DeviceError, match="must be contiguous"):
        view.gather(0, [0, 1], torch.empty(2 * nbytes, dtype=torch.uint8)[::2])
    expected = r"cannot be viewed as torch.float16 \(misaligned start\?\)"
    with pytest.raises(DeviceError, match=expected):
        view.gather(0, [0, 1], torch.empty(nbytes + 1, dtype=torch.uint8)[1:])


def test_mismatched_layers() -> None:
    layout = layout_of(1)
    good = random_layers(1, 4, (2, 3), torch.float16, seed=8)[0]
    expected = r"group 0, layer 1: per-block shape \(2, 4\) differs from layer 0's \(2, 3\)"
    with pytest.raises(DeviceError, match=expected):
        DeviceKVView(layout, [[good, torch.zeros(4, 2, 4, dtype=torch.float16)]])
    expected = "group 0, layer 2: dtype torch.bfloat16 differs from layer 0's torch.float16"
    with pytest.raises(DeviceError, match=expected):
        DeviceKVView(layout, [[good, good, torch.zeros(4, 2, 3, dtype=torch.bfloat16)]])
    with pytest.raises(DeviceError, match="group 0, layer 1: 5 blocks but layer 0 has 4"):
        DeviceKVView(layout, [[good, torch.zeros(5, 2, 3, dtype=torch.float16)]])
    expected = r"group 0, layer 0: shape \(4,\) has no per-block dimensions"
    with pytest.raises(DeviceError, match=expected):
        DeviceKVView(layout, [[torch.zeros(4)]])
    with pytest.raises(DeviceError, match="group 0: no layer tensors"):
        DeviceKVView(layout, [[]])
    with pytest.raises(DeviceError, match="group 1, layer 0: tensor on meta but group 0 is on cpu"):
        DeviceKVView(layout_of(1, 1), [[good], [torch.empty(4, 2, 3, device="meta")]])
    with pytest.raises(DeviceError, match="unsupported device 'meta'"):
        DeviceKVView(layout, [[torch.empty(4, 2, 3, device="meta")]])


def test_wrong_group_count() -> None:
    layers = random_layers(1, 4, (2,), torch.float32, seed=9)
    with pytest.raises(DeviceError, match=r"kv_caches has 1 group\(s\) but the layout has 2"):
        DeviceKVView(layout_of(1, 1), [layers])
    with pytest.raises(DeviceError, match="kv_caches must be a sequence"):
        DeviceKVView(layout_of(1), layers[0])  # a bare tensor instead of [[layer, ...]]


def test_cuda_requested_without_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the missing-GPU path cannot be exercised")
    expected = r"device 'cuda' requested but torch.cuda.is_available\(\) is False"
    with pytest.raises(DeviceError, match=expected):
        DeviceBackend("cuda")
    with pytest.raises(DeviceError, match=r"'cuda:1' requested"):
        DeviceBackend("cuda:1")


def test_cpu_backend_is_the_same_code_path_with_no_ops() -> None:
    backend = DeviceBackend("cpu")
    assert backend.kind == "cpu" and not backend.non_blocking
    stream = backend.new_stream()
    assert stream is None and backend.current_stream() is None
    backend.wait_event(stream, backend.ready_event())
    with backend.stream_scope(stream):
        event = backend.record_event(stream)
    handle = CopyHandle(backend, event)
    assert handle.done()
    handle.wait()
    handle.wait_on_stream()
    buffer = backend.host_buffer(10_000)
    assert buffer.numel() == 10_000 and buffer.data_ptr() % 4096 == 0
    assert int(buffer.count_nonzero()) == 0
    backend.release_host_buffer(buffer)  # no-op on CPU
    with pytest.raises(ValueError, match="nbytes must be a positive int"):
        backend.host_buffer(0)


# -- the CUDA code path, run on CPU through RecordingBackend ------------------------------------


def test_one_copy_per_chunk_and_the_order_is_taken_when_called() -> None:
    # 4 layers, chunks of 3 blocks in scattered runs: the per-run path made 4 x 2-3 copies per
    # chunk; staging gathers each layer over the whole batch on the device and moves one per chunk.
    backend = RecordingBackend()
    layers = random_layers(4, 16, (2, 5), torch.bfloat16, seed=21)
    view = DeviceKVView(layout_of(3), [layers], backend=backend)
    slots = [torch.empty(view.chunk_nbytes(0), dtype=torch.uint8) for _ in range(3)]
    chunks = [[9, 2, 3], [15, 0, 7], [4, 5, 6]]
    view.gather_many_groups([(0, ids, slot) for ids, slot in zip(chunks, slots)])
    assert backend.copies == 3
    for ids, slot in zip(chunks, slots):
        assert torch.equal(slot, torch.cat([as_bytes(layer[ids]).reshape(-1) for layer in layers]))
    # d2h is copy1, h2d copy2; the order was recorded on the caller's stream before anything was
    # queued, and the copy stream waits on exactly that event, then records its own.
    # Each KV tensor is made known to the caching allocator as used by the copy stream (freed KV
    # memory is not reused under a queued copy).
    assert backend.ops() == [
        ("record", "default", 1), ("wait", "copy1", 1), *[("keep", "copy1", None)] * 4,
        ("copy", "copy1", None), ("copy", "copy1", None), ("copy", "copy1", None),
        ("record", "copy1", 2), ("sync", "copy1", 2),
    ]
    backend.log.clear()
    targets = [[1, None, 8], [10, 11, 12]]
    fresh = [torch.zeros_like(layer) for layer in layers]
    dst = DeviceKVView(layout_of(3), [fresh], backend=backend)
    handle = dst.scatter_many_groups([(0, slots[0], targets[0]), (0, slots[1], targets[1])],
                                     compute_stream="side", wait=False)
    assert backend.copies == 5 and backend.ops("record", "wait")[:2] == [("record", "side", 3), ("wait", "copy4", 3)]
    handle.wait_on_stream("consumer")  # the serving process's stream waits for the loads' event
    assert backend.ops("wait")[-1] == ("wait", "consumer", 4)
    for ids, target in zip(chunks[:2], targets):
        for src_block, dst_block in zip(ids, target):
            if dst_block is not None:
                assert all(torch.equal(as_bytes(d[dst_block]), as_bytes(s[src_block])) for s, d in zip(layers, fresh))
    assert all(int(as_bytes(d[2]).count_nonzero()) == 0 for d in fresh)  # no target: untouched
    backend.log.clear()
    mine = TokenEvent(99, "server")  # an event the caller recorded itself: no new record now
    view.gather_many_groups([(0, [1, 2, 3], slots[2])], ready_event=mine)
    assert backend.ops("record", "wait")[:1] == [("wait", "copy1", 99)]


def test_a_batch_failing_partway_waits_for_the_copies_it_queued() -> None:
    seen = []
    backend = RecordingBackend(fail_on_copy=2, on_sync=lambda: seen.append(list(backend.ops())))
    view = DeviceKVView(layout_of(2), [random_layers(2, 8, (3,), torch.float16, seed=22)], backend=backend)
    slots = [torch.empty(view.chunk_nbytes(0), dtype=torch.uint8) for _ in range(3)]
    with pytest.raises(InjectedFault, match="injected failure of copy 2"):
        view.gather_many_groups([(0, [0, 1], slots[0]), (0, [2, 3], slots[1]), (0, [4, 5], slots[2])], wait=False)
    # Copy 1 was queued when copy 2 failed: the batch records an event and waits for it before the
    # exception reaches the caller (who then frees slots and blocks).
    assert backend.ops() == [
        ("record", "default", 1), ("wait", "copy1", 1), ("keep", "copy1", None), ("keep", "copy1", None),
        ("copy", "copy1", None), ("copy_failed", "copy1", None), ("record", "copy1", 2), ("sync", "copy1", 2),
    ]
    assert len(seen) == 1


class _FakeCudart:
    def __init__(self, code: int) -> None:
        self.code, self.calls = code, []

    def cudaHostRegister(self, base, nbytes, flags):  # noqa: N802 - the CUDA name
        self.calls.append(("register", base, nbytes, flags))
        return self.code


class _FakeRuntime:
    def __init__(self, pending: int) -> None:
        self.pending, self.cleared = pending, 0

    def get_last_error(self) -> int:
        self.cleared += 1
        code, self.pending = self.pending, 0
        return code


def test_a_failed_host_registration_clears_the_cuda_error_and_refuses() -> None:
    cudart, runtime = _FakeCudart(2), _FakeRuntime(2)
    with pytest.raises(DeviceError, match=r"cudaHostRegister of 4096 bytes failed with cudaError 2 \(error cleared\)"):
        register_host_range(cudart, runtime, 0x1000, 4096)
    assert runtime.cleared == 1 and runtime.pending == 0  # the next kernel launch sees no stale error
    assert cudart.calls == [("register", 0x1000, 4096, 1)]  # portable: pinned for every context
    with pytest.raises(DeviceError, match=r"error could not be cleared"):
        register_host_range(_FakeCudart(2), None, 0x1000, 4096)
    register_host_range(_FakeCudart(0), _FakeRuntime(0), 0x1000, 4096)  # success: nothing raised


def _chunk_bytes(layers: Sequence[torch.Tensor], blocks: Sequence[int]) -> torch.Tensor:
    """The host form of one chunk: its blocks, layer after layer."""
    return torch.cat([as_bytes(layer[list(blocks)]).reshape(-1) for layer in layers])


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_adjacent_slots_are_copied_as_spans_bitwise(make_view, blocks_per_chunk) -> None:
    # Chunks 0-2 continue one another in blocks and in host slots (one span); chunk 3's slot is
    # not next to chunk 2's; chunk 4's blocks do not continue chunk 3's; chunks 4-5 join again.
    p = blocks_per_chunk
    layers = random_layers(3, 16 * p, (2, 5), torch.bfloat16, seed=31)
    view = make_view(layout_of(p), [layers])
    pool = HostSlabPool(view.chunk_nbytes(0), 8)
    order = [0, 1, 2, 4, 5, 6]  # slot 3 skipped: slot 4 is not adjacent to slot 2
    granted = pool.allocate(8).slots
    slots = [pool.view(granted[i]) for i in order]
    chunk_blocks = [[c * p + j for j in range(p)] for c in (0, 1, 2, 3, 7, 8)]
    view.gather_many_groups([(0, blocks, slot) for blocks, slot in zip(chunk_blocks, slots)])
    for blocks, slot in zip(chunk_blocks, slots):
        assert torch.equal(slot, _chunk_bytes(layers, blocks))
    if isinstance(view.backend, RecordingBackend):
        # The staged path stages every block, so only host adjacency splits: [0-2] [3-5].
        assert view.backend.copies == 2
    # And back: scatter the spans into other blocks, every byte where it belongs.
    fresh = [torch.zeros_like(layer) for layer in layers]
    back = make_view(layout_of(p), [fresh])
    targets = [[(c + 8) * p + j for j in range(p)] for c in range(6)]
    back.scatter_many_groups([(0, slot, blocks) for slot, blocks in zip(slots, targets)])
    for source, target in zip(chunk_blocks, targets):
        for layer, restored in zip(layers, fresh):
            assert torch.equal(as_bytes(restored[target]), as_bytes(layer[source]))
    untouched = sorted(set(range(16 * p)) - {b for t in targets for b in t})
    assert all(int(as_bytes(restored[untouched]).count_nonzero()) == 0 for restored in fresh)
    pool.close()


def _numpy_copies(monkeypatch) -> List[Tuple[int, ...]]:
    """The destination shape of every ``np.copyto`` from now on (the copies still run)."""
    import numpy as np

    calls: List[Tuple[int, ...]] = []
    real = np.copyto
    monkeypatch.setattr(np, "copyto", lambda dst, src: (calls.append(dst.shape), real(dst, src))[1])
    return calls


def test_a_span_on_the_numpy_path_takes_one_copy_per_layer(monkeypatch) -> None:
    # 8 consecutive chunks into 8 consecutive slots: one numpy copy per layer, not one per chunk
    # per layer (the copy thread then takes the GIL 2 times for the batch, not 16).
    layers = random_layers(2, 8, (4,), torch.float16, seed=32)
    view = DeviceKVView(layout_of(1), [layers])
    pool = HostSlabPool(view.chunk_nbytes(0), 8)
    slots = [pool.view(s) for s in pool.allocate(8).slots]
    calls = _numpy_copies(monkeypatch)
    view.gather_many_groups([(0, [c], slot) for c, slot in enumerate(slots)])
    assert calls == [(8, 1, 4), (8, 1, 4)]
    assert all(torch.equal(slot, _chunk_bytes(layers, [c])) for c, slot in enumerate(slots))
    pool.close()


def _one_allocation(num_layers: int, num_blocks: int, block_shape: Tuple[int, ...], gap_blocks: int,
                    seed: int) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """A random-bits tensor and layer tensors that are slices of it, ``gap_blocks`` unused blocks
    between one layer's blocks and the next's (a KV cache allocated as one tensor)."""
    whole = random_layers(1, num_layers * (num_blocks + gap_blocks), block_shape, torch.bfloat16, seed)[0]
    step = num_blocks + gap_blocks
    return whole, [whole[li * step : li * step + num_blocks] for li in range(num_layers)]


def test_stacked_layers_only_for_evenly_spaced_slices_of_one_allocation() -> None:
    from kvtier.tiers.device_groups import stacked_layers

    whole, layers = _one_allocation(3, 5, (2, 4), gap_blocks=2, seed=41)
    stacked = stacked_layers(layers)
    assert stacked is not None and stacked.shape == (3, 5, 2, 4)
    assert all(torch.equal(as_bytes(stacked[li]), as_bytes(layer)) for li, layer in enumerate(layers))
    assert stacked_layers(random_layers(3, 5, (2, 4), torch.bfloat16, seed=42)) is None  # three allocations
    uneven = [whole[0:5], whole[7:12], whole[15:20]]
    assert stacked_layers(uneven) is None
    overlapping = [whole[0:5], whole[3:8], whole[6:11]]
    assert stacked_layers(overlapping) is None
    assert stacked_layers(layers[:1]) is None
    # K and V interleaved per block ([blocks, 2, ...] seen as two strided layers): each layer's
    # blocks are not contiguous, and the next layer starts inside the first one's extent.
    kv = random_layers(1, 6, (2, 3, 4), torch.bfloat16, seed=43)[0]
    assert stacked_layers([kv[:, 0], kv[:, 1]]) is None


@pytest.mark.parametrize("gap_blocks", [0, 3])
def test_layers_of_one_allocation_round_trip_bitwise(make_view, gap_blocks) -> None:
    # Spans (adjacent slots, continuing blocks) and single chunks with scattered runs, both ways.
    p = 2
    _, layers = _one_allocation(4, 16, (3, 5), gap_blocks, seed=44)
    view = make_view(layout_of(p), [layers])
    pool = HostSlabPool(view.chunk_nbytes(0), 8)
    granted = pool.allocate(8).slots
    slots = [pool.view(granted[i]) for i in (0, 1, 2, 5)]
    chunk_blocks = [[0, 1], [2, 3], [4, 5], [9, 7]]  # a span of three, then a chunk of two runs
    view.gather_many_groups([(0, blocks, slot) for blocks, slot in zip(chunk_blocks, slots)])
    for blocks, slot in zip(chunk_blocks, slots):
        assert torch.equal(slot, _chunk_bytes(layers, blocks))
    whole, fresh = _one_allocation(4, 16, (3, 5), gap_blocks, seed=45)
    before = as_bytes(whole).clone()
    back = make_view(layout_of(p), [fresh])
    targets = [[8, 9], [10, 11], [12, 13], [None, 3]]
    back.scatter_many_groups([(0, slot, blocks) for slot, blocks in zip(slots, targets)])
    written = set()
    for source, target in zip(chunk_blocks, targets):
        for s_block, t_block in zip(source, target):
            if t_block is not None:
                written.add(t_block)
                assert all(torch.equal(as_bytes(r[t_block]), as_bytes(l[s_block])) for l, r in zip(layers, fresh))
    # Every other block of the allocation (the other blocks of each layer, and the gaps between
    # layers, which are no layer's) keeps its bytes.
    step = 16 + gap_blocks
    written_rows = {li * step + b for li in range(4) for b in written}
    kept = [row for row in range(4 * step) if row not in written_rows]
    assert torch.equal(as_bytes(whole[kept]), before[kept])
    pool.close()


def test_layers_of_one_allocation_take_one_numpy_copy_per_span_or_run(monkeypatch) -> None:
    _, layers = _one_allocation(4, 8, (4,), gap_blocks=1, seed=46)
    view = DeviceKVView(layout_of(1), [layers])
    pool = HostSlabPool(view.chunk_nbytes(0), 8)
    slots = [pool.view(s) for s in pool.allocate(8).slots]
    calls = _numpy_copies(monkeypatch)
    view.gather_many_groups([(0, [c], slot) for c, slot in enumerate(slots[:6])])
    assert calls == [(6, 4, 1, 4)]  # one span of 6 chunks, every layer at once
    calls.clear()
    view.gather_many_groups([(0, [7], slots[7])])
    assert calls == [(4, 1, 4)]  # a lone chunk: one copy for its run of every layer
    assert all(torch.equal(slot, _chunk_bytes(layers, [c])) for c, slot in enumerate(slots[:6]))
    assert torch.equal(slots[7], _chunk_bytes(layers, [7]))
    pool.close()
