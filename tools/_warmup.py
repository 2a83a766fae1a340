"""Offline warmup: run a local transformers causal LM over a prompt corpus and fill the disk tier.

Primitives:

- ``run_warmup`` (async): load the model, read the prompts (JSONL, aiofiles), and for each prompt
  capture every layer's K/V, write it into paged CPU/GPU blocks and ``store`` it through an
  ``OffloadEngine`` on ``cache_dir``; ``flush`` at the end. Resumable: a prompt whose chunks are
  all present is skipped without running the model.
- ``model_fingerprint``: the layout fingerprint of a transformers model. A serving process calls
  the same function with the same config, layout and dtype, so its keys equal warmup's.
- ``read_prompts`` (async): the JSONL corpus as token-id lists.
- ``WarmupSummary``: what a run did.

Threads: everything engine-facing runs on the event-loop thread; model loading and each forward
pass run in a worker thread (``asyncio.to_thread``), so the engine's spill task keeps writing the
previous prompt's chunks while the next prompt is computed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Type, Union

import aiofiles
import torch
from tqdm.auto import tqdm

from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import OffloadEngine
from kvtier.errors import KvtierError
from kvtier.policy import ChunkState, ModelLayout, cdiv, layout_fingerprint, longest_hit
from kvtier.policy.plan import store_chunk_indices
from kvtier.tiers.device import DeviceKVView
from kvtier.tiers.device_backend import DeviceBackend

from kvtier.integrations.transformers import (
    cache_plan,
    capture_kv,
    layer_kv_shapes,
    layer_types_from_config,
    load_model,
    parse_dtype,
    require_model_dir,
    require_transformers,
    text_config,
)

__all__ = ["WarmupSummary", "run_warmup", "model_fingerprint", "read_prompts"]

logger = logging.getLogger("kvtier.warmup")

PathLike = Union[str, "os.PathLike[str]"]

# Config fields that describe how a model is run, not what it computes, left out of the fingerprint.
# Two processes differing only here compute the same function, but not always the same bytes: the
# attention kernel (attn_implementation) changes rounding, measured on a tiny Gemma-3: KV max |diff|
# 2.4e-6 in float32 and 0.074 (~5 bf16 ulps) in bfloat16, as two batch shapes or a server's own
# prefill and decode kernels do too. Binding it would split one cache per kernel without making any
# restore more exact (docs/ARCHITECTURE.md, "The fingerprint and the attention kernel";
# tests/integration/test_attn_implementation.py). Fields starting with "_" (transformers' private
# bookkeeping) are ignored too.
_RUNTIME_CONFIG_KEYS = frozenset(
    {
        "transformers_version",
        "dtype",
        "torch_dtype",
        "use_cache",
        "attn_implementation",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "architectures",
    }
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
# A store dropped under pressure or a full queue is retried after a flush this many times before
# the prompt is counted as dropped: warmup is offline, so waiting is fine, but not forever.
_STORE_ATTEMPTS = 4
# Marks a prompt line without "token_ids" (a text prompt) apart from one whose token_ids is null.
_TEXT_PROMPT = object()


@dataclass(frozen=True)
class WarmupSummary:
    """What one ``run_warmup`` did. ``chunks_stored``/``bytes_stored`` count chunks this run wrote
    and the disk confirmed durable (chunks another prompt or an earlier run already stored are
    ``chunks_present``; chunks whose write failed, e.g. on a full disk, are ``chunks_not_durable``
    and never counted as stored)."""

    prompts: int
    skipped: int  # already complete in the cache (resumed), or too short to fill one chunk
    tokens: int  # tokens run through the model
    chunks_stored: int
    bytes_stored: int
    seconds: float
    chunks_present: int = 0
    chunks_dropped: int = 0
    chunks_not_durable: int = 0
    fingerprint: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def format(self) -> str:
        """A few readable lines for the ``kvtier warmup`` command."""
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        lines = [
            f"warmup: {self.prompts} prompts ({self.skipped} skipped: already cached or shorter than a chunk)",
            f"  tokens run     {self.tokens} ({rate:,.0f} tokens/s over {self.seconds:.1f} s)",
            f"  chunks stored  {self.chunks_stored} ({self.bytes_stored / 2**20:,.1f} MiB); "
            f"already present {self.chunks_present}",
        ]
        if self.chunks_dropped or self.chunks_not_durable:
            lines.append(f"  NOT stored     {self.chunks_dropped} dropped, {self.chunks_not_durable} not on disk")
        lines.append(f"  fingerprint    {self.fingerprint[:16]}")
        return "\n".join(lines)


def _config_tag(config: Any) -> str:
    data = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    kept = {k: v for k, v in data.items() if not k.startswith("_") and k not in _RUNTIME_CONFIG_KEYS}
    text = json.dumps(kept, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _model_name(config: Any) -> str:
    name = str(getattr(config, "_name_or_path", "") or "")
    # A local directory is named by its last component, so /models/x and /srv/x agree.
    if name and os.path.isdir(name):
        name = os.path.basename(os.path.normpath(name))
    return name


def model_fingerprint(
    config: Any,
    layout: ModelLayout,
    dtype: Union[str, torch.dtype],
    *,
    weights_version: Optional[str] = None,
) -> bytes:
    """``layout_fingerprint`` of a transformers model: model type, dtype, per-group KV shapes
    ``(layers, 2, kv_heads, head_dim)`` and a weights tag.

    The default tag is the model's name (``config._name_or_path``, a local directory by its last
    component) and a hash of the config without its runtime fields. The config cannot tell two
    checkpoints of one architecture apart: for fine-tuned or re-trained weights pass
    ``weights_version`` (a revision or checkpoint hash), the same in warmup and serving.
    """
    text = text_config(config)
    dtype_name, _ = parse_dtype(dtype)
    shapes = cache_plan(text).fingerprint_shapes()
    if len(shapes) != len(layout.groups):
        raise ValueError(f"the layout has {len(layout.groups)} groups but this model's cache has {len(shapes)}")
    if weights_version is None:
        weights_version = f"{_model_name(text)}#{_config_tag(text)}"
    model = str(getattr(text, "model_type", None) or type(text).__name__)
    return layout_fingerprint(layout, model=model, dtype=dtype_name, shapes=shapes, weights_version=weights_version)


# ------------------------------------------------------------------ prompts


async def read_prompts(path: PathLike, tokenizer_dir: Optional[PathLike] = None) -> List[List[int]]:
    """Token ids of every prompt in a JSONL file: each non-blank line is an object with
    ``"token_ids"`` (a list of non-negative ints) or ``"text"`` (tokenized with the tokenizer in
    ``tokenizer_dir``, which must then hold one). Errors name the line."""
    entries: List[Tuple[int, Any, Optional[str]]] = []
    number = 0
    try:
        async with aiofiles.open(os.fspath(path), "r", encoding="utf-8") as f:
            async for line in f:
                number += 1
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{os.fspath(path)}:{number}: not JSON: {exc.msg}") from None
                if not isinstance(record, dict) or ("token_ids" not in record and "text" not in record):
                    raise ValueError(f"{os.fspath(path)}:{number}: expected an object with 'token_ids' or 'text'")
                # A present "token_ids" is a token-id prompt even when its value is wrong (null):
                # the error then names token_ids, not a missing tokenizer.
                ids = record["token_ids"] if "token_ids" in record else _TEXT_PROMPT
                entries.append((number, ids, record.get("text")))
    except FileNotFoundError:
        raise ValueError(f"prompts file {os.fspath(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"prompts file {os.fspath(path)!r} is a directory, not a JSONL file") from None
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"prompts file {os.fspath(path)!r} is not UTF-8 text ({exc.reason}); "
            "expected JSONL with one object per line"
        ) from None

    tokenizer = None
    if any(ids is _TEXT_PROMPT for _, ids, _ in entries):
        tokenizer = _load_tokenizer(tokenizer_dir, path)
    prompts: List[List[int]] = []
    for number, ids, text in entries:
        where = f"{os.fspath(path)}:{number}"
        if ids is _TEXT_PROMPT:
            if not isinstance(text, str):
                raise ValueError(f"{where}: 'text' must be a string")
            assert tokenizer is not None, "loaded above whenever an entry is a text prompt"
            ids = tokenizer(text)["input_ids"]
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
        ):
            raise ValueError(f"{where}: 'token_ids' must be a list of non-negative ints, got {json.dumps(ids)[:60]}")
        if not ids:
            raise ValueError(f"{where}: the prompt is empty (no tokens to warm)")
        prompts.append(ids)
    if not prompts:
        # Exit 0 with "0 prompts" would tell a CI step the cache is warm.
        raise ValueError(f"prompts file {os.fspath(path)!r} holds no prompts (every line is blank)")
    return prompts


def _load_tokenizer(tokenizer_dir: Optional[PathLike], prompts_path: PathLike):
    if tokenizer_dir is None:
        raise ValueError(f"{os.fspath(prompts_path)} has 'text' prompts but no tokenizer directory was given")
    directory = os.fspath(tokenizer_dir)
    # transformers 5 builds an empty tokenizer for a directory without tokenizer files (every word
    # becomes <unk>), so the files are checked here rather than trusting from_pretrained.
    if not any(os.path.isfile(os.path.join(directory, name)) for name in _TOKENIZER_FILES):
        raise ValueError(
            f"{os.fspath(prompts_path)} has 'text' prompts but {directory!r} holds no tokenizer "
            f"(none of {', '.join(_TOKENIZER_FILES)}); give token_ids instead, or save the tokenizer "
            "next to the model"
        )
    transformers = require_transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(
            f"{os.fspath(prompts_path)} has 'text' prompts but {directory!r} holds no "
            f"usable tokenizer ({exc}); give token_ids instead, or save the tokenizer next to the model"
        ) from None


# ------------------------------------------------------------------ resumability


def _reachable_boundaries(layout: ModelLayout, num_tokens: int) -> List[int]:
    """Boundaries a consumer of this prompt can hit, longest first (as the store mask counts them)."""
    alignment = layout.alignment_tokens
    boundaries = set(range(alignment, num_tokens + 1, alignment))
    for group in layout.groups:
        final = (num_tokens // group.block_size) * group.block_size
        if final:
            boundaries.add(final)
    return sorted(boundaries, reverse=True)


def _ideal_state(layout: ModelLayout, num_tokens: int):
    stored = [set(store_chunk_indices(layout, g, num_tokens)) for g in range(len(layout.groups))]

    def state(group_index: int, chunk_index: int) -> ChunkState:
        return ChunkState.READY if chunk_index in stored[group_index] else ChunkState.MISSING

    return state, sum(len(s) for s in stored)


def _already_complete(engine: OffloadEngine, keys, layout: ModelLayout, num_tokens: int) -> bool:
    """True when, at every boundary a consumer can reach, the engine already serves at least the hit
    a complete store of this prompt would give. Checked longest boundary first, so a prompt never
    seen before costs one lookup. ``lookup`` counts these probes in the engine's hit metrics."""
    state, _ = _ideal_state(layout, num_tokens)
    for boundary in _reachable_boundaries(layout, num_tokens):
        expected = longest_hit(layout, boundary, state)
        assert expected is not None, "the ideal state holds READY and MISSING chunks only, none in flight"
        actual = engine.lookup(keys, max_tokens=boundary)
        if actual is None or actual < expected:
            return False
    return True


