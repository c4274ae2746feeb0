// fp8_divide (csrc/reshard/fp8.h) against IEEE division, every pair of one 16-bit float type: each finite
// amax > 0 whose scale fp8_reciprocal_ok accepts, each x with |x| <= amax, both signs; the e4m3 bytes must
// be equal. argv[1]: "bf16" or "f16"; argv[2] (optional): "uncorrected" checks x * (1 / scale) instead (which
// must differ somewhere: the check can fail). Prints "<pairs> <differing>"; exits 1 if any differ.
#include <cmath>
#include <cstdio>
#include <cstring>

#include "reshard/fp8.h"

using vf::reshard::float_to_e4m3;

static float from_bits(uint32_t bits, bool half) {
  if (!half) {
    const uint32_t u = bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  const uint32_t e = (bits >> 10) & 0x1f, m = bits & 0x3ff;  // float16: exact in float
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -24)
                         : std::ldexp(static_cast<float>(m | 0x400), static_cast<int>(e) - 25);
  return (bits & 0x8000) ? -v : v;
}

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  const bool half = std::strcmp(argv[1], "f16") == 0, uncorrected = argc > 2;
  const uint32_t finite = half ? 0x7c00 : 0x7f80;  // the first non-finite magnitude
  long long pairs = 0, differing = 0;
  for (uint32_t a = 1; a < finite; ++a) {
    const float scale = vf::reshard::fp8_scale(from_bits(a, half));
    if (!vf::reshard::fp8_reciprocal_ok(scale)) continue;
    const float inv = 1.0f / scale;  // correctly rounded, as __frcp_rn
    for (uint32_t m = 0; m <= a; ++m)
      for (uint32_t sign : {0u, 0x8000u}) {
        const float x = from_bits(m | sign, half);
        const float q = uncorrected ? x * inv : vf::reshard::fp8_divide(x, scale, inv);
        ++pairs;
        differing += float_to_e4m3(q) != float_to_e4m3(x / scale);
      }
  }
  std::printf("%lld %lld\n", pairs, differing);
  return differing != 0;
}
