// Throughput of the reduction kernels, per dtype and op, on 64 MiB buffers.
// Build and run (from the repository root):
//   g++ -O3 -std=c++17 -Wno-psabi -Inative/src native/bench/reduce_bench.cc native/src/reduce.cc native/src/base/common.cc -o /tmp/reduce_bench && /tmp/reduce_bench
#include "reduce.h"
#include <chrono>
#include <cstdio>
#include <vector>
using namespace ering;
int main() {
  const size_t bytes = 64 << 20;
  std::vector<char> a(bytes, 0), b(bytes, 0); for (size_t i = 0; i + 1 < bytes; i += 2) { a[i+1] = 0x3c; b[i+1] = 0x3c; }
  for (int t = 0; t <= 6; ++t) for (int op : {0, 2}) {
    DType d = DType(t); size_t n = bytes / dtype_size(d);
    reduce_into(a.data(), b.data(), n, d, ReduceOp(op));
    auto s = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) reduce_into(a.data(), b.data(), n, d, ReduceOp(op));
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count() / 10;
    printf("%-9s %-4s %6.2f GB/s (dst bytes per second)\n", dtype_name(d), op_name(ReduceOp(op)), bytes / dt / 1e9);
  }
}
