// One decode step's attention for the compact decoder (sage/eval/decode.py, CompactDecoder.step).
//
// Each row's query attends, under one softmax, to the keys of its prompt (stored once per prompt, shared
// by that prompt's n samples) and to the keys of the tokens it generated itself (a slot-major cache).
// In torch ops this is two batched matrix-VECTOR products per part, one tiny product per (row, head),
// each with a fixed overhead, and a strided read of the cache. Here rows
// are taken in blocks of consecutive rows: at a given slot the cache holds a block's keys as one
// contiguous run, so the pass over the cache streams memory, and the products, the softmax and the
// weighted sum of values are fused with no temporary beyond the block's scores.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // rows per block: 16 KiB of keys per slot at 4 kv heads x 32 dims

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void add_scaled(float w, const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

// exp(x) for the softmax's x <= 0, written so that the compiler vectorises a loop over it (std::exp is a
// scalar libm call): Cephes' expf, range reduction by ln 2 and a degree-5 polynomial, within 2 ulp.
// Clamped at -87, where exp is 1.6e-38: below it the result would be denormal (slow, and 0 in fp32 terms).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n ln2, ln2 split in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& prompt_k, const at::Tensor& prompt_v,
                            const at::Tensor& prompt_real, const at::Tensor& owner,
                            const at::Tensor& cache_k, const at::Tensor& cache_v, int64_t end) {
  // q (B, KV, G, D): row b's queries, G per kv head; prompt_k/v (P, KV, W, D), left-padded prompts;
  // prompt_real (P, W) false on padding; owner (B) the prompt of each row; cache_k/v (S, R, KV, D):
  // slot s of row b at [s, b], slots [0, end) written. Returns (B, KV, G, D).
  TORCH_CHECK(q.dim() == 4 && prompt_k.dim() == 4 && cache_k.dim() == 4, "decode_attention: ranks");
  for (const auto* t : {&q, &prompt_k, &prompt_v, &cache_k, &cache_v}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                "decode_attention: float32 contiguous CPU tensors only");
  }
  TORCH_CHECK(prompt_real.scalar_type() == at::kBool && prompt_real.is_contiguous(), "prompt_real: bool");
  TORCH_CHECK(owner.scalar_type() == at::kLong && owner.is_contiguous(), "owner: int64");
  const int64_t B = q.size(0), KV = q.size(1), G = q.size(2), D = q.size(3);
  const int64_t P = prompt_k.size(0), W = prompt_k.size(2);
  TORCH_CHECK(prompt_k.sizes() == at::IntArrayRef({P, KV, W, D}) && prompt_v.sizes() == prompt_k.sizes(),
              "decode_attention: prompt keys/values must be (P, KV, W, D)");
  TORCH_CHECK(prompt_real.sizes() == at::IntArrayRef({P, W}) && owner.size(0) == B, "prompt_real/owner");
  TORCH_CHECK(cache_k.sizes() == cache_v.sizes() && cache_k.size(1) >= B && cache_k.size(2) == KV &&
                  cache_k.size(3) == D && end >= 1 && end <= cache_k.size(0),
              "decode_attention: cache must be (S >= end >= 1, R >= B, KV, D)");
  const int64_t slot_stride = cache_k.stride(0), L = W + end, HG = KV * G;
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* pk = prompt_k.data_ptr<float>();
  const float* pv = prompt_v.data_ptr<float>();
  const bool* real = prompt_real.data_ptr<bool>();
  const int64_t* own = owner.data_ptr<int64_t>();
  const float* ck = cache_k.data_ptr<float>();
  const float* cv = cache_v.data_ptr<float>();
  float* op = out.data_ptr<float>();

  at::parallel_for(0, (B + kBlock - 1) / kBlock, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores(kBlock * HG * L);  // [row in block][kv head][group][prompt W | own end]
    std::vector<float> acc(kBlock * HG * D);
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t b0 = blk * kBlock, nb = std::min(B, b0 + kBlock) - b0;
      auto score = [&](int64_t i, int64_t h, int64_t g) { return scores.data() + ((i * KV + h) * G + g) * L; };
      auto query = [&](int64_t b, int64_t h, int64_t g) { return qp + ((b * KV + h) * G + g) * D; };
      for (int64_t i = 0; i < nb; ++i) {  // prompt part: the prompt's keys stay in cache across its rows
        const int64_t b = b0 + i, o = own[b];
        for (int64_t h = 0; h < KV; ++h)
          for (int64_t w = 0; w < W; ++w) {
            const float* key = pk + ((o * KV + h) * W + w) * D;
            for (int64_t g = 0; g < G; ++g) score(i, h, g)[w] = dot(query(b, h, g), key, D);
          }
      }
      for (int64_t s = 0; s < end; ++s)  // generated part, slot by slot: one contiguous run per slot
        for (int64_t i = 0; i < nb; ++i) {
          const int64_t b = b0 + i;
          for (int64_t h = 0; h < KV; ++h) {
            const float* key = ck + s * slot_stride + (b * KV + h) * D;
            for (int64_t g = 0; g < G; ++g) score(i, h, g)[W + s] = dot(query(b, h, g), key, D);
          }
        }
      for (int64_t i = 0; i < nb; ++i) {  // softmax; padding positions get probability exactly 0
        const bool* rl = real + own[b0 + i] * W;
        for (int64_t hg = 0; hg < HG; ++hg) {
          float* sc = scores.data() + (i * HG + hg) * L;
          float m = -INFINITY;
          for (int64_t j = 0; j < W; ++j)
            if (rl[j]) m = std::max(m, sc[j]);
          for (int64_t j = W; j < L; ++j) m = std::max(m, sc[j]);
          for (int64_t j = 0; j < L; ++j) sc[j] = exp_nonpositive(std::min(sc[j] - m, 0.f));
          for (int64_t j = 0; j < W; ++j)
            if (!rl[j]) sc[j] = 0.f;
          float sum = 0.f;
          for (int64_t j = 0; j < L; ++j) sum += sc[j];
          const float inv = 1.f / sum;
          for (int64_t j = 0; j < L; ++j) sc[j] *= inv;
        }
      }
      std::fill(acc.begin(), acc.begin() + nb * HG * D, 0.f);
      auto total = [&](int64_t i, int64_t h, int64_t g) { return acc.data() + ((i * KV + h) * G + g) * D; };
      for (int64_t i = 0; i < nb; ++i) {
        const int64_t o = own[b0 + i];
        for (int64_t h = 0; h < KV; ++h)
          for (int64_t w = 0; w < W; ++w) {
            if (!real[o * W + w]) continue;
            const float* value = pv + ((o * KV + h) * W + w) * D;
            for (int64_t g = 0; g < G; ++g) add_scaled(score(i, h, g)[w], value, total(i, h, g), D);
          }
      }
      for (int64_t s = 0; s < end; ++s)
        for (int64_t i = 0; i < nb; ++i) {
          const int64_t b = b0 + i;
          for (int64_t h = 0; h < KV; ++h) {
            const float* value = cv + s * slot_stride + (b * KV + h) * D;
            for (int64_t g = 0; g < G; ++g) add_scaled(score(i, h, g)[W + s], value, total(i, h, g), D);
          }
        }
      std::copy(acc.begin(), acc.begin() + nb * HG * D, op + b0 * HG * D);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(sage, m) {
  m.def(
      "decode_attention(Tensor q, Tensor prompt_k, Tensor prompt_v, Tensor prompt_real, Tensor owner, "
      "Tensor cache_k, Tensor cache_v, int end) -> Tensor");
}

TORCH_LIBRARY_IMPL(sage, CPU, m) { m.impl("decode_attention", decode_attention); }
