"""The flash-attn backend's parts that need no GPU: the 256-token blocks handed to FlashAttention as
128-token pages address exactly the tokens the block tables do, and without the flash-attn-4 package
asking for the backend is a configuration error that says how to install it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")  # the backend runs the Triton kernels for what FlashAttention does not

from tests.services_harness import run_cli  # noqa: E402
from tests.tiny_models import make_tiny_checkpoint  # noqa: E402
from tests.worker_service.triton_runtime import FLASH_ATTN_INSTALLED  # noqa: E402
from worker_service.attention import available_backends, get_attention_backend  # noqa: E402
from worker_service.attention.flash_attn_backend import FLASH_PAGE_SIZE, as_pages, page_tables  # noqa: E402

needs_missing_package = pytest.mark.skipif(FLASH_ATTN_INSTALLED, reason="flash-attn-4 is installed here")


def tokens_by_table(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first length tokens that a block table row addresses in cache [blocks, block_size, ...]."""
    block_size = cache.shape[1]
    positions = torch.arange(length)
    return cache[table[positions // block_size].long(), positions % block_size]


@pytest.mark.parametrize("block_size", [16, 128, 256, 512, 384])
def test_pages_address_the_same_tokens_as_blocks(block_size: int) -> None:
    num_blocks, max_blocks = 11, 4
    cache = torch.randn(num_blocks, block_size, 2, 8)
    generator = torch.Generator().manual_seed(block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=generator)[:max_blocks] for _ in range(3)])
    tables = tables.to(torch.int32)
    pages, paged_tables = as_pages(cache), page_tables(tables, block_size)
    split = block_size > FLASH_PAGE_SIZE and block_size % FLASH_PAGE_SIZE == 0
    assert pages.shape[1] == (FLASH_PAGE_SIZE if split else block_size)
    assert paged_tables.dtype == torch.int32 and paged_tables.shape == (3, max_blocks * block_size // pages.shape[1])
    assert pages.data_ptr() == cache.data_ptr()  # a view: FlashAttention reads the cache itself
    for row in range(3):
        for length in (1, block_size - 1, block_size + 1, max_blocks * block_size):
            assert torch.equal(tokens_by_table(pages, paged_tables[row], length),
                               tokens_by_table(cache, tables[row], length))


@needs_missing_package
def test_missing_package_is_a_configuration_error_naming_the_extra() -> None:
    assert "flash-attn" in available_backends()
    with pytest.raises(ValueError, match=r"attention_backend: flash-attn needs the flash-attn-4 package .*"
                                         r"nanovllm-grpc\[flash-attn\].*--attention-backend triton"):
        get_attention_backend("flash-attn")


@needs_missing_package
def test_the_worker_exits_2_with_one_line_saying_what_to_install(tmp_path: Path) -> None:
    model = make_tiny_checkpoint(tmp_path, "qwen3", seed=1)
    result = run_cli("worker", "--model", str(model), "--device", "cpu", "--attention-backend", "flash-attn")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("nanovllm worker: attention_backend: flash-attn needs the flash-attn-4 package")
    assert "pip install 'nanovllm-grpc[flash-attn]'" in line
