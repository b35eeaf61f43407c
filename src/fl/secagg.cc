// Secure aggregation (Bonawitz et al., CCS 2017), semi-honest variant; see secagg.h for the protocol, the bytes on
// the wire and the security decisions.
#include "fl/secagg.h"

#include <sodium.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>

#include "core/log.h"
#include "fl/log_choose.h"

namespace conduit::fl {
namespace {

constexpr uint8_t kVersion = 1;
constexpr uint8_t kTagAdvertise = 0xA1;
constexpr uint8_t kTagShare = 0xA2;
constexpr uint8_t kTagUnmask = 0xA3;
constexpr size_t kSharePlainBytes = 4 + 4 + 32 + 32;
constexpr uint32_t kGfPoly = 0x1100B;  // x^16 + x^12 + x^3 + x + 1

static_assert(kShareCiphertextBytes == crypto_aead_xchacha20poly1305_ietf_NPUBBYTES + kSharePlainBytes +
                                           crypto_aead_xchacha20poly1305_ietf_ABYTES);
static_assert(crypto_scalarmult_BYTES == 32 && crypto_scalarmult_SCALARBYTES == 32);
static_assert(crypto_stream_chacha20_KEYBYTES == 32 && crypto_stream_chacha20_NONCEBYTES == 8);

const uint8_t kSelfMaskNonce[8] = {'s', 'e', 'l', 'f', 'm', 'a', 's', 'k'};
const uint8_t kPairMaskNonce[8] = {'p', 'a', 'i', 'r', 'm', 'a', 's', 'k'};
constexpr std::string_view kEncDomain = "conduit.secagg.v1.enc";
constexpr std::string_view kMaskDomain = "conduit.secagg.v1.mask";
constexpr std::string_view kAdDomain = "conduit.secagg.v1.share";
constexpr std::string_view kGraphDomain = "conduit.secagg.v1.graph";

using Key = std::array<uint8_t, 32>;

template <class... A>
std::string cat(const A&... a) {
  std::ostringstream os;
  (os << ... << a);
  return os.str();
}

std::string id_list(const std::vector<int>& ids) {
  std::ostringstream os;
  os << '{';
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i == 8) {
      os << ", ... (" << ids.size() << " in all)";
      break;
    }
    os << (i ? ", " : "") << ids[i];
  }
  os << '}';
  return os.str();
}

void ensure_sodium() {
  static const int rc = sodium_init();  // thread-safe static initialisation; 0 or 1 is success
  if (rc < 0) throw Error("secagg: sodium_init() failed; libsodium is unusable here (no entropy source?)");
}

void wipe(Key& k) { sodium_memzero(k.data(), k.size()); }

uint32_t mask_of(int bits) { return bits >= 32 ? 0xFFFFFFFFu : ((uint32_t{1} << bits) - 1u); }

