#include "net/wire.h"

#include <fmt/format.h>

#include "core/env.h"
#include "core/error.h"
#include "net/tags.h"

namespace conduit::net {

uint32_t frame_checksum(const FrameHeader& h) {
  // FNV-1a over the fields before `check`.
  const auto* p = reinterpret_cast<const unsigned char*>(&h);
  uint32_t x = 2166136261u;
  for (size_t i = 0; i < offsetof(FrameHeader, check); ++i) x = (x ^ p[i]) * 16777619u;
  return x;
}

FrameHeader make_frame(FrameType type, uint64_t tag, uint64_t length, int src) {
  FrameHeader h{kFrameMagic, kWireVersion, type, tag, length, static_cast<uint32_t>(src), 0};
  h.check = frame_checksum(h);
  return h;
}

std::string validate_frame(const FrameHeader& h, int expected_src, uint64_t max_length, bool shm_read) {
  if (h.magic != kFrameMagic) return fmt::format("bad frame magic {:#010x} (expected {:#010x})", h.magic, kFrameMagic);
  if (h.version != kWireVersion) return fmt::format("unsupported wire version {} (this build speaks {})", h.version, kWireVersion);
  if (h.check != frame_checksum(h)) return "frame header checksum mismatch (corrupted header)";
  if (h.type != kFrameData && h.type != kFrameAbort && h.type != kFrameHello && !(shm_read && h.type == kFrameShmRead))
    return fmt::format("unknown frame type {} (allowed 1..{})", h.type, shm_read ? 4 : 3);
  if ((h.type == kFrameData || h.type == kFrameShmRead) && !tag_valid(h.tag))
    return fmt::format("invalid tag {:#x} (unknown tag kind)", h.tag);
  if (expected_src >= 0 && h.src != static_cast<uint32_t>(expected_src))
    return fmt::format("frame claims source rank {} on the connection of rank {}", h.src, expected_src);
  if (h.type == kFrameHello) return {};  // (its length is the world size, no payload: the handshake checks it)
  uint64_t limit = h.type == kFrameAbort ? kMaxAbortReason : max_length;
  if (h.length > limit) return fmt::format("frame length {} exceeds the limit of {} bytes", h.length, limit);
  return {};
}

uint64_t max_message_bytes() {
  static const uint64_t v = [] {
    auto s = env_string("CONDUIT_MAX_MESSAGE_BYTES");
    if (!s) return uint64_t{16} << 30;
    const uint64_t b = parse_bytes(*s, "CONDUIT_MAX_MESSAGE_BYTES", "a size from 2M to 1T");
    // Below 2 MiB, the runtime's own start-up messages (the 1 MiB link measurement) would not fit.
    if (b < (uint64_t{2} << 20) || b > (uint64_t{1} << 40))
      throw ConfigError(
          fmt::format("environment variable CONDUIT_MAX_MESSAGE_BYTES='{}' is invalid: expected a size "
                      "from 2M to 1T",
                      *s));
    return b;
  }();
  return v;
}

uint64_t unexpected_budget(const char* variable) {
  auto s = env_string(variable);
  if (!s) return uint64_t{64} << 20;
  const uint64_t v = parse_bytes(*s, variable, "0 to 1T");
  if (v > (uint64_t{1} << 40)) throw ConfigError(fmt::format("{}={} is more than 1T; allowed: 0 to 1T", variable, *s));
  return v;
}

std::string stall_note(const char* transport, int peer, uint64_t tag, uint64_t length, uint64_t buffered,
                       uint64_t budget, bool widened, const char* variable) {
  return fmt::format(
      "{}: the messages from rank {} are held: its next message ({} bytes, tag {:#x}) has no receive posted and {} "
      "bytes of its earlier messages already wait for their receives, the most {}={}{} allows; the messages sent after "
      "it wait behind it unread. Post the receives of the earlier messages first, or raise {}",
      transport, peer, length, tag, buffered, variable, budget,
      widened ? " (x4 while receives of other tags wait)" : "", variable);
}

void check_message_size(uint64_t bytes, uint64_t limit) {
  // A ConfigError, not an InvalidArgument: raised inside an operation on the sending rank only, it must abort the
  // transport so that the receiving ranks fail at once rather than at their deadline.
  if (bytes > limit)
    throw ConfigError(fmt::format("a message of {} bytes is over CONDUIT_MAX_MESSAGE_BYTES = {} (every rank refuses "
                                  "frames above its own setting; raise it, up to 1T, on every rank)",
                                  bytes, limit));
}

std::string printable_reason(std::string_view reason) {
  std::string out(reason);
  for (char& ch : out) {
    const auto b = static_cast<unsigned char>(ch);
    if (ch == '\n' || ch == '\r' || ch == '\t')
      ch = ' ';
    else if (b < 0x20 || b == 0x7f)
      ch = '?';
  }
  return out;
}

}  // namespace conduit::net
