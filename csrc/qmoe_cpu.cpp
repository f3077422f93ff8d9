// CPU kernels for the qmoe:: ops (schemas are defined in Python, qmoe/_library.py).
//
// Glossary: T tokens, E experts, K top-k slots, S map slots per token (E or K), H hidden,
// N output rows, P probs columns. row_id_map: int32 [T, 2S+1] (qmoe/ops/row_id_map.py).
//
// Every kernel computes exactly what the vectorized torch path computes: data movement is
// byte copies, merges accumulate in fp32 in row order with separate multiply and add
// (built with -ffp-contract=off), quantization follows the torch reference step by step.
// Rows are parallelized with at::parallel_for; each output row has one writer.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace qmoe {
namespace {

using at::Tensor;

// A large fresh output, with transparent huge pages asked for (THP's "madvise" mode, the
// common default): its first write then faults 2 MB pages instead of 4 KB ones, which is
// most of the time of a big permute on a fresh buffer. Advisory only: no effect where THP
// is off, and the allocator's own use of the memory is unchanged.
Tensor big_empty(at::IntArrayRef sizes, const at::TensorOptions& opt) {
  auto t = at::empty(sizes, opt);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t huge = uintptr_t{2} << 20;
  const uintptr_t bytes = t.nbytes();
  if (bytes >= 8 * huge) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t b = (p + huge - 1) & ~(huge - 1), e = (p + bytes) & ~(huge - 1);
    if (e > b) madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE);
  }
#endif
  return t;
}

// One row copy for the permute: with `stream` and SSE2 (every x86-64), 16-byte aligned rows
// of a multiple of 64 bytes go out with streaming stores, which skip the read-for-ownership
// of each line a plain store pays (what a large memcpy does too) but leave nothing in cache:
// callers ask for it only when the output is far larger than the caches (kStreamBytes),
// and fence once per token (stream_fence) so the rows are visible before the parallel
// region ends.
inline void copy_row(char* dst, const char* src, int64_t bytes, bool stream) {
  if (bytes == 0) return;  // H = 0: data_ptr() may be null
#if defined(__SSE2__)
  if (stream && (bytes & 63) == 0 && ((reinterpret_cast<uintptr_t>(dst) |
                             reinterpret_cast<uintptr_t>(src)) & 15) == 0) {
    auto* d = reinterpret_cast<__m128i*>(dst);
    const auto* p = reinterpret_cast<const __m128i*>(src);
    for (int64_t i = 0; i < bytes / 16; i += 4) {
      const __m128i a = _mm_load_si128(p + i), b = _mm_load_si128(p + i + 1);
      const __m128i c = _mm_load_si128(p + i + 2), e = _mm_load_si128(p + i + 3);
      _mm_stream_si128(d + i, a);
      _mm_stream_si128(d + i + 1, b);
      _mm_stream_si128(d + i + 2, c);
      _mm_stream_si128(d + i + 3, e);
    }
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

constexpr int64_t kStreamBytes = int64_t{32} << 20;

inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// Bad arguments raise Python ValueError (TORCH_CHECK_VALUE), as the Python layer does.
#define QMOE_CHECK(cond, op, ...) TORCH_CHECK_VALUE(cond, "qmoe::", op, ": ", __VA_ARGS__)

// fp8_dtype arguments: TypeError, as the Python ops and fakes raise.
void check_fp8(const char* op, at::ScalarType fp8) {
  TORCH_CHECK_TYPE(fp8 == at::kFloat8_e4m3fn || fp8 == at::kFloat8_e5m2, "qmoe::", op,
                   ": fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got ", fp8);
}

// The quantize ops' dtypes (qmoe/tensors/quantize.py _check_dtypes).
void check_quantize_dtypes(const char* op, const Tensor& x, at::ScalarType fp8) {
  check_fp8(op, fp8);
  const auto xt = x.scalar_type();
  TORCH_CHECK_TYPE(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf, "qmoe::", op,
                   ": x must be fp32, bf16 or fp16, got ", xt);
}

int64_t slots_of(const Tensor& rid) { return (rid.size(1) - 1) / 2; }

void check_map(const char* op, const Tensor& rid, int64_t t) {
  QMOE_CHECK(rid.scalar_type() == at::kInt && rid.dim() == 2 && rid.size(1) % 2 == 1, op,
             "row_id_map must be int32 [T, 2*S + 1], got ", rid.scalar_type(), " ", rid.sizes(),
             "; pass the map returned by qmoe.moe_permute*");
  QMOE_CHECK(rid.size(0) == t, op, "row_id_map has ", rid.size(0), " rows but the tokens are ",
             t, "; they must match (T)");
  QMOE_CHECK(rid.is_contiguous(), op, "row_id_map must be contiguous");
}

// Rows of a 2-d tensor whose last dim is contiguous (any row stride).
Tensor rows_view(const Tensor& x) { return x.stride(1) == 1 ? x : x.contiguous(); }

// A map row's route count must lie in [0, S]: the kernels read that many entries of the row.
inline void check_count(int32_t cnt, int64_t s, int64_t t) {
  TORCH_CHECK_VALUE(cnt >= 0 && cnt <= s, "qmoe: row_id_map row ", t, " counts ", cnt,
              " routes but the map has ", s, " slots; pass the row_id_map qmoe built");
}

template <typename F>
void for_each_route(const Tensor& rid, F f) {
  const int64_t t = rid.size(0), s = slots_of(rid), w = 2 * s + 1;
  const int32_t* m = rid.data_ptr<int32_t>();
  at::parallel_for(0, t, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int32_t* row = m + i * w;
      check_count(row[2 * s], s, i);
      f(i, row, row + s, row[2 * s]);
    }
  });
}

// ------------------------------------------------------------- make_row_id_map
void write_compact(int32_t* row, int64_t s, const std::vector<std::pair<int32_t, int32_t>>& kept) {
  int64_t j = 0;
  for (const auto& kv : kept) {
    row[j] = kv.first;
    row[s + j] = kv.second;
    ++j;
  }
  for (int64_t q = j; q < s; ++q) row[q] = row[s + q] = -1;
  row[2 * s] = static_cast<int32_t>(j);
}

// The output rows no route writes, as int32 [R, 2] ranges [lo, hi) clipped to [0, n): after
// each expert's rows its padding (R = E + 1, padded maps), then the tail past the last row
// (R = 1 otherwise). `counts`: routed rows per expert (or one total when unpadded).
Tensor fill_ranges(const std::vector<int64_t>& counts, int64_t n, int64_t align) {
  const bool padded = align > 1;
  const int64_t r = padded ? static_cast<int64_t>(counts.size()) + 1 : 1;
  auto fill = at::empty({r, 2}, at::TensorOptions().dtype(at::kInt));
  int32_t* f = fill.data_ptr<int32_t>();
  int64_t end = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const int64_t c = counts[e], p = padded ? (c + align - 1) / align * align : c;
    if (padded) {
      f[2 * e] = static_cast<int32_t>(std::min(end + c, n));
      f[2 * e + 1] = static_cast<int32_t>(std::min(end + p, n));
    }
    end += p;
  }
  f[2 * (r - 1)] = static_cast<int32_t>(std::min(end, n));
  f[2 * (r - 1) + 1] = static_cast<int32_t>(n);
  return fill;
}