void put_u32(std::vector<uint8_t>& b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void put_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t get_u32(const uint8_t* p) {
  return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
}

uint32_t wire_id(int id, const char* what) {
  if (id < 0 || id >= kMaxClients)
    throw InvalidArgument(cat(what, ": client id ", id, " cannot be serialized; allowed 0..", kMaxClients - 1));
  return static_cast<uint32_t>(id);
}

// Bounds-checked little-endian reader; every failure is a ProtocolError naming the message and field.
class Reader {
 public:
  Reader(const uint8_t* p, size_t n, const char* msg) : p_(p), n_(n), msg_(msg) {
    if (n_ && !p_) throw InvalidArgument(cat(msg_, "::parse: null buffer with ", n_, " bytes"));
  }
  void need(size_t k, const char* field) const {
    if (n_ - off_ < k)
      throw ProtocolError(cat(msg_, ": truncated (", n_, " bytes): ", field, " needs ", k, " bytes at offset ", off_,
                              ", only ", n_ - off_, " left"));
  }
  uint8_t u8(const char* field) {
    need(1, field);
    return p_[off_++];
  }
  uint32_t u32(const char* field) {
    need(4, field);
    uint32_t v = get_u32(p_ + off_);
    off_ += 4;
    return v;
  }
  void bytes(uint8_t* out, size_t k, const char* field) {
    need(k, field);
    std::memcpy(out, p_ + off_, k);
    off_ += k;
  }
  int id(const char* field, int num_clients) {
    uint32_t v = u32(field);
    if (v >= static_cast<uint32_t>(num_clients))
      throw ProtocolError(cat(msg_, ": ", field, " ", v, " out of range; allowed 0..", num_clients - 1));
    return static_cast<int>(v);
  }
  void header(uint8_t tag) {
    uint8_t t = u8("tag");
    if (t != tag) throw ProtocolError(cat(msg_, ": tag 0x", std::hex, int(t), " is not this message's 0x", int(tag)));
    uint8_t v = u8("version");
    if (v != kVersion)
      throw ProtocolError(cat(msg_, ": version ", int(v), " unsupported; this build speaks ", int(kVersion)));
  }
  size_t left() const { return n_ - off_; }
  void done() const {
    if (off_ != n_)
      throw ProtocolError(cat(msg_, ": ", n_ - off_, " trailing bytes after the message (", n_, " bytes in all)"));
  }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t off_ = 0;
  const char* msg_;
};

int checked_num_clients(int num_clients) {
  if (num_clients < 1 || num_clients > kMaxClients)
    throw InvalidArgument(cat("secagg parse: num_clients=", num_clients, " out of range; allowed 1..", kMaxClients));
  return num_clients;
}

// ---- key agreement, PRG ------------------------------------------------------------------------------------------

// X25519(sk, peer_pk) hashed (BLAKE2b-256) with a domain, the round and both parties' ids and public keys (lower id
// first), so both sides derive the same key and no key is reused across rounds or purposes. False if the peer's key
// is a low-order point (all-zero shared secret).
bool agree(Key& out, std::string_view domain, uint64_t round_id, const uint8_t* sk, int self_id, const uint8_t* self_pk,
           int peer_id, const uint8_t* peer_pk) {
  Key point;
  if (crypto_scalarmult(point.data(), sk, peer_pk) != 0) {
    wipe(point);
    return false;
  }
  const bool self_low = self_id < peer_id;
  uint8_t hdr[16];
  put_u64(hdr, round_id);
  put_u32(hdr + 8, static_cast<uint32_t>(self_low ? self_id : peer_id));
  put_u32(hdr + 12, static_cast<uint32_t>(self_low ? peer_id : self_id));
  crypto_generichash_state st;
  crypto_generichash_init(&st, nullptr, 0, out.size());
  crypto_generichash_update(&st, reinterpret_cast<const uint8_t*>(domain.data()), domain.size());
  crypto_generichash_update(&st, hdr, sizeof hdr);
  crypto_generichash_update(&st, self_low ? self_pk : peer_pk, 32);
  crypto_generichash_update(&st, self_low ? peer_pk : self_pk, 32);
  crypto_generichash_update(&st, point.data(), point.size());
  crypto_generichash_final(&st, out.data(), out.size());
  sodium_memzero(&st, sizeof st);
  wipe(point);
  return true;
}

// y[i] += (or -=) the i-th little-endian uint32 of the ChaCha20 keystream (key, nonce), mod 2^32 (callers mask to
// bits at the end: mod 2^bits is a quotient of mod 2^32). Streams in 4 KiB chunks (64-bit block counter).
void apply_prg(uint32_t* y, size_t n, const Key& key, const uint8_t nonce[8], bool subtract) {
  constexpr size_t kChunk = 1024;  // elements; 4096 bytes = 64 ChaCha20 blocks
  static const uint8_t kZeros[kChunk * 4] = {};
  alignas(64) uint8_t buf[kChunk * 4];
  for (size_t off = 0; off < n; off += kChunk) {
    const size_t m = std::min(kChunk, n - off);
    crypto_stream_chacha20_xor_ic(buf, kZeros, m * 4, nonce, static_cast<uint64_t>(off / 16), key.data());
    uint32_t* dst = y + off;
    if (subtract) {
      for (size_t i = 0; i < m; ++i) dst[i] -= get_u32(buf + 4 * i);
    } else {
      for (size_t i = 0; i < m; ++i) dst[i] += get_u32(buf + 4 * i);
    }
  }
  sodium_memzero(buf, sizeof buf);
}

// ---- the communication graph (SecAgg+) -----------------------------------------------------------------------------

// Complete (half == 0), or the Harary graph H(2 * half, n) on a ring whose order is a permutation of the ids drawn
// (Fisher-Yates) from ChaCha20 keyed by BLAKE2b(domain, round_id, n, k, graph_seed): every party derives the same
// graph.
class Graph {
 public:
  explicit Graph(const SecAggConfig& cfg) : n_(cfg.num_clients), half_(cfg.neighbors / 2) {
    if (complete()) return;
    uint8_t in[16];
    put_u64(in, cfg.round_id);
    put_u32(in + 8, static_cast<uint32_t>(n_));
    put_u32(in + 12, static_cast<uint32_t>(cfg.neighbors));
    Key key;
    crypto_generichash_state st;
    crypto_generichash_init(&st, nullptr, 0, key.size());
    crypto_generichash_update(&st, reinterpret_cast<const uint8_t*>(kGraphDomain.data()), kGraphDomain.size());
    crypto_generichash_update(&st, in, sizeof in);
    crypto_generichash_update(&st, cfg.graph_seed.data(), cfg.graph_seed.size());
    crypto_generichash_final(&st, key.data(), key.size());
    std::vector<uint8_t> rnd(8 * size_t(n_));
    static const uint8_t kNonce[8] = {};
    crypto_stream_chacha20(rnd.data(), rnd.size(), kNonce, key.data());
    at_.resize(size_t(n_));
    for (int i = 0; i < n_; ++i) at_[size_t(i)] = i;
    for (int i = n_ - 1; i > 0; --i) {  // (64-bit little-endian draws: the modulo bias is below 2^-48)
      const uint8_t* d = rnd.data() + 8 * size_t(i);
      const uint64_t r = uint64_t{get_u32(d)} | (uint64_t{get_u32(d + 4)} << 32);
      std::swap(at_[size_t(i)], at_[size_t(r % uint64_t(i + 1))]);
    }
    pos_.resize(size_t(n_));
    for (int i = 0; i < n_; ++i) pos_[size_t(at_[size_t(i)])] = i;
  }
  bool complete() const { return half_ == 0; }
  int group() const { return complete() ? n_ : 2 * half_ + 1; }
  // u and v (ids in range) are one client or neighbours.
  bool close(int u, int v) const {
    if (complete()) return true;
    const int d = std::abs(pos_[size_t(u)] - pos_[size_t(v)]);
    return std::min(d, n_ - d) <= half_;
  }
  // N[u], sorted (u included).
  std::vector<int> closed(int u) const {
    std::vector<int> out;
    if (complete()) {
      out.resize(size_t(n_));
      for (int i = 0; i < n_; ++i) out[size_t(i)] = i;
      return out;
    }
    const int p = pos_[size_t(u)];
    for (int d = -half_; d <= half_; ++d) out.push_back(at_[size_t(((p + d) % n_ + n_) % n_)]);
    std::sort(out.begin(), out.end());
    return out;
  }
  // How many members of the sorted set are in N[u] (u counted if in the set); no copy for the complete graph.
  size_t count_closed_in(int u, const std::vector<int>& set) const {
    if (complete()) return set.size();
    size_t k = 0;
    for (int v : closed(u)) k += std::binary_search(set.begin(), set.end(), v) ? 1 : 0;
    return k;
  }
  // The members of the sorted set that are in N[u] (u included if in the set), sorted.
  std::vector<int> closed_in(int u, const std::vector<int>& set) const {
    if (complete()) return set;
    std::vector<int> out;
    for (int v : closed(u))
      if (std::binary_search(set.begin(), set.end(), v)) out.push_back(v);
    return out;
  }
  // The largest subset of the sorted set in which every member has at least t members of its closed neighbourhood
  // (repeatedly dropping those with fewer). The complete graph keeps the set.
  std::vector<int> prune(const std::vector<int>& set, int t) const {
    if (complete()) return set;
    std::vector<char> in(size_t(n_), 0);
    for (int v : set) in[size_t(v)] = 1;
    std::vector<int> count(size_t(n_), 0), gone;
    for (int v : set)  // every count first: a removal is subtracted below, once
      for (int w : closed(v)) count[size_t(v)] += in[size_t(w)];
    for (int v : set)
      if (count[size_t(v)] < t) {
        in[size_t(v)] = 0;
        gone.push_back(v);
      }
    while (!gone.empty()) {  // each removal lowers its neighbours' counts once: O(n k) in all
      const int v = gone.back();
      gone.pop_back();
      for (int w : closed(v))
        if (w != v && in[size_t(w)] && --count[size_t(w)] < t) {
          in[size_t(w)] = 0;
          gone.push_back(w);
        }
    }
    std::vector<int> out;
    for (int v : set)
      if (in[size_t(v)]) out.push_back(v);
    return out;
  }
  // The number of groups the sorted set falls into when joined by the graph's edges (1 for a non-empty set of the
  // complete graph).
  int components(const std::vector<int>& set) const {
    if (set.empty()) return 0;
    if (complete()) return 1;
    std::vector<char> left(size_t(n_), 0);
    for (int v : set) left[size_t(v)] = 1;
    int groups = 0;
    std::vector<int> stack;
    for (int s : set) {
      if (!left[size_t(s)]) continue;
      ++groups;
      left[size_t(s)] = 0;
      stack.push_back(s);
      while (!stack.empty()) {
        const int v = stack.back();
        stack.pop_back();
        for (int w : closed(v))
          if (left[size_t(w)]) {
            left[size_t(w)] = 0;
            stack.push_back(w);
          }
      }
    }
    return groups;
  }

 private:
  int n_, half_;
  std::vector<int> at_;   // the id at each ring position
  std::vector<int> pos_;  // the ring position of each id
};

// One round's graph is built once per process however many clients (and the server) of it live there.
std::shared_ptr<const Graph> graph_for(const SecAggConfig& cfg) {
  static std::mutex mu;
  static std::shared_ptr<const Graph> last;
  static std::tuple<uint64_t, int, int, std::array<uint8_t, 32>> last_key{0, -1, -1, {}};
  const std::tuple<uint64_t, int, int, std::array<uint8_t, 32>> key{cfg.round_id, cfg.num_clients, cfg.neighbors,
                                                                    cfg.graph_seed};
  std::lock_guard<std::mutex> lock(mu);
  if (!last || last_key != key) {
    last = std::make_shared<const Graph>(cfg);
    last_key = key;
  }
  return last;
}

void share_ad(uint8_t ad[kAdDomain.size() + 16], uint64_t round_id, int from, int to) {
  std::memcpy(ad, kAdDomain.data(), kAdDomain.size());
  put_u64(ad + kAdDomain.size(), round_id);
  put_u32(ad + kAdDomain.size() + 8, static_cast<uint32_t>(from));
  put_u32(ad + kAdDomain.size() + 12, static_cast<uint32_t>(to));
}

// ---- GF(2^16) Shamir -----------------------------------------------------------------------------------------------

void load_words(const uint8_t* b, uint16_t w[16]) {
  for (int i = 0; i < 16; ++i) w[i] = static_cast<uint16_t>(b[2 * i] | (b[2 * i + 1] << 8));
}
void store_words(const uint16_t w[16], uint8_t* b) {
  for (int i = 0; i < 16; ++i) {
    b[2 * i] = static_cast<uint8_t>(w[i]);
    b[2 * i + 1] = static_cast<uint8_t>(w[i] >> 8);
  }
}

void check_xs(const std::vector<uint16_t>& xs, const char* where) {
  std::vector<uint16_t> s(xs);
  std::sort(s.begin(), s.end());
  if (!s.empty() && s.front() == 0) throw InvalidArgument(cat(where, ": x-coordinate 0 would reveal the secret"));
  if (std::adjacent_find(s.begin(), s.end()) != s.end())
    throw InvalidArgument(cat(where, ": x-coordinates must be distinct"));
}

// Lagrange basis through xs evaluated at `at`: L_j(at) = prod_{m != j} (at - x_m) / (x_j - x_m) (minus is xor).
std::vector<uint16_t> lagrange_at(const std::vector<uint16_t>& xs, uint16_t at) {
  std::vector<uint16_t> c(xs.size());
  for (size_t j = 0; j < xs.size(); ++j) {
    uint16_t num = 1, den = 1;
    for (size_t m = 0; m < xs.size(); ++m) {
      if (m == j) continue;
      num = gf16_mul(num, static_cast<uint16_t>(at ^ xs[m]));
      den = gf16_mul(den, static_cast<uint16_t>(xs[j] ^ xs[m]));
    }
    c[j] = gf16_mul(num, gf16_inv(den));
  }
  return c;
}

// sum_j coef[j] * share_j, word-wise.
Key combine_with(const std::vector<uint16_t>& coef, const std::vector<const uint8_t*>& shares) {
  uint16_t acc[16] = {};
  uint16_t w[16];
  for (size_t j = 0; j < coef.size(); ++j) {
    load_words(shares[j], w);
    for (int k = 0; k < 16; ++k) acc[k] ^= gf16_mul(w[k], coef[j]);
  }
  Key out;
  store_words(acc, out.data());
  sodium_memzero(acc, sizeof acc);
  sodium_memzero(w, sizeof w);
  return out;
}

}  // namespace

// ---- GF(2^16) and Shamir (public) ----------------------------------------------------------------------------------