# ------------------------------------------------------------------ the run


def _host_capacity_for(view: DeviceKVView, layout: ModelLayout, max_tokens: int) -> int:
    # The engine gives every group the same slot count (capacity // sum of chunk sizes); room for two
    # prompts' chunks lets one prompt spill while the next one is stored.
    chunks = max(cdiv(max_tokens, g.tokens_per_chunk) for g in layout.groups)
    return 2 * chunks * sum(view.chunk_nbytes(g) for g in range(len(layout.groups)))


def _checkpoint_errors() -> Tuple[Type[BaseException], ...]:
    """What a damaged or foreign checkpoint raises while loading: safetensors' own error (a
    garbage ``model.safetensors``), OSError (missing or unreadable files), ValueError / KeyError
    (a config that does not parse) and RuntimeError (weights of the wrong shape)."""
    errors: Tuple[Type[BaseException], ...] = (OSError, ValueError, KeyError, RuntimeError)
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - transformers requires safetensors
        return errors
    return errors + (SafetensorError,)


def _load_quietly(model_dir: PathLike, **kwargs: Any):
    """``load_model`` without transformers' own progress bars (restored afterwards)."""
    hf_logging = require_transformers().utils.logging
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return load_model(model_dir, **kwargs)
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


async def _store(engine: OffloadEngine, keys, block_table, num_tokens: int):
    """Store, retrying after a flush when the engine drops the chunks (pressure, full queue or host
    pool): the device blocks are ours until the handle is released, so a retry reads the same bytes."""
    handle = None
    for attempt in range(_STORE_ATTEMPTS):
        handle = engine.store(keys, block_table, num_tokens)
        if not handle.dropped:
            return handle
        if attempt + 1 == _STORE_ATTEMPTS:
            break
        logger.info("store dropped (%s), attempt %d: flushing and retrying", handle.drop_reason, attempt + 1)
        await engine.flush()
        if handle.drop_reason == "pressure":
            await asyncio.sleep(engine.config.pressure_poll_interval_s)
    return handle


