// Element-wise reduction kernels, per dtype and op. float16 and bfloat16 reduce through float32.
#pragma once

#include <cstddef>
#include <vector>

#include "base/common.h"

namespace ering {

// dst[i] = dst[i] op src[i]. Average reduces like Sum; the division happens once, in scale_down().
void reduce_into(void* dst, const void* src, size_t count, DType dtype, ReduceOp op);

// dst[i] = a[i] op b[i]: the same operands in the same order as reduce_into(a, b), written
// elsewhere (so a caller's buffer is read, not copied first). dst may be a itself; otherwise
// it overlaps neither a nor b.
void reduce_to(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op);

// dst[i] = dst[i] / divisor (floats: IEEE division; integers: truncating division).
void scale_down(void* dst, size_t count, DType dtype, int divisor);

// How a reduction of `dtype` by `op` travels and accumulates: float16 and bfloat16 Sum and
// Average in float32 (twice the bytes), rounded once at the end, so partial sums cannot
// overflow and every path rounds once; Min and Max, exact in any width, and every other
// dtype as they are. The one place that decides this and converts: every collective that
// widens 16-bit floats does it through here (in place: accumulate() below).
class Widening {
 public:
  Widening(DType dtype, ReduceOp op);
  bool active() const { return active_; }
  DType dtype() const { return active_ ? DType::Float32 : dtype_; }  // what travels and accumulates
  // Active only: `count` elements of `src` as float32 in `storage` (grown to fit), returned.
  char* widen(const void* src, size_t count, std::vector<char>& storage) const;
  // Active only: rounds `count` float32 results at `wide` to the 16-bit dtype in `dst`, once
  // (to nearest, ties to even).
  void narrow(void* dst, const char* wide, size_t count) const;

 private:
  DType dtype_;
  bool active_;
};

// Runs reduce(data, dtype) for `count` elements of `buf` reduced in place: on a float32 copy
// rounded back into buf at the end when the Widening is active, else on buf itself.
template <class Reduce>
void accumulate(void* buf, size_t count, DType dtype, ReduceOp op, Reduce&& reduce) {
  const Widening widening(dtype, op);
  if (!widening.active()) return reduce(static_cast<char*>(buf), dtype);
  std::vector<char> storage;
  char* wide = widening.widen(buf, count, storage);
  reduce(wide, widening.dtype());
  widening.narrow(buf, wide, count);
}

// dst = srcs[0] op srcs[1] op ... op srcs[n-1], in that order, then / n for Average.
// float16/bfloat16 accumulate all n inputs in float32 and round once.
// dst may alias srcs[k] for any k.
void reduce_many(void* dst, const void* const* srcs, int n, size_t count, DType dtype, ReduceOp op);

}  // namespace ering
