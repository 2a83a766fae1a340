"""vLLM's real scheduler and ``OffloadingConnector`` on CPU tensors, for tests and for integrators.

Everything scheduler-side is vLLM's own code (``Scheduler``, ``OffloadingConnector`` in both roles,
``TieringOffloadingSpec`` and its CPU primary tier, the secondary tier factory). Only vLLM's
GPU <-> CPU copy worker is replaced: vLLM's handler asserts CUDA tensors, records CUDA events and
calls a CUDA kernel absent from the CPU wheel. ``CpuCopyWorker`` computes the same byte addresses
with vLLM's own ``compute_sub_block_ptrs`` and copies them with ``ctypes.memmove``, synchronously.

``VllmCpuRig`` builds them in ``EngineCore``'s order (the Scheduler and its tiers, then
``init_none_hash``), builds a hybrid model's KV cache (a hand-written ``config.json``, no weights; the
groups are given as vLLM ``KVCacheSpec``s), runs requests step by step like vLLM's model runner
(bind metadata, start loads, forward, wait for saves, report), and stands in for the model: its
forward writes, for every computed token, bytes that depend on the whole prefix, the group and the
layer (``expected_slot``), so a restored block is right only if it holds exactly the producer's bytes.

Thread: everything here runs on the caller's thread (vLLM's tier has its own loop thread).
"""

from __future__ import annotations

import ctypes
import json
import os
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch
import xxhash

from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.config.cache import PrefixCachingHashAlgo
from vllm.distributed.kv_events import EventBatch, EventPublisher, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, KVCacheTensor
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

__all__ = ["CpuCopyWorker", "CpuTieringOffloadingSpec", "RecordingEventPublisher", "VllmCpuRig", "RunRecord",
           "write_model_config"]

EOS_TOKEN_ID = 0


# ---------------------------------------------------------------------------------- copy worker


