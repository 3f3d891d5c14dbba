// Reduction kernels written as plain loops over restrict pointers so GCC vectorizes them
// (-O3). On x86-64 each entry point is also compiled for x86-64-v3 (AVX2, FMA, F16C) and
// the loader picks the clone the CPU supports ("arch=haswell" would match the CPU model,
// not its features, and newer CPUs would get the slow clone). float16 has an explicit
// F16C path because GCC converts _Float16 one element at a time. No -ffast-math: every
// path gives the same IEEE result, so ranks on different CPUs agree bit for bit.
#include "reduce.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ERING_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#define ERING_F16C 1
#include <immintrin.h>
#else
#define ERING_CLONES
#endif

namespace ering {
namespace {

using half = _Float16;

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // keep NaN a (quiet) NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return uint16_t(u >> 16);
}

struct Sum { template <class T> static T apply(T a, T b) { return a + b; } };
struct Min { template <class T> static T apply(T a, T b) { return b < a ? b : a; } };
struct Max { template <class T> static T apply(T a, T b) { return a < b ? b : a; } };

template <class T, class Op>
inline __attribute__((always_inline)) void loop_native(T* __restrict d, const T* __restrict s, size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = Op::apply(d[i], s[i]);
}

template <class T, class Op>
inline __attribute__((always_inline)) void loop_native3(T* __restrict d, const T* __restrict a,
                                                        const T* __restrict b, size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = Op::apply(a[i], b[i]);
}

#ifdef ERING_F16C
#define ERING_AVX __attribute__((target("avx2,f16c"), always_inline)) inline
struct SumV { ERING_AVX static __m256 apply(__m256 a, __m256 b) { return _mm256_add_ps(a, b); } };
// min/max with the scalar path's operand order, so NaN handling matches bit for bit.
struct MinV { ERING_AVX static __m256 apply(__m256 a, __m256 b) { return _mm256_blendv_ps(a, b, _mm256_cmp_ps(b, a, _CMP_LT_OQ)); } };
struct MaxV { ERING_AVX static __m256 apply(__m256 a, __m256 b) { return _mm256_blendv_ps(a, b, _mm256_cmp_ps(a, b, _CMP_LT_OQ)); } };

// d = x op s elementwise; d may be x itself (reduce_into), else overlaps neither.
template <class V>
__attribute__((target("avx2,f16c"))) void half_f16c(half* d, const half* x, const half* __restrict s, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm256_cvtps_ph(V::apply(a, b), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) {
    __m128 a = _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const uint16_t*>(x + i)));
    __m128 b = _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const uint16_t*>(s + i)));
    __m256 r = V::apply(_mm256_castps128_ps256(a), _mm256_castps128_ps256(b));
    uint16_t out = uint16_t(_mm_cvtsi128_si32(_mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT)));
    *reinterpret_cast<uint16_t*>(d + i) = out;
  }
}

__attribute__((target("avx2,f16c"))) void half_scale_f16c(half* __restrict d, size_t n, float k) {
  const __m256 kv = _mm256_set1_ps(k);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm256_cvtps_ph(_mm256_div_ps(a, kv), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) d[i] = half(float(d[i]) / k);
}

bool have_f16c() {
  static const bool yes = [] {
    __builtin_cpu_init();  // may run before the CPU-model constructor, so initialise explicitly
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  }();
  return yes;
}
#endif

// 16-bit floats: d = x op s, through float32, rounded once; d may be x itself.
template <class Op>
inline __attribute__((always_inline)) void loop_half(half* d, const half* x, const half* __restrict s, size_t n) {
#ifdef ERING_F16C
  if (have_f16c()) {
    if constexpr (std::is_same_v<Op, Sum>) return half_f16c<SumV>(d, x, s, n);
    else if constexpr (std::is_same_v<Op, Min>) return half_f16c<MinV>(d, x, s, n);
    else return half_f16c<MaxV>(d, x, s, n);
  }
#endif
  for (size_t i = 0; i < n; ++i) d[i] = half(Op::apply(float(x[i]), float(s[i])));
}

template <class Op>
inline __attribute__((always_inline)) void loop_bf16(uint16_t* d, const uint16_t* x, const uint16_t* __restrict s,
                                                     size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(Op::apply(bf16_to_f32(x[i]), bf16_to_f32(s[i])));
}

