"""A CPU host pool for driving HiCache storage backends without SGLang's ``memory_pool_host``.

SGLang's host pool module does not import beside a CPU-only torch (its config package imports
torchvision), so tests register ``PageHostPool`` instead: an MHA host pool (K and V of
``layer_num`` layers, ``head_num`` x ``head_dim`` per token) with SGLang's three page layouts, and
exactly the surface SGLang's storage backends call on a registered pool:

- ``page_size``, ``size``, ``dtype``, ``layout``, ``kv_buffer`` (``None`` marks a logical anchor:
  ``LogicalAnchorPool``), ``size_per_token``, ``storage_format_tag``;
- ``get_data_page(index, flat)``, ``get_dummy_flat_data_page()``, ``set_from_flat_data_page(index,
  page)`` (``HiCacheFile``, kvtier's backend, SGLang's generic page path), with the same index
  arithmetic as SGLang 0.5.23's ``MHATokenToKVPoolHost``;
- ``get_page_buffer_meta(indices)``, ``get_size_per_token()``, ``get_ksize_per_token()``
  (Mooncake's zero-copy path).

``page_bytes(index)`` / ``fill_page(index, seed)`` are the test's view: one page's bytes as stored,
and a page filled with bytes derived from ``seed``. Tooling, never imported by the product.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

__all__ = ["PageHostPool", "LogicalAnchorPool", "LAYOUTS"]

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class PageHostPool:
    """An MHA host pool of ``num_pages`` pages on CPU (see the module docstring)."""

    storage_format_tag: Optional[str] = None
    dcp_size = 1
    dcp_rank = 0

    def __init__(self, *, num_pages: int, page_size: int, layer_num: int = 2, head_num: int = 2,
                 head_dim: int = 8, dtype: torch.dtype = torch.bfloat16, layout: str = "page_first") -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.page_size = page_size
        self.page_num = num_pages
        self.size = num_pages * page_size
        self.layer_num = layer_num
        self.head_num = head_num
        self.head_dim = head_dim
        self.dtype = dtype
        self.layout = layout
        self.device = "cpu"
        self.pin_memory = False
        self.size_per_token = 2 * layer_num * head_num * head_dim * dtype.itemsize
        if layout == "layer_first":
            dims: Tuple[int, ...] = (2, layer_num, self.size, head_num, head_dim)
        elif layout == "page_first":
            dims = (2, self.size, layer_num, head_num, head_dim)
        else:
            dims = (2, num_pages, layer_num, page_size, head_num, head_dim)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    # ------------------------------------------------------------------ what backends call

    def get_size_per_token(self) -> int:
        return self.size_per_token

    def get_ksize_per_token(self) -> int:
        return self.size_per_token // 2

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        index = int(index)
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index : index + self.page_size, :, :]
        elif self.layout == "page_first":
            page = self.kv_buffer[:, index : index + self.page_size, :, :, :]
        else:
            real = index // self.page_size
            page = self.kv_buffer[:, real : real + 1, :, :, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        index = int(index)
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index : index + self.page_size, :, :] = data_page.reshape(
                2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        elif self.layout == "page_first":
            self.kv_buffer[:, index : index + self.page_size, :, :, :] = data_page.reshape(
                2, self.page_size, self.layer_num, self.head_num, self.head_dim)
        else:
            real = index // self.page_size
            self.kv_buffer[:, real : real + 1, :, :, :, :] = data_page.reshape(
                2, 1, self.layer_num, self.page_size, self.head_num, self.head_dim)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> Tuple[List[int], List[int]]:
        """(pointer, byte size) of the K and V part of each page (page-major layouts only)."""
        if self.layout == "layer_first":
            raise NotImplementedError("PageHostPool: page buffer meta of layer_first is per layer (not needed here)")
        itemsize = self.dtype.itemsize
        per_token = self.layer_num * self.head_num * self.head_dim * itemsize
        v_offset = self.size * per_token
        base = self.kv_buffer.data_ptr()
        ptrs: List[int] = []
        for i in range(0, len(indices), self.page_size):
            k_ptr = base + int(indices[i]) * per_token
            ptrs += [k_ptr, k_ptr + v_offset]
        return ptrs, [per_token * self.page_size] * len(ptrs)

    # ------------------------------------------------------------------ the test's view

    def page_bytes(self, index: int) -> bytes:
        """The bytes of the page at token index ``index`` (as ``get_data_page`` flattens them)."""
        return self.get_data_page(index, flat=True).contiguous().view(torch.uint8).numpy().tobytes()

    def fill_page(self, index: int, seed: int) -> bytes:
        """Fill the page at ``index`` with bytes derived from ``seed``; returns them."""
        page = self.get_dummy_flat_data_page()
        generator = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (page.numel() * page.element_size(),), dtype=torch.uint8, generator=generator)
        self.set_from_flat_data_page(index, raw.view(self.dtype))
        return raw.numpy().tobytes()


class LogicalAnchorPool:
    """A KV anchor that holds no tensor (SGLang's ``LogicalHostPool``, DeepSeek-V4's KV anchor):
    its pages carry no bytes; side pools hold the data."""

    storage_format_tag: Optional[str] = None
    kv_buffer = None
    dtype = torch.uint8
    layout = "layer_first"
    size_per_token = 0

    def __init__(self, *, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.size = num_pages * page_size

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        pass

    def get_page_buffer_meta(self, indices: torch.Tensor) -> None:
        return None

    def get_ksize_per_token(self) -> int:
        return 0
