// Element-wise reduction kernels, per dtype and op. float16 and bfloat16 reduce through float32.
#pragma once

#include <cstddef>

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

// float16/bfloat16 <-> float32, rounding to nearest even; used to sum 16-bit tensors in float32.
void widen_to_f32(float* dst, const void* src, size_t count, DType dtype);
void narrow_from_f32(void* dst, const float* src, size_t count, DType dtype);

// dst = srcs[0] op srcs[1] op ... op srcs[n-1], in that order, then / n for Average.
// float16/bfloat16 accumulate all n inputs in float32 and round once.
// dst may alias srcs[k] for any k.
void reduce_many(void* dst, const void* const* srcs, int n, size_t count, DType dtype, ReduceOp op);

}  // namespace ering