template <typename M>
std::tuple<Tensor, Tensor> mask_map(const Tensor& rm, int64_t n, int64_t align) {
  const int64_t t = rm.size(0), e = rm.size(1);
  auto m = rm.contiguous();
  const M* mp = m.data_ptr<M>();
  std::vector<int64_t> counts(e, 0);
  for (int64_t i = 0; i < t; ++i)
    for (int64_t j = 0; j < e; ++j) counts[j] += mp[i * e + j] != 0;
  std::vector<int64_t> cursor(e, 0);
  int64_t acc = 0;
  for (int64_t j = 0; j < e; ++j) {
    cursor[j] = acc;  // start of expert j
    acc += align > 1 ? (counts[j] + align - 1) / align * align : counts[j];
  }
  auto rid = at::empty({t, 2 * e + 1}, m.options().dtype(at::kInt));
  int32_t* r = rid.data_ptr<int32_t>();
  std::vector<std::pair<int32_t, int32_t>> kept;
  kept.reserve(e);
  for (int64_t i = 0; i < t; ++i) {  // token order gives the in-expert rank
    kept.clear();
    for (int64_t j = 0; j < e; ++j) {
      if (mp[i * e + j] == 0) continue;
      const int64_t dst = cursor[j]++;
      if (dst < n) kept.emplace_back(static_cast<int32_t>(dst), static_cast<int32_t>(j));
    }
    write_compact(r + i * (2 * e + 1), e, kept);
  }
  return {rid, fill_ranges(counts, n, align)};
}

template <typename I>
std::tuple<Tensor, Tensor> index_map(const Tensor& rm, int64_t n) {
  const int64_t t = rm.size(0), k = rm.size(1);
  auto m = rm.contiguous();
  const I* ip = m.data_ptr<I>();
  int64_t hi = -1;
  for (int64_t q = 0; q < t * k; ++q) {
    QMOE_CHECK(ip[q] >= -1, "make_row_id_map", "routing_map holds expert id ",
               static_cast<int64_t>(ip[q]), "; ids must be in [-1, E)");
    hi = std::max<int64_t>(hi, static_cast<int64_t>(ip[q]));
  }
  // dst[q]: output row of route q, expert-major, then (t, k) order, as a stable sort of
  // the ids gives; -1 for unrouted slots.
  std::vector<int64_t> dst(t * k, -1);
  int64_t routed_count = 0;
  if (hi < 4 * t * k + 4096) {
    // A counting sort over E = hi + 1 experts (E bounded by the route count).
    std::vector<int64_t> cursor(hi + 1, 0);
    for (int64_t q = 0; q < t * k; ++q)
      if (ip[q] >= 0) ++cursor[ip[q]];
    for (int64_t j = 0; j <= hi; ++j) {
      const int64_t c = cursor[j];
      cursor[j] = routed_count;
      routed_count += c;
    }
    for (int64_t q = 0; q < t * k; ++q)
      if (ip[q] >= 0) dst[q] = cursor[ip[q]]++;
  } else {
    // Ids far past the route count (no num_experts to bound them): a stable sort of the
    // routed slots, so memory follows T*K rather than the largest id.
    std::vector<int64_t> order;
    for (int64_t q = 0; q < t * k; ++q)
      if (ip[q] >= 0) order.push_back(q);
    std::stable_sort(order.begin(), order.end(),
                     [ip](int64_t a, int64_t b) { return ip[a] < ip[b]; });
    routed_count = static_cast<int64_t>(order.size());
    for (int64_t j = 0; j < routed_count; ++j) dst[order[j]] = j;
  }
  const std::vector<int64_t> routed{routed_count};
  auto rid = at::empty({t, 2 * k + 1}, m.options().dtype(at::kInt));
  int32_t* r = rid.data_ptr<int32_t>();
  at::parallel_for(0, t, 256, [&](int64_t b, int64_t end) {
    std::vector<std::pair<int32_t, int32_t>> kept;
    for (int64_t i = b; i < end; ++i) {
      kept.clear();
      for (int64_t j = 0; j < k; ++j) {
        const int64_t d = dst[i * k + j];
        if (d >= 0 && d < n) kept.emplace_back(static_cast<int32_t>(d), static_cast<int32_t>(j));
      }
      std::sort(kept.begin(), kept.end());  // routes by output row
      write_compact(r + i * (2 * k + 1), k, kept);
    }
  });
  return {rid, fill_ranges(routed, n, 1)};
}

std::tuple<Tensor, Tensor> make_row_id_map(const Tensor& rm, int64_t n, bool is_index, int64_t align) {
  QMOE_CHECK(rm.dim() == 2, "make_row_id_map", "routing_map must be 2-d, got ", rm.sizes());
  QMOE_CHECK(n >= 0, "make_row_id_map", "num_out_tokens must be >= 0, got ", n);
  QMOE_CHECK(n <= std::numeric_limits<int32_t>::max(), "make_row_id_map",
             "num_out_tokens must be < 2**31 (row_id_map rows are int32), got ", n);
  QMOE_CHECK(align >= 1, "make_row_id_map", "align_size must be >= 1, got ", align);
  QMOE_CHECK(align <= std::numeric_limits<int32_t>::max() / std::max<int64_t>(rm.size(-1) + 1, 1),
             "make_row_id_map", "align_size ", align, " could pad past 2**31 rows");
  if (is_index) {
    switch (rm.scalar_type()) {
      case at::kLong: return index_map<int64_t>(rm, n);
      case at::kInt: return index_map<int32_t>(rm, n);
      case at::kShort: return index_map<int16_t>(rm, n);
      case at::kChar: return index_map<int8_t>(rm, n);
      default: TORCH_CHECK_TYPE(false, "qmoe::make_row_id_map: index routing_map must be an integer "
                                  "tensor, got ", rm.scalar_type());
    }
  }
  switch (rm.scalar_type()) {
    case at::kBool: return mask_map<bool>(rm, n, align);
    case at::kByte: return mask_map<uint8_t>(rm, n, align);
    case at::kChar: return mask_map<int8_t>(rm, n, align);
    case at::kShort: return mask_map<int16_t>(rm, n, align);
    case at::kInt: return mask_map<int32_t>(rm, n, align);
    case at::kLong: return mask_map<int64_t>(rm, n, align);
    default: TORCH_CHECK_TYPE(false, "qmoe::make_row_id_map: mask routing_map must be bool or "
                                "integer, got ", rm.scalar_type());
  }
}

// --------------------------------------------------------------------- permute
// A route's probs column must lie in [0, P): the map is the caller's to pass back.
inline void check_col(int32_t c, int64_t p, int64_t t) {
  TORCH_CHECK_VALUE(c >= 0 && c < p, "qmoe: row_id_map row ", t, " names probs column ", c,
              " but the probs have ", p, " columns; pass the row_id_map qmoe built with "
              "these probs' routing");
}

// Routing weights [T, P] as fp32, converted once per call (small; fp64 weights round to
// fp32, as every merge reads them); `at(t, c)` checks the column, then reads one float.
struct RouteWeights {
  Tensor f;
  const float* p;
  int64_t cols;
  explicit RouteWeights(const Tensor& w)
      : f(w.to(at::kFloat).contiguous()), p(f.data_ptr<float>()), cols(f.size(1)) {}
  float at(int64_t t, int32_t c) const {
    check_col(c, cols, t);
    return p[t * cols + c];
  }
};

