// f32 <-> f16 / bf16 conversions on the host, rounding to nearest even,
// bit-compatible with CUDA's __float2half_rn / __float2bfloat16_rn and with
// graphed's own host backend.
#pragma once

#include <cstdint>
#include <cstring>

namespace kit {

inline uint32_t bits_of(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

inline float float_of(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline uint16_t float_to_bf16(float f) {
    uint32_t u = bits_of(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    uint32_t lsb = (u >> 16) & 1u;
    return static_cast<uint16_t>((u + 0x7FFFu + lsb) >> 16);
}

inline float bf16_to_float(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_half(float f) {
    uint32_t u = bits_of(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t abs = u & 0x7FFFFFFFu;
    if (abs >= 0x7F800000u) return static_cast<uint16_t>(sign | (abs > 0x7F800000u ? 0x7E00u : 0x7C00u));
    if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to infinity
    if (abs < 0x38800000u) {  // below the smallest normal half: a subnormal or zero
        if (abs < 0x33000000u) return static_cast<uint16_t>(sign);  // under half the smallest subnormal
        // value = mant * 2^(exp - 150); in units of 2^-24 that is mant >> (126 - exp).
        uint32_t exp = abs >> 23;
        uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
        uint32_t s = 126u - exp;  // 14..24
        uint32_t q = mant >> s;
        uint32_t rem = mant & ((1u << s) - 1u);
        uint32_t halfway = 1u << (s - 1u);
        if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
        return static_cast<uint16_t>(sign | q);
    }
    uint32_t h = ((abs - 0x38000000u) >> 13);
    uint32_t rem = abs & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
}

inline float half_to_float(uint16_t h) {
    uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;
    if (exp == 0) {
        if (mant == 0) return float_of(sign);
        float f = static_cast<float>(mant) * (1.0f / 16777216.0f);  // mant * 2^-24
        return sign ? -f : f;
    }
    if (exp == 31) return float_of(sign | 0x7F800000u | (mant << 13));
    return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
}

}  // namespace kit
