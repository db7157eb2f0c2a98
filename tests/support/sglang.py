"""The SGLang tests' shared pieces: the wheel, a host pool stand-in, pages and keys, the storage config."""

from __future__ import annotations

import importlib
import sys
import zipfile
from pathlib import Path

import pytest
import torch


WHEEL_DIR = Path(__file__).resolve().parents[2] / ".venv" / "wheels"
SGLANG_FILES = ("sglang/srt/environ.py", "sglang/srt/mem_cache/hicache_storage.py",
                "sglang/srt/mem_cache/storage/__init__.py", "sglang/srt/mem_cache/storage/backend_factory.py")
MODULE = "kvtier.integrations.sglang.storage"
FORMER_MODULE = "kvtier.integrations.sglang_storage"  # the alias existing configs name


def find_wheel() -> Path | None:
    """The sglang 0.5.23 wheel `make venv` downloads (`pip download --no-deps sglang==0.5.23`)."""
    wheels = sorted(WHEEL_DIR.glob("sglang-0.5.23-*.whl"))
    return wheels[0] if wheels else None


# A page: 4 tokens x 2 layers x 2 KV heads x 128 dims, K and V, bfloat16 = 8 KiB.
PAGE_TOKENS, LAYERS, HEADS, HEAD_DIM, DTYPE = 4, 2, 2, 128, torch.bfloat16
PAGE_BYTES = 2 * LAYERS * PAGE_TOKENS * HEADS * HEAD_DIM * DTYPE.itemsize


@pytest.fixture(scope="module")
def sgl(tmp_path_factory):
    """The real SGLang modules, extracted from the wheel; removed from sys.modules afterwards."""
    root = tmp_path_factory.mktemp("sglang-0.5.23")
    with zipfile.ZipFile(find_wheel()) as wheel:
        for name in SGLANG_FILES:
            wheel.extract(name, root)
    sys.path.insert(0, str(root))
    try:
        storage = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
        factory = importlib.import_module("sglang.srt.mem_cache.storage.backend_factory")
        adapter = importlib.import_module(MODULE)
        yield type("SGLang", (), {"storage": storage, "factory": factory, "adapter": adapter})
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.") or m in (MODULE, FORMER_MODULE)]:
            del sys.modules[name]


class FakeHostPool:
    """The page accessors of SGLang 0.5.23's `MHATokenToKVPoolHost` for its two main layouts."""

    def __init__(self, layout: str = "page_first", num_pages: int = 16, seed: int = 0) -> None:
        self.layout, self.page_size, self.dtype = layout, PAGE_TOKENS, DTYPE
        self.layer_num, self.head_num, self.head_dim = LAYERS, HEADS, HEAD_DIM
        size = num_pages * PAGE_TOKENS
        dims = (2, LAYERS, size, HEADS, HEAD_DIM) if layout == "layer_first" else (2, size, LAYERS, HEADS, HEAD_DIM)
        self.kv_buffer = torch.randn(dims, generator=torch.Generator().manual_seed(seed)).to(DTYPE)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index : index + self.page_size]
        else:
            page = self.kv_buffer[:, index : index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, LAYERS, PAGE_TOKENS, HEADS, HEAD_DIM), dtype=DTYPE).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index : index + self.page_size] = data_page.reshape(2, LAYERS, PAGE_TOKENS, HEADS, HEAD_DIM)
        else:
            self.kv_buffer[:, index : index + self.page_size] = data_page.reshape(2, PAGE_TOKENS, LAYERS, HEADS, HEAD_DIM)

    def indices(self, pages) -> torch.Tensor:
        return torch.cat([torch.arange(p * PAGE_TOKENS, (p + 1) * PAGE_TOKENS) for p in pages])


def storage_config(sgl, extra=None, **overrides):
    fields = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0, "attn_cp_size": 1,
              "is_mla_model": False, "enable_storage_metrics": False, "is_page_first_layout": True,
              "model_name": "org/tiny", "extra_config": extra}
    return sgl.storage.HiCacheStorageConfig(**{**fields, **overrides})


def page(seed: int) -> torch.Tensor:
    """A distinct bf16 page per seed, in SGLang's flat page shape."""
    return torch.randn(PAGE_BYTES // 2, generator=torch.Generator().manual_seed(seed)).to(DTYPE)


def keys(n: int, tag: str = "p") -> list[str]:
    return [f"{tag}{i:061x}" for i in range(n)]  # SGLang keys are sha256 hex strings


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
