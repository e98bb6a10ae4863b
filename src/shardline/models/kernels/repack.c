/* What a shard's load does to every weight, compiled (see shardline/models/native_dequant.py,
 * which compiles and loads this file): GGUF blocks of 32 weights unpacked into integer
 * groups in one pass (unpack_blocks_32; numpy's unpackers took 5 passes and temporaries),
 * and integer values packed into torch's CPU int4 layout (int4_pack_halves, which
 * shardline/models/int4_planes.py's pack_int4_planes calls in place of
 * torch._convert_weight_to_int4pack_for_cpu, which takes int32 values: a 4-byte copy of
 * every weight before packing).
 *
 * int4_pack_halves:
 * The layout for blocks of 2 * half rows, "halves" order: [rows / (2 half), cols, half]
 * bytes, byte j of a block's column k holding row j (low nibble) and row j + half (high
 * nibble) of the block. Each value is ((q >> shift) & 15) + add, which the caller keeps
 * in 0..15 (a plane of a wider integer: its low or high four bits, re-centred). */
#include <stdint.h>
#include <string.h>

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

/* IEEE half to float, subnormals, infinities and NaNs included. */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0 && man == 0) {
        bits = sign;
    } else if (exp == 0) { /* subnormal: man * 2^-24, normalised */
        uint32_t e = 0;
        while (!(man & 0x400u)) {
            man <<= 1;
            e++;
        }
        bits = sign | ((113u - e) << 23) | ((man & 0x3FFu) << 13);
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* GGUF blocks of 32 weights (ggml-common.h) unpacked into integer groups: q[r, c] (uint8),
 * scale[r, c / 32] and offset[r, c / 32] (float32) with w = q * scale + offset, the values
 * of shardline/models/gguf_quants.py's numpy unpackers (the reference). kind: 0 = Q4_0
 * (f16 d, 16 nibble bytes; q - 8), 1 = Q4_1 (f16 d, f16 m, nibbles), 2 = Q8_0 (f16 d,
 * 32 int8, stored as int8 + 128). Byte i of the nibbles holds weight i (low nibble) and
 * weight i + 16 (high). `data` is rows x blocks blocks of the kind's size. */
void unpack_blocks_32(const uint8_t *restrict data, int64_t rows, int64_t blocks, int kind,
                      uint8_t *restrict q, float *restrict scale, float *restrict offset) {
    const int64_t size = kind == 0 ? 18 : kind == 1 ? 20 : 34;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *blk = data + (r * blocks + b) * size;
            uint8_t *out = q + (r * blocks + b) * 32;
            uint16_t h;
            memcpy(&h, blk, 2);
            float d = half_to_float(h);
            scale[r * blocks + b] = d;
            if (kind == 2) {
                offset[r * blocks + b] = -128.0f * d;
                for (int i = 0; i < 32; i++) out[i] = blk[2 + i] ^ 0x80u;
                continue;
            }
            const uint8_t *nib = blk + (kind == 0 ? 2 : 4);
            if (kind == 0) {
                offset[r * blocks + b] = -8.0f * d;
            } else {
                memcpy(&h, blk + 2, 2);
                offset[r * blocks + b] = half_to_float(h);
            }
            for (int i = 0; i < 16; i++) {
                out[i] = nib[i] & 15u;
                out[i + 16] = nib[i] >> 4;
            }
        }
    }
}
