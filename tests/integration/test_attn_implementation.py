"""The fingerprint leaves out ``attn_implementation``; what that costs, measured.

Decision (docs/ARCHITECTURE.md, "The fingerprint and the attention kernel"): the attention kernel is
not bound into the fingerprint. sdpa and eager compute the same function with different rounding,
so their KV bytes differ by a few ulps (float32 ~1e-6 relative, bfloat16 a few bf16 ulps), exactly
as one server's prefill and decode kernels, or two batch shapes, already do. Binding it would split
one cache per kernel without making any restore more exact. These tests pin the measured sizes and
that decoding with sdpa over eager-written KV is as close to an sdpa recompute as eager is.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvtier.integrations.transformers import capture_kv, full_logits, layout_from_config, next_token_logits, tiny_hybrid_config  # noqa: E402
from kvtier.tools._warmup import model_fingerprint  # noqa: E402

PREFIX = 96
# (dtype, bound on max |KV eager - KV sdpa| / max |KV|): float32 rounding; bfloat16 ~8 ulps (2^-7 each)
BOUNDS = [(torch.float32, 1e-5), (torch.bfloat16, 8 * 2.0**-7)]


def test_fingerprint_ignores_the_attention_kernel():
    eager = tiny_hybrid_config(attn_implementation="eager")
    sdpa = tiny_hybrid_config(attn_implementation="sdpa")
    layout, _ = layout_from_config(eager)
    assert model_fingerprint(eager, layout, "bfloat16") == model_fingerprint(sdpa, layout, "bfloat16")


@pytest.mark.parametrize("dtype, relative_bound", BOUNDS, ids=["float32", "bfloat16"])
def test_sdpa_and_eager_kv_differ_by_rounding_only(dtype, relative_bound):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_hybrid_config(initializer_range=0.2), dtype=dtype).eval()
    ids = torch.randint(3, 128, (PREFIX + 4,), generator=torch.Generator().manual_seed(1)).tolist()
    kv, logits = {}, {}
    for kernel in ("eager", "sdpa"):
        model.set_attn_implementation(kernel)
        kv[kernel] = capture_kv(model, ids[:PREFIX])
        logits[kernel] = full_logits(model, ids)
    scale = max(k.float().abs().max().item() for k, _ in kv["eager"])
    diff = max(
        (a.float() - b.float()).abs().max().item()
        for pair_e, pair_s in zip(kv["eager"], kv["sdpa"])
        for a, b in zip(pair_e, pair_s)
    )
    assert 0 < diff / scale <= relative_bound  # different bytes, same values up to rounding

    # sdpa decoding over eager-written KV vs sdpa recomputing everything: no further than the two
    # kernels are from each other anyway.
    cache = transformers.DynamicCache()
    for layer, (keys, values) in enumerate(kv["eager"]):
        cache.update(keys.unsqueeze(0), values.unsqueeze(0), layer)
    mixed = next_token_logits(model, cache, ids, PREFIX)  # model is on sdpa now
    kernels_apart = (logits["eager"] - logits["sdpa"]).abs().max().item()
    mixed_apart = (mixed - logits["sdpa"]).abs().max().item()
    print(f"\n{dtype}: KV max |eager - sdpa| {diff:.3g} (max |KV| {scale:.3g}); next-token logits: eager vs sdpa "
          f"recompute {kernels_apart:.3g}, sdpa over eager KV vs sdpa recompute {mixed_apart:.3g}")
    assert mixed_apart <= 2 * kernels_apart + (1e-6 if dtype == torch.float32 else 2.0**-6)