// d = bf16(float(src) * w) over a row: widen (exact), multiply, round to nearest even
// (NaN -> 0x7FC0), c10::BFloat16's conversions written as an integer loop that vectorizes.
__attribute__((target_clones("avx2", "default"))) void scale_bf16_row(
    const uint16_t* src, float w, uint16_t* d, int64_t h) {
  for (int64_t j = 0; j < h; ++j) {
    const uint32_t in = static_cast<uint32_t>(src[j]) << 16;
    float f;
    std::memcpy(&f, &in, 4);
    const float p = f * w;
    uint32_t u;
    std::memcpy(&u, &p, 4);
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    d[j] = nan ? static_cast<uint16_t>(0x7FC0)
               : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
}

// out[N, H]: token rows (times weight if given) at their rows, other rows zero.
Tensor permute_rows(const Tensor& inp, const Tensor& rid, int64_t n,
                    const c10::optional<Tensor>& weights) {
  const char* op = "permute";
  QMOE_CHECK(inp.dim() == 2, op, "inp must be [T, H], got ", inp.sizes());
  check_map(op, rid, inp.size(0));
  QMOE_CHECK(n >= 0, op, "num_out_tokens must be >= 0, got ", n);
  auto x = rows_view(inp);
  const int64_t h = x.size(1), es = x.element_size(), rb = h * es;
  auto out = big_empty({n, h}, x.options());
  std::vector<char> written(n, 0);
  char* o = static_cast<char*>(out.data_ptr());
  const char* xp = static_cast<const char*>(x.data_ptr());
  const int64_t xs = x.stride(0) * es;
  if (!weights.has_value()) {
    const bool stream = n * rb >= kStreamBytes;
    for_each_route(rid, [&](int64_t t, const int32_t* dst, const int32_t*, int32_t cnt) {
      for (int32_t s = 0; s < cnt; ++s) {
        TORCH_CHECK_VALUE(dst[s] >= 0 && dst[s] < n, "qmoe::permute: row_id_map row ", dst[s],
                    " out of range for num_out_tokens=", n, "; rebuild the map for this N");
        copy_row(o + dst[s] * rb, xp + t * xs, rb, stream);
        written[dst[s]] = 1;
      }
      if (stream) stream_fence();
    });
  } else {
    const RouteWeights rw(*weights);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "permute_w", [&] {
      for_each_route(rid, [&](int64_t t, const int32_t* dst, const int32_t* col, int32_t cnt) {
        const scalar_t* src = reinterpret_cast<const scalar_t*>(xp + t * xs);
        for (int32_t s = 0; s < cnt; ++s) {
          TORCH_CHECK_VALUE(dst[s] >= 0 && dst[s] < n, "qmoe::permute: row_id_map row out of range");
          const float wv = rw.at(t, col[s]);
          scalar_t* d = reinterpret_cast<scalar_t*>(o + dst[s] * rb);
          if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
            scale_bf16_row(reinterpret_cast<const uint16_t*>(src), wv,
                           reinterpret_cast<uint16_t*>(d), h);
          } else {
            for (int64_t j = 0; j < h; ++j)
              d[j] = static_cast<scalar_t>(static_cast<float>(src[j]) * wv);
          }
          written[dst[s]] = 1;
        }
      });
    });
  }
  at::parallel_for(0, n, 256, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      if (!written[r] && rb) std::memset(o + r * rb, 0, rb);
  });
  return out;
}

Tensor permute_probs(const Tensor& probs, const Tensor& rid, int64_t n) {
  auto pp = at::zeros({n}, probs.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, probs.scalar_type(), "pp", [&] {
    scalar_t* out = pp.data_ptr<scalar_t>();
    const scalar_t* p = probs.data_ptr<scalar_t>();
    for_each_route(rid, [&](int64_t t, const int32_t* dst, const int32_t* col, int32_t cnt) {
      for (int32_t s = 0; s < cnt; ++s) {
        TORCH_CHECK_VALUE(dst[s] >= 0 && dst[s] < n, "qmoe::permute: row_id_map row ", dst[s],
                          " out of range for num_out_tokens=", n, "; rebuild the map for this N");
        check_col(col[s], probs.size(1), t);
        out[dst[s]] = p[t * probs.stride(0) + col[s] * probs.stride(1)];
      }
    });
  });
  return pp;
}

// `fill` (the map's unwritten row ranges) is accepted for the schema and unused: the CPU
// kernel tracks the rows it writes and zeroes the rest itself.
std::tuple<Tensor, Tensor> permute(const Tensor& inp, const Tensor& rid_in,
                                   const c10::optional<Tensor>& probs, int64_t n,
                                   const c10::optional<Tensor>& /*fill*/) {
  const Tensor rid = rid_in.contiguous();  // the walks read rows of 2S+1 entries
  auto out = permute_rows(inp, rid, n, c10::nullopt);
  if (!probs.has_value()) return {out, at::empty({0}, inp.options())};
  QMOE_CHECK(probs->dim() == 2 && probs->size(0) == inp.size(0), "permute",
             "probs must be [T, P], got ", probs->sizes());
  return {out, permute_probs(*probs, rid, n)};
}

// Quantized rows and their block-scale rows moved by one map (the passthrough rule of
// the FP8 permute): `(bits [N, H], scale rows [N, NB], permuted probs [N] or empty)`, as
// two permutes, without a trip through Python between them.
std::tuple<Tensor, Tensor, Tensor> permute_with_scales(const Tensor& qbits,
                                                       const Tensor& scale_rows,
                                                       const Tensor& rid_in,
                                                       const c10::optional<Tensor>& probs,
                                                       int64_t n,
                                                       const c10::optional<Tensor>& fill) {
  QMOE_CHECK(scale_rows.dim() == 2 && scale_rows.size(0) == qbits.size(0),
             "permute_with_scales", "scale_rows must be [T, NB] with T = qbits' rows, got ",
             scale_rows.sizes(), " for qbits ", qbits.sizes());
  const Tensor rid = rid_in.contiguous();
  auto [bits, pp] = permute(qbits, rid, probs, n, fill);
  auto s_out = permute_rows(scale_rows, rid, n, c10::nullopt);
  return {bits, s_out, pp};
}

// ------------------------------------------------------------------- unpermute
// The hot loops, compiled for AVX2 and for the baseline ISA and picked at run time
// (target_clones), so the build stays portable. Separate multiply and add (no FMA:
// -ffp-contract=off) keep the rounding of the torch path.
__attribute__((target_clones("avx2", "default"))) void accumulate_scaled(
    float* acc, const float* v, float w, int64_t h) {
  for (int64_t j = 0; j < h; ++j) {
    const float p = v[j] * w;
    acc[j] += p;
  }
}