uint16_t gf16_mul(uint16_t a, uint16_t b) {
  // Shift-and-add without branches or tables on either operand (constant time).
  uint32_t r = 0, aa = a;
  for (int i = 0; i < 16; ++i) {
    r ^= aa & (0u - ((static_cast<uint32_t>(b) >> i) & 1u));
    aa <<= 1;
    aa ^= kGfPoly & (0u - (aa >> 16));
  }
  return static_cast<uint16_t>(r);
}

uint16_t gf16_inv(uint16_t a) {
  if (a == 0) throw InvalidArgument("gf16_inv: 0 has no inverse");
  uint16_t result = 1, base = a;
  for (uint32_t e = 0xFFFE; e; e >>= 1) {  // a^(2^16 - 2)
    if (e & 1) result = gf16_mul(result, base);
    base = gf16_mul(base, base);
  }
  return result;
}

std::vector<std::array<uint8_t, 32>> shamir_split(const std::array<uint8_t, 32>& secret, int threshold,
                                                  const std::vector<uint16_t>& xs) {
  ensure_sodium();
  if (threshold < 1 || static_cast<size_t>(threshold) > xs.size())
    throw InvalidArgument(
        cat("shamir_split: threshold=", threshold, " must be in 1..", xs.size(), " (number of shares)"));
  check_xs(xs, "shamir_split");
  const size_t t = static_cast<size_t>(threshold);
  // coef[k*16 + w], k = 0..t-1: k = 0 is the secret, the rest uniformly random.
  std::vector<uint16_t> coef(t * 16);
  load_words(secret.data(), coef.data());
  if (t > 1) randombytes_buf(coef.data() + 16, (t - 1) * 16 * sizeof(uint16_t));
  std::vector<std::array<uint8_t, 32>> shares(xs.size());
  uint16_t acc[16];
  for (size_t i = 0; i < xs.size(); ++i) {
    std::memcpy(acc, coef.data() + (t - 1) * 16, sizeof acc);  // Horner from the highest coefficient
    for (size_t k = t - 1; k-- > 0;) {
      const uint16_t* c = coef.data() + k * 16;
      for (int w = 0; w < 16; ++w) acc[w] = static_cast<uint16_t>(gf16_mul(acc[w], xs[i]) ^ c[w]);
    }
    store_words(acc, shares[i].data());
  }
  sodium_memzero(acc, sizeof acc);
  sodium_memzero(coef.data(), coef.size() * sizeof(uint16_t));
  return shares;
}

std::array<uint8_t, 32> shamir_combine(const std::vector<uint16_t>& xs,
                                       const std::vector<std::array<uint8_t, 32>>& shares) {
  if (xs.empty() || xs.size() != shares.size())
    throw InvalidArgument(
        cat("shamir_combine: ", xs.size(), " x-coordinates for ", shares.size(), " shares; need equal, >= 1"));
  check_xs(xs, "shamir_combine");
  std::vector<const uint8_t*> ptrs;
  for (const auto& s : shares) ptrs.push_back(s.data());
  return combine_with(lagrange_at(xs, 0), ptrs);
}

// ---- fixed point ---------------------------------------------------------------------------------------------------

size_t wire_bytes_per_element(int bits) {
  if (bits < 8 || bits > 32)
    throw InvalidArgument(cat("wire_bytes_per_element: bits=", bits, " out of range; allowed 8..32"));
  return static_cast<size_t>((bits + 7) / 8);
}

std::vector<uint8_t> pack_elements(const uint32_t* v, size_t n, int bits) {
  const size_t wb = wire_bytes_per_element(bits);
  const uint32_t mask = mask_of(bits);
  if (n && !v) throw InvalidArgument("pack_elements: null input with n > 0");
  std::vector<uint8_t> out(n * wb);
  for (size_t i = 0; i < n; ++i) {
    if (v[i] > mask) throw InvalidArgument(cat("pack_elements: element ", i, " = ", v[i], " exceeds 2^", bits, "-1"));
    for (size_t b = 0; b < wb; ++b) out[i * wb + b] = static_cast<uint8_t>(v[i] >> (8 * b));
  }
  return out;
}

std::vector<uint32_t> unpack_elements(const uint8_t* p, size_t nbytes, int bits, size_t n) {
  const size_t wb = wire_bytes_per_element(bits);
  const uint32_t mask = mask_of(bits);
  if (n > nbytes / wb || nbytes != n * wb)
    throw ProtocolError(
        cat("masked vector: expected ", n, " elements x ", wb, " bytes (bits=", bits, "), got ", nbytes, " bytes"));
  if (nbytes && !p) throw InvalidArgument("unpack_elements: null buffer with nbytes > 0");
  std::vector<uint32_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    uint32_t v = 0;
    for (size_t b = 0; b < wb; ++b) v |= uint32_t{p[i * wb + b]} << (8 * b);
    if (v > mask) throw ProtocolError(cat("masked vector: element ", i, " = ", v, " exceeds 2^", bits, "-1"));
    out[i] = v;
  }
  return out;
}

FixedPointCodec::FixedPointCodec(int bits, double clip, int max_summands)
    : bits_(bits), clip_(clip), max_summands_(max_summands) {
  if (bits < 8 || bits > 32) throw ConfigError(cat("FixedPointCodec: bits=", bits, " out of range; allowed 8..32"));
  if (!std::isfinite(clip) || clip <= 0)
    throw ConfigError(cat("FixedPointCodec: clip=", clip, " invalid; must be a finite number > 0"));
  if (max_summands < 1)
    throw ConfigError(cat("FixedPointCodec: max_summands=", max_summands, " invalid; must be >= 1"));
  mask_ = mask_of(bits);
  const int64_t half_minus_1 = (int64_t{1} << (bits - 1)) - 1;
  max_level_ = half_minus_1 / max_summands;
  if (max_level_ < 2)
    throw ConfigError(cat("FixedPointCodec: bits=", bits, " with max_summands=", max_summands,
                          " leaves fewer than 1 integer level per clip (2^(bits-1)-1 = ", half_minus_1,
                          " / max_summands < 2); raise bits or lower max_summands (clients per round)"));
  scale_ = static_cast<double>(max_level_ - 1) / clip;
}

size_t FixedPointCodec::wire_bytes_per_element() const { return fl::wire_bytes_per_element(bits_); }

namespace {
uint64_t mix64(uint64_t z) {  // SplitMix64 finaliser
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
}  // namespace

size_t FixedPointCodec::encode(const float* x, size_t n, uint32_t* out, uint64_t seed) const {
  if (n && (!x || !out)) throw InvalidArgument("FixedPointCodec::encode: null pointer with n > 0");
  const uint64_t stream = mix64(seed ^ 0x5EC5A66C0DEC0000ull);
  size_t clipped = 0;
  for (size_t i = 0; i < n; ++i) {
    double v = x[i];
    if (!std::isfinite(v))
      throw InvalidArgument(cat("FixedPointCodec::encode: x[", i, "] is ", v, "; only finite values can be encoded"));
    if (v > clip_) {
      v = clip_;
      ++clipped;
    } else if (v < -clip_) {
      v = -clip_;
      ++clipped;
    }
    const double s = v * scale_;
    const double f = std::floor(s);
    const double u = static_cast<double>(mix64(stream + (i + 1) * 0x9E3779B97F4A7C15ull) >> 11) * 0x1p-53;  // [0, 1)
    int64_t q = static_cast<int64_t>(f) + (u < s - f ? 1 : 0);                                              // E[q] = s
    q = std::clamp(q, -max_level_, max_level_);
    out[i] = static_cast<uint32_t>(static_cast<uint64_t>(q)) & mask_;
  }
  return clipped;
}

void FixedPointCodec::decode(const uint32_t* sum, size_t n, float* out) const {
  if (n && (!sum || !out)) throw InvalidArgument("FixedPointCodec::decode: null pointer with n > 0");
  const uint32_t half = uint32_t{1} << (bits_ - 1);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t s = sum[i] & mask_;
    const int64_t v = s >= half ? static_cast<int64_t>(s) - (int64_t{1} << bits_) : static_cast<int64_t>(s);
    out[i] = static_cast<float>(static_cast<double>(v) / scale_);
  }
}

// ---- config and messages -------------------------------------------------------------------------------------------

int group_size(const SecAggConfig& cfg) { return cfg.neighbors > 0 ? cfg.neighbors + 1 : cfg.num_clients; }

int threshold_for(int group, double x) {
  // (floor of the product plus a rounding error: 0.7 * 90 is 62.99999999999999, which gave 63 for floor(63) + 1 = 64)
  return std::min(group, std::max(2, static_cast<int>(std::floor(x * group * (1 + 1e-12))) + 1));
}

