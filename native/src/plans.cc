// The collectives as Plans: block and segment arithmetic, and what each plan does with a
// segment once it has arrived.
#include "plans.h"

#include <algorithm>
#include <cstring>

#include "reduce.h"

namespace ering {
namespace {

inline size_t mod(long a, long n) { return size_t(((a % n) + n) % n); }

Blocks even_blocks(size_t count, size_t esize, int n) {
  Blocks b;
  size_t base = count / n, rem = count % n, at = 0;
  for (int c = 0; c < n; ++c) {
    size_t elems = base + (size_t(c) < rem ? 1 : 0);
    b.off.push_back(at * esize);
    b.len.push_back(elems * esize);
    at += elems;
    b.max_len = std::max(b.max_len, elems * esize);
  }
  return b;
}

// Segment k of a block: [k*seg, min(len, (k+1)*seg)), possibly empty, so every rank
// uses the same number of segments per step whatever its block sizes.
Span segment(char* base, const Blocks& b, size_t block, size_t k, size_t seg) {
  size_t lo = std::min(b.len[block], k * seg), hi = std::min(b.len[block], (k + 1) * seg);
  return {base + b.off[block] + lo, hi - lo};
}

size_t segments_for(size_t max_len, size_t seg) { return std::max<size_t>(1, (max_len + seg - 1) / seg); }

}  // namespace

uint32_t op_tag(std::initializer_list<uint64_t> words) {
  uint32_t h = 2166136261u;  // FNV-1a
  for (uint64_t w : words)
    for (int i = 0; i < 8; ++i) { h ^= uint8_t(w >> (8 * i)); h *= 16777619u; }
  return h;
}

// ---------------------------------------------------------------- AllreducePlan

AllreducePlan::AllreducePlan(char* buf, size_t count, DType dtype, ReduceOp op, int rank, int n, size_t seg_bytes,
                             std::vector<char>& scratch, int average_over)
    : buf_(buf), dtype_(dtype), op_(op), r_(rank), n_(n), average_over_(average_over ? average_over : n),
      esize_(dtype_size(dtype)) {
  blocks_ = even_blocks(count, esize_, n);
  seg_ = std::max(esize_, seg_bytes / esize_ * esize_);
  k_ = segments_for(blocks_.max_len, seg_);
  if (scratch.size() < seg_) scratch.resize(seg_);
  scratch_ = scratch.data();
}

Span AllreducePlan::send_span(size_t i) { return segment(buf_, blocks_, send_block(i / k_), i % k_, seg_); }

Span AllreducePlan::recv_span(size_t i) {
  size_t g = i / k_;
  Span s = segment(buf_, blocks_, recv_block(g), i % k_, seg_);
  if (g < size_t(n_ - 1)) return {scratch_, s.bytes};  // reduce-scatter: land beside, then reduce
  return s;                                             // allgather: land in place
}

void AllreducePlan::received(size_t i) {
  size_t g = i / k_;
  if (g >= size_t(n_ - 1)) return;
  Span s = segment(buf_, blocks_, recv_block(g), i % k_, seg_);
  reduce_into(s.ptr, scratch_, s.bytes / esize_, dtype_, op_);
  // The last reduce-scatter step completes this rank's own block: divide once, here.
  if (g == size_t(n_ - 2) && op_ == ReduceOp::Average) scale_down(s.ptr, s.bytes / esize_, dtype_, average_over_);
}

void AllreducePlan::deliver(size_t i, size_t offset, const char* src, size_t n) {
  size_t g = i / k_;
  Span s = segment(buf_, blocks_, recv_block(g), i % k_, seg_);
  if (g < size_t(n_ - 1)) reduce_into(s.ptr + offset, src, n / esize_, dtype_, op_);
  else std::memcpy(s.ptr + offset, src, n);
}

void AllreducePlan::delivered(size_t i) {
  size_t g = i / k_;
  if (g == size_t(n_ - 2) && op_ == ReduceOp::Average) {
    Span s = segment(buf_, blocks_, recv_block(g), i % k_, seg_);
    scale_down(s.ptr, s.bytes / esize_, dtype_, average_over_);
  }
}

size_t AllreducePlan::send_block(size_t g) const {
  if (g < size_t(n_ - 1)) return mod(long(r_) - long(g), n_);
  return mod(long(r_) + 1 - long(g - (n_ - 1)), n_);
}

size_t AllreducePlan::recv_block(size_t g) const {
  if (g < size_t(n_ - 1)) return mod(long(r_) - long(g) - 1, n_);
  return mod(long(r_) - long(g - (n_ - 1)), n_);
}

// ---------------------------------------------------------------- ReduceScatterPlan

ReduceScatterPlan::ReduceScatterPlan(const char* in, char* work, char* own, Blocks blocks, DType dtype, ReduceOp op,
                                     int rank, int n, size_t seg_bytes, std::vector<char>& scratch)
    : in_(in), work_(work), own_(own), blocks_(std::move(blocks)), dtype_(dtype), op_(op), r_(rank), n_(n),
      esize_(dtype_size(dtype)) {
  // Segments hold whole elements, so a reduction never straddles two of them.
  seg_ = std::max(esize_, seg_bytes / esize_ * esize_);
  k_ = segments_for(blocks_.max_len, seg_);
  if (scratch.size() < seg_) scratch.resize(seg_);
  scratch_ = scratch.data();
}

// Step g sends the block it finished reducing in step g-1 (its own contribution at g = 0),
// one place further round than the allreduce's reduce-scatter, so the last block each rank
// completes is its own.
size_t ReduceScatterPlan::send_block(size_t g) const { return mod(long(r_) - long(g) - 1, n_); }
size_t ReduceScatterPlan::recv_block(size_t g) const { return mod(long(r_) - long(g) - 2, n_); }

Span ReduceScatterPlan::send_span(size_t i) {
  size_t g = i / k_;
  // The contribution is only read: a Span is the links' one type for both directions.
  char* from = g == 0 ? const_cast<char*>(in_) : work_;
  return segment(from, blocks_, send_block(g), i % k_, seg_);
}

Span ReduceScatterPlan::recv_span(size_t i) {
  Span s = segment(work_, blocks_, recv_block(i / k_), i % k_, seg_);
  return {scratch_, s.bytes};
}

char* ReduceScatterPlan::target(size_t i) const {
  size_t g = i / k_, block = recv_block(g);
  if (g == size_t(n_ - 2) && own_ != nullptr)   // the own block, complete: straight to the caller
    return own_ + std::min(blocks_.len[block], (i % k_) * seg_);
  return segment(work_, blocks_, block, i % k_, seg_).ptr;
}

void ReduceScatterPlan::received(size_t i) {
  size_t g = i / k_;
  Span s = segment(const_cast<char*>(in_), blocks_, recv_block(g), i % k_, seg_);
  char* dst = target(i);
  reduce_to(dst, s.ptr, scratch_, s.bytes / esize_, dtype_, op_);
  if (g == size_t(n_ - 2) && op_ == ReduceOp::Average) scale_down(dst, s.bytes / esize_, dtype_, n_);
}

void ReduceScatterPlan::deliver(size_t i, size_t offset, const char* src, size_t n) {
  Span s = segment(const_cast<char*>(in_), blocks_, recv_block(i / k_), i % k_, seg_);
  reduce_to(target(i) + offset, s.ptr + offset, src, n / esize_, dtype_, op_);
}

void ReduceScatterPlan::delivered(size_t i) {
  size_t g = i / k_;
  if (g == size_t(n_ - 2) && op_ == ReduceOp::Average) {
    Span s = segment(work_, blocks_, recv_block(g), i % k_, seg_);
    scale_down(target(i), s.bytes / esize_, dtype_, n_);
  }
}

// ---------------------------------------------------------------- AllgatherPlan

AllgatherPlan::AllgatherPlan(char* buf, Blocks blocks, int rank, int n, size_t seg_bytes)
    : buf_(buf), blocks_(std::move(blocks)), r_(rank), n_(n), seg_(std::max<size_t>(1, seg_bytes)) {
  k_ = segments_for(blocks_.max_len, seg_);
}

Span AllgatherPlan::send_span(size_t i) { return segment(buf_, blocks_, mod(long(r_) - long(i / k_), n_), i % k_, seg_); }

Span AllgatherPlan::recv_span(size_t i) {
  return segment(buf_, blocks_, mod(long(r_) - long(i / k_) - 1, n_), i % k_, seg_);
}

// ---------------------------------------------------------------- ShiftPlan

ShiftPlan::ShiftPlan(const char* send, size_t send_bytes, char* recv, size_t recv_bytes, size_t seg_bytes)
    : send_(const_cast<char*>(send)), send_bytes_(send_bytes), recv_(recv), recv_bytes_(recv_bytes),
      seg_(std::max<size_t>(1, seg_bytes)) {}

Span ShiftPlan::send_span(size_t i) {
  size_t lo = std::min(send_bytes_, i * seg_), hi = std::min(send_bytes_, (i + 1) * seg_);
  return {send_ + lo, hi - lo};
}

Span ShiftPlan::recv_span(size_t i) {
  size_t lo = std::min(recv_bytes_, i * seg_), hi = std::min(recv_bytes_, (i + 1) * seg_);
  return {recv_ + lo, hi - lo};
}

// ---------------------------------------------------------------- BroadcastPlan

BroadcastPlan::BroadcastPlan(char* buf, size_t bytes, int rank, int n, int root, size_t seg_bytes)
    : buf_(buf), bytes_(bytes), seg_(std::max<size_t>(1, seg_bytes)) {
  k_ = segments_for(bytes, seg_);
  is_root_ = rank == root;
  is_last_ = int(mod(long(rank) + 1, n)) == root;
}

Span BroadcastPlan::seg(size_t i) const {
  size_t lo = std::min(bytes_, i * seg_), hi = std::min(bytes_, (i + 1) * seg_);
  return {buf_ + lo, hi - lo};
}

}  // namespace ering