// bf16 rows fused into the sum: widen (exact: a bf16 is the top half of an fp32), then the
// same separate multiply and add, in one pass over the row (w = 1 without weights: exact).
__attribute__((target_clones("avx2", "default"))) void accumulate_bf16_scaled(
    float* acc, const uint16_t* r, float w, int64_t h) {
  for (int64_t j = 0; j < h; ++j) {
    const uint32_t u = static_cast<uint32_t>(r[j]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    const float p = f * w;
    acc[j] += p;
  }
}

// fp32 -> bf16 bits, round to nearest even, NaN -> 0x7FC0: c10::BFloat16's conversion,
// written as an integer loop the compiler vectorizes.
__attribute__((target_clones("avx2", "default"))) void narrow_bf16(const uint32_t* a,
                                                                   uint16_t* o, int64_t h) {
  for (int64_t j = 0; j < h; ++j) {
    const uint32_t u = a[j];
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    o[j] = nan ? static_cast<uint16_t>(0x7FC0)
               : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
}

template <typename out_t>
void store_row(const float* acc, out_t* o, int64_t h) {
  if constexpr (std::is_same_v<out_t, c10::BFloat16>) {
    narrow_bf16(reinterpret_cast<const uint32_t*>(acc), reinterpret_cast<uint16_t*>(o), h);
  } else {
    for (int64_t j = 0; j < h; ++j) o[j] = static_cast<out_t>(acc[j]);
  }
}

// Asks for [p, p + bytes) in cache ahead of use, a line at a time.
inline void prefetch_bytes(const char* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

// Columns of a row the merge sums at a time, over all of a token's routes: the routes' rows
// are read as that many concurrent streams (more reads in flight than one row after
// another), and the fp32 sums stay in L1. Block scales may straddle two steps: the FP8
// merge walks each step in runs of one block.
constexpr int64_t kMergeCols = 1024;

// acc[t] += float(row) * weight, rows in map order (weight 1 without merging probs: exact).
// `add_row(d, acc, weight, scratch, lo, hi)` adds columns [lo, hi) of row d into acc[lo:hi]
// (scratch: H floats it may use); the sums are separate multiply and add, as the torch
// path, and each column sees the routes in map order whatever the column steps.
template <typename out_t, typename AddRow, typename Prefetch>
Tensor merge(const Tensor& rid, int64_t h, int64_t nrows, const c10::optional<Tensor>& w,
             at::TensorOptions opt, AddRow add_row, Prefetch prefetch) {
  const int64_t t = rid.size(0);
  auto out = big_empty({t, h}, opt);
  out_t* o = out.data_ptr<out_t>();
  const int64_t s_ = slots_of(rid), width = 2 * s_ + 1;
  const int32_t* m = rid.data_ptr<int32_t>();
  const c10::optional<RouteWeights> rw =
      w.has_value() ? c10::optional<RouteWeights>(RouteWeights(*w)) : c10::nullopt;
  at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
    std::vector<float> acc(h), v(h), wts(s_);
    for (int64_t i = b; i < e; ++i) {
      const int32_t* dst = m + i * width;
      const int32_t* col = dst + s_;
      const int32_t cnt = dst[2 * s_];
      check_count(cnt, s_, i);
      for (int32_t s = 0; s < cnt; ++s) {
        TORCH_CHECK_VALUE(dst[s] >= 0 && dst[s] < nrows, "qmoe: row_id_map row ", dst[s],
                    " out of range for an input of ", nrows, " rows");
        wts[s] = rw.has_value() ? rw->at(i, col[s]) : 1.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t lo = 0; lo < h; lo += kMergeCols) {
        const int64_t hi = std::min(h, lo + kMergeCols);
        for (int32_t s = 0; s < cnt; ++s) {
          if (hi < h) prefetch(dst[s], hi, std::min(h, hi + kMergeCols));
          add_row(dst[s], acc.data(), wts[s], v.data(), lo, hi);
        }
      }
      store_row(acc.data(), o + i * h, h);
    }
  });
  return out;
}

void check_weights(const char* op, const c10::optional<Tensor>& w, int64_t t, int64_t s) {
  if (!w.has_value()) return;
  QMOE_CHECK(w->dim() == 2 && w->size(0) == t && w->size(1) == s, op,
             "merging_probs must be [T, ", s, "] = [", t, ", ", s, "], got ", w->sizes());
}

// The first thing wrong with a row_id_map as a merge reads it (qmoe::map_check; the codes
// and their messages are in qmoe/ops/unpermute.py): 0 nothing, 1 a route count outside
// [0, S], 2 a kept route's row outside [0, N), 3 a row named by two kept routes, 4 a kept
// route's probs column outside [0, P), 5 a NaN weight at a kept route. One pass per check,
// in that order, as the torch kernel reports them.
Tensor map_check(const Tensor& rid_in, int64_t n, const c10::optional<Tensor>& w) {
  const Tensor rid = rid_in.contiguous();
  QMOE_CHECK(rid.scalar_type() == at::kInt && rid.dim() == 2 && rid.size(1) % 2 == 1,
             "map_check", "row_id_map must be int32 [T, 2*S + 1], got ", rid.scalar_type(),
             " ", rid.sizes());
  const int64_t t = rid.size(0), s = slots_of(rid), width = 2 * s + 1;
  const int32_t* m = rid.data_ptr<int32_t>();
  auto code = [&]() -> int32_t {
    if (s == 0) return 0;
    for (int64_t i = 0; i < t; ++i) {
      const int32_t c = m[i * width + 2 * s];
      if (c < 0 || c > s) return 1;
    }
    for (int64_t i = 0; i < t; ++i)
      for (int32_t j = 0; j < m[i * width + 2 * s]; ++j)
        if (m[i * width + j] < 0 || m[i * width + j] >= n) return 2;
    std::vector<uint8_t> seen(static_cast<size_t>(n), 0);
    for (int64_t i = 0; i < t; ++i)
      for (int32_t j = 0; j < m[i * width + 2 * s]; ++j)
        if (seen[m[i * width + j]]++) return 3;
    if (!w.has_value()) return 0;
    const int64_t p = w->size(1);
    for (int64_t i = 0; i < t; ++i)
      for (int32_t j = 0; j < m[i * width + 2 * s]; ++j)
        if (m[i * width + s + j] < 0 || m[i * width + s + j] >= p) return 4;
    return AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w->scalar_type(), "w", [&] {
      const scalar_t* wp = w->data_ptr<scalar_t>();
      const int64_t s0 = w->stride(0), s1 = w->stride(1);
      for (int64_t i = 0; i < t; ++i)
        for (int32_t j = 0; j < m[i * width + 2 * s]; ++j)
          if (std::isnan(static_cast<float>(wp[i * s0 + m[i * width + s + j] * s1])))
            return int32_t{5};
      return int32_t{0};
    });
  }();
  return at::scalar_tensor(code, rid.options().dtype(at::kInt));
}