double hypergeometric_tail(int64_t N, int64_t K, int64_t k, int64_t j) {
  if (N < 0 || K < 0 || K > N || k < 0 || k > N)
    throw InvalidArgument(cat("hypergeometric_tail: N=", N, " K=", K, " k=", k, "; allowed: 0 <= K, k <= N"));
  const int64_t lo = std::max<int64_t>(0, k - (N - K)), hi = std::min(K, k);
  if (j <= lo) return 1.0;
  if (j > hi) return 0.0;
  const double total = log_choose(N, k);
  // The terms rise to the mode and fall after it: past it, stop once they no longer move the sum.
  const int64_t mode = (k + 1) * (K + 1) / (N + 2);
  double p = 0;
  for (int64_t i = j; i <= hi; ++i) {
    const double term = std::exp(log_choose(K, i) + log_choose(N - K, k - i) - total);
    p += term;
    if (i > mode && term <= p * 1e-18) break;
  }
  return std::min(1.0, p);
}

int choose_neighbors(int n, double corrupt, double dropout, double x) {
  if (!(corrupt >= 0 && corrupt < 0.5) || !(dropout >= 0 && dropout < 1) || !(x >= 0.5 && x <= 1))
    throw InvalidArgument(cat("choose_neighbors: corrupt=", corrupt, " dropout=", dropout, " x=", x,
                              "; allowed: corrupt in [0, 0.5), dropout in [0, 1), x in [0.5, 1]"));
  static std::mutex mu;
  static std::map<std::tuple<int, double, double, double>, int> cache;
  const auto key = std::make_tuple(n, corrupt, dropout, x);
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  // (ceil of the product less a rounding error: 0.07 * 100 is 7.000000000000001)
  const int64_t c = std::min<int64_t>(n - 1, static_cast<int64_t>(std::ceil(corrupt * n * (1 - 1e-12))));
  const int64_t d = std::min<int64_t>(n - 1, static_cast<int64_t>(std::ceil(dropout * n * (1 - 1e-12))));
  const int64_t removed = std::min<int64_t>(n, c + d);
  const double privacy = std::ldexp(1.0, -40), correctness = std::ldexp(1.0, -20), pairs = double(n) * n / 2;
  int chosen = 0;
  for (int k = 2; k <= std::min(n - 2, 2048); k += 2) {
    const int t = threshold_for(k + 1, x);
    if (double(n) * hypergeometric_tail(n - 1, c, k, t) > privacy) continue;
    if (d > 0 && double(n) * hypergeometric_tail(n - 1, d, k, k + 1 - t) > correctness) continue;
    // (C(removed, k) / C(n, k): all k places of two runs of k/2 removed)
    if (pairs * hypergeometric_tail(n, removed, k, k) > privacy) continue;
    chosen = k;
    break;
  }
  if (chosen == 0 && n >= 4)
    CONDUIT_LOG_WARN(
        "fl: SecAgg+ auto: no even k up to {} keeps the bounds for {} clients with {} colluding and {} dropping: "
        "every pair of them masks (O(n^2) work); fewer clients a round or smaller fractions allow a graph",
        std::min(n - 2, 2048), n, corrupt, dropout);
  cache.emplace(key, chosen);
  return chosen;
}

void check(const SecAggConfig& cfg) {
  std::vector<std::string> problems;
  if (cfg.num_clients < 2 || cfg.num_clients > kMaxClients)
    problems.push_back(cat("num_clients=", cfg.num_clients, " out of range; allowed 2..", kMaxClients));
  const bool graph_ok = cfg.neighbors == 0 || (cfg.neighbors >= 2 && cfg.neighbors % 2 == 0 &&
                                               static_cast<int64_t>(cfg.neighbors) <= int64_t{cfg.num_clients} - 2);
  if (!graph_ok)
    problems.push_back(cat("neighbors=", cfg.neighbors, " not allowed for num_clients=", cfg.num_clients,
                           "; allowed 0 (every pair) or an even number in 2..", int64_t{cfg.num_clients} - 2,
                           " (k/2 on each side of a ring)"));
  const int group = group_size(cfg);
  if (cfg.num_clients >= 1 && graph_ok && (2 * static_cast<int64_t>(cfg.threshold) <= group || cfg.threshold > group))
    problems.push_back(cat("threshold=", cfg.threshold, " out of range for ",
                           cfg.neighbors ? cat(cfg.neighbors, " neighbours and self") : cat("num_clients=", group),
                           "; allowed ", group / 2 + 1, "..", group, " (more than half, at most all)"));
  if (cfg.bits < 8 || cfg.bits > 32) problems.push_back(cat("bits=", cfg.bits, " out of range; allowed 8..32"));
  if (cfg.length == 0) problems.push_back("length=0; need at least 1 element per vector");
  if (problems.empty()) return;
  std::string msg = "secagg config: ";
  for (size_t i = 0; i < problems.size(); ++i) msg += (i ? "; " : "") + problems[i];
  throw ConfigError(msg);
}

std::vector<uint8_t> AdvertiseMsg::serialize() const {
  std::vector<uint8_t> b{kTagAdvertise, kVersion};
  b.reserve(kAdvertiseMsgBytes);
  put_u32(b, wire_id(client, "AdvertiseMsg"));
  b.insert(b.end(), c_pk.begin(), c_pk.end());
  b.insert(b.end(), s_pk.begin(), s_pk.end());
  return b;
}

AdvertiseMsg AdvertiseMsg::parse(const uint8_t* p, size_t n, int num_clients) {
  checked_num_clients(num_clients);
  if (n != kAdvertiseMsgBytes)
    throw ProtocolError(cat("AdvertiseMsg: ", n, " bytes; expected exactly ", kAdvertiseMsgBytes));
  Reader r(p, n, "AdvertiseMsg");
  r.header(kTagAdvertise);
  AdvertiseMsg m;
  m.client = r.id("client id", num_clients);
  r.bytes(m.c_pk.data(), 32, "c_pk");
  r.bytes(m.s_pk.data(), 32, "s_pk");
  r.done();
  return m;
}

std::vector<uint8_t> ShareMsg::serialize() const {
  if (ciphertext.size() != kShareCiphertextBytes)
    throw InvalidArgument(
        cat("ShareMsg: ciphertext of ", ciphertext.size(), " bytes; expected ", kShareCiphertextBytes));
  std::vector<uint8_t> b{kTagShare, kVersion};
  b.reserve(kShareMsgBytes);
  put_u32(b, wire_id(from, "ShareMsg"));
  put_u32(b, wire_id(to, "ShareMsg"));
  put_u32(b, static_cast<uint32_t>(ciphertext.size()));
  b.insert(b.end(), ciphertext.begin(), ciphertext.end());
  return b;
}

ShareMsg ShareMsg::parse(const uint8_t* p, size_t n, int num_clients) {
  checked_num_clients(num_clients);
  Reader r(p, n, "ShareMsg");
  r.header(kTagShare);
  ShareMsg m;
  m.from = r.id("sender id", num_clients);
  m.to = r.id("recipient id", num_clients);
  const uint32_t len = r.u32("ciphertext length");
  if (len != kShareCiphertextBytes)
    throw ProtocolError(
        cat("ShareMsg: ciphertext length ", len, " from client ", m.from, "; expected ", kShareCiphertextBytes));
  m.ciphertext.resize(len);
  r.bytes(m.ciphertext.data(), len, "ciphertext");
  r.done();
  return m;
}

namespace {
void put_entries(std::vector<uint8_t>& b, const std::vector<std::pair<int, std::vector<uint8_t>>>& entries,
                 const char* list) {
  put_u32(b, static_cast<uint32_t>(entries.size()));
  for (const auto& [id, share] : entries) {
    put_u32(b, wire_id(id, "UnmaskMsg"));
    if (share.size() != kSecAggKeyBytes)
      throw InvalidArgument(
          cat("UnmaskMsg: ", list, " share for client ", id, " has ", share.size(), " bytes; expected 32"));
    b.insert(b.end(), share.begin(), share.end());
  }
}

std::vector<std::pair<int, std::vector<uint8_t>>> get_entries(Reader& r, int num_clients, const char* list) {
  const uint32_t count = r.u32(list);
  if (count > static_cast<uint32_t>(num_clients) || count > r.left() / kUnmaskMsgEntryBytes)
    throw ProtocolError(cat("UnmaskMsg: ", list, " count ", count, " impossible (num_clients=", num_clients, ", ",
                            r.left(), " bytes left, ", kUnmaskMsgEntryBytes, " per entry)"));
  std::vector<std::pair<int, std::vector<uint8_t>>> out(count);
  for (uint32_t i = 0; i < count; ++i) {
    out[i].first = r.id(list, num_clients);
    if (i && out[i].first <= out[i - 1].first)
      throw ProtocolError(
          cat("UnmaskMsg: ", list, " ids not strictly ascending (", out[i - 1].first, " then ", out[i].first, ")"));
    out[i].second.resize(kSecAggKeyBytes);
    r.bytes(out[i].second.data(), kSecAggKeyBytes, list);
  }
  return out;
}
}  // namespace

