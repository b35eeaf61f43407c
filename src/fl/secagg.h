#pragma once
// Secure aggregation: Bonawitz et al., CCS 2017, "Practical Secure Aggregation for Privacy-Preserving Machine
// Learning", the semi-honest protocol with dropout tolerance, as transport-free, message-driven state machines
// (SecAggClient, SecAggServer), plus the fixed-point codec that turns float updates into Z_{2^bits}.
//
// Round (n clients with ids 0..n-1, Shamir threshold t with n/2 < t <= n (SecAgg+, below: (k+1)/2 < t <= k+1),
// arithmetic mod 2^bits):
//   0 advertise   u -> S   AdvertiseMsg (c_pk_u, s_pk_u), two fresh X25519 key pairs.
//                          S: U1 = advertisers, |U1| >= t, broadcast to U1.
//   1 share_keys  u -> S   for every v in U1\{u}: ShareMsg = XChaCha20-Poly1305 under KA(c_sk_u, c_pk_v) of
//                          (u, v, share_v(s_sk_u), share_v(b_u)); AD = (round_id, u, v). Shamir t-of-|U1| over
//                          GF(2^16) word-wise on the 32-byte secrets, share x-coordinate = client id + 1.
//                          S: U2 = senders, |U2| >= t; forwards to each v in U2 the shares addressed to it.
//   2 mask_input  u -> S   y_u = x_u + PRG(b_u) + sum_{v in U2, v < u} PRG(s_uv) - sum_{v in U2, v > u} PRG(s_uv)
//                          mod 2^bits, s_uv = BLAKE2b(round_id, ids, keys, X25519(s_sk_u, s_pk_v)),
//                          PRG = ChaCha20 keystream read as little-endian uint32.  S: U3 = senders, |U3| >= t.
//   3 unmask      u -> S   shares of b_v for v in U3 and of s_sk_v for v in U2\U3 (never both for one v).
//                          S: U4 = responders, |U4| >= t; reconstructs b_v, s_sk_v (checks s_pk_v and, with a
//                          (t+1)-th response, that all shares lie on one polynomial) and returns
//                          z = sum_{u in U3} y_u - PRG(b_u) + (the pairwise masks towards U2\U3) = sum_{u in U3} x_u.
//
// Messages per client: 1 + (|U1|-1) + 1 + 1 up, 3 down (U1, inbox, U3).
// Bytes per client up: 70 (advertise) + (|U1|-1) * 126 (shares) + length * ceil(bits/8) (masked vector, see
// pack_elements) + 14 + 36 * |U2| (unmask).  The server relays (|U2|-1) * 126 bytes to each member of U2.
// Compute: a client does |U1| Shamir sharings of 2 secrets and |U2| ChaCha20 expansions of `length` elements; the
// server |U3| + |U3| * |U2\U3| expansions and |U2| reconstructions (O(t^2) once for the Lagrange coefficients).
// (Under SecAgg+, below, each |U1|, |U2| and U3 of a client is its closed neighbourhood's part of it: at most k + 1.)
//
// Security (semi-honest server and clients; colluding sets below t learn nothing about honest inputs beyond the
// sum of U3): a client masks exactly once and refuses a second mask_input, refuses a second share_keys, and unmask
// answers only a repeat of the same survivor set, so no v ever has both b_v and s_sk_v revealed. Secret keys, b_u,
// held shares and derived seeds are wiped (sodium_memzero) when no longer needed. Field multiplication on secret
// shares is branch- and table-free. Each phase of the server is fixed by the first successful call that reads its
// set (advertised(), u2()/inbox_for(), survivors()); messages for a closed phase are refused (ProtocolError), so
// every client sees the same U1, U2 and U3. Neither class is thread-safe; both are movable, not copyable.
//
// SecAgg+ (Bell et al., CCS 2020, "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead"): with
// SecAggConfig::neighbors = k (even, 2..n-2) the pairs above are the edges of a k-regular graph instead of the complete
// graph: the Harary graph H(k, n), each client joined to the k/2 nearest on each side of a ring, on a permutation of
// the ids drawn from (round_id, n, k, graph_seed) (every party computes it once it has the seed; a semi-honest
// server, as above). Each client shares its secrets t-of-|U1 and N[u]| (at most k + 1) among its closed
// neighbourhood N[u] = N(u) + {u}, masks with its neighbours only and answers unmask for them only. Every threshold
// check above applies to each client's closed neighbourhood: the server keeps in U1 and U2 the largest set in which
// every member has at least t members of N[u] (so no member's mask_input fails), and fixes U3 only if every survivor,
// and every dropped client with a surviving neighbour, has t survivors in its closed neighbourhood (itself counted when
// it survived; TooFewClientsError naming the client otherwise), and if the survivors are joined into one group by the
// graph's edges among them: survivors split into groups no pairwise mask joins would reveal each group's sum
// (TooFewClientsError at the server; a client given such a U3 refuses to unmask, ProtocolError). Per client: k shares,
// 2k key agreements and k+1 expansions of the vector instead of n-1, 2(n-1) and n (and at unmask an O(|U3| k) check
// that the survivors form one group); the server's unmask work is |U3| +
// (dropped) * (their surviving neighbours) expansions. Privacy needs fewer than t colluders in every closed
// neighbourhood and the honest survivors joined without them (the server and the clients can check only the
// survivors' connectivity, not who colludes); Bell et al.
// bound the k that gives both with high probability for a fraction of corrupt and dropped clients as O(log n).
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "core/error.h"