Tensor unpermute(const Tensor& inp, const Tensor& rid_in, const c10::optional<Tensor>& w) {
  const char* op = "unpermute";
  const Tensor rid = rid_in.contiguous();
  QMOE_CHECK(inp.dim() == 2, op, "inp must be [N, H], got ", inp.sizes());
  QMOE_CHECK(rid.dim() == 2, op, "row_id_map must be 2-d");
  check_map(op, rid, rid.size(0));
  check_weights(op, w, rid.size(0), slots_of(rid));
  auto x = inp.contiguous();
  const int64_t h = x.size(1), nrows = x.size(0);
  Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "unpermute", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    out = merge<scalar_t>(rid, h, nrows, w, x.options(),
                          [&](int32_t d, float* acc, float wt, float* v, int64_t lo, int64_t hi) {
      const scalar_t* r = xp + d * h;
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        accumulate_bf16_scaled(acc + lo, reinterpret_cast<const uint16_t*>(r) + lo, wt, hi - lo);
      } else {
        for (int64_t j = lo; j < hi; ++j) v[j] = static_cast<float>(r[j]);
        accumulate_scaled(acc + lo, v + lo, wt, hi - lo);
      }
    }, [&](int32_t d, int64_t lo, int64_t hi) {
      prefetch_bytes(reinterpret_cast<const char*>(xp + d * h + lo), (hi - lo) * sizeof(scalar_t));
    });
  });
  return out;
}

// fp8 bits * scale, as QuantizedTensor.dequantize defines it (layout 0: per-tensor fp32,
// 1: fp32 block scales, 2: e8m0 block scale bits).
float e8m0_value(uint8_t b) {
  if (b == 255) return std::numeric_limits<float>::quiet_NaN();
  if (b == 0) return std::ldexp(1.f, -127);
  uint32_t bits = static_cast<uint32_t>(b) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

Tensor unpermute_fp8(const Tensor& qbits, const Tensor& scale, const Tensor& rid_in,
                     const c10::optional<Tensor>& w, int64_t layout, int64_t block_size,
                     at::ScalarType fp8_dtype, at::ScalarType out_dtype) {
  const char* op = "unpermute_fp8";
  const Tensor rid = rid_in.contiguous();
  QMOE_CHECK(qbits.scalar_type() == at::kByte && qbits.dim() == 2, op,
             "qbits must be uint8 [N, H], got ", qbits.scalar_type(), " ", qbits.sizes());
  check_map(op, rid, rid.size(0));
  check_weights(op, w, rid.size(0), slots_of(rid));
  QMOE_CHECK(layout >= 0 && layout <= 2, op, "layout must be 0, 1 or 2, got ", layout);
  QMOE_CHECK(layout == 0 || block_size > 0, op, "block_size must be > 0 for block scales");
  auto q = qbits.contiguous();
  auto sc = scale.contiguous();
  const int64_t h = q.size(1), nrows = q.size(0);
  const int64_t nb = layout == 0 ? 1 : h / block_size + (h % block_size != 0);
  QMOE_CHECK(layout != 0 || sc.numel() == 1, op, "a per-tensor scale must have one element, got ",
             sc.sizes());
  QMOE_CHECK(layout == 0 || (sc.dim() == 2 && sc.size(0) == nrows && sc.size(1) == nb), op,
             "block scales must be [N, ceil(H / block_size)] = [", nrows, ", ", nb, "], got ",
             sc.sizes());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  check_fp8(op, fp8_dtype);
  const bool e4m3 = fp8_dtype == at::kFloat8_e4m3fn;
  float lut[256];  // fp8 bits -> fp32, exact
  for (int b = 0; b < 256; ++b)
    lut[b] = e4m3 ? static_cast<float>(c10::Float8_e4m3fn(b, c10::Float8_e4m3fn::from_bits()))
                  : static_cast<float>(c10::Float8_e5m2(b, c10::Float8_e5m2::from_bits()));
  const float* sf = layout == 1 ? sc.data_ptr<float>() : nullptr;
  const uint8_t* sb = layout == 2 ? sc.data_ptr<uint8_t>() : nullptr;
  const float s0 = layout == 0 ? sc.to(at::kFloat).data_ptr<float>()[0] : 0.f;
  Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "unpermute_fp8", [&] {
    out = merge<scalar_t>(rid, h, nrows, w, q.options().dtype(out_dtype),
                          [&](int32_t d, float* acc, float wt, float* v, int64_t c0, int64_t c1) {
      const uint8_t* r = qp + d * h;
      // [c0, c1) in runs of one block each (a block may start before c0: any block size,
      // e.g. torchao's per-row scales, one block of H columns)
      for (int64_t lo = c0, hi; lo < c1; lo = hi) {
        hi = layout == 0 ? c1 : std::min(c1, (lo / block_size + 1) * block_size);
        const float s = layout == 0 ? s0
                        : layout == 1 ? sf[d * nb + lo / block_size]
                                      : e8m0_value(sb[d * nb + lo / block_size]);
        for (int64_t j = lo; j < hi; ++j) v[j] = lut[r[j]] * s;
      }
      accumulate_scaled(acc + c0, v + c0, wt, c1 - c0);
    }, [&](int32_t d, int64_t lo, int64_t hi) {
      prefetch_bytes(reinterpret_cast<const char*>(qp + d * h + lo), hi - lo);
    });
  });
  return out;
}

// Dot products of the merge weights' gradient: products in fp32 (exact for bf16 and fp16
// inputs), summed in 16 fp32 lanes (column j into lane j % 16, the lanes combined in a
// fixed tree), so the loop vectorizes (AVX2 where the CPU has it) and the result does not
// depend on the thread count. Error at most (h + 1) 2^-24 sum |a b|, like any fp32 sum.
constexpr int kDotLanes = 16;

inline float tree_sum(const float* acc) {
  float v[kDotLanes / 2];
  for (int u = 0; u < kDotLanes / 2; ++u) v[u] = acc[u] + acc[u + kDotLanes / 2];
  for (int w = kDotLanes / 4; w >= 1; w /= 2)
    for (int u = 0; u < w; ++u) v[u] = v[u] + v[u + w];
  return v[0];
}

inline float bf16_bits_to_float(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

__attribute__((target_clones("avx2", "default"))) float dot_bf16(const uint16_t* a,
                                                                 const uint16_t* b,
                                                                 int64_t h) {
  float acc[kDotLanes] = {};
  int64_t j = 0;
  for (; j + kDotLanes <= h; j += kDotLanes)
    for (int u = 0; u < kDotLanes; ++u)
      acc[u] += bf16_bits_to_float(a[j + u]) * bf16_bits_to_float(b[j + u]);
  for (; j < h; ++j) acc[j % kDotLanes] += bf16_bits_to_float(a[j]) * bf16_bits_to_float(b[j]);
  return tree_sum(acc);
}

__attribute__((target_clones("avx2", "default"))) float dot_f32(const float* a, const float* b,
                                                                int64_t h) {
  float acc[kDotLanes] = {};
  int64_t j = 0;
  for (; j + kDotLanes <= h; j += kDotLanes)
    for (int u = 0; u < kDotLanes; ++u) acc[u] += a[j + u] * b[j + u];
  for (; j < h; ++j) acc[j % kDotLanes] += a[j] * b[j];
  return tree_sum(acc);
}

template <typename scalar_t>
float dot_row(const scalar_t* a, const scalar_t* b, int64_t h) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return dot_bf16(reinterpret_cast<const uint16_t*>(a), reinterpret_cast<const uint16_t*>(b),
                    h);
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    return dot_f32(a, b, h);
  } else if constexpr (std::is_same_v<scalar_t, double>) {  // fp64 rows: an fp64 sum
    double acc = 0;
    for (int64_t j = 0; j < h; ++j) acc += a[j] * b[j];
    return static_cast<float>(acc);
  } else {  // fp16: products exact in fp32
    float acc[kDotLanes] = {};
    for (int64_t j = 0; j < h; ++j)
      acc[j % kDotLanes] += static_cast<float>(a[j]) * static_cast<float>(b[j]);
    return tree_sum(acc);
  }
}

