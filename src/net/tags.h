#pragma once
// Tag layout shared by every transport and the collectives:
//   bits 56..63  kind (kCollective, kUser, kDebug, kControl); any other value is a ProtocolError
//   bits 32..55  communicator id (24 bits)
//   bits  0..31  operation sequence number (collectives) or the user's tag (send/recv)
#include <cstdint>

namespace conduit::net {

enum TagKind : uint8_t { kCollective = 1, kUser = 2, kDebug = 3, kControl = 4 };

inline constexpr uint64_t make_tag(TagKind kind, uint32_t comm_id, uint32_t low) {
  return (static_cast<uint64_t>(kind) << 56) | (static_cast<uint64_t>(comm_id & 0xffffffu) << 32) | low;
}
inline constexpr uint8_t tag_kind(uint64_t tag) { return static_cast<uint8_t>(tag >> 56); }
inline constexpr bool tag_valid(uint64_t tag) {
  uint8_t k = tag_kind(tag);
  return k >= kCollective && k <= kControl;
}

}  // namespace conduit::net