namespace conduit::fl {

// Ids are 0..kMaxClients-1 so that the Shamir x-coordinate id + 1 is a nonzero element of GF(2^16).
constexpr int kMaxClients = 65535;
constexpr size_t kSecAggKeyBytes = 32;         // X25519 keys, b_u, Shamir shares
constexpr size_t kShareCiphertextBytes = 112;  // 24-byte nonce + 72-byte plaintext + 16-byte tag
// Serialized sizes of the messages below (what a caller may bound a receive by).
constexpr size_t kAdvertiseMsgBytes = 2 + 4 + 2 * kSecAggKeyBytes;  // 70
constexpr size_t kShareMsgBytes = 14 + kShareCiphertextBytes;       // 126
constexpr size_t kUnmaskMsgBaseBytes = 14;                          // then per share:
constexpr size_t kUnmaskMsgEntryBytes = 4 + kSecAggKeyBytes;        // 36

// Fewer clients than the threshold remain in some phase: the round cannot complete (abort it; nothing leaks).
class TooFewClientsError : public ProtocolError {
 public:
  using ProtocolError::ProtocolError;
};

// Values in Z_{2^bits}, stored in uint32_t (bits in [8, 32]).
class FixedPointCodec {
 public:
  // |x| <= clip per element; the sum of up to max_summands encoded vectors never wraps: every encoded element has
  // |q| <= L = floor((2^(bits-1) - 1) / max_summands) and scale = (L - 1) / clip, so
  // max_summands * (clip * scale + 1) <= 2^(bits-1) - 1. ConfigError naming the field if bits is outside 8..32,
  // clip is not finite or <= 0, max_summands < 1, or clip * scale < 1 (L < 2).
  FixedPointCodec(int bits, double clip, int max_summands);

  double scale() const { return scale_; }
  int bits() const { return bits_; }
  double clip() const { return clip_; }
  int max_summands() const { return max_summands_; }
  uint32_t modulus_mask() const { return mask_; }
  // The largest |q| one encoded element can have (L above).
  int64_t max_level() const { return max_level_; }