// gw[t, col] = <grad[t], x[row]> over each kept route (row, col) of t, in fp32.
Tensor merge_weight_grad(const Tensor& grad, const Tensor& x_in, const Tensor& rid, int64_t p) {
  auto g = grad.contiguous();
  auto x = x_in.scalar_type() == g.scalar_type() ? x_in.contiguous()
                                                 : x_in.to(g.scalar_type()).contiguous();
  const int64_t t = g.size(0), h = g.size(1);
  auto gw = at::zeros({t, p}, g.options().dtype(at::kFloat));
  float* o = gw.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "gw", [&] {
    const scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    for_each_route(rid, [&](int64_t i, const int32_t* dst, const int32_t* col, int32_t cnt) {
      for (int32_t s = 0; s < cnt; ++s) {
        check_col(col[s], p, i);
        o[i * p + col[s]] = dot_row(gp + i * h, xp + static_cast<int64_t>(dst[s]) * h, h);
      }
    });
  });
  return gw;
}

std::tuple<Tensor, Tensor> unpermute_backward(const Tensor& grad, const Tensor& rid_in,
                                              const c10::optional<Tensor>& w,
                                              const c10::optional<Tensor>& fwd_inp,
                                              int64_t num_rows) {
  const Tensor rid = rid_in.contiguous();
  const char* op = "unpermute_backward";
  QMOE_CHECK(grad.dim() == 2, op, "grad_out must be [T, H], got ", grad.sizes());
  check_map(op, rid, grad.size(0));
  check_weights(op, w, rid.size(0), slots_of(rid));
  QMOE_CHECK(!fwd_inp.has_value() || (fwd_inp->dim() == 2 && fwd_inp->size(0) == num_rows &&
                                      fwd_inp->size(1) == grad.size(1)),
             op, "fwd_inp must be [num_rows, H] = [", num_rows, ", ", grad.size(1), "], got ",
             fwd_inp.has_value() ? fwd_inp->sizes() : at::IntArrayRef{});
  auto gi = permute_rows(grad, rid, num_rows, w);
  if (!w.has_value() || !fwd_inp.has_value()) return {gi, at::empty({0}, grad.options())};
  return {gi, merge_weight_grad(grad, *fwd_inp, rid, w->size(1)).to(w->scalar_type())};
}

// A permute's backward with probs: the merge of the rows' gradient, and the permuted
// probs' gradient gpp [N] at each kept route's column of a [T, P] tensor in `dtype` (zeros
// elsewhere; each value converted once, from fp64, which holds any float input exactly).
std::tuple<Tensor, Tensor> permute_backward(const Tensor& grad, const Tensor& rid_in,
                                            const Tensor& gpp_in, int64_t p,
                                            at::ScalarType dtype) {
  const char* op = "permute_backward";
  const Tensor rid = rid_in.contiguous();
  QMOE_CHECK(p >= 0, op, "num_cols must be >= 0, got ", p);
  QMOE_CHECK(gpp_in.dim() == 1 && gpp_in.size(0) == grad.size(0), op,
             "grad_probs must be [N] with N = ", grad.size(0), " (the rows of grad_out), got ",
             gpp_in.sizes());
  auto gi = unpermute(grad, rid, c10::nullopt);  // checks the map's counts and rows
  const Tensor gpp = gpp_in.to(at::kDouble).contiguous();
  const double* g = gpp.data_ptr<double>();
  const int64_t n = gpp.size(0);
  auto gp = at::zeros({rid.size(0), p}, gpp.options());
  double* o = gp.data_ptr<double>();
  for_each_route(rid, [&](int64_t t, const int32_t* dst, const int32_t* col, int32_t cnt) {
    for (int32_t s = 0; s < cnt; ++s) {
      TORCH_CHECK_VALUE(dst[s] >= 0 && dst[s] < n, "qmoe::permute_backward: row_id_map row ",
                        dst[s], " out of range for ", n, " rows");
      check_col(col[s], p, t);
      o[t * p + col[s]] = g[dst[s]];
    }
  });
  return {gi, gp.to(dtype)};
}

// ----------------------------------------------------------------- sort_chunks
// src[i]: the input row that output row i of the chunk sort of T rows reads (chunks of
// `sizes` taken in the order `index`; rows past the chunks stay in place), the arguments
// checked as `sort_chunks` states them.
std::vector<int64_t> chunk_sources(const char* op, const Tensor& sizes, const Tensor& index,
                                   int64_t t) {
  QMOE_CHECK(sizes.dim() == 1 && index.dim() == 1 && sizes.numel() == index.numel(), op,
             "split_sizes and sorted_index must both be [C]");
  auto sz = sizes.to(at::kLong).contiguous();
  auto ix = index.to(at::kLong).contiguous();
  const int64_t c = sz.numel();
  const int64_t* s = sz.data_ptr<int64_t>();
  const int64_t* k = ix.data_ptr<int64_t>();
  std::vector<int64_t> start(c, 0);
  int64_t total = 0;
  for (int64_t i = 0; i < c; ++i) {
    QMOE_CHECK(s[i] >= 0, op, "split_sizes must be >= 0, got ", s[i]);
    // checked before the sum (which would overflow for huge sizes)
    QMOE_CHECK(s[i] <= t - total, op, "split_sizes must sum to at most T=", t);
    start[i] = total;
    total += s[i];
  }
  std::vector<int64_t> src(t);
  std::vector<char> seen(c, 0);
  int64_t r = 0;
  for (int64_t j = 0; j < c; ++j) {
    QMOE_CHECK(k[j] >= 0 && k[j] < c, op, "sorted_index entries must be in [0, ", c, "), got ", k[j]);
    QMOE_CHECK(!seen[k[j]], op, "sorted_index must be a permutation of 0..", c - 1,
               " (each chunk once); chunk ", k[j], " repeats");
    seen[k[j]] = 1;
    for (int64_t q = 0; q < s[k[j]]; ++q) src[r++] = start[k[j]] + q;
  }
  for (; r < t; ++r) src[r] = r;  // rows past the chunks stay in place
  return src;
}

// out[i] = inp[src[i]] for the T rows of `inp` [T, H].
Tensor gather_rows(const Tensor& inp, const std::vector<int64_t>& src) {
  auto x = rows_view(inp);
  auto out = big_empty(x.sizes(), x.options());
  const int64_t rb = x.size(1) * x.element_size(), xs = x.stride(0) * x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, x.size(0), 256, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) copy_row(o + i * rb, xp + src[i] * xs, rb, false);
  });
  return out;
}

// The permuted probs [T] of a chunk sort (empty without probs).
Tensor gather_probs(const Tensor& inp, const c10::optional<Tensor>& probs,
                    std::vector<int64_t>& src) {
  if (!probs.has_value()) return at::empty({0}, inp.options());
  auto srct = at::from_blob(src.data(), {static_cast<int64_t>(src.size())}, at::kLong).clone();
  return probs->index_select(0, srct);
}

