// The executor thread: a queue of fused allreduce buckets and other operations.
#include "executor.h"

#include <cstring>

#include "reduce.h"

namespace ering {

void Work::finish(std::exception_ptr error) {
  std::lock_guard<std::mutex> g(mu_);
  error_ = error;
  done_ = true;
  cv_.notify_all();
}

void Work::wait() {
  std::unique_lock<std::mutex> g(mu_);
  // No deadline here on purpose: every operation underneath has one (the communicator's
  // timeout and abort), so the work always finishes.
  cv_.wait(g, [&] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

bool Work::done() {
  std::lock_guard<std::mutex> g(mu_);
  return done_;
}

Executor::Executor(std::shared_ptr<Communicator> comm, size_t fusion_bytes)
    : comm_(std::move(comm)), fusion_bytes_(fusion_bytes) {
  thread_ = std::thread([this] { loop(); });
}

Executor::~Executor() { stop(); }

void Executor::stop() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!stop_) {
      close_bucket_locked();  // queued work still runs (and fails fast on an aborted ring)
      stop_ = true;
      cv_.notify_all();
    }
  }
  std::lock_guard<std::mutex> j(join_mu_);
  if (!joined_ && thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
    thread_.join();
    joined_ = true;
  }
}

void Executor::close_bucket_locked() {
  if (open_.empty()) return;
  Job j;
  j.bucket = std::move(open_);
  open_.clear();
  open_bytes_ = 0;
  queue_.push_back(std::move(j));
  cv_.notify_all();
}

std::shared_ptr<Work> Executor::allreduce_async(void* buf, size_t count, DType dtype, ReduceOp op) {
  auto w = std::make_shared<Work>();
  const size_t bytes = count * dtype_size(dtype);
  std::lock_guard<std::mutex> g(mu_);
  if (stop_) throw CommError(ErrorKind::Aborted, "allreduce_async: communicator is closed", "allreduce");
  if (!open_.empty() && (open_.front().dtype != dtype || open_.front().op != op || open_bytes_ + bytes > fusion_bytes_))
    close_bucket_locked();
  open_.push_back({static_cast<char*>(buf), count, dtype, op, w});
  open_bytes_ += bytes;
  if (open_bytes_ >= fusion_bytes_) close_bucket_locked();
  return w;
}

void Executor::flush() {
  std::lock_guard<std::mutex> g(mu_);
  close_bucket_locked();
}

void Executor::wait(const std::shared_ptr<Work>& w) {
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& e : open_)
      if (e.work == w) { close_bucket_locked(); break; }
  }
  w->wait();
}

void Executor::run(std::function<void()> fn) {
  auto w = std::make_shared<Work>();
  {
    std::lock_guard<std::mutex> g(mu_);
    if (stop_) throw CommError(ErrorKind::Aborted, "communicator is closed");
    close_bucket_locked();
    Job j;
    j.fn = std::move(fn);
    j.work = w;
    queue_.push_back(std::move(j));
    cv_.notify_all();
  }
  w->wait();
}

void Executor::loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait(g, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    execute(job);
  }
}

void Executor::execute(Job& job) {
  if (job.fn) {
    std::exception_ptr err;
    try { job.fn(); } catch (...) { err = std::current_exception(); }
    job.work->finish(err);
    return;
  }
  std::exception_ptr err;
  try {
    auto& b = job.bucket;
    if (b.size() == 1) {
      comm_->allreduce(b[0].buf, b[0].count, b[0].dtype, b[0].op);
    } else {
      const size_t esize = dtype_size(b[0].dtype);
      size_t total = 0;
      for (auto& e : b) total += e.count;
      if (fusion_buf_.size() < total * esize) fusion_buf_.resize(total * esize);
      size_t at = 0;
      for (auto& e : b) { std::memcpy(fusion_buf_.data() + at, e.buf, e.count * esize); at += e.count * esize; }
      comm_->allreduce(fusion_buf_.data(), total, b[0].dtype, b[0].op);
      at = 0;
      for (auto& e : b) { std::memcpy(e.buf, fusion_buf_.data() + at, e.count * esize); at += e.count * esize; }
    }
  } catch (...) {
    err = std::current_exception();
  }
  for (auto& e : job.bucket) e.work->finish(err);
}

}  // namespace ering
