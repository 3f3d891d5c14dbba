// Encoding, decoding and judging of ring handshake messages; no sockets here.
#include "transport/handshake.h"

#include <algorithm>
#include <cstring>

#include "base/common.h"
#include "transport/wire.h"

namespace ering {
namespace {

constexpr size_t kHelloFixed = 8 + 4 + 4 + 4 + 1 + kWorldDigestBytes + kNonceBytes + 2;

}  // namespace

const char* channel_name(uint32_t channel) {
  switch (channel) {
    case kChannelFlat: return "ring";
    case kChannelLocal: return "host-local ring";
    case kChannelLeaders: return "leaders' ring";
    case kChannelReverse: return "reverse ring";
  }
  return "unknown ring";
}

std::vector<uint8_t> encode_message(MsgType type, Status status, const std::vector<uint8_t>& body) {
  std::vector<uint8_t> b;
  b.reserve(kHeaderBytes + body.size());
  put_u32(b, kMagic);
  put_u16(b, kProtocolVersion);
  b.push_back(uint8_t(type));
  b.push_back(uint8_t(status));
  put_u32(b, uint32_t(body.size()));
  b.insert(b.end(), body.begin(), body.end());
  return b;
}

std::vector<uint8_t> encode_hello_body(const Hello& h) {
  std::vector<uint8_t> b;
  put_u64(b, h.world_version);
  put_u32(b, h.from_rank);
  put_u32(b, h.to_rank);
  put_u32(b, h.world_size);
  b.push_back(h.channel);
  b.insert(b.end(), h.world_digest.begin(), h.world_digest.end());
  b.insert(b.end(), h.nonce.begin(), h.nonce.end());
  put_u16(b, uint16_t(h.job_id.size()));
  b.insert(b.end(), h.job_id.begin(), h.job_id.end());
  return b;
}

bool decode_header(const uint8_t* p, MsgHeader* out, std::string* why) {
  if (get_u32(p) != kMagic) { *why = "not an elastic-ring handshake (bad magic)"; return false; }
  uint16_t proto = get_u16(p + 4);
  if (proto != kProtocolVersion) {
    *why = "unsupported ring protocol version " + std::to_string(proto) + " (this build speaks " +
           std::to_string(kProtocolVersion) + ")";
    return false;
  }
  uint8_t type = p[6], status = p[7];
  if (type < uint8_t(MsgType::Hello) || type > uint8_t(MsgType::LinkAck)) {
    *why = "unknown handshake message type " + std::to_string(type);
    return false;
  }
  if (status > uint8_t(Status::Refused)) { *why = "unknown handshake status " + std::to_string(status); return false; }
  uint32_t len = get_u32(p + 8);
  if (len > kMaxBodyBytes) { *why = "handshake message too long (" + std::to_string(len) + " bytes)"; return false; }
  *out = MsgHeader{MsgType(type), Status(status), len};
  return true;
}

bool decode_hello_body(const uint8_t* p, size_t n, Hello* out, std::string* why) {
  if (n < kHelloFixed) { *why = "HELLO too short"; return false; }
  out->world_version = get_u64(p);
  out->from_rank = get_u32(p + 8);
  out->to_rank = get_u32(p + 12);
  out->world_size = get_u32(p + 16);
  out->channel = p[20];
  std::memcpy(out->world_digest.data(), p + 21, kWorldDigestBytes);
  std::memcpy(out->nonce.data(), p + 21 + kWorldDigestBytes, kNonceBytes);
  size_t job_len = get_u16(p + 21 + kWorldDigestBytes + kNonceBytes);
  if (job_len > kMaxJobIdBytes || kHelloFixed + job_len != n) { *why = "HELLO has an invalid job id length"; return false; }
  out->job_id.assign(reinterpret_cast<const char*>(p + kHelloFixed), job_len);
  return true;
}

Verdict judge_hello(const Hello& h, const Expectation& e, Refusal* code, std::string* reason) {
  auto refuse = [&](Refusal c, std::string why) {
    *code = c;
    *reason = std::move(why);
    return Verdict::Refuse;
  };
  if (!e.active) return Verdict::Park;
  if (h.job_id != e.job_id)
    return refuse(Refusal::OtherJob, "job mismatch: this worker is in job '" + printable(e.job_id) +
                                         "', the peer is in job '" + printable(h.job_id) + "'");
  if (h.world_version < e.world_version || (e.retired && h.world_version == e.world_version))
    return refuse(Refusal::StaleVersion, "stale world version " + std::to_string(h.world_version) +
                                             ": this worker is at world version " + std::to_string(e.world_version) +
                                             (e.retired ? " (closed)" : ""));
  if (h.world_version > e.world_version) return Verdict::Park;
  if (h.world_size != e.world_size)
    return refuse(Refusal::WorldSize, "world size mismatch at world version " + std::to_string(h.world_version) +
                                          ": peer says " + std::to_string(h.world_size) + ", this worker " +
                                          std::to_string(e.world_size));
  if (h.world_digest != e.world_digest)
    return refuse(Refusal::OtherWorld, "world digest mismatch at world version " + std::to_string(h.world_version) +
                                           ": the peer was told other members of this world than this worker "
                                           "(views of two different worlds under one version)");
  if (h.to_rank != e.rank)
    return refuse(Refusal::WrongRank, "connection meant for rank " + std::to_string(h.to_rank) + " reached rank " +
                                          std::to_string(e.rank));
  if (h.channel >= kChannels) return refuse(Refusal::UnknownChannel, "unknown ring channel " + std::to_string(h.channel));
  int64_t want = e.prev_rank[h.channel];
  if (want < 0) {
    // Every rank derives the rings from the same world, so only different settings get here.
    return refuse(Refusal::NoSuchRing, std::string("this worker forms no ") + channel_name(h.channel) +
                                           " at world version " + std::to_string(h.world_version) + " (channel " +
                                           std::to_string(h.channel) + "): " +
                                           (h.channel == kChannelReverse
                                                ? "does every worker run the same elastic-ring version?"
                                                : "is ELASTIC_ALLREDUCE_ALGORITHM the same on every worker?"));
  }
  if (int64_t(h.from_rank) != want)
    return refuse(Refusal::WrongRank, "rank " + std::to_string(h.from_rank) + " is not this worker's " +
                                          channel_name(h.channel) + " predecessor (expected rank " +
                                          std::to_string(want) + ")");
  return Verdict::Accept;
}

Digest handshake_mac(const std::string& secret, const char* role, const std::vector<uint8_t>& hello_body,
                     const uint8_t* acceptor_nonce, const std::vector<uint8_t>& extra) {
  std::vector<uint8_t> t;
  const char* label = "elastic-ring handshake v3:";
  t.insert(t.end(), label, label + std::strlen(label));
  t.insert(t.end(), role, role + std::strlen(role));
  t.push_back(0);
  t.insert(t.end(), hello_body.begin(), hello_body.end());
  t.insert(t.end(), acceptor_nonce, acceptor_nonce + kNonceBytes);
  t.insert(t.end(), extra.begin(), extra.end());
  return hmac_sha256(secret, t.data(), t.size());
}

namespace {
constexpr size_t kDigestBytes = sizeof(Digest);
constexpr size_t kRefusalFixed = 1 + 2;
constexpr size_t kMaxReasonBytes = kMaxBodyBytes - kRefusalFixed - kDigestBytes;
}  // namespace

std::vector<uint8_t> encode_refusal(const std::string* secret, const std::vector<uint8_t>& hello_body,
                                    const uint8_t* acceptor_nonce, Refusal code, const std::string& reason) {
  std::string text = reason.substr(0, kMaxReasonBytes);
  std::vector<uint8_t> b;
  b.push_back(uint8_t(code));
  put_u16(b, uint16_t(text.size()));
  b.insert(b.end(), text.begin(), text.end());
  Digest mac{};
  if (secret) mac = handshake_mac(*secret, "refusal", hello_body, acceptor_nonce, b);
  b.insert(b.end(), mac.begin(), mac.end());
  return b;
}

bool decode_refusal(const std::vector<uint8_t>& body, const std::string& secret,
                    const std::vector<uint8_t>& hello_body, const uint8_t* acceptor_nonce, Refusal* code,
                    std::string* reason, bool* authenticated) {
  *authenticated = false;
  if (body.size() < kRefusalFixed + kDigestBytes) return false;
  size_t len = get_u16(body.data() + 1);
  if (kRefusalFixed + len + kDigestBytes != body.size() || body[0] > kMaxRefusal) return false;
  *code = Refusal(body[0]);
  reason->assign(reinterpret_cast<const char*>(body.data() + kRefusalFixed), len);
  std::vector<uint8_t> signed_part(body.begin(), body.begin() + long(kRefusalFixed + len));
  Digest want = handshake_mac(secret, "refusal", hello_body, acceptor_nonce, signed_part);
  *authenticated = digest_equal(body.data() + kRefusalFixed + len, want.data(), want.size());
  return true;
}

}  // namespace ering