// The native types: two loops, each with no aliasing for the compiler to fear, so both vectorize.
template <class T, class Op>
inline __attribute__((always_inline)) void loop_any(T* d, const T* x, const T* s, size_t n) {
  if (d == x) loop_native<T, Op>(d, s, n);
  else loop_native3<T, Op>(d, x, s, n);
}

// d = x op s elementwise (x == d: reduce in place).
template <class Op>
inline __attribute__((always_inline)) void dispatch(void* d, const void* x, const void* s, size_t n, DType t) {
  switch (t) {
    case DType::Float16:
      loop_half<Op>(static_cast<half*>(d), static_cast<const half*>(x), static_cast<const half*>(s), n);
      break;
    case DType::BFloat16:
      loop_bf16<Op>(static_cast<uint16_t*>(d), static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(s), n);
      break;
    case DType::Float32:
      loop_any<float, Op>(static_cast<float*>(d), static_cast<const float*>(x), static_cast<const float*>(s), n);
      break;
    case DType::Float64:
      loop_any<double, Op>(static_cast<double*>(d), static_cast<const double*>(x), static_cast<const double*>(s), n);
      break;
    case DType::Int32:
      loop_any<int32_t, Op>(static_cast<int32_t*>(d), static_cast<const int32_t*>(x),
                            static_cast<const int32_t*>(s), n);
      break;
    case DType::Int64:
      loop_any<int64_t, Op>(static_cast<int64_t*>(d), static_cast<const int64_t*>(x),
                            static_cast<const int64_t*>(s), n);
      break;
    case DType::UInt8:
      loop_any<uint8_t, Op>(static_cast<uint8_t*>(d), static_cast<const uint8_t*>(x),
                            static_cast<const uint8_t*>(s), n);
      break;
  }
}

// Integer sums wrap in the tensor's dtype, as numpy and torch integer sums do.
template <>
inline __attribute__((always_inline)) void loop_native<int32_t, Sum>(int32_t* __restrict d, const int32_t* __restrict s, size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = int32_t(uint32_t(d[i]) + uint32_t(s[i]));
}
template <>
inline __attribute__((always_inline)) void loop_native<int64_t, Sum>(int64_t* __restrict d, const int64_t* __restrict s, size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = int64_t(uint64_t(d[i]) + uint64_t(s[i]));
}
template <>
inline __attribute__((always_inline)) void loop_native<uint8_t, Sum>(uint8_t* __restrict d, const uint8_t* __restrict s, size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = uint8_t(d[i] + s[i]);
}
template <>
inline __attribute__((always_inline)) void loop_native3<int32_t, Sum>(int32_t* __restrict d, const int32_t* __restrict a,
                                                                     const int32_t* __restrict b, size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = int32_t(uint32_t(a[i]) + uint32_t(b[i]));
}
template <>
inline __attribute__((always_inline)) void loop_native3<int64_t, Sum>(int64_t* __restrict d, const int64_t* __restrict a,
                                                                     const int64_t* __restrict b, size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = int64_t(uint64_t(a[i]) + uint64_t(b[i]));
}
template <>
inline __attribute__((always_inline)) void loop_native3<uint8_t, Sum>(uint8_t* __restrict d, const uint8_t* __restrict a,
                                                                     const uint8_t* __restrict b, size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = uint8_t(a[i] + b[i]);
}

template <class T>
inline __attribute__((always_inline)) void scale_loop(T* __restrict d, size_t n, int k) {
  if constexpr (std::is_integral_v<T>) {
    // In 64 bits: T(k) would be 0 for uint8 at 256 ranks.
    const int64_t div = k;
    for (size_t i = 0; i < n; ++i) d[i] = T(int64_t(d[i]) / div);
  } else {
    const T div = T(k);
    for (size_t i = 0; i < n; ++i) d[i] = d[i] / div;
  }
}

