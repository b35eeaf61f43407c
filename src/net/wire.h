#pragma once
// The frame every byte stream transport (tcp, shm) puts in front of a message, and its validation.
// Little-endian, 32 bytes:
//   u32 magic 'CNDT' | u16 version | u16 type | u64 tag | u64 length | u32 src rank | u32 header checksum
// A frame is rejected (ProtocolError on that connection, never a crash) when the magic, version, type, tag kind,
// source rank or checksum is wrong, or when the length exceeds the limit (CONDUIT_MAX_MESSAGE_BYTES, default 16 GiB;
// abort frames at most 4 KiB; a hello's length is its job's world size, checked by the tcp handshake).
#include <cstdint>
#include <string>
#include <string_view>

namespace conduit::net {

inline constexpr uint32_t kFrameMagic = 0x54444e43u;  // "CNDT"
// 2: the lower rank answers each tcp hello (with its own, or an abort frame with the reason it refused); a build
// speaking 1 is refused at the handshake, naming both versions, instead of waiting for an answer that never comes.
// 3: a tcp hello (and its answer) carries the job's fingerprint in `tag` (a hash of every rank's published address,
// the same on each rank of one rendezvous) and its world size in `length` (no bytes follow a hello): a rank of
// another job or an earlier run that reaches this job's port is refused naming why, not adopted as a peer.
inline constexpr uint16_t kWireVersion = 3;
// kFrameShmRead: shm only (refused on tcp): a data message the receiver copies straight out of the sender's memory
// (process_vm_readv); the frame is followed by the sender's address and sequence number, not by the payload.
enum FrameType : uint16_t { kFrameData = 1, kFrameAbort = 2, kFrameHello = 3, kFrameShmRead = 4 };
inline constexpr uint64_t kMaxAbortReason = 4096;

struct FrameHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t type;
  uint64_t tag;
  uint64_t length;
  uint32_t src;
  uint32_t check;
};
static_assert(sizeof(FrameHeader) == 32);

uint32_t frame_checksum(const FrameHeader& h);
FrameHeader make_frame(FrameType type, uint64_t tag, uint64_t length, int src);
// Empty string when valid, else what is wrong (one line). `expected_src` is the peer the stream belongs to.
// `shm_read`: kFrameShmRead is allowed (the shm transport's rings).
std::string validate_frame(const FrameHeader& h, int expected_src, uint64_t max_length, bool shm_read = false);
uint64_t max_message_bytes();
// A transport's per-peer budget for messages that arrive before their receive, from environment variable `variable`
// (CONDUIT_TCP_UNEXPECTED_BYTES, CONDUIT_SHM_UNEXPECTED_BYTES): default 64M, 0 to 1T, else ConfigError naming it.
uint64_t unexpected_budget(const char* variable);
// The note (PeerNotes) a transport keeps while the messages from `peer` are held because the next one, `length` bytes
// of `tag`, has no receive and `buffered` bytes of earlier messages already wait for theirs: over `budget` (from
// `variable`), or 4x it while receives of other tags wait on that peer (`widened`).
std::string stall_note(const char* transport, int peer, uint64_t tag, uint64_t length, uint64_t buffered,
                       uint64_t budget, bool widened, const char* variable);
// Throws ConfigError when a message of `bytes` is over `limit` (max_message_bytes()): its receiver would refuse the
// frame and blame the sender.
void check_message_size(uint64_t bytes, uint64_t limit);
// A peer's abort reason as this rank reports it: one line whatever the peer sent (a line break or tab becomes a
// space, another control byte '?'; bytes past ASCII stay, as UTF-8 names in a reason).
std::string printable_reason(std::string_view reason);

}  // namespace conduit::net
