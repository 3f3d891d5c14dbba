// The registry of ring sockets and the fork handler that lets go of them in a child.
#include "transport/fork_guard.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <mutex>
#include <vector>

namespace ering {
namespace {

struct Guarded {
  int fd;
  dev_t dev;
  ino_t ino;
};

// Never destroyed: a fork may come while static destructors run at exit.
std::mutex& registry_mutex() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::vector<Guarded>& registry() {
  static auto* entries = new std::vector<Guarded>;
  return *entries;
}

// fstat is async-signal-safe: the child handler may use it.
bool still_ours(const Guarded& g) {
  struct stat st;
  return ::fstat(g.fd, &st) == 0 && st.st_dev == g.dev && st.st_ino == g.ino;
}

// The registry is held across fork(), so the child sees it whole (no half-done insertion).
void before_fork() { registry_mutex().lock(); }
void in_parent() { registry_mutex().unlock(); }
void in_child() {
  // Only async-signal-safe calls: the child of a threaded process may run nothing else.
  int null = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  if (null >= 0) {
    for (const Guarded& g : registry())
      if (still_ours(g)) ::dup3(null, g.fd, O_CLOEXEC);
    ::close(null);
  }
  registry().clear();  // none of them is the child's (no allocation: a vector keeps its capacity)
  registry_mutex().unlock();
}

}  // namespace

void guard_from_fork(int fd) {
  static std::once_flag installed;
  std::call_once(installed, [] {
    registry_mutex();  // made here, never for the first time in a child's handler
    registry();
    pthread_atfork(before_fork, in_parent, in_child);
  });
  struct stat st;
  if (::fstat(fd, &st) != 0) return;
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& entries = registry();
  // Entries of sockets closed since (their number now names another file, or nothing) go.
  entries.erase(std::remove_if(entries.begin(), entries.end(), [](const Guarded& g) { return !still_ours(g); }),
                entries.end());
  for (const Guarded& g : entries)
    if (g.fd == fd && g.dev == st.st_dev && g.ino == st.st_ino) return;  // guarded at accept or connect already
  entries.push_back({fd, st.st_dev, st.st_ino});
}

}  // namespace ering
