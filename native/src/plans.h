// The collectives as Plans: which segment goes to the next rank, where the previous rank's
// segment lands, and what to do with it once it arrives. The links (links.h) execute them;
// a plan knows nothing of sockets or shared memory.
//
// allreduce: reduce-scatter then allgather (2(n-1) steps, each rank sends 2(n-1)/n of the
// buffer). Every block is reduced along one fixed path around the ring and the finished
// block is then copied to everyone, so all ranks end with the same bits. Steps are not
// separated by barriers: segment k of step g+1 leaves as soon as segment k of step g has
// arrived and been reduced, which keeps both directions of every link busy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "base/common.h"
#include "transport/links.h"

namespace ering {

// The tag of an operation (OpInfo::tag): a hash of what it is (kind, dtype, op, sizes), so
// ranks that call different collectives fail with a mismatch instead of wrong numbers.
uint32_t op_tag(std::initializer_list<uint64_t> words);

// Blocks of a buffer, one per rank, in rank order.
struct Blocks {
  std::vector<size_t> off, len;  // bytes
  size_t max_len = 0;
};

// Reduce-scatter then allgather of `count` elements in `buf`, cut in one block per rank
// and each block in segments of about seg_bytes. Reduce-scatter segments land in scratch
// and are reduced from there (or straight from shared memory, see deliver()).
class AllreducePlan : public Plan {
 public:
  // Average divides by `average_over` ranks (0: the ring's n) where each block completes: a
  // ring of a hierarchy divides by the whole world's size.
  AllreducePlan(char* buf, size_t count, DType dtype, ReduceOp op, int rank, int n, size_t seg_bytes,
                std::vector<char>& scratch, int average_over = 0);
  size_t num_sends() const override { return size_t(2 * (n_ - 1)) * k_; }
  size_t num_recvs() const override { return num_sends(); }
  ptrdiff_t send_after(size_t i) const override { return i < k_ ? -1 : ptrdiff_t(i - k_); }
  Span send_span(size_t i) override;
  Span recv_span(size_t i) override;
  void received(size_t i) override;
  // Shared memory: reduce straight from the transport's memory, skipping the copy to scratch.
  // Same operands in the same order as received(), so the same bits.
  void deliver(size_t i, size_t offset, const char* src, size_t n) override;
  void delivered(size_t i) override;

 private:
  size_t send_block(size_t g) const;
  size_t recv_block(size_t g) const;
  char* buf_;
  DType dtype_;
  ReduceOp op_;
  int r_, n_, average_over_;
  size_t esize_, seg_, k_;
  Blocks blocks_;
  char* scratch_;
};

// Ring reduce-scatter of `blocks` (one per rank, in rank order, any sizes): n-1 steps, each
// rank sends (n-1)/n of the buffer. Block b travels b+1 -> b+2 -> ... -> b and is reduced at
// each hop, so it ends complete on its owner, rank b (Average divides there, once).
// `in` is this rank's contribution, only read: the first step sends from it, and every
// arriving segment is reduced with it into `work` (same block layout), whose partial sums
// later steps send; the own block's last reduction lands in `own` instead. `in` may be `work`
// itself (contributions copied there first: then `own` is null and the block stays in work).
class ReduceScatterPlan : public Plan {
 public:
  ReduceScatterPlan(const char* in, char* work, char* own, Blocks blocks, DType dtype, ReduceOp op, int rank, int n,
                    size_t seg_bytes, std::vector<char>& scratch);
  size_t num_sends() const override { return size_t(n_ - 1) * k_; }
  size_t num_recvs() const override { return num_sends(); }
  ptrdiff_t send_after(size_t i) const override { return i < k_ ? -1 : ptrdiff_t(i - k_); }
  Span send_span(size_t i) override;
  Span recv_span(size_t i) override;
  void received(size_t i) override;
  // Shared memory: reduce straight from the transport's memory (same operands, same order).
  void deliver(size_t i, size_t offset, const char* src, size_t n) override;
  void delivered(size_t i) override;

 private:
  size_t send_block(size_t g) const;
  size_t recv_block(size_t g) const;
  // Where segment i's reduction goes: its block in work, or in `own` at the last step.
  char* target(size_t i) const;
  const char* in_;
  char* work_;
  char* own_;
  Blocks blocks_;
  DType dtype_;
  ReduceOp op_;
  int r_, n_;
  size_t esize_, seg_, k_;
  char* scratch_;
};

// Ring allgather of blocks already laid out in rank order in buf.
class AllgatherPlan : public Plan {
 public:
  AllgatherPlan(char* buf, Blocks blocks, int rank, int n, size_t seg_bytes);
  size_t num_sends() const override { return size_t(n_ - 1) * k_; }
  size_t num_recvs() const override { return num_sends(); }
  ptrdiff_t send_after(size_t i) const override { return i < k_ ? -1 : ptrdiff_t(i - k_); }
  Span send_span(size_t i) override;
  Span recv_span(size_t i) override;

 private:
  char* buf_;
  Blocks blocks_;
  int r_, n_;
  size_t seg_, k_;
};

// One step round the ring: this rank's bytes go to the next rank while the previous rank's
// arrive (a commit's copy for a buddy, say). The two sizes may differ; each must be what
// the other end of its link says, or the segments do not match.
class ShiftPlan : public Plan {
 public:
  ShiftPlan(const char* send, size_t send_bytes, char* recv, size_t recv_bytes, size_t seg_bytes);
  size_t num_sends() const override { return segments_for_(send_bytes_); }
  size_t num_recvs() const override { return segments_for_(recv_bytes_); }
  ptrdiff_t send_after(size_t) const override { return -1; }
  Span send_span(size_t i) override;
  Span recv_span(size_t i) override;

 private:
  size_t segments_for_(size_t bytes) const { return bytes == 0 ? 1 : (bytes + seg_ - 1) / seg_; }
  char* send_;
  size_t send_bytes_;
  char* recv_;
  size_t recv_bytes_, seg_;
};

// Pipelined chain from the root around the ring; the root's predecessor only receives.
class BroadcastPlan : public Plan {
 public:
  BroadcastPlan(char* buf, size_t bytes, int rank, int n, int root, size_t seg_bytes);
  size_t num_sends() const override { return is_last_ ? 0 : k_; }
  size_t num_recvs() const override { return is_root_ ? 0 : k_; }
  ptrdiff_t send_after(size_t i) const override { return is_root_ ? -1 : ptrdiff_t(i); }
  Span send_span(size_t i) override { return seg(i); }
  Span recv_span(size_t i) override { return seg(i); }

 private:
  Span seg(size_t i) const;
  char* buf_;
  size_t bytes_, seg_, k_;
  bool is_root_, is_last_;
};

}  // namespace ering