std::vector<uint8_t> UnmaskMsg::serialize() const {
  std::vector<uint8_t> b{kTagUnmask, kVersion};
  b.reserve(kUnmaskMsgBaseBytes + kUnmaskMsgEntryBytes * (self_mask_shares.size() + key_shares.size()));
  put_u32(b, wire_id(client, "UnmaskMsg"));
  put_entries(b, self_mask_shares, "self-mask");
  put_entries(b, key_shares, "key");
  return b;
}

UnmaskMsg UnmaskMsg::parse(const uint8_t* p, size_t n, int num_clients) {
  checked_num_clients(num_clients);
  Reader r(p, n, "UnmaskMsg");
  r.header(kTagUnmask);
  UnmaskMsg m;
  m.client = r.id("client id", num_clients);
  m.self_mask_shares = get_entries(r, num_clients, "self-mask share");
  m.key_shares = get_entries(r, num_clients, "key share");
  r.done();
  return m;
}

std::vector<int> neighbors_of(const SecAggConfig& cfg, int id) {
  check(cfg);
  if (id < 0 || id >= cfg.num_clients)
    throw InvalidArgument(cat("secagg neighbors_of: id=", id, " out of range; allowed 0..", cfg.num_clients - 1));
  std::vector<int> out = graph_for(cfg)->closed(id);
  out.erase(std::find(out.begin(), out.end(), id));
  return out;
}

// ---- client --------------------------------------------------------------------------------------------------------

namespace {
enum class ClientState { fresh, advertised, shared, masked, unmasked };

struct HeldShares {  // this client's shares of peer v's secrets (x = id + 1)
  Key s_sk{};
  Key b{};
};

bool is_sorted_unique(const std::vector<int>& ids) {
  for (size_t i = 1; i < ids.size(); ++i)
    if (ids[i] <= ids[i - 1]) return false;
  return true;
}
}  // namespace

struct SecAggClient::Impl {
  SecAggConfig cfg;
  int id;
  std::shared_ptr<const Graph> graph;
  ClientState state = ClientState::fresh;
  Key c_pk{}, c_sk{}, s_pk{}, s_sk{}, b{};
  std::map<int, AdvertiseMsg> u1;  // public keys of U1 in the closed neighbourhood
  HeldShares own;                  // this client's shares of its own secrets, kept until mask_input
  std::map<int, HeldShares> held;  // after mask_input: shares of every v in U2 (self included)
  std::vector<int> u2;
  std::vector<int> u3;  // the survivor set answered (state unmasked)
  UnmaskMsg answer;

  // (the protocol's round id: `conduit fl` gives its rounds from 0, its records count them from 1)
  std::string who() const { return cat("secagg client ", id, " (round id ", cfg.round_id, ")"); }

  void wipe_all() {
    wipe(c_sk);
    wipe(s_sk);
    wipe(b);
    wipe(own.s_sk);
    wipe(own.b);
    for (auto& [v, h] : held) {
      wipe(h.s_sk);
      wipe(h.b);
    }
    for (auto& e : answer.self_mask_shares) sodium_memzero(e.second.data(), e.second.size());
    for (auto& e : answer.key_shares) sodium_memzero(e.second.data(), e.second.size());
  }
  ~Impl() { wipe_all(); }
};

SecAggClient::SecAggClient(const SecAggConfig& cfg, int id) {
  check(cfg);
  if (id < 0 || id >= cfg.num_clients)
    throw InvalidArgument(cat("SecAggClient: id=", id, " out of range; allowed 0..", cfg.num_clients - 1));
  ensure_sodium();
  impl_ = std::make_unique<Impl>();
  impl_->cfg = cfg;
  impl_->id = id;
  impl_->graph = graph_for(cfg);
  if (crypto_box_keypair(impl_->c_pk.data(), impl_->c_sk.data()) != 0 ||
      crypto_box_keypair(impl_->s_pk.data(), impl_->s_sk.data()) != 0)
    throw Error(cat("SecAggClient ", id, ": X25519 key generation failed"));
  randombytes_buf(impl_->b.data(), impl_->b.size());
}

SecAggClient::~SecAggClient() = default;
SecAggClient::SecAggClient(SecAggClient&&) noexcept = default;
SecAggClient& SecAggClient::operator=(SecAggClient&&) noexcept = default;

namespace {
template <class P>
auto& live(const P& impl, const char* cls) {
  if (!impl) throw InvalidArgument(cat(cls, ": used after being moved from"));
  return *impl;
}
}  // namespace

int SecAggClient::id() const { return live(impl_, "SecAggClient").id; }

std::vector<int> SecAggClient::u2() const { return live(impl_, "SecAggClient").u2; }

AdvertiseMsg SecAggClient::advertise() {
  Impl& s = live(impl_, "SecAggClient");
  if (s.state == ClientState::fresh) s.state = ClientState::advertised;
  AdvertiseMsg m;
  m.client = s.id;
  m.c_pk = s.c_pk;
  m.s_pk = s.s_pk;
  return m;
}

std::vector<ShareMsg> SecAggClient::share_keys(const std::vector<AdvertiseMsg>& u1) {
  Impl& s = live(impl_, "SecAggClient");
  if (s.state != ClientState::advertised)
    throw ProtocolError(
        cat(s.who(), ": share_keys called ",
            s.state == ClientState::fresh ? "before advertise()" : "a second time; it runs once per round"));
  const int n = s.cfg.num_clients, t = s.cfg.threshold;
  const Graph& g = *s.graph;
  if (u1.size() < static_cast<size_t>(t))
    throw TooFewClientsError(cat(s.who(), ": U1 has ", u1.size(), " clients, fewer than threshold t=", t));
  std::vector<int> ids;
  bool self_seen = false;
  for (const auto& m : u1) {
    if (m.client < 0 || m.client >= n)
      throw ProtocolError(cat(s.who(), ": U1 lists client ", m.client, ", out of range 0..", n - 1));
    if (!ids.empty() && m.client <= ids.back())
      throw ProtocolError(cat(s.who(), ": U1 ids not sorted and unique (", ids.back(), " then ", m.client, ")"));
    ids.push_back(m.client);
    if (m.client == s.id) {
      if (m.c_pk != s.c_pk || m.s_pk != s.s_pk)
        throw ProtocolError(cat(s.who(), ": U1 lists other public keys for this client than it advertised"));
      self_seen = true;
    }
  }
  if (!self_seen) throw ProtocolError(cat(s.who(), ": U1 does not include this client"));
  std::vector<const AdvertiseMsg*> group;  // U1's members in N[u]: the only keys this client uses
  std::set<Key> keys;
  for (const auto& m : u1) {
    if (!g.close(s.id, m.client)) continue;
    group.push_back(&m);
    if (!keys.insert(m.c_pk).second || !keys.insert(m.s_pk).second)
      throw ProtocolError(
          cat(s.who(), ": U1 lists a public key of client ", m.client, " twice (replayed or copied key)"));
  }
  if (group.size() < static_cast<size_t>(t))
    throw TooFewClientsError(cat(s.who(), ": U1 holds ", group.size(), " of this client's ", g.group() - 1,
                                 " neighbours and itself, fewer than threshold t=", t));

  std::vector<uint16_t> xs;
  for (const auto* m : group) xs.push_back(static_cast<uint16_t>(m->client + 1));
  auto s_shares = shamir_split(s.s_sk, t, xs);
  auto b_shares = shamir_split(s.b, t, xs);
  auto wipe_shares = [&] {
    for (auto& k : s_shares) wipe(k);
    for (auto& k : b_shares) wipe(k);
  };

  std::vector<ShareMsg> out;
  out.reserve(group.size() - 1);
  uint8_t plain[kSharePlainBytes];
  uint8_t ad[kAdDomain.size() + 16];
  Key k;
  for (size_t i = 0; i < group.size(); ++i) {
    const int v = group[i]->client;
    if (v == s.id) {
      s.own.s_sk = s_shares[i];
      s.own.b = b_shares[i];
      continue;
    }
    if (!agree(k, kEncDomain, s.cfg.round_id, s.c_sk.data(), s.id, s.c_pk.data(), v, group[i]->c_pk.data())) {
      wipe_shares();
      throw ProtocolError(cat(s.who(), ": c_pk of client ", v, " is a low-order point; key agreement refused"));
    }
    put_u32(plain, static_cast<uint32_t>(s.id));
    put_u32(plain + 4, static_cast<uint32_t>(v));
    std::memcpy(plain + 8, s_shares[i].data(), 32);
    std::memcpy(plain + 40, b_shares[i].data(), 32);
    share_ad(ad, s.cfg.round_id, s.id, v);
    ShareMsg m;
    m.from = s.id;
    m.to = v;
    m.ciphertext.resize(kShareCiphertextBytes);
    uint8_t* nonce = m.ciphertext.data();
    randombytes_buf(nonce, crypto_aead_xchacha20poly1305_ietf_NPUBBYTES);
    unsigned long long clen = 0;
    crypto_aead_xchacha20poly1305_ietf_encrypt(nonce + crypto_aead_xchacha20poly1305_ietf_NPUBBYTES, &clen, plain,
                                               sizeof plain, ad, sizeof ad, nullptr, nonce, k.data());
    out.push_back(std::move(m));
  }
  sodium_memzero(plain, sizeof plain);
  wipe(k);
  wipe_shares();
  for (const auto* m : group) s.u1[m->client] = *m;
  s.state = ClientState::shared;
  return out;
}