// float16/bfloat16 <-> float32, rounding to nearest even.
void widen_to_f32(float* dst, const void* src, size_t count, DType dtype) {
  if (dtype == DType::Float16) {
    const half* s = static_cast<const half*>(src);
    for (size_t i = 0; i < count; ++i) dst[i] = float(s[i]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (size_t i = 0; i < count; ++i) dst[i] = bf16_to_f32(s[i]);
  }
}

void narrow_from_f32(void* dst, const float* src, size_t count, DType dtype) {
  if (dtype == DType::Float16) {
    half* d = static_cast<half*>(dst);
    for (size_t i = 0; i < count; ++i) d[i] = half(src[i]);
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (size_t i = 0; i < count; ++i) d[i] = f32_to_bf16(src[i]);
  }
}

}  // namespace

void reduce_into(void* dst, const void* src, size_t count, DType dtype, ReduceOp op) {
  reduce_to(dst, dst, src, count, dtype, op);
}

ERING_CLONES
void reduce_to(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: case ReduceOp::Average: dispatch<Sum>(dst, a, b, count, dtype); break;
    case ReduceOp::Min: dispatch<Min>(dst, a, b, count, dtype); break;
    case ReduceOp::Max: dispatch<Max>(dst, a, b, count, dtype); break;
  }
}

ERING_CLONES
void scale_down(void* dst, size_t count, DType dtype, int divisor) {
  switch (dtype) {
    case DType::Float16: {
      half* d = static_cast<half*>(dst);
      const float k = float(divisor);
#ifdef ERING_F16C
      if (have_f16c()) { half_scale_f16c(d, count, k); break; }
#endif
      for (size_t i = 0; i < count; ++i) d[i] = half(float(d[i]) / k);
      break;
    }
    case DType::BFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      const float k = float(divisor);
      for (size_t i = 0; i < count; ++i) d[i] = f32_to_bf16(bf16_to_f32(d[i]) / k);
      break;
    }
    case DType::Float32: scale_loop(static_cast<float*>(dst), count, divisor); break;
    case DType::Float64: scale_loop(static_cast<double*>(dst), count, divisor); break;
    case DType::Int32: scale_loop(static_cast<int32_t*>(dst), count, divisor); break;
    case DType::Int64: scale_loop(static_cast<int64_t*>(dst), count, divisor); break;
    case DType::UInt8: scale_loop(static_cast<uint8_t*>(dst), count, divisor); break;
  }
}

Widening::Widening(DType dtype, ReduceOp op)
    : dtype_(dtype),
      active_((dtype == DType::Float16 || dtype == DType::BFloat16) && (op == ReduceOp::Sum || op == ReduceOp::Average)) {}

char* Widening::widen(const void* src, size_t count, std::vector<char>& storage) const {
  if (storage.size() < count * sizeof(float)) storage.resize(count * sizeof(float));
  widen_to_f32(reinterpret_cast<float*>(storage.data()), src, count, dtype_);
  return storage.data();
}

void Widening::narrow(void* dst, const char* wide, size_t count) const {
  narrow_from_f32(dst, reinterpret_cast<const float*>(wide), count, dtype_);
}

void reduce_many(void* dst, const void* const* srcs, int n, size_t count, DType dtype, ReduceOp op) {
  if (dtype == DType::Float16 || dtype == DType::BFloat16) {
    // Every op through float32 here, in rank order, rounded once: same inputs, same order,
    // same bits on every rank (for Min and Max the same bits as in 16 bits).
    std::vector<float> acc(count), next(count);
    widen_to_f32(acc.data(), srcs[0], count, dtype);
    for (int k = 1; k < n; ++k) {
      widen_to_f32(next.data(), srcs[k], count, dtype);
      reduce_into(acc.data(), next.data(), count, DType::Float32, op);
    }
    if (op == ReduceOp::Average) scale_down(acc.data(), count, DType::Float32, n);
    narrow_from_f32(dst, acc.data(), count, dtype);
    return;
  }
  const size_t bytes = count * dtype_size(dtype);
  std::vector<char> acc(static_cast<const char*>(srcs[0]), static_cast<const char*>(srcs[0]) + bytes);
  for (int k = 1; k < n; ++k) reduce_into(acc.data(), srcs[k], count, dtype, op);
  if (op == ReduceOp::Average) scale_down(acc.data(), count, dtype, n);
  std::memcpy(dst, acc.data(), bytes);
}

}  // namespace ering