  // Clips to [-clip, clip] (compared in double), rounds x*scale stochastically and without bias (the random
  // numbers are a deterministic function of seed and index), stores two's complement mod 2^bits. Returns how many
  // elements were clipped. NaN or inf -> InvalidArgument naming the index (out is then partly written).
  size_t encode(const float* x, size_t n, uint32_t* out, uint64_t seed) const;
  // Reads a sum of encoded vectors (mod 2^bits, as a signed value) back to floats: sum / scale.
  void decode(const uint32_t* sum, size_t n, float* out) const;
  // Bytes one element takes on the wire: ceil(bits/8).
  size_t wire_bytes_per_element() const;

 private:
  int bits_;
  double clip_;
  int max_summands_;
  uint32_t mask_;
  int64_t max_level_;
  double scale_;
};

// Wire form of vectors of Z_{2^bits} (masked inputs, sums): ceil(bits/8) bytes per element, little endian.
size_t wire_bytes_per_element(int bits);
// InvalidArgument if bits is outside 8..32 or an element exceeds 2^bits - 1.
std::vector<uint8_t> pack_elements(const uint32_t* v, size_t n, int bits);
// ProtocolError if nbytes != n * wire_bytes_per_element(bits) or an element exceeds 2^bits - 1.
std::vector<uint32_t> unpack_elements(const uint8_t* p, size_t nbytes, int bits, size_t n);

struct SecAggConfig {
  int num_clients = 0;    // n: clients starting the round, ids 0..n-1 (2..kMaxClients)
  int threshold = 0;      // t: Shamir threshold, minimum survivors of every phase; group/2 < t <= group_size(cfg)
  int bits = 32;          // arithmetic mod 2^bits on the masked vectors (8..32)
  size_t length = 0;      // elements per vector (> 0)
  uint64_t round_id = 0;  // bound into every ciphertext's associated data and every mask seed (no replay)
  int neighbors = 0;      // k: 0 = the complete graph (Bonawitz et al.); else SecAgg+'s k-regular graph, k even, 2..n-2
  // SecAgg+: mixed into the graph's permutation with (round_id, n, k). `conduit fl`'s server draws it fresh each round
  // (OS randomness) and sends it with the round's header, so nobody can tell a round's neighbourhoods before the
  // round starts (Bell et al.'s server samples the graph); all zero: the graph follows from (round_id, n, k) alone.
  std::array<uint8_t, 32> graph_seed{};
};
// The clients one client holds shares for and masks with: t counts members of its closed neighbourhood,
// group_size(cfg) of them (k + 1, or n for the complete graph). threshold must lie in (group/2, group].
int group_size(const SecAggConfig& cfg);
// The neighbours of client id (sorted, id excluded) in the round's graph: every other id for the complete graph.
// Checks cfg (ConfigError) and id (InvalidArgument).
std::vector<int> neighbors_of(const SecAggConfig& cfg, int id);
// ConfigError listing every problem (on one line, separated by "; ").
void check(const SecAggConfig& cfg);
// The threshold for a group of g clients (a neighbourhood's k + 1, or a round's n) at fraction x in [0.5, 1]:
// min(g, max(2, floor(x g) + 1)).
int threshold_for(int group, double x);
// P[X >= j] for X ~ Hypergeometric(N items, K of them marked, k drawn without replacement).
double hypergeometric_tail(int64_t N, int64_t K, int64_t k, int64_t j);
// SecAgg+'s k for a round of n clients (`conduit fl --secagg-neighbors auto`): the smallest even k for which union
// bounds over the round's graph give, with C = ceil(corrupt n) colluding and D = ceil(dropout n) dropped clients
// and t = threshold_for(k + 1, x):
//   privacy      n P[Hyp(n-1, C, k) >= t] <= 2^-40          (no honest client has t colluders among its neighbours)
//   correctness  n P[Hyp(n-1, D, k) >= k + 1 - t] <= 2^-20  (every neighbourhood keeps t survivors)
//   one group    (n^2 / 2) C(C + D, k) / C(n, k) <= 2^-40     (no two runs of k/2 removed clients on the ring,
//                                                              which would split the honest survivors)
// These hold because the graph is drawn afresh each round, independently of who colludes or drops: a client's k
// neighbours are then a uniform k-subset of the others (given at most D dropped: stragglers count). 0 (every pair,
// with a warning) when no k up to min(n - 2, 2048) does.
// InvalidArgument for corrupt outside [0, 0.5), dropout outside [0, 1), or x outside [0.5, 1].
int choose_neighbors(int n, double corrupt, double dropout, double x);

// Wire format of the three messages: tag byte, version byte (1), then little-endian fields. parse() throws
// ProtocolError naming what is malformed (length, tag, version, counts, ids >= num_clients, unsorted ids).
struct AdvertiseMsg {
  int client = -1;
  std::array<uint8_t, 32> c_pk{};  // encryption key agreement (X25519)
  std::array<uint8_t, 32> s_pk{};  // mask key agreement (X25519)