std::vector<uint32_t> SecAggClient::mask_input(const std::vector<ShareMsg>& inbox, const uint32_t* x) {
  Impl& s = live(impl_, "SecAggClient");
  if (s.state != ClientState::shared)
    throw ProtocolError(cat(
        s.who(), ": mask_input called ",
        s.state < ClientState::shared ? "before share_keys()" : "a second time; masking twice would reveal x1 - x2"));
  const SecAggConfig& cfg = s.cfg;
  const uint32_t mask = mask_of(cfg.bits);
  if (!x) throw InvalidArgument(cat(s.who(), ": mask_input x is null"));
  for (size_t i = 0; i < cfg.length; ++i)
    if (x[i] > mask)
      throw InvalidArgument(
          cat(s.who(), ": mask_input x[", i, "] = ", x[i], " exceeds 2^", cfg.bits, "-1 (bits=", cfg.bits, ")"));

  // Decrypt and verify everything before changing any state.
  std::map<int, HeldShares> held;
  auto wipe_held = [&] {
    for (auto& [v, h] : held) {
      wipe(h.s_sk);
      wipe(h.b);
    }
  };
  auto fail = [&](const std::string& why) {
    wipe_held();
    throw ProtocolError(why);
  };
  uint8_t plain[kSharePlainBytes];
  uint8_t ad[kAdDomain.size() + 16];
  Key k;
  for (const auto& m : inbox) {
    if (m.to != s.id) fail(cat(s.who(), ": inbox holds a share from client ", m.from, " addressed to client ", m.to));
    auto it = s.u1.find(m.from);
    if (it == s.u1.end() || m.from == s.id)
      fail(cat(s.who(), ": inbox holds a share from client ", m.from, ", not another member of U1",
               s.graph->complete() ? "" : " among this client's neighbours"));
    if (held.count(m.from)) fail(cat(s.who(), ": inbox holds two shares from client ", m.from));
    if (m.ciphertext.size() != kShareCiphertextBytes)
      fail(cat(s.who(), ": share from client ", m.from, " has ", m.ciphertext.size(), " bytes; expected ",
               kShareCiphertextBytes));
    if (!agree(k, kEncDomain, cfg.round_id, s.c_sk.data(), s.id, s.c_pk.data(), m.from, it->second.c_pk.data()))
      fail(cat(s.who(), ": c_pk of client ", m.from, " is a low-order point; key agreement refused"));
    share_ad(ad, cfg.round_id, m.from, s.id);
    const uint8_t* nonce = m.ciphertext.data();
    unsigned long long plen = 0;
    const int rc = crypto_aead_xchacha20poly1305_ietf_decrypt(
        plain, &plen, nullptr, nonce + crypto_aead_xchacha20poly1305_ietf_NPUBBYTES,
        kShareCiphertextBytes - crypto_aead_xchacha20poly1305_ietf_NPUBBYTES, ad, sizeof ad, nonce, k.data());
    wipe(k);
    if (rc != 0 || plen != kSharePlainBytes)
      fail(cat(s.who(), ": share from client ", m.from,
               " failed authentication (tampered, misaddressed or from another round)"));
    if (get_u32(plain) != static_cast<uint32_t>(m.from) || get_u32(plain + 4) != static_cast<uint32_t>(s.id)) {
      sodium_memzero(plain, sizeof plain);
      fail(cat(s.who(), ": share from client ", m.from, " names other sender/recipient ids inside the ciphertext"));
    }
    HeldShares& h = held[m.from];
    std::memcpy(h.s_sk.data(), plain + 8, 32);
    std::memcpy(h.b.data(), plain + 40, 32);
    sodium_memzero(plain, sizeof plain);
  }
  if (held.size() + 1 < static_cast<size_t>(cfg.threshold)) {
    wipe_held();
    throw TooFewClientsError(cat(s.who(), ": U2 has ", held.size() + 1, " clients (", held.size(),
                                 " shares + self), fewer than threshold t=", cfg.threshold));
  }

  std::vector<uint32_t> y(x, x + cfg.length);
  apply_prg(y.data(), y.size(), s.b, kSelfMaskNonce, false);
  Key seed;
  for (const auto& [v, h] : held) {
    const AdvertiseMsg& pv = s.u1.at(v);
    if (!agree(seed, kMaskDomain, cfg.round_id, s.s_sk.data(), s.id, s.s_pk.data(), v, pv.s_pk.data())) {
      wipe(seed);
      std::fill(y.begin(), y.end(), 0u);
      fail(cat(s.who(), ": s_pk of client ", v, " is a low-order point; key agreement refused"));
    }
    apply_prg(y.data(), y.size(), seed, kPairMaskNonce, /*subtract=*/v > s.id);
  }
  wipe(seed);
  for (auto& e : y) e &= mask;

  held[s.id] = s.own;
  wipe(s.own.s_sk);
  wipe(s.own.b);
  s.held = std::move(held);
  s.u2.clear();
  for (const auto& [v, h] : s.held) s.u2.push_back(v);
  s.state = ClientState::masked;
  return y;
}

UnmaskMsg SecAggClient::unmask(const std::vector<int>& survivors) {
  Impl& s = live(impl_, "SecAggClient");
  if (s.state == ClientState::unmasked) {
    if (survivors == s.u3) return s.answer;
    // Every v of U2 other than self sits in exactly one of U3, U2\U3: a different set moves some v across.
    for (int v : s.u2) {
      const bool before = std::binary_search(s.u3.begin(), s.u3.end(), v);
      const bool now = std::find(survivors.begin(), survivors.end(), v) != survivors.end();
      if (before != now)
        throw ProtocolError(cat(s.who(), ": refuses to unmask: client ", v, " was ", before ? "a survivor" : "dropped",
                                " in the previous request and is ", now ? "a survivor" : "dropped",
                                " now; revealing both b_", v, " and s_sk_", v, " shares would expose its input"));
    }
    throw ProtocolError(cat(s.who(), ": refuses to unmask a second, different survivor set ", id_list(survivors)));
  }
  if (s.state != ClientState::masked)
    throw ProtocolError(cat(s.who(), ": unmask called before mask_input(); survivors are only defined after masking"));
  if (!is_sorted_unique(survivors))
    throw ProtocolError(cat(s.who(), ": survivors ", id_list(survivors), " are not sorted and unique"));
  const Graph& g = *s.graph;
  const size_t near = g.count_closed_in(s.id, survivors);
  if (near < static_cast<size_t>(s.cfg.threshold))
    throw TooFewClientsError(cat(s.who(), ": ", near, " survivors", g.complete() ? "" : " in its neighbourhood",
                                 ", fewer than threshold t=", s.cfg.threshold));
  for (int v : survivors) {
    if (v < 0 || v >= s.cfg.num_clients)
      throw ProtocolError(cat(s.who(), ": survivors list client ", v, ", out of range 0..", s.cfg.num_clients - 1));
    if (g.close(s.id, v) && !s.held.count(v))
      throw ProtocolError(
          cat(s.who(), ": survivors are not a subset of U2: client ", v, " is not in U2 ", id_list(s.u2)));
  }
  if (!std::binary_search(survivors.begin(), survivors.end(), s.id))
    throw ProtocolError(cat(s.who(), ": survivors ", id_list(survivors), " do not include this client"));
  // (the server checks this too; a server that chose U3 otherwise would learn each group's sum: refused here)
  if (const int groups = g.components(survivors); groups > 1)
    throw ProtocolError(cat(s.who(), ": refuses to unmask: the ", survivors.size(), " survivors fall into ", groups,
                            " groups that no pairwise mask joins; unmasking would reveal each group's sum"));

  UnmaskMsg m;
  m.client = s.id;
  for (const auto& [v, h] : s.held) {
    if (std::binary_search(survivors.begin(), survivors.end(), v))
      m.self_mask_shares.emplace_back(v, std::vector<uint8_t>(h.b.begin(), h.b.end()));
    else
      m.key_shares.emplace_back(v, std::vector<uint8_t>(h.s_sk.begin(), h.s_sk.end()));
  }
  s.u3 = survivors;
  s.answer = m;
  s.state = ClientState::unmasked;
  return m;
}

// ---- server --------------------------------------------------------------------------------------------------------

namespace {
enum class Phase { advertise, share_keys, masked_input, unmask, done };
}