class CpuCopyWorker(OffloadingWorker):
    """vLLM's ``CPUOffloadingWorker`` with the CUDA copy replaced by ``memmove`` (direct layout).

    Addresses come from vLLM's ``compute_sub_block_ptrs`` with the same per-group skip counts as
    vLLM's ``SingleDirectionOffloadingHandler.transfer_async``; a copy completes before the call
    returns and is reported by the next ``get_finished``. ``transfers`` keeps (direction, group,
    logical block index, GPU block id) of every block copied, for the tests' agreement checks.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, mmap_region: SharedOffloadRegion):
        self._region: Optional[SharedOffloadRegion] = mmap_region
        self._bpc = blocks_per_chunk
        self._refs = kv_caches.group_data_refs
        self._gpu: List[torch.Tensor] = []
        self._cpu: List[torch.Tensor] = []
        for t in kv_caches.tensors:
            self._gpu.append(t.tensor.view(torch.int8).view((-1, t.page_size_bytes)))
            self._cpu.append(mmap_region.create_next_worker_view(t.page_size_bytes * blocks_per_chunk))
        self._finished: List[TransferResult] = []
        self.transfers: List[Tuple[str, int, int, int]] = []  # (direction, group, first logical, block)

    def _copy(self, job_id: int, gpu_to_cpu: bool, src_spec: Any, dst_spec: Any) -> bool:
        gpu_spec = src_spec if gpu_to_cpu else dst_spec
        src_tensors, dst_tensors = (self._gpu, self._cpu) if gpu_to_cpu else (self._cpu, self._gpu)
        src_bpc, dst_bpc = (1, self._bpc) if gpu_to_cpu else (self._bpc, 1)
        src_blocks, dst_blocks = np.asarray(src_spec.block_ids), np.asarray(dst_spec.block_ids)
        gpu_blocks = np.asarray(gpu_spec.block_ids)
        src_off = dst_off = gpu_off = 0
        nbytes = 0
        for g, (size, block_idx) in enumerate(zip(gpu_spec.group_sizes, gpu_spec.block_indices)):
            if size == 0:
                continue
            src_skip, dst_skip = block_idx % src_bpc, block_idx % dst_bpc
            src_n = cdiv(size + src_skip, src_bpc)
            dst_n = cdiv(size + dst_skip, dst_bpc)
            group_src, group_dst = src_blocks[src_off : src_off + src_n], dst_blocks[dst_off : dst_off + dst_n]
            for j in range(size):
                self.transfers.append(("store" if gpu_to_cpu else "load", g, block_idx + j, int(gpu_blocks[gpu_off + j])))
            for ref in self._refs[g]:
                src_ptrs = np.empty(size, dtype=np.uint64)
                dst_ptrs = np.empty(size, dtype=np.uint64)
                compute_sub_block_ptrs(group_src, src_bpc, src_ptrs, src_tensors[ref.tensor_idx], skip_count=src_skip)
                compute_sub_block_ptrs(group_dst, dst_bpc, dst_ptrs, dst_tensors[ref.tensor_idx], skip_count=dst_skip)
                for s, d in zip(src_ptrs.tolist(), dst_ptrs.tolist()):
                    ctypes.memmove(d, s, ref.page_size_bytes)
                nbytes += size * ref.page_size_bytes
            src_off += src_n
            dst_off += dst_n
            gpu_off += size
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes, transfer_time=0.0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: Any) -> bool:
        return self._copy(job_id, True, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: GPULoadStoreSpec, expedited: bool = False) -> bool:
        return self._copy(job_id, False, src_spec, dst_spec)

    def get_finished(self) -> List[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: Set[int]) -> None:
        return None

    def shutdown(self) -> None:
        self._gpu.clear()
        self._cpu.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None


class CpuTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` whose worker is ``CpuCopyWorker`` (vLLM's refuses non-CUDA)."""

    _copy_worker: Optional[CpuCopyWorker] = None  # in place of vLLM's ``_worker`` (a CPUOffloadingWorker)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._copy_worker is None:
            self._copy_worker = self.create_worker(kv_caches)
        return self._copy_worker

    def create_worker(self, kv_caches: CanonicalKVCaches) -> CpuCopyWorker:  # type: ignore[override]
        region = SharedOffloadRegion(
            engine_id=self._engine_id, num_chunks=self.num_chunks, rank=0,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk, cpu_page_size=self.cpu_page_size_per_worker,
        )
        return CpuCopyWorker(kv_caches, self.blocks_per_chunk, region)


class RecordingEventPublisher(EventPublisher):
    """A vLLM KV event publisher that keeps every event the scheduler publishes (in order), where
    vLLM's ZMQ publisher would send them to a KV-aware router."""

    def __init__(self) -> None:
        super().__init__()
        self.events: List[KVCacheEvent] = []

    def publish(self, events: EventBatch) -> None:
        self.events.extend(events.events)

    def shutdown(self) -> None:
        return None


# ---------------------------------------------------------------------------------- the rig


def write_model_config(directory: Path, num_layers: int, sliding_window: int) -> Path:
    """A tiny Gemma3-style hybrid config (no weights): vLLM's ModelConfig reads only this."""
    directory.mkdir(parents=True, exist_ok=True)
    layer_types = ["full_attention" if i % 2 == 0 else "sliding_attention" for i in range(num_layers)]
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": num_layers, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 1000, "max_position_embeddings": 4096,
        "sliding_window": sliding_window, "layer_types": layer_types, "torch_dtype": "bfloat16",
    }))
    return directory


@dataclass
class RunRecord:
    """What one request did: hit tokens, and the (group, logical block) sets vLLM stored / loaded."""

    request_id: str
    prompt: List[int]
    external_hit_tokens: int = 0
    stored: Dict[int, Set[int]] = field(default_factory=lambda: defaultdict(set))
    loaded: Dict[int, Set[int]] = field(default_factory=lambda: defaultdict(set))
    block_ids: Tuple[List[int], ...] = ()
    max_step_s: float = 0.0


