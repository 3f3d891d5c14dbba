// HMAC-SHA256 for the ring handshake, so the core needs no crypto library.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace ering {

using Digest = std::array<uint8_t, 32>;

Digest sha256(const void* data, size_t len);
Digest hmac_sha256(const std::string& key, const void* data, size_t len);
// Compares without an early exit so response time does not leak how many bytes matched.
bool digest_equal(const uint8_t* a, const uint8_t* b, size_t len);
// Fills buf from the kernel's CSPRNG (getrandom); throws if it cannot.
void random_bytes(uint8_t* buf, size_t len);

}  // namespace ering
