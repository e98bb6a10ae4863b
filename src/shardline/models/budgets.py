"""Memory the model code takes beyond its weights and KV cache, as constants placement
counts (:mod:`shardline.placement.memory`): no torch here, the node imports it."""

DEQUANT_SCRATCH_BYTES = 64 << 20
"""Scratch for a dense product's dequantized weight rows (:mod:`shardline.models.linear`):
a product dequantizes as many output rows at a time as fit, in multiples of 256 rows (a
multiple of torch's int4 block). The compiled kernels write the compute dtype only (a
whole matrix of up to 32M bfloat16 weights at once); the eager code they replace where
no C compiler works also holds float32 work, a second plane and the nibbles (11 bytes a
weight, so at most 6M weights at once, and up to 9 bytes a weight more than placement
counts)."""