struct SecAggServer::Impl {
  SecAggConfig cfg;
  std::shared_ptr<const Graph> graph;
  Phase phase = Phase::advertise;
  std::map<int, AdvertiseMsg> adverts;
  std::vector<int> u1;
  std::set<int> senders;
  std::map<int, std::vector<ShareMsg>> inbox;  // by recipient
  std::vector<int> u2;
  std::vector<uint32_t> sum;  // sum of masked inputs mod 2^32
  std::set<int> masked;
  std::vector<int> u3;
  std::vector<int> dropped;  // U2 \ U3, with a neighbour in U3
  std::map<int, UnmaskMsg> unmasks;
  std::vector<uint32_t> result;

  std::string who() const { return cat("secagg server (round id ", cfg.round_id, ")"); }

  void fix_u1() {
    if (phase != Phase::advertise) return;
    std::vector<int> ids;
    for (const auto& [v, m] : adverts) ids.push_back(v);
    ids = graph->prune(std::move(ids), cfg.threshold);
    if (ids.size() < static_cast<size_t>(cfg.threshold))
      throw TooFewClientsError(cat(who(), ": too few clients: ", ids.size(), " advertised keys",
                                   graph->complete() ? "" : " with enough advertising neighbours",
                                   ", threshold t=", cfg.threshold, " needs at least ", cfg.threshold,
                                   "; wait longer or abort the round"));
    u1 = std::move(ids);
    phase = Phase::share_keys;
  }
  void fix_u2() {
    if (phase == Phase::advertise)
      throw ProtocolError(cat(who(), ": U2 requested before U1 was fixed (call advertised() first)"));
    if (phase != Phase::share_keys) return;
    std::vector<int> ids = graph->prune(std::vector<int>(senders.begin(), senders.end()), cfg.threshold);
    if (ids.size() < static_cast<size_t>(cfg.threshold))
      throw TooFewClientsError(cat(who(), ": too few clients: ", ids.size(), " sent shares",
                                   graph->complete() ? "" : " with enough sending neighbours",
                                   ", threshold t=", cfg.threshold, "; wait longer or abort the round"));
    u2 = std::move(ids);
    phase = Phase::masked_input;
  }
  void fix_u3() {
    if (phase < Phase::masked_input)
      throw ProtocolError(cat(who(), ": survivors requested before U2 was fixed (call u2() first)"));
    if (phase != Phase::masked_input) return;
    if (masked.size() < static_cast<size_t>(cfg.threshold))
      throw TooFewClientsError(cat(who(), ": too few survivors: ", masked.size(), " masked inputs, threshold t=",
                                   cfg.threshold, "; the round cannot be unmasked, abort it"));
    std::vector<int> in(masked.begin(), masked.end()), out;
    for (int v : u2) {
      const bool survived = masked.count(v) > 0;
      const size_t near = graph->count_closed_in(v, in);   // (v itself counted when it survived)
      if (!survived && near == 0) continue;                // no mask of v's is in the sum
      if (near < static_cast<size_t>(cfg.threshold))
        throw TooFewClientsError(
            cat(who(), ": too few survivors near client ", v, " (", survived ? "a survivor" : "dropped", "): ", near,
                survived ? cat(" of the ", graph->group(), " of its neighbourhood (its ", graph->group() - 1,
                               " neighbours and itself)")
                         : cat(" of its ", graph->group() - 1, " neighbours"),
                " sent masked inputs, threshold t=", cfg.threshold, "; its ", survived ? "self mask" : "pairwise masks",
                " could not be removed, abort the round"));
      if (!survived) out.push_back(v);
    }
    // Survivors joined by no pairwise mask would each group's sum reveal (a group can be as small as t).
    if (const int groups = graph->components(in); groups > 1)
      throw TooFewClientsError(cat(who(), ": the dropouts split the ", in.size(), " survivors into ", groups,
                                   " groups that no pairwise mask joins; unmasking would reveal each group's sum, "
                                   "abort the round"));
    u3 = std::move(in);
    dropped = std::move(out);
    phase = Phase::unmask;
  }
};

SecAggServer::SecAggServer(const SecAggConfig& cfg) {
  check(cfg);
  ensure_sodium();
  impl_ = std::make_unique<Impl>();
  impl_->cfg = cfg;
  impl_->graph = graph_for(cfg);
  impl_->sum.assign(cfg.length, 0u);
}

SecAggServer::~SecAggServer() = default;
SecAggServer::SecAggServer(SecAggServer&&) noexcept = default;
SecAggServer& SecAggServer::operator=(SecAggServer&&) noexcept = default;

void SecAggServer::add_advertise(const AdvertiseMsg& m) {
  Impl& s = live(impl_, "SecAggServer");
  if (m.client < 0 || m.client >= s.cfg.num_clients)
    throw ProtocolError(
        cat(s.who(), ": advertise from client ", m.client, ", out of range 0..", s.cfg.num_clients - 1));
  if (s.phase != Phase::advertise)
    throw ProtocolError(
        cat(s.who(), ": advertise from client ", m.client, " after U1 was fixed; it sits this round out"));
  if (s.adverts.count(m.client)) throw ProtocolError(cat(s.who(), ": duplicate advertise from client ", m.client));
  s.adverts[m.client] = m;
}

std::vector<AdvertiseMsg> SecAggServer::advertised() const {
  Impl& s = live(impl_, "SecAggServer");
  s.fix_u1();
  std::vector<AdvertiseMsg> out;
  for (int v : s.u1) out.push_back(s.adverts.at(v));
  return out;
}

void SecAggServer::add_shares(int from, const std::vector<ShareMsg>& shares) {
  Impl& s = live(impl_, "SecAggServer");
  if (s.phase == Phase::advertise)
    throw ProtocolError(cat(s.who(), ": shares from client ", from, " before U1 was fixed (call advertised() first)"));
  if (s.phase != Phase::share_keys)
    throw ProtocolError(cat(s.who(), ": shares from client ", from, " after U2 was fixed; it sits this round out"));
  if (!std::binary_search(s.u1.begin(), s.u1.end(), from))
    throw ProtocolError(cat(s.who(), ": shares from client ", from, ", not a member of U1"));
  if (s.senders.count(from)) throw ProtocolError(cat(s.who(), ": duplicate shares from client ", from));
  const Graph& g = *s.graph;
  const size_t want = g.count_closed_in(from, s.u1) - 1;
  if (shares.size() != want)
    throw ProtocolError(cat(s.who(), ": client ", from, " sent ", shares.size(),
                            " shares; expected one for each of the ", want, " other members of U1",
                            g.complete() ? "" : " among its neighbours"));
  std::set<int> to;
  for (const auto& m : shares) {
    if (m.from != from)
      throw ProtocolError(cat(s.who(), ": client ", from, " sent a share labelled as from client ", m.from));
    if (m.to == from || !std::binary_search(s.u1.begin(), s.u1.end(), m.to) || !g.close(from, m.to))
      throw ProtocolError(cat(s.who(), ": client ", from, " sent a share to client ", m.to,
                              ", not another member of U1", g.complete() ? "" : " among its neighbours"));
    if (!to.insert(m.to).second)
      throw ProtocolError(cat(s.who(), ": client ", from, " sent two shares to client ", m.to));
    if (m.ciphertext.size() != kShareCiphertextBytes)
      throw ProtocolError(cat(s.who(), ": client ", from, " sent a ", m.ciphertext.size(), "-byte share to client ",
                              m.to, "; expected ", kShareCiphertextBytes));
  }
  for (const auto& m : shares) s.inbox[m.to].push_back(m);
  s.senders.insert(from);
}

std::vector<int> SecAggServer::u2() const {
  Impl& s = live(impl_, "SecAggServer");
  s.fix_u2();
  return s.u2;
}

std::vector<ShareMsg> SecAggServer::inbox_for(int client) const {
  Impl& s = live(impl_, "SecAggServer");
  s.fix_u2();
  if (!std::binary_search(s.u2.begin(), s.u2.end(), client))
    throw ProtocolError(cat(s.who(), ": inbox for client ", client, ", which is not in U2 ", id_list(s.u2)));
  auto it = s.inbox.find(client);
  std::vector<ShareMsg> out;
  if (it != s.inbox.end())
    for (const auto& m : it->second)  // (a sender pruned from U2 under SecAgg+ is left out)
      if (std::binary_search(s.u2.begin(), s.u2.end(), m.from)) out.push_back(m);
  std::sort(out.begin(), out.end(), [](const ShareMsg& a, const ShareMsg& b) { return a.from < b.from; });
  return out;
}

