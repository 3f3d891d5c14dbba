// The ring handshake: wire encoding of its four messages and the pure decision on a HELLO.
//
// Connector -> acceptor: HELLO  (job, world version, ranks, connector nonce)
// Acceptor -> connector: ACK    (status; on OK: acceptor nonce)
// Connector -> acceptor: PROOF  (MAC over HELLO and both nonces: the connector holds the secret)
// Acceptor -> connector: RESULT (status; on OK: the acceptor's MAC, else the reason)
// The acceptor judges the HELLO only after the PROOF checks out, so an unauthenticated
// peer learns nothing about the ring (not even the job id) and cannot park connections;
// a peer that holds the secret gets the precise reason (stale version, wrong rank, ...).
// Every message starts with a 12-byte header: magic "ERNG", protocol version,
// type, status, body length (big-endian). See native/README.md.
//
// Protocol 2 adds a channel to HELLO: one world version forms several rings (the flat
// ring, and for the hierarchical allreduce a ring of the ranks of one host and a ring of
// one leader per host), all through the same listener. The channel is inside the MAC,
// and each channel of a world version has its own expected predecessor and slot.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "auth.h"

namespace ering {

constexpr uint32_t kMagic = 0x45524E47;  // "ERNG"
constexpr uint16_t kProtocolVersion = 2;
constexpr size_t kHeaderBytes = 12;
constexpr size_t kMaxBodyBytes = 4096;
constexpr size_t kMaxJobIdBytes = 255;
constexpr size_t kNonceBytes = 16;

// The rings a communicator may form for one world version; a HELLO names one of them.
enum Channel : uint8_t { kChannelFlat = 0, kChannelLocal = 1, kChannelLeaders = 2 };
constexpr size_t kChannels = 3;
const char* channel_name(uint32_t channel);

// LINK and LINK_ACK follow an accepted handshake on the same connection: how the data of
// this link travels (TCP frames, or shared memory for a neighbour on the same host).
enum class MsgType : uint8_t { Hello = 1, Ack = 2, Proof = 3, Result = 4, Link = 5, LinkAck = 6 };
enum class Status : uint8_t { Ok = 0, NotReady = 1, Refused = 2 };

struct MsgHeader {
  MsgType type;
  Status status;
  uint32_t body_len;
};

struct Hello {
  std::string job_id;
  uint64_t world_version = 0;
  uint32_t from_rank = 0;
  uint32_t to_rank = 0;
  uint32_t world_size = 0;
  uint8_t channel = kChannelFlat;
  std::array<uint8_t, kNonceBytes> nonce{};
};

// Encodes a whole message (header + body).
std::vector<uint8_t> encode_message(MsgType type, Status status, const std::vector<uint8_t>& body);
std::vector<uint8_t> encode_hello_body(const Hello& h);

// Returns false with *why set when the 12 bytes are not a valid header of this protocol.
bool decode_header(const uint8_t* p, MsgHeader* out, std::string* why);
bool decode_hello_body(const uint8_t* p, size_t n, Hello* out, std::string* why);

// What the acceptor expects to be connected to right now.
struct Expectation {
  bool active = false;        // false until a communicator starts forming
  std::string job_id;
  std::string secret;
  uint64_t world_version = 0;
  uint32_t rank = 0;
  uint32_t world_size = 0;
  // Per channel: the ring predecessor expected on it, or -1 when this rank forms no such ring.
  std::array<int64_t, kChannels> prev_rank{{-1, -1, -1}};
  // Per channel: its predecessor of this world version is already connected.
  std::array<bool, kChannels> connected{{false, false, false}};
  bool retired = false;       // the communicator of this version is gone: refuse, don't park
};

enum class Verdict { Accept, Park, Refuse };

// Pure decision on an authenticated HELLO: Park (hold, unanswered) when this worker has
// not yet reached the peer's world version, so a fast neighbour does not have to retry.
Verdict judge_hello(const Hello& h, const Expectation& e, std::string* reason);

// MAC over the transcript; role distinguishes the two proofs so one cannot be replayed as the other.
Digest handshake_mac(const std::string& secret, const char* role, const std::vector<uint8_t>& hello_body,
                     const uint8_t* acceptor_nonce);

}  // namespace ering
