"""The KV cache reserves context x slots but takes memory only as positions are written."""

import psutil
import pytest
import torch
from model_shapes import smollm2

from shardline.models.kv_cache import KVCache

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


def test_a_released_slot_gives_its_memory_back_and_reads_zeros():
    process = psutil.Process()
    cache = KVCache(smollm2(), 30, 4, 1000, torch.bfloat16)  # 1000 -> 1024 positions
    assert cache.block_tokens == 32 and cache.blocks_for(1) == 32 and cache.blocks_for(33) == 64
    assert cache.bytes_per_token == 2 * 30 * 3 * 64 * 2
    before = process.memory_info().rss
    for layer in range(30):
        for slot in (1, 2):
            cache.k[layer][slot, :, :1000] = 1
            cache.v[layer][slot, :, :1000] = 1
    written = process.memory_info().rss - before
    cache.release(1)
    released = process.memory_info().rss - before
    print(f"\nRSS: +{written / MIB:.1f} MiB written, +{released / MIB:.1f} MiB after one release")
    assert written > 2 * 20 * MIB  # two sequences of 1000 tokens: 2 x 22 MiB
    assert written - released > 20 * MIB  # one sequence's pages went back
    assert cache.k[29][1].abs().sum().item() == 0 and cache.v[0][1].abs().sum().item() == 0
    assert cache.k[29][2, :, :1000].min().item() == 1  # the other slot keeps its keys


def test_releasing_a_slot_past_a_prefix_keeps_the_prefix_and_gives_back_the_rest():
    """A cached prefix (runner.prefix_cache) keeps its first whole blocks; the pages of
    every head past them go back, in every layer."""
    process = psutil.Process()
    cache = KVCache(smollm2(), 30, 4, 1000, torch.bfloat16)
    for layer in range(30):
        cache.k[layer][1, :, :1000] = 1
        cache.v[layer][1, :, :1000] = 1
    written = process.memory_info().rss
    cache.release(1, 100)  # keeps 128 positions (4 blocks of 32)
    freed = written - process.memory_info().rss
    assert freed > 15 * MIB  # 872 of 1000 positions of 22 MiB
    for t in (cache.k[0], cache.v[29], cache.k[17]):
        assert t[1, :, :128].min().item() == 1  # every head keeps its prefix
        assert t[1, :, 128:].abs().sum().item() == 0


def test_more_address_space_than_memory_is_reserved_without_taking_it():
    """A cache of more slots x context than the machine's RAM and swap (admission bounds
    what is written) maps: the kernel's overcommit check refused it without
    MAP_NORESERVE, and the runner failed with ENOMEM."""
    from pathlib import Path

    from shardline.models.kv_cache import MAP_NORESERVE

    overcommit = Path("/proc/sys/vm/overcommit_memory")
    if not MAP_NORESERVE or not overcommit.exists() or overcommit.read_text().strip() != "0":
        pytest.skip("only Linux's heuristic overcommit (mode 0) checks a mapping's size this way")
    memory = psutil.virtual_memory().total + psutil.swap_memory().total
    slots = -(-2 * memory // (720 * MIB // 8))  # twice RAM + swap, in SmolLM2 slots of 4,096
    process = psutil.Process()
    before = process.memory_info().rss
    cache = KVCache(smollm2(), 30, slots, 4096, torch.bfloat16)
    assert cache.nbytes() > memory
    cache.k[29][slots - 1, :, :64] = 1
    assert process.memory_info().rss - before < 20 * MIB
