/* Packing of a weight's integer values into torch's CPU int4 layout when a shard loads
 * (see shardline/models/native_dequant.py, which compiles and loads this file, and
 * shardline/models/int4_planes.py, whose pack_int4_planes calls it in place of
 * torch._convert_weight_to_int4pack_for_cpu, which takes int32 values: a 4-byte copy of
 * every weight before packing, most of a load's time).
 *
 * The layout for blocks of 2 * half rows, "halves" order: [rows / (2 half), cols, half]
 * bytes, byte j of a block's column k holding row j (low nibble) and row j + half (high
 * nibble) of the block. Each value is ((q >> shift) & 15) + add, which the caller keeps
 * in 0..15 (a plane of a wider integer: its low or high four bits, re-centred). */
#include <stdint.h>

void int4_pack_halves(const uint8_t *restrict q, int64_t rows, int64_t cols, int shift,
                      int add, int64_t half, uint8_t *restrict out) {
    const int64_t block = 2 * half;
    for (int64_t b = 0; b < rows / block; b++) {
        uint8_t *restrict o = out + b * cols * half;
        for (int64_t j = 0; j < half; j++) {
            const uint8_t *restrict lo = q + (b * block + j) * cols;
            const uint8_t *restrict hi = lo + half * cols;
            for (int64_t k = 0; k < cols; k++) {
                uint8_t l = (uint8_t)(((lo[k] >> shift) & 15) + add);
                uint8_t h = (uint8_t)(((hi[k] >> shift) & 15) + add);
                o[k * half + j] = (uint8_t)((l & 15) | (h << 4));
            }
        }
    }
}