  std::vector<uint8_t> serialize() const;  // 70 bytes
  static AdvertiseMsg parse(const uint8_t* p, size_t n, int num_clients = kMaxClients);
  friend bool operator==(const AdvertiseMsg&, const AdvertiseMsg&) = default;
};

// AEAD (XChaCha20-Poly1305) of (from, to, share of s_sk_from, share of b_from) for client `to`.
struct ShareMsg {
  int from = -1;
  int to = -1;
  std::vector<uint8_t> ciphertext;  // kShareCiphertextBytes

  std::vector<uint8_t> serialize() const;  // 14 + 112 bytes
  static ShareMsg parse(const uint8_t* p, size_t n, int num_clients = kMaxClients);
  friend bool operator==(const ShareMsg&, const ShareMsg&) = default;
};

struct UnmaskMsg {
  int client = -1;
  // (v, this client's share of b_v) for every survivor v in U3 (SecAgg+: in its closed neighbourhood), ascending v;
  // shares are 32 bytes.
  std::vector<std::pair<int, std::vector<uint8_t>>> self_mask_shares;
  // (v, this client's share of s_sk_v) for every v in U2\U3 (dropped after sending shares; SecAgg+: its neighbours),
  // ascending v.
  std::vector<std::pair<int, std::vector<uint8_t>>> key_shares;

  std::vector<uint8_t> serialize() const;  // 14 + 36 per share
  static UnmaskMsg parse(const uint8_t* p, size_t n, int num_clients = kMaxClients);
  friend bool operator==(const UnmaskMsg&, const UnmaskMsg&) = default;
};

class SecAggClient {
 public:
  // Checks cfg and 0 <= id < n; generates (c_sk, c_pk), (s_sk, s_pk) (X25519) and b_u (32 random bytes).
  SecAggClient(const SecAggConfig& cfg, int id);
  ~SecAggClient();  // wipes every secret
  SecAggClient(SecAggClient&&) noexcept;
  SecAggClient& operator=(SecAggClient&&) noexcept;
  SecAggClient(const SecAggClient&) = delete;
  SecAggClient& operator=(const SecAggClient&) = delete;

