"""`python -m pagedllm.kv_demo`: a short demonstration of the native KV-cache core.

It walks one paged KV cache through what a serving engine does: allocate slots for a prompt,
fork a sequence for parallel sampling (blocks shared, ref count + 1), copy-on-write on the first
divergent token, a prefix-cache hit for a second request with the same prompt, and the usage and
prefix-cache statistics.
"""

from __future__ import annotations

import numpy as np

from pagedllm import _C


def main() -> int:
    print(f"pagedllm._C loaded; built with CUDA: {_C.built_with_cuda}; CUDA devices: {_C.cuda_device_count()}")
    block_size, num_blocks = 16, 64
    kv = _C.KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    print(f"KV cache: {num_blocks} blocks of {block_size} tokens, prefix caching on")

    prompt = np.arange(1000, 1040, dtype=np.int32)  # 40 tokens: 2 full blocks + 8 tokens
    hit = kv.find_cached_prefix(prompt)
    kv.allocate_slots(1, len(prompt), hit)
    kv.cache_full_blocks(1, prompt, len(prompt))
    print(f"seq 1: prompt of {len(prompt)} tokens -> blocks {kv.block_ids(1).tolist()}, "
          f"slot mapping {kv.slots(1, 0, 3).tolist()}...{kv.slots(1, 37, 3).tolist()}")

    kv.fork(1, 2)
    refs = [kv.ref_count(int(b)) for b in kv.block_ids(1)]
    print(f"fork 1 -> 2: seq 2 shares blocks {kv.block_ids(2).tolist()} (ref counts {refs})")

    copies = kv.allocate_slots(2, 1)
    print(f"seq 2 appends a token into the shared partial block: copy-on-write {copies} "
          f"-> seq 2 blocks {kv.block_ids(2).tolist()}")
    copies = kv.allocate_slots(1, 1)
    print(f"seq 1 appends a token: no copy needed ({copies}), it owns its last block alone again")

    hit = kv.find_cached_prefix(prompt)
    kv.allocate_slots(3, len(prompt) - hit.num_tokens, hit)
    print(f"seq 3, same prompt: prefix-cache hit of {hit.num_tokens} tokens in blocks {hit.blocks} "
          f"(the last {len(prompt) - hit.num_tokens} tokens are computed) -> blocks {kv.block_ids(3).tolist()}")
    s = kv.stats()
    print(f"stats: usage {s.usage:.3f} ({s.num_blocks - s.num_free_blocks}/{s.num_blocks} blocks held), "
          f"{s.num_cached_blocks} cached blocks, prefix cache {s.prefix_cache_hits}/{s.prefix_cache_queries} tokens hit")

    for seq in (1, 2, 3):
        kv.free(seq)
    s = kv.stats()
    print(f"all freed: usage {s.usage:.3f}, {s.num_free_blocks}/{s.num_blocks} blocks free "
          f"({s.num_cached_blocks} keep their prefix-cache hash until reused)")
    if s.num_free_blocks != num_blocks:
        print("error: the pool is not whole again")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
