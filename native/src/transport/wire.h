// Big-endian integers of the handshake and link set-up messages: one writer and one reader
// per width, so every message is framed the same way.
#pragma once

#include <cstdint>
#include <vector>

namespace ering {

inline void put_u16(std::vector<uint8_t>& b, uint16_t v) { b.push_back(uint8_t(v >> 8)); b.push_back(uint8_t(v)); }
inline void put_u32(std::vector<uint8_t>& b, uint32_t v) {
  for (int i = 3; i >= 0; --i) b.push_back(uint8_t(v >> (8 * i)));
}
inline void put_u64(std::vector<uint8_t>& b, uint64_t v) {
  for (int i = 7; i >= 0; --i) b.push_back(uint8_t(v >> (8 * i)));
}
inline uint16_t get_u16(const uint8_t* p) { return uint16_t(uint16_t(p[0]) << 8 | p[1]); }
inline uint32_t get_u32(const uint8_t* p) {
  return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3];
}
inline uint64_t get_u64(const uint8_t* p) { return uint64_t(get_u32(p)) << 32 | get_u32(p + 4); }

}  // namespace ering