  int id() const;
  AdvertiseMsg advertise();
  // u1: the advertised keys the server forwards (ids sorted, unique, in range, including this client with its own
  // keys, no key listed twice; at least t of them in this client's closed neighbourhood) -> one encrypted ShareMsg for
  // every neighbour v in U1. Once per round.
  std::vector<ShareMsg> share_keys(const std::vector<AdvertiseMsg>& u1);
  // inbox: the ShareMsgs addressed to this client from its neighbours in U2 (senders plus self: at least t).
  // Decrypts and verifies each (ProtocolError naming the sender on failure; the client state is then unchanged),
  // returns y (length elements, each < 2^bits). x must have length elements < 2^bits. Once per round.
  std::vector<uint32_t> mask_input(const std::vector<ShareMsg>& inbox, const uint32_t* x);
  // survivors U3 (sorted, unique, including self, its neighbours in it a subset of U2, at least t of them in the
  // closed neighbourhood): shares of b_v for neighbours v in U3 and of s_sk_v for neighbours v in U2\U3.
  // ProtocolError if called before mask_input, if U3 is malformed, or if a previous call named a different U3 (that
  // would reveal both shares of some v); a repeat with the same U3 returns the same message.
  UnmaskMsg unmask(const std::vector<int>& survivors);
  // U2 as this client saw it: itself and the neighbours whose shares it holds (empty before mask_input).
  std::vector<int> u2() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class SecAggServer {
 public:
  explicit SecAggServer(const SecAggConfig& cfg);  // checks cfg
  ~SecAggServer();
  SecAggServer(SecAggServer&&) noexcept;
  SecAggServer& operator=(SecAggServer&&) noexcept;
  SecAggServer(const SecAggServer&) = delete;
  SecAggServer& operator=(const SecAggServer&) = delete;

  // ProtocolError on a duplicate or out-of-range id, or once U1 is fixed.
  void add_advertise(const AdvertiseMsg& m);
  // U1 sorted by id: the advertisers (under SecAgg+, the largest subset in which each member has t members of its
  // closed neighbourhood); TooFewClientsError if |U1| < t. The first successful call fixes U1.
  std::vector<AdvertiseMsg> advertised() const;
  // from must be in U1 and send once; exactly one share (from == from, 112-byte ciphertext) for every neighbour of
  // from in U1. Refused before U1 or after U2 is fixed. Validated fully before anything is stored.
  void add_shares(int from, const std::vector<ShareMsg>& shares);
  // Senders of shares, sorted (under SecAgg+, pruned as U1 is); TooFewClientsError if < t. The first successful call
  // (or inbox_for) fixes U2.
  std::vector<int> u2() const;
  // The shares addressed to client (a member of U2) from its neighbours in U2, ascending sender id.
  std::vector<ShareMsg> inbox_for(int client) const;
  // client in U2, once; y.size() == length and every element < 2^bits. Refused once U3 is fixed.
  void add_masked_input(int client, std::vector<uint32_t> y);
  // Senders of masked inputs, sorted; TooFewClientsError if < t or (SecAgg+) if a survivor, or a dropped client
  // with a surviving neighbour, has fewer than t survivors in its neighbourhood. The first successful call fixes U3.
  std::vector<int> survivors() const;
  // client in U3, once; self_mask_shares exactly for its closed neighbourhood in U3 and key_shares exactly for its
  // neighbours in U2\U3 (ascending, 32 bytes).
  void add_unmask(const UnmaskMsg& m);
  size_t unmask_count() const;
  // TooFewClientsError with fewer than t unmask responses, or fewer than t from some v's closed neighbourhood.
  // Reconstructs b_v (v in U3) and s_sk_v (v in U2\U3 with a surviving neighbour) from the t lowest responders among
  // v's neighbourhood, checks s_pk_v and (with a (t+1)-th response) share consistency (ProtocolError naming v),
  // removes the masks and returns sum_{v in U3} x_v mod 2^bits. A failed call changes nothing; a successful one ends
  // the round and later calls return the same sum.
  std::vector<uint32_t> finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Shamir t-of-n sharing of 32-byte secrets, word-wise over GF(2^16) (x^16 + x^12 + x^3 + x + 1), exposed for
// tests and reuse. xs: distinct nonzero x-coordinates (InvalidArgument otherwise).
uint16_t gf16_mul(uint16_t a, uint16_t b);
uint16_t gf16_inv(uint16_t a);  // InvalidArgument for 0
std::vector<std::array<uint8_t, 32>> shamir_split(const std::array<uint8_t, 32>& secret, int threshold,
                                                  const std::vector<uint16_t>& xs);
// Interpolates at 0 through all given points (pass exactly t shares for a t-of-n sharing).
std::array<uint8_t, 32> shamir_combine(const std::vector<uint16_t>& xs,
                                       const std::vector<std::array<uint8_t, 32>>& shares);

}  // namespace conduit::fl
