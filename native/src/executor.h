// Runs a communicator's operations on one background thread, in submission order, and
// fuses consecutive small async allreduces into one buffer.
//
// Fusion is deterministic: a bucket closes when the next tensor would not fit under the
// fusion threshold, has another dtype or op, or when anything waits or another
// collective is submitted. Every rank submits the same sequence, so every rank fuses the
// same way and no negotiation round is needed (Horovod needs one because it fuses by time).
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "communicator.h"

namespace ering {

class Work {
 public:
  void finish(std::exception_ptr error);
  void wait();  // rethrows the operation's error
  bool done();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

class Executor {
 public:
  // Shares ownership of comm so the communicator outlives the executor thread.
  Executor(std::shared_ptr<Communicator> comm, size_t fusion_bytes);
  ~Executor();  // aborting is the caller's job; this only stops the thread
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  std::shared_ptr<Work> allreduce_async(void* buf, size_t count, DType dtype, ReduceOp op);
  // Waits for w, first dispatching the bucket it sits in if that is still open.
  void wait(const std::shared_ptr<Work>& w);
  // Runs fn on the executor thread after everything submitted before it; rethrows its error.
  void run(std::function<void()> fn);
  void flush();
  void stop();

 private:
  struct Entry {
    char* buf;
    size_t count;
    DType dtype;
    ReduceOp op;
    std::shared_ptr<Work> work;
  };
  struct Job {
    std::vector<Entry> bucket;    // a fused allreduce, or
    std::function<void()> fn;     // any other operation
    std::shared_ptr<Work> work;   // for fn
  };
  void close_bucket_locked();
  void loop();
  void execute(Job& job);

  std::shared_ptr<Communicator> comm_;
  size_t fusion_bytes_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  std::vector<Entry> open_;
  size_t open_bytes_ = 0;
  bool stop_ = false;
  bool joined_ = false;
  std::mutex join_mu_;  // two concurrent stop() calls must not both join
  std::vector<char> fusion_buf_;
  std::thread thread_;
};

}  // namespace ering
