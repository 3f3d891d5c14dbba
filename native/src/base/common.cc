// Names of the shared vocabulary, and peer-supplied strings made safe to print.
#include "base/common.h"

#include <algorithm>

namespace ering {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::Float16: case DType::BFloat16: return 2;
    case DType::Float32: case DType::Int32: return 4;
    case DType::Float64: case DType::Int64: return 8;
    case DType::UInt8: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
    case DType::UInt8: return "uint8";
  }
  return "?";
}

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Average: return "average";
    case ReduceOp::Min: return "min";
    case ReduceOp::Max: return "max";
  }
  return "?";
}

std::string printable(const std::string& s, size_t max_bytes) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  size_t n = std::min(s.size(), max_bytes);
  for (size_t i = 0; i < n; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '\\') {
      out += "\\\\";
    } else if (c >= 0x20 && c < 0x7f) {
      out += char(c);
    } else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  if (s.size() > max_bytes) out += "...(" + std::to_string(s.size()) + " bytes)";
  return out;
}

}  // namespace ering