def _remove_unused_cache_dir(cache_dir: PathLike) -> None:
    """Remove a cache directory this run created and never stored into (a failure must not leave an
    empty cache behind that looks like a warmed one)."""
    try:
        shutil.rmtree(os.fspath(cache_dir))
    except OSError as exc:  # pragma: no cover - best effort; the original error is what matters
        logger.warning("could not remove the unused cache directory %s: %s", os.fspath(cache_dir), exc)


def _require_a_chunk(layout: ModelLayout, prompts: Sequence[Sequence[int]]) -> None:
    """A chunk longer than every prompt stores nothing: refused, or warmup would exit 0 having
    warmed nothing."""
    chunk = min(g.tokens_per_chunk for g in layout.groups)
    longest = max(len(ids) for ids in prompts)
    if chunk > longest:
        raise ValueError(
            f"a chunk is {chunk} tokens (--block-size x --blocks-per-chunk), longer than the longest prompt "
            f"({longest} tokens): nothing would be stored"
        )


async def run_warmup(
    model_dir: PathLike,
    prompts_path: PathLike,
    cache_dir: PathLike,
    *,
    salt: Union[bytes, str, None] = None,
    device: str = "cpu",
    dtype: str = "float32",
    block_size: int = 16,
    blocks_per_chunk: int = 1,
    extra_retained_tokens: int = 0,
    progress: bool = True,
    attn_implementation: Optional[str] = None,
    weights_version: Optional[str] = None,
    engine_config: Optional[EngineConfig] = None,
) -> WarmupSummary:
    """Fill ``cache_dir`` with the KV chunks of every prompt in ``prompts_path``.

    The model is ``AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)``; its
    layout comes from ``layout_from_config`` and its fingerprint from ``model_fingerprint`` (pass the
    same ``weights_version``, ``salt``, block geometry and ``dtype`` in the serving process, and its
    keys match). ``engine_config`` overrides the engine settings (its ``cache_dir`` is replaced by
    ``cache_dir``); by default the host pool is sized to hold two prompts' chunks. A prompt whose
    chunks are already all present is skipped without running the model, so an interrupted run is
    resumed by running it again. Chunks dropped after every retry are counted, not raised.
    """
    started = time.perf_counter()
    dtype_name, torch_dtype = parse_dtype(dtype)
    require_model_dir(model_dir)
    DeviceBackend(device)  # a missing GPU is a one-line DeviceError now, not torch's assertion later
    prompts = await read_prompts(prompts_path, tokenizer_dir=model_dir)
    # Refusals that the config alone decides (shared or lossy KV, unsupported attention) come
    # before the model is loaded and before anything is created on disk.
    plan = cache_plan(
        require_transformers().AutoConfig.from_pretrained(os.fspath(model_dir), local_files_only=True),
        block_size=block_size,
        blocks_per_chunk=blocks_per_chunk,
        extra_retained_tokens=extra_retained_tokens,
    )
    _require_a_chunk(plan.layout, prompts)
    try:
        model = await asyncio.to_thread(
            _load_quietly if not progress else load_model,
            model_dir,
            device=device,
            dtype=torch_dtype,
            attn_implementation=attn_implementation,
        )
    except _checkpoint_errors() as exc:
        raise ValueError(
            f"cannot load the model in {os.fspath(model_dir)!r} ({type(exc).__name__}: {exc}); "
            "is it a complete transformers checkpoint?"
        ) from exc
    config = text_config(model.config)
    vocab = getattr(config, "vocab_size", None)
    max_positions = getattr(config, "max_position_embeddings", None)
    for index, ids in enumerate(prompts):
        if vocab is not None and ids and max(ids) >= vocab:
            raise ValueError(f"prompt {index + 1}: token id {max(ids)} is outside the vocabulary ({vocab})")
        if max_positions is not None and len(ids) > max_positions:
            raise ValueError(
                f"prompt {index + 1}: {len(ids)} tokens, more than the model's max_position_embeddings "
                f"({max_positions})"
            )
    layout = plan.layout
    fingerprint = model_fingerprint(config, layout, dtype_name, weights_version=weights_version)
    probe = next((ids[:8] for ids in prompts if ids), None)
    if probe is not None:  # the model caches what the config says (shapes), checked before the engine opens
        try:
            await asyncio.to_thread(plan.capture, model, probe)
        except (KvtierError, ValueError):
            raise
        except Exception as exc:  # the model's own forward: a model problem, not a kvtier bug
            raise ValueError(
                f"the model in {os.fspath(model_dir)!r} fails its own forward pass on an 8-token probe "
                f"({type(exc).__name__}: {exc}); its config does not describe a model that runs"
            ) from exc

    max_tokens = max((len(ids) for ids in prompts), default=1) or 1
    num_blocks = [cdiv(max_tokens, g.block_size) for g in layout.groups]
    kv_caches = plan.allocate(num_blocks, torch_dtype, device)
    view = DeviceKVView(layout, kv_caches)
    block_table = [list(range(n)) for n in num_blocks]
    if engine_config is None:
        capacity = max(EngineConfig().host_capacity_bytes, _host_capacity_for(view, layout, max_tokens))
        engine_config = EngineConfig(
            cache_dir=os.fspath(cache_dir),
            host_capacity_bytes=capacity,
            device_kind="cuda" if str(device).startswith("cuda") else "cpu",
        )
    else:
        engine_config = dataclasses.replace(engine_config, cache_dir=os.fspath(cache_dir))

    skipped = tokens = scheduled = stored = stored_bytes = present = dropped = 0
    handles = []
    bar = tqdm(total=len(prompts), unit="prompt", desc="warmup", disable=not progress)
    created_cache_dir = not os.path.exists(os.fspath(cache_dir))
    try:
        async with OffloadEngine(layout, view, engine_config, fingerprint=fingerprint) as engine:
            previous = None
            for ids in prompts:
                keys = engine.request_keys(ids, salt=salt)
                _, wanted = _ideal_state(layout, len(ids))
                if wanted == 0 or _already_complete(engine, keys, layout, len(ids)):
                    skipped += 1
                    bar.update(1)
                    continue
                kv = await asyncio.to_thread(plan.capture, model, ids)
                if previous is not None:
                    await previous.wait_released()  # the device blocks are reused below
                plan.write(kv, kv_caches, block_table, len(ids))
                del kv
                handle = await _store(engine, keys, block_table, len(ids))
                tokens += len(ids)
                present += len(handle.skipped)
                if handle.dropped:
                    dropped += len(handle.dropped)
                    logger.warning(
                        "prompt of %d tokens: %d chunks dropped (%s)", len(ids), len(handle.dropped), handle.drop_reason
                    )
                else:
                    scheduled += len(handle.scheduled)
                    handles.append(handle)
                previous = handle
                bar.update(1)
                bar.set_postfix(tokens=tokens, chunks=scheduled, refresh=False)
            await engine.flush()
            durable = await asyncio.gather(*(h.wait_durable() for h in handles))
            # Only chunks on disk count as stored: a summary must not promise what a full disk lost.
            not_durable = sum(len(h.scheduled) for h, ok in zip(handles, durable) if not ok)
            stored = sum(len(h.scheduled) for h, ok in zip(handles, durable) if ok)
            stored_bytes = sum(view.chunk_nbytes(g) for h, ok in zip(handles, durable) if ok for g, _ in h.scheduled)
    except BaseException:
        if created_cache_dir and scheduled == 0 and present == 0:
            _remove_unused_cache_dir(cache_dir)
        raise
    finally:
        bar.close()
    return WarmupSummary(
        prompts=len(prompts),
        skipped=skipped,
        tokens=tokens,
        chunks_stored=stored,
        bytes_stored=stored_bytes,
        seconds=time.perf_counter() - started,
        chunks_present=present,
        chunks_dropped=dropped,
        chunks_not_durable=not_durable,
        fingerprint=fingerprint.hex(),
    )