def _slot_bytes(spec: KVCacheSpec) -> int:
    return spec.page_size_bytes // spec.block_size


class VllmCpuRig:
    """vLLM's Scheduler + OffloadingConnector (scheduler and worker roles) over CPU KV tensors.

    ``group_specs``: one vLLM ``KVCacheSpec`` per group (equal ``page_size_bytes``), each group one
    layer. ``secondary_tiers``: the tier dicts of ``kv_connector_extra_config``. ``retention``:
    vLLM's ``prefix_cache_retention_interval``. ``kv_events``: vLLM's KV cache events on, kept by
    ``self.kv_events`` (a ``RecordingEventPublisher``). ``log_stats``: vLLM's scheduler stats on;
    each step's KV connector stats payload (what vLLM's Prometheus logger reads) is kept in
    ``self.connector_stats``. ``cpu_eviction_policy``: vLLM's CPU tier eviction (its ``lru`` or
    ``arc``).
    """

    _engine_counter = 0

    def __init__(
        self,
        group_specs: Sequence[KVCacheSpec],
        secondary_tiers: Sequence[Dict[str, Any]],
        *,
        retention: Optional[int] = 0,
        num_gpu_blocks: int = 128,
        cpu_chunks: int = 64,
        blocks_per_chunk: int = 1,
        max_model_len: int = 1024,
        hash_algorithm: PrefixCachingHashAlgo = "sha256",
        model_dir: Optional[Path] = None,
        kv_events: bool = False,
        log_stats: bool = False,
        cpu_eviction_policy: str = "lru",
    ) -> None:
        self.group_specs = list(group_specs)
        pages = {s.page_size_bytes for s in self.group_specs}
        if len(pages) != 1:
            raise ValueError(f"groups must share one page size, got {sorted(pages)}")
        self.page = pages.pop()
        self.hash_block_size = min(s.block_size for s in self.group_specs)
        windows = [getattr(s, "sliding_window", None) for s in self.group_specs]
        window = max([w for w in windows if w] or [32])
        if model_dir is None:
            model_dir = Path(tempfile.mkdtemp(prefix="kvtier-vllm-model-"))
        write_model_config(model_dir, 2, window)
        layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(len(self.group_specs))]
        self.layer_names = layer_names

        model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                                   dtype="bfloat16", max_model_len=max_model_len)
        cache_config = CacheConfig(block_size=self.group_specs[0].block_size, enable_prefix_caching=True,
                                   prefix_caching_hash_algo=hash_algorithm,
                                   prefix_cache_retention_interval=retention)
        scheduler_config = SchedulerConfig(max_num_batched_tokens=max_model_len, max_num_seqs=16,
                                           max_model_len=max_model_len, is_encoder_decoder=False)
        VllmCpuRig._engine_counter += 1
        kv_bytes_per_chunk = self.page * blocks_per_chunk * len(self.group_specs)
        extra = {
            "spec_name": "CpuTieringOffloadingSpec",
            "spec_module_path": __name__,
            "cpu_bytes_to_use": kv_bytes_per_chunk * cpu_chunks,
            "eviction_policy": cpu_eviction_policy,
            "secondary_tiers": [dict(t) for t in secondary_tiers],
        }
        if blocks_per_chunk > 1:  # vLLM takes the offloaded block size only when the groups share one
            extra["block_size"] = self.group_specs[0].block_size * blocks_per_chunk
        self.vllm_config = VllmConfig(
            model_config=model_config, cache_config=cache_config, scheduler_config=scheduler_config,
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra,
                engine_id=f"kvtier-rig-{os.getpid()}-{VllmCpuRig._engine_counter}",
            ),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None,
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_gpu_blocks,
            # every KVCacheTensor's size is the whole backing allocation (vLLM sizes the
            # worker's bytes per block from kv_cache_tensors[0].size); layer i sits at offset i
            kv_cache_tensors=[
                KVCacheTensor(size=len(layer_names) * num_gpu_blocks * self.page, layers=[name],
                              layer_stride=num_gpu_blocks * self.page, block_stride=self.page,
                              offset=i * num_gpu_blocks * self.page)
                for i, name in enumerate(layer_names)
            ],
            kv_cache_groups=[KVCacheGroupSpec([name], spec) for name, spec in zip(layer_names, self.group_specs)],
            prefix_cache_retention_interval=retention,
            hash_block_size=self.hash_block_size,
        )
        # EngineCore's order: the Scheduler (and with it every secondary tier) is built before
        # init_none_hash seeds the block hashes, and outside set_current_vllm_config.
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=self.group_specs[0].block_size, hash_block_size=self.hash_block_size,
            log_stats=log_stats,
        )
        self.kv_events = RecordingEventPublisher()
        if kv_events:
            self.scheduler.kv_event_publisher = self.kv_events
        self.hash_fn = get_hash_fn_by_name(hash_algorithm)
        init_none_hash(self.hash_fn)
        self._block_hasher = get_request_block_hasher(self.hash_block_size, self.hash_fn)
        with set_current_vllm_config(self.vllm_config):
            self.worker = OffloadingConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
            # layer tensors: (blocks, block_size, slot bytes) so a token's slot is one row
            self.kv: Dict[str, torch.Tensor] = {
                name: torch.zeros((num_gpu_blocks, spec.block_size, _slot_bytes(spec)), dtype=torch.int8)
                for name, spec in zip(layer_names, self.group_specs)
            }
            self.worker.register_kv_caches(self.kv)
        self.connector_stats: List[Dict[str, Any]] = []
        self._requests = 0
        self._started: Set[str] = set()
        self.records: Dict[str, RunRecord] = {}

    # ---- parts of vLLM the tests reach into

    @property
    def manager(self) -> Any:
        """vLLM's ``TieringOffloadingManager`` (scheduler side)."""
        return self.scheduler.connector.connector_scheduler.manager  # type: ignore[union-attr]

    @property
    def secondary_tiers(self) -> List[Any]:
        return list(self.manager.secondary_tiers)

    @property
    def copy_worker(self) -> CpuCopyWorker:
        return self.worker.connector_worker.worker  # type: ignore[union-attr,return-value]

    # ---- the stand-in model

    def expected_slot(self, prefix: Sequence[int], group: int) -> bytes:
        """The bytes the stand-in model writes for the last token of ``prefix`` in ``group``."""
        n = _slot_bytes(self.group_specs[group])
        seed = xxhash.xxh64(np.asarray(prefix, dtype=np.int64).tobytes(), seed=group + 1).digest()
        return (seed * (n // len(seed) + 1))[:n]

    def _forward(self, req: Request, start: int, count: int, block_ids: Tuple[List[int], ...]) -> None:
        tokens = req.all_token_ids
        for g, (name, spec) in enumerate(zip(self.layer_names, self.group_specs)):
            table = block_ids[g]
            for t in range(start, start + count):
                block = table[t // spec.block_size]
                if block == 0:  # vLLM's null block: this group keeps no KV there
                    continue
                slot = self.expected_slot(tokens[: t + 1], g)
                self.kv[name][block, t % spec.block_size] = torch.frombuffer(bytearray(slot), dtype=torch.int8)

    def wipe(self) -> None:
        """Forget everything but the secondary tiers: vLLM's GPU prefix cache and its CPU tier
        (vLLM's own reset path), then zero every GPU KV byte and every byte of the CPU slab."""
        if not self.scheduler.reset_prefix_cache(reset_connector=True):
            raise RuntimeError("vLLM refused to reset its caches (requests still running)")
        for _ in range(100):
            if not self._transfers_pending():
                break
            self.step()
        for tensor in self.kv.values():
            tensor.zero_()
        slab = self.manager.primary_tier.get_kv_memoryview()
        np.frombuffer(slab.cast("B") if slab.ndim > 1 else slab, dtype=np.uint8)[:] = 0

    # ---- running requests

    def add_request(self, prompt: Sequence[int], *, max_tokens: int = 1, cache_salt: Optional[str] = None) -> str:
        self._requests += 1
        req_id = f"req-{self._requests}"
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=params,
                      pooling_params=None, block_hasher=self._block_hasher, cache_salt=cache_salt)
        self.scheduler.add_request(req)
        self.records[req_id] = RunRecord(req_id, list(prompt))
        return req_id

    def step(self) -> float:
        """One engine step (schedule, worker, update); returns the seconds the scheduler side took."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        scheduler_s = time.perf_counter() - t0
        meta = out.kv_connector_metadata
        assert meta is not None, "the rig's scheduler has a KV connector: its outputs carry metadata"
        for req_id in self.scheduler.requests:  # block tables, also of requests waiting for loads
            blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            if any(blocks):
                self.records[req_id].block_ids = tuple(list(b) for b in blocks)
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        sampled: Dict[str, List[int]] = {}
        for req_id, count in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            start = computed[req_id]
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            self._forward(req, start, count, block_ids)
            record = self.records[req_id]
            if req_id not in self._started:  # first forward: what it did not compute was a hit
                self._started.add(req_id)
                record.external_hit_tokens = start
            if start + count >= req.num_prompt_tokens:
                sampled[req_id] = [1 + (req.num_tokens % 997)]
        if out.total_num_scheduled_tokens > 0:
            self.worker.wait_for_save()
        results = self.worker.get_transfer_results(out.finished_req_ids)
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending, finished_recving=results.finished_recving,
            invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=self.worker.build_connector_worker_meta(),
        )
        self.worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        runner_out = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(r, []) for r in req_ids], kv_connector_output=kv_out,
        )
        t1 = time.perf_counter()
        outputs = self.scheduler.update_from_output(out, runner_out)
        scheduler_s += time.perf_counter() - t1
        for client_outputs in outputs.values():
            stats = client_outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.connector_stats.append(stats.kv_connector_stats)
        return scheduler_s

    def run(self, prompt: Sequence[int], *, max_tokens: int = 1, max_steps: int = 200,
            cache_salt: Optional[str] = None) -> RunRecord:
        """Run one request to completion and let its stores reach every tier; every GPU <-> CPU
        block copy meanwhile is this request's (one request at a time)."""
        req_id = self.add_request(prompt, max_tokens=max_tokens, cache_salt=cache_salt)
        record = self.records[req_id]
        first = len(self.copy_worker.transfers)
        for _ in range(max_steps):
            record.max_step_s = max(record.max_step_s, self.step())
            pending = self._transfers_pending()  # waits for the tiers' jobs between steps
            if not self.scheduler.requests and not pending:
                break
        else:
            raise TimeoutError(f"{req_id} did not finish in {max_steps} steps")
        for kind, group, _, block in self.copy_worker.transfers[first:]:
            logical = record.block_ids[group].index(block)  # vLLM's null block 0 is never copied
            (record.stored if kind == "store" else record.loaded)[group].add(logical)
        return record

    def _transfers_pending(self) -> bool:
        """Whether copies or tier jobs are still in flight; waits for the tiers' running jobs
        first (the test's own wait between steps, never inside one)."""
        for tier in self.secondary_tiers:
            if tier.has_pending_work():
                tier.drain_jobs()
        connector = self.scheduler.connector.connector_scheduler  # type: ignore[union-attr]
        return bool(connector.has_pending_push_work())

    def block_bytes(self, group: int, block: int) -> bytes:
        return self.kv[self.layer_names[group]][block].numpy().tobytes()

    def expected_block(self, prompt: Sequence[int], group: int, logical: int) -> bytes:
        b = self.group_specs[group].block_size
        return b"".join(self.expected_slot(prompt[: t + 1], group) for t in range(logical * b, (logical + 1) * b))

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()
