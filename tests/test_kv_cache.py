"""The KV cache reserves context x slots but takes memory only as positions are written."""

import psutil
import pytest
import torch
from model_shapes import smollm2

from shardline.models.llama import KVCache

pytestmark = pytest.mark.timeout(30)

MIB = 2**20


def test_memory_is_taken_as_positions_are_written():
    process = psutil.Process()
    before = process.memory_info().rss
    cache = KVCache(smollm2(), 30, 8, 4096, torch.bfloat16)
    assert cache.nbytes() == 720 * MIB  # SmolLM2: 30 layers x 8 slots x 3 KV heads x 4096
    reserved = process.memory_info().rss - before
    for layer in range(30):
        for slot in range(4):  # 4 sequences of 576 tokens: 53 MiB of positions
            cache.k[layer][slot, :, :576] = 1
            cache.v[layer][slot, :, :576] = 1
    written = process.memory_info().rss - before
    print(f"\nRSS: +{reserved / MIB:.0f} MiB reserved, +{written / MIB:.0f} MiB after writing")
    assert reserved < 20 * MIB
    # 4 KiB pages, not 2 MiB huge pages (which took about half of the whole cache)
    assert written < 80 * MIB
    assert cache.k[0][5].abs().sum().item() == 0  # unwritten slots read as zeros