std::tuple<Tensor, Tensor> sort_chunks(const Tensor& inp, const Tensor& sizes, const Tensor& index,
                                       const c10::optional<Tensor>& probs) {
  const char* op = "sort_chunks";
  QMOE_CHECK(inp.dim() == 2, op, "inp must be [T, H], got ", inp.sizes());
  auto src = chunk_sources(op, sizes, index, inp.size(0));
  return {gather_rows(inp, src), gather_probs(inp, probs, src)};
}

// The chunk sort of rows with side rows (the block scales of quantized rows) moved alike:
// `(out [T, H], side_out [T, NS], permuted probs [T] or empty)`, the source rows worked
// out once for both (the passthrough rule of the FP8 chunk sort).
std::tuple<Tensor, Tensor, Tensor> sort_chunks_rows(const Tensor& inp, const Tensor& side,
                                                    const Tensor& sizes, const Tensor& index,
                                                    const c10::optional<Tensor>& probs) {
  const char* op = "sort_chunks_rows";
  QMOE_CHECK(inp.dim() == 2, op, "inp must be [T, H], got ", inp.sizes());
  QMOE_CHECK(side.dim() == 2 && side.size(0) == inp.size(0), op,
             "side must be [T, NS] with T = inp's rows, got ", side.sizes(), " for inp ",
             inp.sizes());
  auto src = chunk_sources(op, sizes, index, inp.size(0));
  return {gather_rows(inp, src), gather_rows(side, src), gather_probs(inp, probs, src)};
}

// -------------------------------------------------------------------- quantize
inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// fp32 -> fp8 bits (MB mantissa bits, exponent bias BIAS: e4m3fn 3/7, e5m2 2/15), saturated
// to +-fmax (given by its fp32 bits), NaN to the canonical +NaN 0x7F, round to nearest
// even: c10's conversion (its subnormal add and its biased-exponent round), written as
// integer selects with both branches computed, so that the element loops vectorize.
template <int MB, int BIAS>
inline uint8_t fp8_bits(float y, uint32_t fmax_bits) {
  uint32_t u = float_bits(y);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  const uint32_t is_nan = 0u - static_cast<uint32_t>(u > 0x7F800000u);
  u = std::min(u, fmax_bits);  // |y| saturated (as unsigned bits: same order as floats)
  constexpr uint32_t denorm = static_cast<uint32_t>(127 - BIAS + 23 - MB + 1) << 23;
  const uint32_t sub = float_bits(bits_float(u) + bits_float(denorm)) - denorm;
  const uint32_t nrm = (u + (static_cast<uint32_t>(BIAS - 127) << 23) +
                        ((1u << (22 - MB)) - 1u) + ((u >> (23 - MB)) & 1u)) >> (23 - MB);
  const uint32_t is_sub =
      0u - static_cast<uint32_t>(u < (static_cast<uint32_t>(127 - BIAS + 1) << 23));
  const uint32_t r = ((sub & is_sub) | (nrm & ~is_sub)) | (sign >> 24);
  return static_cast<uint8_t>((r & ~is_nan) | (0x7Fu & is_nan));
}

template <typename F8>
inline uint8_t to_fp8(float y, uint32_t fmax_bits) {
  if constexpr (std::is_same_v<F8, c10::Float8_e4m3fn>) return fp8_bits<3, 7>(y, fmax_bits);
  else return fp8_bits<2, 15>(y, fmax_bits);
}

// One block's elements: the largest |x| (NaN ignored; `nan` set if any), and the fp8 bits
// of x / d. fp32 and bf16 (widened through its bits) in loops the compiler vectorizes,
// with AVX2 clones; other dtypes through their conversion.
template <typename scalar_t>
inline float elem(const scalar_t* x, int64_t j) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return bits_float(static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(x)[j]) << 16);
  } else {
    return static_cast<float>(x[j]);
  }
}

// |x| compared as unsigned bits (the order of the floats for non-NaN values): an integer
// max, which vectorizes where a float one would not; a NaN sets `nan`.
template <typename scalar_t>
inline float block_amax_impl(const scalar_t* x, int64_t n, bool& nan) {
  uint32_t m = 0, bad = 0;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t a = float_bits(elem(x, j)) & 0x7FFFFFFFu;
    bad |= static_cast<uint32_t>(a > 0x7F800000u);
    m = std::max(m, a);
  }
  nan = bad != 0;
  return bits_float(m);
}

template <typename scalar_t, typename F8>
inline void block_bits_impl(const scalar_t* x, int64_t n, float d, float fmax, uint8_t* q) {
  const uint32_t fb = float_bits(fmax);
  for (int64_t j = 0; j < n; ++j) q[j] = to_fp8<F8>(elem(x, j) / d, fb);
}

__attribute__((target_clones("avx2", "default"))) float block_amax_bf16(
    const c10::BFloat16* x, int64_t n, bool& nan) {
  return block_amax_impl(x, n, nan);
}
__attribute__((target_clones("avx2", "default"))) float block_amax_f32(const float* x,
                                                                       int64_t n, bool& nan) {
  return block_amax_impl(x, n, nan);
}
__attribute__((target_clones("avx2", "default"))) void block_e4m3_bf16(
    const c10::BFloat16* x, int64_t n, float d, float fmax, uint8_t* q) {
  block_bits_impl<c10::BFloat16, c10::Float8_e4m3fn>(x, n, d, fmax, q);
}
__attribute__((target_clones("avx2", "default"))) void block_e5m2_bf16(
    const c10::BFloat16* x, int64_t n, float d, float fmax, uint8_t* q) {
  block_bits_impl<c10::BFloat16, c10::Float8_e5m2>(x, n, d, fmax, q);
}
__attribute__((target_clones("avx2", "default"))) void block_e4m3_f32(
    const float* x, int64_t n, float d, float fmax, uint8_t* q) {
  block_bits_impl<float, c10::Float8_e4m3fn>(x, n, d, fmax, q);
}
__attribute__((target_clones("avx2", "default"))) void block_e5m2_f32(
    const float* x, int64_t n, float d, float fmax, uint8_t* q) {
  block_bits_impl<float, c10::Float8_e5m2>(x, n, d, fmax, q);
}

template <typename scalar_t>
float block_amax(const scalar_t* x, int64_t n, bool& nan) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) return block_amax_bf16(x, n, nan);
  else if constexpr (std::is_same_v<scalar_t, float>) return block_amax_f32(x, n, nan);
  else return block_amax_impl(x, n, nan);
}

template <typename scalar_t, typename F8>
void block_bits(const scalar_t* x, int64_t n, float d, float fmax, uint8_t* q) {
  constexpr bool e4m3 = std::is_same_v<F8, c10::Float8_e4m3fn>;
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    e4m3 ? block_e4m3_bf16(x, n, d, fmax, q) : block_e5m2_bf16(x, n, d, fmax, q);
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    e4m3 ? block_e4m3_f32(x, n, d, fmax, q) : block_e5m2_f32(x, n, d, fmax, q);
  } else {
    block_bits_impl<scalar_t, F8>(x, n, d, fmax, q);
  }
}

