// The ring handshake: wire encoding of its four messages and the pure decision on a HELLO.
//
// Connector -> acceptor: HELLO  (job, world version, ranks, world digest, connector nonce)
// Acceptor -> connector: ACK    (status; on OK: acceptor nonce)
// Connector -> acceptor: PROOF  (MAC over HELLO and both nonces: the connector holds the secret)
// Acceptor -> connector: RESULT (status; on OK: the acceptor's MAC; on REFUSED: a refusal
//                                 code, the reason, and a MAC over both)
// The acceptor judges the HELLO only after the PROOF checks out, so an unauthenticated
// peer learns nothing about the ring (not even the job id) and cannot park connections;
// a peer that holds the secret gets the precise reason (stale version, wrong rank, ...).
// The connector acts on a refusal's code only when its MAC proves the acceptor holds the
// secret too: anyone listening at a neighbour's address can send words, not a verdict.
// Every message starts with a 12-byte header: magic "ERNG", protocol version,
// type, status, body length (big-endian). See native/README.md.
//
// Protocol 3 authenticates refusals (code + reason + MAC). Protocol 2 added a channel to HELLO: one world version forms several rings (the flat
// ring, and for the hierarchical allreduce a ring of the ranks of one host and a ring of
// one leader per host), all through the same listener. The channel is inside the MAC,
// and each channel of a world version has its own expected predecessor and slot.
//
// Protocol 4 adds the world digest to HELLO: 32 bytes that name the world's membership (the
// rendezvous server hashes every member's rank, worker id, host and ring address; a ring
// formed by hand from a full list hashes that list). A worker is told only its neighbours,
// not every member, so two workers holding different views of one world version (a server
// bug, a replica that answered from an older record) would otherwise agree on version, size
// and ranks and form a ring of two worlds. judge_hello refuses a HELLO whose digest is not
// the acceptor's (Refusal::OtherWorld) once version and size agree. The digest is inside the
// MAC like the rest of HELLO.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "transport/auth.h"

namespace ering {

constexpr uint32_t kMagic = 0x45524E47;  // "ERNG"
constexpr uint16_t kProtocolVersion = 4;
constexpr size_t kHeaderBytes = 12;
constexpr size_t kMaxBodyBytes = 4096;
constexpr size_t kMaxJobIdBytes = 255;
constexpr size_t kNonceBytes = 16;
constexpr size_t kWorldDigestBytes = 32;
using WorldDigest = std::array<uint8_t, kWorldDigestBytes>;

// The rings a communicator may form for one world version; a HELLO names one of them. The
// reverse ring joins the flat ring's ranks the other way round (each rank connects to its
// previous rank); a communicator forms it at its first shift_back().
enum Channel : uint8_t { kChannelFlat = 0, kChannelLocal = 1, kChannelLeaders = 2, kChannelReverse = 3 };
constexpr size_t kChannels = 4;
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
  WorldDigest world_digest{};  // names the members of world_version (see the top of this file)
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
  WorldDigest world_digest{};
  // Per channel: the ring predecessor expected on it, or -1 when this rank forms no such ring.
  std::array<int64_t, kChannels> prev_rank{{-1, -1, -1, -1}};
  // Per channel: its predecessor of this world version is already connected.
  std::array<bool, kChannels> connected{{false, false, false, false}};
  bool retired = false;       // the communicator of this version is gone: refuse, don't park
};

enum class Verdict { Accept, Park, Refuse };

// Why an acceptor refused, as the first byte of a RESULT REFUSED body. A connector trusts
// it only with a valid MAC (see decode_refusal); NotAuthenticated never carries one.
enum class Refusal : uint8_t {
  NotAuthenticated = 0,  // the connector's PROOF failed: it holds another secret (or another job's)
  OtherJob = 1,          // authenticated, but for another job id
  StaleVersion = 2,      // an older world version, or this worker's communicator for it is closed
  WorldSize = 3,         // the same world version with another size
  WrongRank = 4,         // meant for another rank, or not this ring's expected predecessor
  UnknownChannel = 5,    // a channel this protocol does not have
  NoSuchRing = 6,        // a ring this worker does not form at this world version: settings differ
  Duplicate = 7,         // the ring of this world version is already connected
  OtherWorld = 8,        // the same world version and size, another world digest: different views
};
constexpr uint8_t kMaxRefusal = uint8_t(Refusal::OtherWorld);

// Pure decision on an authenticated HELLO: Park (hold, unanswered) when this worker has
// not yet reached the peer's world version, so a fast neighbour does not have to retry.
// On Refuse, *code and *reason say why.
Verdict judge_hello(const Hello& h, const Expectation& e, Refusal* code, std::string* reason);

// MAC over the transcript (and `extra`, if given); role distinguishes the proofs and the
// refusal so that none can be replayed as another.
Digest handshake_mac(const std::string& secret, const char* role, const std::vector<uint8_t>& hello_body,
                     const uint8_t* acceptor_nonce, const std::vector<uint8_t>& extra = {});

// RESULT REFUSED body: u8 code | u16 reason length | reason | 32-byte MAC (role "refusal",
// over code, length and reason). `secret` null: an all-zero MAC (the acceptor could not
// authenticate the connector, so it proves nothing to it either).
std::vector<uint8_t> encode_refusal(const std::string* secret, const std::vector<uint8_t>& hello_body,
                                    const uint8_t* acceptor_nonce, Refusal code, const std::string& reason);
// Decodes a RESULT REFUSED body. Returns false when it is malformed. *authenticated says
// whether its MAC proves `secret`; only then is *code to be acted on.
bool decode_refusal(const std::vector<uint8_t>& body, const std::string& secret,
                    const std::vector<uint8_t>& hello_body, const uint8_t* acceptor_nonce, Refusal* code,
                    std::string* reason, bool* authenticated);

}  // namespace ering