def vllm_key_coverage(prompts_path: PathLike, cache_dir: PathLike, layout_path: Optional[PathLike] = None, *,
                      cache_salt: Optional[str] = None, tokenizer_dir: Optional[PathLike] = None) -> list:
    """``kvtier warmup --key-scheme vllm``: the prompts' keys computed as a vLLM server computes them
    (``kvtier.integrations.vllm.warmup``; imports vLLM), and per prompt and group how many chunks
    the cache holds under them. ``layout_path`` defaults to the layout file the server's
    ``KvtierTier`` left in ``cache_dir``."""
    from kvtier.integrations.vllm.warmup import cache_coverage, load_layout

    prompts = asyncio.run(read_prompts(prompts_path, tokenizer_dir))
    layout = load_layout(layout_path if layout_path is not None else cache_dir)
    return cache_coverage(cache_dir, layout, prompts, cache_salt=cache_salt)


def vllm_warm_from_model(model_dir: PathLike, prompts_path: PathLike, cache_dir: PathLike,
                         layout_path: Optional[PathLike] = None, *, cache_salt: Optional[str] = None,
                         retention_interval: Optional[int] = 0, kv_cache_layout: Optional[str] = None,
                         extra_retained_tokens: int = 0, dtype: str = "float32", device: str = "cpu"):
    """``kvtier warmup --key-scheme vllm --model DIR``: fill ``cache_dir`` offline with the records a
    vLLM server with ``KvtierTier`` would store for the prompts
    (``kvtier.integrations.vllm.model_warmup``; imports vLLM)."""
    from kvtier.integrations.vllm.model_warmup import page_order, warm_from_kv
    from kvtier.integrations.vllm.warmup import load_layout

    prompts = asyncio.run(read_prompts(prompts_path, model_dir))
    layout = load_layout(layout_path if layout_path is not None else cache_dir)
    page_order(layout, kv_cache_layout)  # refuse a layout it cannot fill before loading the model
    model = load_model(model_dir, device=device, dtype=dtype)
    config = text_config(model.config)
    layer_types, window = layer_types_from_config(config)
    return warm_from_kv(lambda prompt: capture_kv(model, prompt), cache_dir, layout, prompts,
                        layer_shapes=layer_kv_shapes(config), layer_types=layer_types,
                        sliding_window=window, cache_salt=cache_salt, retention_interval=retention_interval,
                        kv_cache_layout=kv_cache_layout, extra_retained_tokens=extra_retained_tokens)