void SecAggServer::add_masked_input(int client, std::vector<uint32_t> y) {
  Impl& s = live(impl_, "SecAggServer");
  if (s.phase < Phase::masked_input)
    throw ProtocolError(cat(s.who(), ": masked input from client ", client, " before U2 was fixed"));
  if (s.phase != Phase::masked_input)
    throw ProtocolError(
        cat(s.who(), ": masked input from client ", client, " after U3 was fixed; it is counted as dropped"));
  if (!std::binary_search(s.u2.begin(), s.u2.end(), client))
    throw ProtocolError(cat(s.who(), ": masked input from client ", client, ", which is not in U2"));
  if (s.masked.count(client)) throw ProtocolError(cat(s.who(), ": duplicate masked input from client ", client));
  if (y.size() != s.cfg.length)
    throw ProtocolError(
        cat(s.who(), ": masked input from client ", client, " has ", y.size(), " elements; expected ", s.cfg.length));
  const uint32_t mask = mask_of(s.cfg.bits);
  for (size_t i = 0; i < y.size(); ++i)
    if (y[i] > mask)
      throw ProtocolError(cat(s.who(), ": masked input from client ", client, ": element ", i, " = ", y[i],
                              " exceeds 2^", s.cfg.bits, "-1"));
  for (size_t i = 0; i < y.size(); ++i) s.sum[i] += y[i];
  s.masked.insert(client);
}

std::vector<int> SecAggServer::survivors() const {
  Impl& s = live(impl_, "SecAggServer");
  s.fix_u3();
  return s.u3;
}

void SecAggServer::add_unmask(const UnmaskMsg& m) {
  Impl& s = live(impl_, "SecAggServer");
  if (s.phase != Phase::unmask)
    throw ProtocolError(
        cat(s.who(), ": unmask from client ", m.client,
            s.phase < Phase::unmask ? " before U3 was fixed (call survivors() first)" : " after the round finished"));
  if (!std::binary_search(s.u3.begin(), s.u3.end(), m.client))
    throw ProtocolError(cat(s.who(), ": unmask from client ", m.client, ", which is not in U3"));
  if (s.unmasks.count(m.client)) throw ProtocolError(cat(s.who(), ": duplicate unmask from client ", m.client));
  auto check_list = [&](const std::vector<std::pair<int, std::vector<uint8_t>>>& got, const std::vector<int>& want,
                        const char* what) {
    if (got.size() != want.size())
      throw ProtocolError(cat(s.who(), ": unmask from client ", m.client, " has ", got.size(), " ", what,
                              " shares; expected ", want.size(), " for ", id_list(want)));
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i].first != want[i])
        throw ProtocolError(cat(s.who(), ": unmask from client ", m.client, " has a ", what, " share for client ",
                                got[i].first, " where client ", want[i], " was expected (", id_list(want), ")"));
      if (got[i].second.size() != kSecAggKeyBytes)
        throw ProtocolError(cat(s.who(), ": unmask from client ", m.client, ": ", what, " share for client ", want[i],
                                " has ", got[i].second.size(), " bytes; expected 32"));
    }
  };
  check_list(m.self_mask_shares, s.graph->closed_in(m.client, s.u3), "self-mask");
  check_list(m.key_shares, s.graph->closed_in(m.client, s.dropped), "key");
  s.unmasks[m.client] = m;
}

size_t SecAggServer::unmask_count() const { return live(impl_, "SecAggServer").unmasks.size(); }

std::vector<uint32_t> SecAggServer::finish() {
  Impl& s = live(impl_, "SecAggServer");
  if (s.phase == Phase::done) return s.result;
  if (s.phase != Phase::unmask)
    throw ProtocolError(
        cat(s.who(), ": finish called before U3 was fixed (call survivors() and collect unmasks first)"));
  const size_t t = static_cast<size_t>(s.cfg.threshold);
  if (s.unmasks.size() < t)
    throw TooFewClientsError(cat(s.who(), ": only ", s.unmasks.size(), " unmask responses, threshold t=", t,
                                 " needs at least ", t, "; wait longer or abort the round"));

  // For each secret, the t lowest responders in its owner's closed neighbourhood reconstruct it; a (t+1)-th, if any,
  // checks that all shares lie on one polynomial. (The complete graph: the same responders, one set of coefficients.)
  const Graph& g = *s.graph;
  std::vector<uint16_t> xs, at0, at_extra;  // the coefficients of the last responder set, reused while it repeats
  int extra_id = -1;
  // Writes the secret of v (idx: its place in U3, or in the dropped list) to out; returns the responders whose shares
  // made it.
  auto reconstruct = [&](bool self_mask, size_t idx, int v, Key& out) {
    const char* what = self_mask ? "b_" : "s_sk_";
    std::vector<const uint8_t*> ptrs;
    std::vector<uint16_t> ids;
    std::vector<int> base_ids;
    const uint8_t* extra = nullptr;
    int extra_client = -1;
    auto take = [&](const UnmaskMsg& m) {
      const auto& list = self_mask ? m.self_mask_shares : m.key_shares;  // (checked sorted by add_unmask)
      // Every pair: each list is U3 or the dropped list exactly (add_unmask checked), so v sits at idx.
      auto it = g.complete()
                    ? list.begin() + static_cast<std::ptrdiff_t>(idx)
                    : std::lower_bound(list.begin(), list.end(), v, [](const auto& e, int x) { return e.first < x; });
      if (it == list.end() || it->first != v) return true;  // (not a neighbour: holds no share of v)
      if (ptrs.size() < t) {
        ptrs.push_back(it->second.data());
        ids.push_back(static_cast<uint16_t>(m.client + 1));
        base_ids.push_back(m.client);
        return true;
      }
      extra = it->second.data();
      extra_client = m.client;
      return false;
    };
    if (g.complete()) {
      for (const auto& e : s.unmasks)
        if (!take(e.second)) break;
    } else {
      for (int w : g.closed(v))
        if (auto it = s.unmasks.find(w); it != s.unmasks.end() && !take(it->second)) break;
    }
    if (ptrs.size() < t)
      throw TooFewClientsError(cat(s.who(), ": only ", ptrs.size(), " unmask responses hold shares of ", what, v,
                                   g.complete() ? "" : " (in its neighbourhood)", ", threshold t=", t,
                                   "; wait longer or abort the round"));
    if (ids != xs) {
      xs = ids;
      at0 = lagrange_at(xs, 0);
      extra_id = -1;
    }
    if (extra && extra_id != extra_client) {
      at_extra = lagrange_at(xs, static_cast<uint16_t>(extra_client + 1));
      extra_id = extra_client;
    }
    Key& secret = out;
    secret = combine_with(at0, ptrs);
    if (extra) {
      Key predicted = combine_with(at_extra, ptrs);
      const bool ok = sodium_memcmp(predicted.data(), extra, 32) == 0;
      wipe(predicted);
      if (!ok) {
        wipe(secret);
        throw ProtocolError(cat(s.who(), ": the ", what, v, " shares of client ", v,
                                " are inconsistent across responders ", id_list(base_ids), " and ", extra_client,
                                "; a share was corrupted"));
      }
    }
    return base_ids;
  };

  // Reconstruct and verify every secret before doing any PRG work.
  std::vector<Key> b(s.u3.size()), s_sk(s.dropped.size());
  auto wipe_secrets = [&] {
    for (auto& k : b) wipe(k);
    for (auto& k : s_sk) wipe(k);
  };
  try {
    for (size_t i = 0; i < s.u3.size(); ++i) reconstruct(true, i, s.u3[i], b[i]);
    for (size_t i = 0; i < s.dropped.size(); ++i) {
      const int v = s.dropped[i];
      const std::vector<int> base_ids = reconstruct(false, i, v, s_sk[i]);
      Key pk;
      crypto_scalarmult_base(pk.data(), s_sk[i].data());
      if (pk != s.adverts.at(v).s_pk)
        throw ProtocolError(cat(s.who(), ": the reconstructed s_sk of dropped client ", v,
                                " does not match its advertised s_pk; its shares from responders ", id_list(base_ids),
                                " are corrupt"));
    }
  } catch (...) {
    wipe_secrets();
    throw;
  }

  std::vector<uint32_t> z = s.sum;
  for (size_t i = 0; i < s.u3.size(); ++i) apply_prg(z.data(), z.size(), b[i], kSelfMaskNonce, /*subtract=*/true);
  Key seed;
  for (size_t i = 0; i < s.dropped.size(); ++i) {
    const int v = s.dropped[i];
    const AdvertiseMsg& pv = s.adverts.at(v);
    for (int u : g.closed_in(v, s.u3)) {
      const AdvertiseMsg& pu = s.adverts.at(u);
      if (!agree(seed, kMaskDomain, s.cfg.round_id, s_sk[i].data(), v, pv.s_pk.data(), u, pu.s_pk.data())) {
        wipe(seed);
        wipe_secrets();
        throw ProtocolError(
            cat(s.who(), ": s_pk of client ", u, " is a low-order point; cannot remove its mask with ", v));
      }
      // Client u added PRG(s_uv) when v < u and subtracted it when v > u: undo that.
      apply_prg(z.data(), z.size(), seed, kPairMaskNonce, /*subtract=*/v < u);
    }
  }
  wipe(seed);
  wipe_secrets();
  const uint32_t mask = mask_of(s.cfg.bits);
  for (auto& e : z) e &= mask;
  s.result = z;
  s.phase = Phase::done;
  return z;
}

}  // namespace conduit::fl