float pow2_ceil(float s) {
  if (std::isnan(s)) return s;
  uint32_t b;
  std::memcpy(&b, &s, 4);
  b = (b + 0x7FFFFFu) & 0x7F800000u;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

float canonical(float s) { return std::isnan(s) ? std::numeric_limits<float>::quiet_NaN() : s; }

template <typename scalar_t, typename F8>
void quantize_rows_impl(const Tensor& x, Tensor& q, Tensor& s, int64_t bs, int64_t mode,
                        float fmax, int64_t emax) {
  const int64_t h = x.size(-1), r = x.numel() / std::max<int64_t>(h, 1);
  const int64_t nb = (h + bs - 1) / bs;
  const scalar_t* xp = x.data_ptr<scalar_t>();
  uint8_t* qp = static_cast<uint8_t*>(q.data_ptr());
  at::parallel_for(0, r, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      for (int64_t blk = 0; blk < nb; ++blk) {
        const int64_t lo = blk * bs, hi = std::min(h, lo + bs);
        bool nan = false;
        float amax = block_amax(xp + i * h + lo, hi - lo, nan);
        if (nan) amax = std::numeric_limits<float>::quiet_NaN();
        float divisor;
        if (mode == 2) {  // OCP MX floor, as the torch reference
          uint32_t bits;
          std::memcpy(&bits, &amax, 4);
          const int32_t ex = static_cast<int32_t>((bits >> 23) & 0xFF) - 127;
          // a nonzero block stops at byte 1, the divisor 2**-126 used below (byte 0,
          // 2**-127, would halve it); an all-zero block keeps byte 0
          const int32_t low = amax > 0.f ? -126 : -127;
          int32_t biased = std::min<int32_t>(std::max<int32_t>(ex - emax, low), 128) + 127;
          if (nan) biased = 255;
          s.data_ptr<uint8_t>()[i * nb + blk] = static_cast<uint8_t>(biased);
          const uint32_t sb = static_cast<uint32_t>(biased) << 23;
          std::memcpy(&divisor, &sb, 4);
          divisor = std::max(divisor, std::ldexp(1.f, -126));
        } else if (mode == 4) {  // TransformerEngine's RCEIL, as the torch reference
          const float d = amax / fmax;
          uint32_t db;
          std::memcpy(&db, &d, 4);
          const uint32_t e = (db >> 23) & 0xFF, m = db & 0x7FFFFF;
          // amax / fp8_max rounded up to a power of two; 254 for inf, 255 for NaN
          int32_t biased = static_cast<int32_t>(e) +
                           (m > 0 && e != 0xFE && (e != 0 || m > 0x400000u) ? 1 : 0);
          if (e == 0xFF) biased = 254;
          if (nan) biased = 255;
          s.data_ptr<uint8_t>()[i * nb + blk] = static_cast<uint8_t>(biased);
          const uint32_t sb = static_cast<uint32_t>(biased) << 23;
          std::memcpy(&divisor, &sb, 4);
          if (biased == 0) divisor = 1.f;  // TE's and torchao's: the elements round to +-0
          if (nan) divisor = std::numeric_limits<float>::quiet_NaN();
        } else {
          divisor = (nan ? amax : std::max(amax, 1e-12f)) / fmax;
          if (mode == 1) divisor = pow2_ceil(divisor);
          divisor = canonical(divisor);
          s.data_ptr<float>()[i * nb + blk] = divisor;
        }
        block_bits<scalar_t, F8>(xp + i * h + lo, hi - lo, divisor, fmax, qp + i * h + lo);
      }
    }
  });
}

std::tuple<Tensor, Tensor> quantize_blocks(const Tensor& x_in, int64_t bs, at::ScalarType fp8,
                                           c10::string_view mode_s) {
  const char* op = "quantize_blocks";
  const std::string mode_str(mode_s);
  const int64_t mode = mode_str == "amax" ? 0 : mode_str == "pow2" ? 1
                       : mode_str == "mx_floor" ? 2 : mode_str == "mx_rceil" ? 4 : -1;
  QMOE_CHECK(mode >= 0, op, "scale_mode must be one of ['amax', 'mx_floor', 'mx_rceil', 'pow2'], got ",
             mode_str);
  QMOE_CHECK(bs >= 1 && bs <= 16384 && (bs & (bs - 1)) == 0, op,
             "block_size must be a power of two in [1, 16384], got ", bs);
  check_quantize_dtypes(op, x_in, fp8);
  const bool e4m3 = fp8 == at::kFloat8_e4m3fn;
  auto x = x_in.contiguous();
  const int64_t h = x.size(-1), nb = (h + bs - 1) / bs;
  auto q = at::empty(x.sizes(), x.options().dtype(fp8));
  auto sshape = x.sizes().vec();
  sshape.back() = nb;
  auto s = at::empty(sshape, x.options().dtype(mode == 2 || mode == 4 ? at::kByte : at::kFloat));
  if (x.numel() == 0) return {q, s};
  const float fmax = e4m3 ? 448.f : 57344.f;
  const int64_t emax = e4m3 ? 8 : 15;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quantize_blocks", [&] {
    if (e4m3) quantize_rows_impl<scalar_t, c10::Float8_e4m3fn>(x, q, s, bs, mode, fmax, emax);
    else quantize_rows_impl<scalar_t, c10::Float8_e5m2>(x, q, s, bs, mode, fmax, emax);
  });
  return {q, s};
}

Tensor quantize_with_scale(const Tensor& x_in, const Tensor& scale, at::ScalarType fp8) {
  const char* op = "quantize_with_scale";
  check_quantize_dtypes(op, x_in, fp8);
  const bool e4m3 = fp8 == at::kFloat8_e4m3fn;
  QMOE_CHECK(scale.numel() == 1, op, "scale must have one element, got ", scale.sizes());
  auto x = x_in.contiguous();
  auto q = at::empty(x.sizes(), x.options().dtype(fp8));
  const float sv = scale.to(at::kFloat).item<float>();
  const float fmax = e4m3 ? 448.f : 57344.f;
  uint8_t* qp = static_cast<uint8_t*>(q.data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quantize_with_scale", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), 4096, [&](int64_t b, int64_t e) {
      if (e4m3) block_bits<scalar_t, c10::Float8_e4m3fn>(xp + b, e - b, sv, fmax, qp + b);
      else block_bits<scalar_t, c10::Float8_e5m2>(xp + b, e - b, sv, fmax, qp + b);
    });
  });
  return q;
}

}  // namespace

TORCH_LIBRARY_IMPL(qmoe, CPU, m) {
  m.impl("make_row_id_map", &make_row_id_map);
  m.impl("permute", &permute);
  m.impl("permute_with_scales", &permute_with_scales);
  m.impl("unpermute", &unpermute);
  m.impl("map_check", &map_check);
  m.impl("permute_backward", &permute_backward);
  m.impl("unpermute_backward", &unpermute_backward);
  m.impl("unpermute_fp8", &unpermute_fp8);
  m.impl("sort_chunks", &sort_chunks);
  m.impl("sort_chunks_rows", &sort_chunks_rows);
  m.impl("quantize_blocks", &quantize_blocks);
  m.impl("quantize_with_scale", &quantize_with_scale);
}

}  // namespace qmoe
