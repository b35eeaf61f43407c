// The federation's round protocol (federation.h). Per round, between the server (rank 0) and each host h that holds
// a sampled client (hosts without one get the header only):
//
//   S -> h  header: round, continue flag, the sampled clients (ids of the whole federation, ascending); with secure
//           aggregation then the round's 32-byte graph seed (SecAgg+'s graph, drawn afresh each round) and its k
//           (0: every pair; the server's choice under --secagg-neighbors auto, so every rank builds one graph)
//   S -> h  the global weights (f32; with SCAFFOLD then the server's control variate)
//   with secure aggregation (ids inside the protocol: positions in the sampled list):
//     h -> S  AdvertiseMsg of each of its sampled clients            (round 0 of Bonawitz et al.)
//     S -> h  U1: every advertised pair of keys
//     h -> S  the encrypted shares of each of its clients              (round 1)
//     S -> h  U2 and the shares addressed to each of its clients
//     h -> S  a message per client: its outcome (sent / straggler / dropout), masked vector, steps and seconds
//     S -> h  U3 (the clients whose masked vector arrived), or "abandoned" when fewer than t did
//     h -> S  UnmaskMsg of each of its clients in U3                   (round 3)
//   without: h -> S  a message per client: its outcome, training loss, f32 update, steps and seconds
//
// The server takes the update messages in turns, one of each host's in each (a host's in its order), and sums each
// before taking the next: it holds one update, not the round's (plus what the transports buffer of messages it has
// not asked for yet: tcp and shm up to 64 MiB a peer). A host keeps its posted updates until they are sent, at most
// kHostWindowBytes of them (and always one): past that it waits for its oldest to go before posting the next. In
// turns, a host's oldest update is taken after at most one update of each other host, not after their whole lists.
// (Over shm and MPI a host's message moves only while that host waits, so a host whose window is full can wait for
// another host to reach its next wait; within the same deadline.)
//
// A client's vector is its delta times its weight w_k = n_k / mean partition size (1 under differential privacy);
// under secure aggregation more elements carry its training loss (scaled into the codec's range) and, exactly, the
// count of its elements the codec clipped (count_digits), so the server learns their sums only. The server knows the
// sample counts (the partition) and divides by the summed weights of the clients that sent (McMahan et al.'s
// sample-weighted average). The steps and seconds are the simulation's own measurement (for the modelled round time),
// not client data.
//
// SCAFFOLD (Karimireddy et al. 2020, option II): the weights message also carries the server's control variate c, and
// each hosted client keeps its own c_i (zero until it first trains). A client trains with the gradient corrected by
// c - c_i, computes c_i+ = c_i - c + (x - y) / (K lr) from its K steps, and appends w_k * (c_i+ - c_i) * s to its
// vector (s = lr times the reference client's steps: the same scale as a weight update, for secure aggregation's clip).
// The server adds the weighted sum / (s N) to c, so c stays the sample-weighted mean of every client's c_i (the
// global objective's, not the clients' plain mean). A client commits c_i+ only once its vector is in the applied
// sum: at once without secure aggregation, on U3 of a round that is not abandoned with it.
#include "fl/federation.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sodium.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "core/clock.h"
#include "core/cpus.h"
#include "core/env.h"
#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "fl/checkpoint.h"
#include "fl/partition.h"
#include "fl/privacy.h"
#include "fl/secagg.h"
#include "fl/server_opt.h"
#include "net/tags.h"

namespace conduit::fl {
namespace {

using Bytes = std::vector<uint8_t>;

// User tags (top byte 0x46, "F": apart from the trainer's and the sync schemes' tags).
enum FlTag : uint32_t {
  kTagHeader = 0x46000001,
  kTagWeights = 0x46000002,
  kTagAdvertise = 0x46000003,
  kTagU1 = 0x46000004,
  kTagShares = 0x46000005,
  kTagInbox = 0x46000006,
  kTagUpdate = 0x46000007,
  kTagU3 = 0x46000008,
  kTagUnmask = 0x46000009,
};

// Under secure aggregation the loss is a non-negative element scaled into [0, kTop * clip] (kTop < 1: float rounding
// stays inside the clip); losses above kLossCap count as kLossCap.
constexpr double kLossCap = 20.0, kTop = 0.999;
// A framed blob's length (the secure-aggregation messages' sizes are secagg.h's).
constexpr uint64_t kLen = 8;

class Out {
 public:
  void u64(uint64_t v) { put(&v, 8); }
  void i64(int64_t v) { put(&v, 8); }
  void f64(double v) { put(&v, 8); }
  void blob(const Bytes& b) {
    u64(b.size());
    put(b.data(), b.size());
  }
  void put(const void* p, size_t n) {
    const auto* c = static_cast<const uint8_t*>(p);
    b_.insert(b_.end(), c, c + n);
  }
  void reserve(size_t more) { b_.reserve(b_.size() + more); }
  Bytes take() { return std::move(b_); }

 private:
  Bytes b_;
};

class In {
 public:
  In(const Bytes& b, std::string what) : b_(b), what_(std::move(what)) {}
  uint64_t u64() {
    uint64_t v;
    get(&v, 8);
    return v;
  }
  int64_t i64() {
    int64_t v;
    get(&v, 8);
    return v;
  }
  double f64() {
    double v;
    get(&v, 8);
    return v;
  }
  // A count of items of at least `min_item` bytes each that the rest of the message can hold.
  uint64_t count(size_t min_item) {
    uint64_t n = u64();
    if (min_item > 0 && n > (b_.size() - pos_) / min_item)
      throw ProtocolError(fmt::format("fl: {} announces {} items in {} bytes left", what_, n, b_.size() - pos_));
    return n;
  }
  Bytes blob() {
    const auto [p, n] = view();
    return Bytes(p, p + n);
  }
  // A blob without copying it: its bytes inside the message (valid while the message is).
  std::pair<const uint8_t*, size_t> view() {
    uint64_t n = u64();
    need(n);
    const uint8_t* p = b_.data() + pos_;
    pos_ += n;
    return {p, size_t(n)};
  }
  // An id, position or round in [0, limit), checked before it narrows to int: ProtocolError naming it otherwise.
  int index(int64_t limit, std::string_view what) {
    const int64_t v = i64();
    if (v < 0 || v >= limit)
      throw ProtocolError(fmt::format("fl: {} names {} {}; allowed: 0..{}", what_, what, v, limit - 1));
    return int(v);
  }
  void get(void* p, size_t n) {
    need(n);
    std::memcpy(p, b_.data() + pos_, n);
    pos_ += n;
  }
  void done() const {
    if (pos_ != b_.size())
      throw ProtocolError(fmt::format("fl: {} has {} bytes after its end", what_, b_.size() - pos_));
  }

 private:
  void need(uint64_t n) const {
    if (n > b_.size() - pos_)
      throw ProtocolError(
          fmt::format("fl: {} is truncated ({} bytes, {} more needed at byte {})", what_, b_.size(), n, pos_));
  }
  const Bytes& b_;
  size_t pos_ = 0;
  std::string what_;
};

// Seconds as a person reads them: 0.001, 0.5, 2.5, 360, 24600 (not 2.46e+04; timeout_s is at least 0.001).
std::string seconds_text(double s) { return s >= 100 ? fmt::format("{:.0f}", s) : fmt::format("{:.3g}", s); }

// The most bytes of update messages a host keeps posted (a message larger than this is posted alone).
constexpr uint64_t kHostWindowBytes = uint64_t(256) << 20;

// Framed point-to-point messages over the communicator's transport, with deadlines, size limits and byte counts.
class Wire {
 public:
  explicit Wire(coll::Communicator& c) : c_(c) {}
  // Sends still posted (an error unwinds past finish_sends): withdrawn, or the transport aborted, before their
  // buffers go.
  ~Wire() {
    for (auto& m : posted_)
      for (auto& r : m.reqs) {
        if (r->done()) continue;
        try {
          net::give_up(c_.transport(), r, "fl: a rank stopped with sends in flight");
        } catch (...) {
          c_.transport().abort("fl: a rank stopped with sends in flight");
        }
      }
  }
  Wire(const Wire&) = delete;
  Wire& operator=(const Wire&) = delete;
  // `steps` timeouts: a large message completes only once the receiver posts its receive (MPI's rendezvous, or past
  // tcp's and shm's unexpected-message budget), which may come after other ranks' work.
  void send(int peer, uint32_t tag, const Bytes& b, double steps = 1) { send_many({peer}, tag, {&b}, steps); }
  // Sends b[i] to peers[i], all at once.
  void send_many(const std::vector<int>& peers, uint32_t tag, const std::vector<const Bytes*>& b, double steps = 1) {
    std::vector<uint64_t> sizes(peers.size());
    std::vector<net::RequestPtr> reqs;
    for (size_t i = 0; i < peers.size(); ++i) {
      sizes[i] = b[i]->size();
      reqs.push_back(isend(peers[i], tag, &sizes[i], 8));
      if (!b[i]->empty()) reqs.push_back(isend(peers[i], tag, b[i]->data(), b[i]->size()));
      sent += 8 + b[i]->size();
    }
    wait_sent(reqs, steps, fmt::format("its message (tag {:#x}) to rank(s) {}", tag, fmt::join(peers, ", ")));
  }
  // Starts sending b to peer and keeps it until it is sent (messages of one tag to one peer arrive in order). First,
  // while the messages still posted and b together exceed `window` bytes, waits for the oldest to be sent (within
  // `steps` timeouts each; `what` names them in the error) and releases it.
  void post(int peer, uint32_t tag, Bytes b, uint64_t window, double steps, const char* what) {
    while (!posted_.empty() && posted_total_ + b.size() > window) {
      wait_sent(posted_.front().reqs, steps, fmt::format("{} to the server", what));
      for (auto& r : posted_.front().reqs)
        if (!r->done()) throw Error("fl: internal: a posted message was released before it was sent");
      posted_total_ -= posted_.front().bytes.size();
      posted_.pop_front();
    }
    Posted& m = posted_.emplace_back();
    m.reqs.reserve(2);  // (no allocation between an isend and its request's keeping)
    m.bytes = std::move(b);
    m.size = m.bytes.size();
    m.reqs.push_back(isend(peer, tag, &m.size, 8));
    if (!m.bytes.empty()) m.reqs.push_back(isend(peer, tag, m.bytes.data(), m.bytes.size()));
    sent += 8 + m.size;
    posted_total_ += m.size;
    peak_posted = std::max(peak_posted, posted_total_);
  }
  // Waits for every posted send, within `steps` timeouts from now, and releases their buffers.
  void finish_sends(double steps, const char* what) {
    std::vector<net::RequestPtr> all;
    for (auto& m : posted_) all.insert(all.end(), m.reqs.begin(), m.reqs.end());
    wait_sent(all, steps, fmt::format("{} to the server", what));
    posted_.clear();
    posted_total_ = 0;
  }
  // Receives one framed message from each of `peers`: at most caps[i] bytes from peers[i] (a longer announcement is
  // a ProtocolError before anything is allocated), within `steps` timeouts (the steps of the peers' work it spans).
  std::vector<Bytes> recv_many(const std::vector<int>& peers, uint32_t tag, const char* what,
                               const std::vector<uint64_t>& caps, double steps = 1) {
    return recv_many_until(peers, tag, what, caps, Deadline::after(c_.timeout_s() * steps), steps);
  }
  // The same by a deadline the caller set (`steps`: the timeouts it spans, for the error).
  std::vector<Bytes> recv_many_until(const std::vector<int>& peers, uint32_t tag, const char* what,
                                     const std::vector<uint64_t>& caps, const Deadline& d, double steps) {
    std::vector<uint64_t> sizes(peers.size());
    std::vector<net::RequestPtr> reqs;
    for (size_t i = 0; i < peers.size(); ++i) reqs.push_back(irecv(peers[i], tag, &sizes[i], 8));
    wait_or_explain(reqs, d, peers, what, steps);
    // Every announcement checked before any payload's receive is posted: a receive left posted into `out` while a
    // later peer's refusal unwinds would be written into freed memory.
    for (size_t i = 0; i < peers.size(); ++i)
      if (sizes[i] > caps[i])
        throw ProtocolError(fmt::format("fl: rank {} announced {} of {} bytes; allowed: at most {} at this step",
                                        peers[i], what, sizes[i], caps[i]));
    // (and every buffer allocated before the first is posted: a std::bad_alloc midway would leave it the same way)
    std::vector<Bytes> out(peers.size());
    for (size_t i = 0; i < peers.size(); ++i) out[i].resize(sizes[i]);
    reqs.clear();
    reqs.reserve(peers.size());
    std::vector<int> from;
    from.reserve(peers.size());
    for (size_t i = 0; i < peers.size(); ++i) {
      received += 8 + sizes[i];
      if (sizes[i]) {
        reqs.push_back(irecv(peers[i], tag, out[i].data(), sizes[i]));
        from.push_back(peers[i]);
      }
    }
    wait_or_explain(reqs, d, from, what, steps);
    return out;
  }
  // The server's sends that each host hands on to copies[i] of its clients: a deployed federation sends every client
  // its own, so `delivered` counts copies[i] of each (the simulation's processes carry one: `sent`).
  void send_to_clients(const std::vector<int>& peers, uint32_t tag, const std::vector<const Bytes*>& b,
                       const std::vector<uint64_t>& copies) {
    send_many(peers, tag, b);
    for (size_t i = 0; i < peers.size(); ++i) delivered += copies[i] * (8 + b[i]->size());
  }
  Bytes recv(int peer, uint32_t tag, const char* what, uint64_t cap, double steps = 1) {
    return std::move(recv_many({peer}, tag, what, {cap}, steps)[0]);
  }
  uint64_t sent = 0, received = 0;
  uint64_t delivered = 0;    // the server: what its clients would download (send_to_clients)
  uint64_t peak_posted = 0;  // the most bytes of posted messages held at once

 private:
  struct Posted {
    Bytes bytes;
    uint64_t size = 0;  // (the frame's length, sent from here)
    std::vector<net::RequestPtr> reqs;
  };
  // Waits for sends within `steps` timeouts; `what` names them and their receiver in the error.
  void wait_sent(const std::vector<net::RequestPtr>& reqs, double steps, const std::string& what) {
    try {
      net::wait_all_or_give_up(c_.transport(), reqs, Deadline::after(c_.timeout_s() * steps));
    } catch (const TimeoutError&) {
      throw TimeoutError(
          fmt::format("fl: rank {} could not hand {} within {} s ({:.0f} x --timeout-s); allowed: a larger --timeout-s",
                      c_.rank(), what, seconds_text(c_.timeout_s() * steps), steps));
    }
  }
  net::RequestPtr isend(int peer, uint32_t tag, const void* p, size_t n) {
    return c_.transport().isend(c_.transport_rank(peer), net::make_tag(net::kUser, c_.id(), tag), p, n);
  }
  net::RequestPtr irecv(int peer, uint32_t tag, void* p, size_t n) {
    return c_.transport().irecv(c_.transport_rank(peer), net::make_tag(net::kUser, c_.id(), tag), p, n);
  }
  void wait_or_explain(const std::vector<net::RequestPtr>& reqs, const Deadline& d, const std::vector<int>& peers,
                       const char* what, double steps) {
    try {
      net::wait_all(reqs, d);
    } catch (const TimeoutError&) {
      std::string silent;  // (before giving the receives up, which completes them)
      for (size_t i = 0; i < reqs.size(); ++i)
        if (!reqs[i]->done()) silent += (silent.empty() ? "" : ", ") + std::to_string(peers[i]);
      const std::string msg = fmt::format(
          "fl: rank {} waited {} s ({:.0f} x --timeout-s, the work of the clients one rank handles) for {} from "
          "rank(s) {}; allowed: a larger --timeout-s when local training, evaluation or the key exchange takes longer",
          c_.rank(), seconds_text(c_.timeout_s() * steps), steps, what, silent);
      give_up_all(reqs, msg);
      throw TimeoutError(msg);
    } catch (const std::exception& e) {
      give_up_all(reqs, e.what());
      throw;
    }
  }
  void give_up_all(const std::vector<net::RequestPtr>& reqs, const std::string& why) {
    for (auto& r : reqs) net::give_up(c_.transport(), r, why);
  }
  coll::Communicator& c_;
  std::deque<Posted> posted_;  // (a deque: the messages stay where they are as more are posted)
  uint64_t posted_total_ = 0;
};

int host_of_client(int client, int world) { return 1 + client % (world - 1); }

// Checkpoints are written after rounds R (counted from 1) that are a multiple of checkpoint_every, and the last.
bool checkpoint_after(const FlConfig& c, int64_t rounds_done) {
  return c.checkpoint_every > 0 && rounds_done > 0 &&
         (rounds_done % c.checkpoint_every == 0 || rounds_done == c.rounds);
}

// Per-client facts every rank derives from the config alone.
struct Federation {
  std::vector<std::vector<int64_t>> parts;
  std::vector<double> speed;    // slow-down factor of each client's compute (1: the reference)
  double mean_examples = 0;     // mean partition size
  int64_t reference_steps = 1;  // a speed-1 client's full local work on a mean-sized partition
  double tv_distance = 0;
  int64_t samples = 0;     // training samples
  uint64_t data_hash = 0;  // FNV-1a of their labels (a resume checks the data are the checkpoint's)
  // FNV-1a of the partition (each client's count and indices), and of the speed factors and the first round's dropout
  // draws: the ranks compare them at start-up (std's distributions are implementation-defined).
  uint64_t partition_hash = 0, draws_hash = 0;
  size_t n = 0;          // model weights
  size_t len = 0;        // elements of a client's update: n, or 2n with SCAFFOLD (its control variate's change)
  double control_scale = 1;  // SCAFFOLD: s, the control variates' scale on the wire
  int hosted = 1;            // the most clients one host hosts
  int max_per_host = 1;  // the most sampled clients one host can hold in a round
};

// SCAFFOLD: a host keeps a model-sized c_i for every client of its own that has trained. Refuses (before round 1,
// not when memory runs out mid-run) a federation whose hosts on this machine together could not.
void check_control_memory(const FlConfig& c, coll::Communicator& comm, const Federation& f) {
  const auto& hosts = comm.transport().hosts();
  const int here = hosts[size_t(comm.transport_rank(comm.rank()))];
  int local_hosts = 0;
  for (int r = 1; r < comm.size(); ++r) local_hosts += hosts[size_t(comm.transport_rank(r))] == here ? 1 : 0;
  const double need = double(local_hosts) * double(f.hosted) * double(f.n) * 4, have = usable_memory_bytes();
  if (have > 0 && need > 0.8 * have)
    throw ConfigError(fmt::format(
        "fl: scaffold: the {} client host(s) on this machine would keep {} clients' control variates of {} weights "
        "each, {:.1f} GB, and it has {:.1f} GB; allowed: more machines, fewer --clients or --scaffold false",
        local_hosts, f.hosted, f.n, need / 1e9, have / 1e9));
}

int round_neighbors(const FlConfig& c, int sampled);

// (the hosts on the server's machine: SecAgg's relay counts their share of it)
void check_secagg_memory_here(const FlConfig& c, coll::Communicator& comm) {
  if (!c.secagg) return;
  const auto& hosts = comm.transport().hosts();
  const int here = hosts[size_t(comm.transport_rank(comm.rank()))];
  int local_hosts = 0;
  for (int r = 1; r < comm.size(); ++r) local_hosts += hosts[size_t(comm.transport_rank(r))] == here ? 1 : 0;
  fl::check_secagg_memory(c, double(local_hosts) / std::max(1, comm.size() - 1));
}

int64_t full_steps(const FlConfig& c, int64_t examples) {
  return int64_t(c.local_epochs) * ((examples + c.batch_size - 1) / c.batch_size);
}

bool dp_on(const FlConfig& c) { return c.dp_noise > 0 || c.dp_clip > 0; }

double dropout_draw(const FlConfig& c, int client, int round);

Federation make_federation(const FlConfig& c, LocalTrainer& t, int world) {
  Federation f;
  const std::vector<int64_t> labels = t.train_labels();
  const int classes = t.num_classes();
  check_sample_count(c, int64_t(labels.size()));
  f.parts = partition(labels, classes, c.clients, parse_partition(c.partition), c.seed);
  f.tv_distance = mean_label_tv_distance(label_histograms(labels, classes, f.parts));
  f.samples = int64_t(labels.size());
  f.data_hash = 0xcbf29ce484222325ull;
  for (int64_t l : labels) f.data_hash = (f.data_hash ^ uint64_t(l)) * 0x100000001b3ull;
  f.mean_examples = double(labels.size()) / c.clients;
  f.reference_steps =
      std::max<int64_t>(1, int64_t(c.local_epochs) * int64_t(std::ceil(f.mean_examples / c.batch_size)));
  f.speed.assign(size_t(c.clients), 1.0);
  if (c.speed_sigma > 0) {
    std::mt19937_64 g(c.seed ^ 0x5eedc11e5eedull);
    std::normal_distribution<double> n(0.0, c.speed_sigma);
    for (auto& s : f.speed) s = std::exp(n(g));
  }
  // (what the ranks compare at start-up: a partition, speed or dropout that a rank draws otherwise than the server
  // would move clients' samples or outcomes without a word; std's gamma, normal and uniform_real distributions are
  // implementation-defined, so ranks built on other standard libraries can draw otherwise from the same seed)
  auto fnv = [](uint64_t h, uint64_t x) {
    for (int b = 0; b < 64; b += 8) h = (h ^ ((x >> b) & 0xff)) * 0x100000001b3ull;
    return h;
  };
  auto bits = [](double x) {
    uint64_t u;
    std::memcpy(&u, &x, 8);
    return u;
  };
  f.partition_hash = 0xcbf29ce484222325ull;
  for (const auto& part : f.parts) {
    f.partition_hash = fnv(f.partition_hash, part.size());
    for (int64_t i : part) f.partition_hash = fnv(f.partition_hash, uint64_t(i));
  }
  f.draws_hash = 0xcbf29ce484222325ull;
  for (double s : f.speed) f.draws_hash = fnv(f.draws_hash, bits(s));
  // (the first round's draws of at most 1024 clients: another implementation differs in nearly every draw, and a
  // million clients' generators would take seconds to seed)
  if (c.dropout > 0)
    for (int k = 0; k < std::min(c.clients, 1024); ++k) f.draws_hash = fnv(f.draws_hash, bits(dropout_draw(c, k, 0)));
  f.n = t.initial_weights().size();
  f.len = c.scaffold ? 2 * f.n : f.n;
  f.control_scale = c.lr * double(f.reference_steps);
  f.hosted = (c.clients + world - 2) / (world - 1);
  f.max_per_host = std::max(1, dp_on(c) ? f.hosted : std::min(f.hosted, clients_per_round(c)));
  return f;
}

// What happens to a sampled client this round.
enum class Fate : uint64_t { sent = 0, straggler = 1, dropout = 2 };

// The uniform draw in [0, 1) that decides whether `client` drops out of `round` (below the dropout probability).
double dropout_draw(const FlConfig& c, int client, int round) {
  std::mt19937_64 g(c.seed ^ (uint64_t(round) * 0x9e3779b97f4a7c15ull) ^ (uint64_t(client) << 20) ^ 0xd20);
  return std::uniform_real_distribution<double>(0, 1)(g);
}

struct Plan {
  Fate fate = Fate::sent;
  int64_t max_steps = 0;  // > 0: partial work
  int64_t steps = 0;      // the steps it trains when it sends
};

Plan plan_client(const FlConfig& c, const Federation& f, int client, int round) {
  Plan p;
  const int64_t steps = full_steps(c, int64_t(f.parts[size_t(client)].size()));
  p.steps = steps;
  if (c.dropout > 0 && dropout_draw(c, client, round) < c.dropout) {
    p.fate = Fate::dropout;
    return p;
  }
  if (c.deadline > 0) {
    const double budget = c.deadline * double(f.reference_steps);
    if (double(steps) * f.speed[size_t(client)] > budget) {
      // (partial: the steps that fit; a client too slow for one step is a straggler in either mode, else its one
      // step would overrun the deadline the round is modelled to keep)
      const auto fit = int64_t(std::floor(budget / f.speed[size_t(client)]));
      if (c.stragglers == "drop" || fit < 1) {
        p.fate = Fate::straggler;
      } else {
        p.max_steps = fit;
        p.steps = std::min(steps, p.max_steps);
      }
    }
  }
  return p;
}

// The codec's summand count: the round's sampled clients, or under DP (Poisson sampling: the count varies) a bound
// the count exceeds with negligible probability, fixed for the run (a round above it is abandoned).
int codec_summands(const FlConfig& c, int sampled) {
  if (!dp_on(c)) return sampled;
  return dp_max_sampled(c);
}

// The round's SecAgg+ k (0: every pair): the configured one where the round has more clients than a neighbourhood
// (k <= sampled - 2), or under auto choose_neighbors' (the server's: it sends it to the hosts).
int round_neighbors(const FlConfig& c, int sampled) {
  if (sampled < 4) return 0;
  const int k = c.secagg_neighbors >= 0
                    ? c.secagg_neighbors
                    : choose_neighbors(sampled, c.secagg_max_corrupt, c.secagg_max_dropout, c.secagg_threshold);
  return k > 0 && k <= sampled - 2 ? k : 0;
}

// Under secure aggregation a client's count of the elements its codec clipped travels exactly, as count_digits
// digits in base L + 1 (L the codec's max_level), least significant first, each an integer element of the masked
// vector after the loss: no digit exceeds L, so the codec's most clients' digits sum without wrapping, as their
// elements do. (Scaled into one element, as the loss is, one codec level was 9% of a client's elements at 8 bits and
// 10 clients: the sum's rounding hid the >1% clipped that the warning is for.)
int64_t count_base(const FlConfig& c, int sampled) {
  return FixedPointCodec(c.secagg_bits, c.secagg_clip, codec_summands(c, sampled)).max_level() + 1;
}
size_t count_digits(int64_t base, size_t len) {  // (a count is at most len)
  size_t d = 1;
  for (uint64_t rest = len; rest >= uint64_t(base); rest /= uint64_t(base)) ++d;
  return d;
}

SecAggConfig secagg_config(const FlConfig& c, int sampled, size_t len, int round,
                           const std::array<uint8_t, 32>& graph_seed, int neighbors) {
  SecAggConfig s;
  s.num_clients = sampled;
  s.neighbors = neighbors;
  s.threshold = threshold_for(group_size(s), c.secagg_threshold);
  s.bits = c.secagg_bits;
  s.length = len + 1 + count_digits(count_base(c, sampled), len);  // the vector, the loss, the clipped count
  s.round_id = uint64_t(round);
  if (s.neighbors > 0) s.graph_seed = graph_seed;
  return s;
}

// What shrinks secure aggregation's rounding under DP, for its messages: a level is secagg_clip / (L - 1), and a
// secagg_clip above dp_clip is range no element uses (an update of L2 norm dp_clip has none above dp_clip), so the
// first remedy is --secagg-clip down to dp_clip; a larger dp_clip raises the noise with it.
std::string dp_rounding_remedy(const FlConfig& c) {
  return c.secagg_clip > c.dp_clip
             ? fmt::format(
                   "a --secagg-clip of at most --dp-clip {} (it is {}: an update clipped to L2 norm {} has no "
                   "element above it, so the rest of the range only coarsens the rounding), or more --secagg-bits",
                   c.dp_clip, c.secagg_clip, c.dp_clip)
             : "more --secagg-bits, or a smaller --secagg-clip (elements above it are clipped)";
}

// The L2 bound a DP client clips its delta to: dp_clip, less what secure aggregation's stochastic rounding can add
// (up to one level, 1/scale, per element), so the encoded update's norm stays within dp_clip (the sensitivity the
// noise and the accountant assume).
double dp_clip_bound(const FlConfig& c, size_t n, const FixedPointCodec* codec) {
  if (!codec) return c.dp_clip;
  const double bound = c.dp_clip - std::sqrt(double(n)) / codec->scale();
  if (!(bound > 0))
    throw ConfigError(fmt::format(
        "fl: dp_clip: {} leaves no room for secure aggregation's rounding ({:.3g} in L2 for {} weights at {} bits "
        "and --secagg-clip {}); allowed: {}",
        c.dp_clip, std::sqrt(double(n)) / codec->scale(), n, c.secagg_bits, c.secagg_clip, dp_rounding_remedy(c)));
  return bound;
}

// The weighted update a client contributes: w * delta (DP: clipped first, w = 1).
std::vector<float> weighted_update(const FlConfig& c, const Federation& f, const LocalResult& r, double dp_bound) {
  std::vector<float> v = r.delta;
  if (dp_on(c)) {
    if (!c.dp_unclipped_for_testing) clip_l2(v.data(), v.size(), dp_bound);
    return v;
  }
  const double w = double(r.examples) / f.mean_examples;
  for (auto& x : v) x = float(w * x);
  return v;
}

void check_finite(const std::vector<float>& v, int client) {
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i]))
      throw Error(fmt::format(
          "fl: client {}'s update holds {} at element {}: its local training diverged; allowed: a smaller --lr", client,
          v[i], i));
}

// ---------------------------------------------------------------------------------------------------------------
// Hosts

// SCAFFOLD resumed: the c_i of a host's clients, from the generation the server resumes from.
struct HostResume {
  int64_t round = -1;  // the generation's rounds (-1: not resumed)
  std::string dir;
  std::map<int, std::vector<float>> control;
};

// Read before the ranks meet, under start-up's deadline: once the rounds start every wait has a step's deadline (the
// server's send of the first round's weights among them: over MPI, and in-process, a send completes only once its
// receive is posted), which reading large files could outlast. The generation is the one the server takes, the newest
// complete one (the first round's header says which the server took).
HostResume read_host_resume(const FlConfig& c, coll::Communicator& comm, const Federation& f) {
  HostResume h;
  h.dir = resume_checkpoint_dir(c.resume);
  h.round = read_latest_checkpoint(h.dir).round;
  const int me = comm.rank(), world = comm.size();
  // (another --workers regroups the clients: each host keeps its own)
  h.control = read_host_checkpoints(h.dir, h.round, f.n, c.clients,
                                    [&](int client) { return host_of_client(client, world) == me; });
  return h;
}

void host_rounds(const FlConfig& c, coll::Communicator& comm, LocalTrainer& trainer, const Federation& f, Wire& w,
                 HostResume resumed);

// Returns the most bytes of updates it held posted at once.
uint64_t run_host(const FlConfig& c, coll::Communicator& comm, LocalTrainer& trainer, const Federation& f,
                  HostResume resumed) {
  Wire w(comm);
  try {
    if (c.scaffold) check_control_memory(c, comm, f);
    host_rounds(c, comm, trainer, f, w, std::move(resumed));
    return w.peak_posted;
  } catch (const std::exception& e) {
    // Before the Wire gives up its posted sends (which may abort the transport with a reason of its own): the
    // others hear why this rank stopped.
    comm.transport().abort(fmt::format("fl: rank {} failed: {}", comm.rank(), e.what()));
    throw;
  }
}

void host_rounds(const FlConfig& c, coll::Communicator& comm, LocalTrainer& trainer, const Federation& f, Wire& w,
                 HostResume resumed) {
  const int me = comm.rank(), world = comm.size();
  const size_t n = f.n, len = f.len;
  const uint64_t max_sampled = uint64_t(c.clients);
  const size_t down = c.scaffold ? 2 * n : n;  // the weights, and SCAFFOLD's server control variate
  std::map<int, std::vector<float>> control;   // SCAFFOLD: c_i of each hosted client that trained (absent: zeros)
  int first = -1;                              // the round this host started at (a resumed run's is not 0)
  // Each step of the key exchange spans every host's work for each of its clients (k key pairs; k x m key agreements
  // and share encryptions; k unmaskings), which at thousands of clients a round outlasts one step, and the server
  // takes a step's messages only once every host's has come. (One step more than the server's wait, which may
  // start after this one: the server, which names the silent ranks, times out first.)
  const double per_client = 2.0 + f.max_per_host;
  for (;;) {
    // The next header comes after the server's aggregation and evaluation and the other hosts' training.
    Bytes hb = w.recv(0, kTagHeader, "the next round's header", 8 * (3 + max_sampled) + 40, 2.0 + f.max_per_host);
    In h(hb, "round header");
    const int round = h.index(int64_t(c.rounds) + 1, "round");
    // SCAFFOLD: this host's file of the rounds before this one (the server wrote its own before sending this
    // header), written once the weights are in: over MPI the server's send of them completes only when this host
    // posts their receive, and a large file's write and fsync could outlast that send's deadline.
    bool save = false;
    auto save_now = [&] {
      if (save) write_host_checkpoint(checkpoint_dir(c.output), me, round, control, n);
      save = false;
    };
    if (first < 0) {
      first = round;
      if (resumed.round >= 0) {
        // The server resumed after `round` rounds (its choice of generation): this host read that generation's c_i.
        if (resumed.round != round)
          throw ProtocolError(fmt::format(
              "fl: resume: the server resumed after round {}, and rank {} read its clients' control variates of "
              "round {} from '{}' (a newer checkpoint written there in between?); allowed: a checkpoint folder no "
              "run writes to while a run resumes from it",
              round, me, resumed.round, resumed.dir));
        control = std::move(resumed.control);
      }
    } else {
      save = c.scaffold && checkpoint_after(c, round);
    }
    const bool go = h.u64() != 0;
    const uint64_t ns = h.count(8);
    std::vector<int> sampled(ns);
    for (auto& s : sampled) s = h.index(c.clients, "client");
    std::array<uint8_t, 32> graph_seed{};
    int neighbors = 0;
    if (c.secagg) {
      h.get(graph_seed.data(), graph_seed.size());
      const int64_t k = h.i64();
      if (k != 0 && (k < 2 || k % 2 != 0 || k > int64_t(sampled.size()) - 2))
        throw ProtocolError(
            fmt::format("fl: the round header says k = {} for {} clients; allowed: 0 or an even "
                        "number in 2..{}",
                        k, sampled.size(), int64_t(sampled.size()) - 2));
      neighbors = int(k);
    }
    h.done();
    if (!go) {
      save_now();
      return;
    }
    std::vector<int> mine;  // positions in `sampled`
    for (size_t i = 0; i < sampled.size(); ++i)
      if (host_of_client(sampled[i], world) == me) mine.push_back(int(i));
    if (mine.empty()) {
      save_now();
      continue;
    }
    const uint64_t m = sampled.size(), k = mine.size();
    Bytes wb = w.recv(0, kTagWeights, "the global weights", down * 4);
    save_now();
    if (wb.size() != down * 4)
      throw ProtocolError(fmt::format("fl: the global weights are {} bytes; expected {}", wb.size(), down * 4));
    std::vector<float> global(n), server_control;
    std::memcpy(global.data(), wb.data(), n * 4);
    if (c.scaffold) {
      server_control.resize(n);
      std::memcpy(server_control.data(), wb.data() + n * 4, n * 4);
      for (float x : server_control)
        if (!std::isfinite(x))
          throw ProtocolError("fl: the server's SCAFFOLD control variate holds a non-finite value");
    }
    Bytes().swap(wb);
    std::map<int, std::vector<float>> pending;  // SCAFFOLD: c_i+ of the clients that sent, until their sum applies

    std::map<int, std::unique_ptr<SecAggClient>> sa;
    std::map<int, std::vector<ShareMsg>> inbox;
    std::vector<int> u2;
    std::unique_ptr<FixedPointCodec> codec;
    if (c.secagg) {
      const SecAggConfig scfg = secagg_config(c, int(m), f.len, round, graph_seed, neighbors);
      codec = std::make_unique<FixedPointCodec>(c.secagg_bits, c.secagg_clip, codec_summands(c, int(m)));
      Out adv;
      adv.u64(k);
      for (int i : mine) {
        sa[i] = std::make_unique<SecAggClient>(scfg, i);
        adv.blob(sa[i]->advertise().serialize());
      }
      w.send(0, kTagAdvertise, adv.take(), per_client);
      Bytes ub = w.recv(0, kTagU1, "the advertised keys", kLen + m * (kLen + kAdvertiseMsgBytes), per_client);
      In u(ub, "advertised keys");
      std::vector<AdvertiseMsg> u1(u.count(8));
      for (auto& a : u1) {
        Bytes b = u.blob();
        a = AdvertiseMsg::parse(b.data(), b.size(), scfg.num_clients);
      }
      u.done();
      // A client the server left out of U1 (SecAgg+: too few of its neighbours advertised) sits the round out: not in
      // U2, it counts as a dropout.
      std::vector<int> in_u1;
      for (int i : mine) {  // (U1 is sorted by client: the client checks it)
        auto it = std::lower_bound(u1.begin(), u1.end(), i, [](const AdvertiseMsg& a, int x) { return a.client < x; });
        if (it != u1.end() && it->client == i) in_u1.push_back(i);
      }
      Out sh;
      sh.u64(in_u1.size());
      for (int i : in_u1) {
        std::vector<ShareMsg> s = sa[i]->share_keys(u1);
        sh.i64(i);
        sh.u64(s.size());
        for (auto& msg : s) sh.blob(msg.serialize());
      }
      w.send(0, kTagShares, sh.take(), per_client);
      Bytes ib = w.recv(0, kTagInbox, "the shares", 2 * kLen + m * 8 + k * (2 * kLen + m * (kLen + kShareMsgBytes)),
                        per_client);
      In in(ib, "shares");
      u2.resize(in.count(8));
      for (auto& v : u2) v = in.index(int64_t(m), "client position");
      const uint64_t nc = in.count(16);
      for (uint64_t j = 0; j < nc; ++j) {
        const int i = in.index(int64_t(m), "client position");
        if (!sa.count(i)) throw ProtocolError(fmt::format("fl: the server sent shares for client {} (not here)", i));
        const uint64_t nm = in.count(8);
        for (uint64_t q = 0; q < nm; ++q) {
          Bytes b = in.blob();
          inbox[i].push_back(ShareMsg::parse(b.data(), b.size(), scfg.num_clients));
        }
      }
      in.done();
    }

    // Local training, then each client's update (masked under secure aggregation) posted at once (tcp's thread moves
    // it while the next client trains; shm and MPI when the host next waits): position, outcome, [loss without
    // secure aggregation, the vector], the steps and seconds measured. At most `window` bytes stay posted; the
    // oldest is taken after the other hosts' updates of its turn, which may wait for their training.
    const uint64_t window = c.host_window_bytes_for_testing ? c.host_window_bytes_for_testing : kHostWindowBytes;
    const double window_steps = 2.0 + f.max_per_host;
    for (int i : mine) {
      const int client = sampled[size_t(i)];
      Plan p = plan_client(c, f, client, round);
      if (c.secagg && !std::binary_search(u2.begin(), u2.end(), i)) p.fate = Fate::dropout;  // not in U2
      Out up;
      up.i64(i);
      up.u64(uint64_t(p.fate));
      if (p.fate != Fate::sent) {
        up.i64(0);
        up.f64(0);
        w.post(0, kTagUpdate, up.take(), window, window_steps, "its clients' updates");
        continue;
      }
      LocalWork work;
      work.max_steps = p.max_steps;
      work.seed = c.seed ^ (uint64_t(round) << 32) ^ uint64_t(client);
      std::vector<float> correction;  // SCAFFOLD: c - c_i
      if (c.scaffold) {
        correction = server_control;
        if (auto it = control.find(client); it != control.end())
          for (size_t j = 0; j < n; ++j) correction[j] -= it->second[j];
        work.correction = &correction;
      }
      LocalResult r = trainer.train(global, f.parts[size_t(client)], work);
      if (r.delta.size() != n)
        throw Error(fmt::format("fl: client {}'s update has {} elements, the model {}", client, r.delta.size(), n));
      check_finite(r.delta, client);
      if (!std::isfinite(r.loss))
        throw Error(
            fmt::format("fl: client {}'s training loss is {}: its local training diverged; allowed: a "
                        "smaller --lr",
                        client, r.loss));
      std::vector<float> v = weighted_update(c, f, r, dp_on(c) ? dp_clip_bound(c, n, codec.get()) : 0.0);
      if (c.scaffold) {
        // w_k (c_i+ - c_i) s after the weighted delta, c_i+ - c_i = -c + (x - y) / (K lr).
        if (r.steps <= 0)
          throw Error(
              fmt::format("fl: client {} reported {} local steps; SCAFFOLD needs at least one", client, r.steps));
        const double inv = 1.0 / (double(r.steps) * c.lr);
        const double wk = double(r.examples) / f.mean_examples;
        v.resize(len);
        for (size_t j = 0; j < n; ++j)
          v[n + j] = float(wk * (-double(server_control[j]) - double(r.delta[j]) * inv) * f.control_scale);
      }
      std::vector<float> sent;  // SCAFFOLD: w_k s (c_i+ - c_i) as the server will add it
      if (c.secagg) {
        // More elements: the loss scaled into [0, kTop * clip], then the clipped count's digits, exact.
        const double top = kTop * c.secagg_clip;
        v.push_back(float(top * std::min(std::max(r.loss, 0.0), kLossCap) / kLossCap));
        const int64_t base = codec->max_level() + 1;
        std::vector<uint32_t> x(len + 1 + count_digits(base, len));
        uint64_t clipped = codec->encode(v.data(), len + 1, x.data(), work.seed ^ 0xc0dec);
        for (size_t j = len + 1; j < x.size(); ++j, clipped /= uint64_t(base))
          x[j] = uint32_t(clipped % uint64_t(base));
        if (c.scaffold) {  // (the codec's clipped and rounded value)
          sent.resize(n);
          codec->decode(x.data() + n, n, sent.data());
        }
        std::vector<uint32_t> y = sa[i]->mask_input(inbox[i], x.data());
        const Bytes packed = pack_elements(y.data(), y.size(), c.secagg_bits);
        up.reserve(kLen + packed.size() + 16);  // (kept until the server takes it: no spare capacity)
        up.blob(packed);
      } else {
        if (c.scaffold) sent.assign(v.begin() + long(n), v.begin() + long(len));
        up.f64(r.loss);
        up.reserve(kLen + len * 4 + 16);
        up.u64(len * 4);
        up.put(v.data(), len * 4);
      }
      if (c.scaffold) {
        // The client keeps c_i+ as the server adds it: under secure aggregation a clipped part left out of c would
        // never be corrected and would move SCAFFOLD's fixed point.
        const double back = double(f.mean_examples) / (double(r.examples) * f.control_scale);
        auto it = control.find(client);
        std::vector<float>& next = pending[client];
        next.resize(n);
        for (size_t j = 0; j < n; ++j)
          next[j] = float((it == control.end() ? 0.0 : double(it->second[j])) + double(sent[j]) * back);
        check_finite(next, client);
      }
      up.i64(r.steps);
      up.f64(r.compute_s);
      w.post(0, kTagUpdate, up.take(), window, window_steps, "its clients' updates");
    }
    // (the server takes the hosts' updates in turns: the slowest host's training, or the others'; one step more than
    // the server's wait, which may start after this one)
    w.finish_sends(2.0 + f.max_per_host, "its clients' updates");
    if (!c.secagg) {  // every update sent is in the sum
      for (auto& [client, next] : pending) control[client] = std::move(next);
      continue;
    }
    // (after the other hosts' training too: the server sends U3 once every update has arrived)
    Bytes u3b = w.recv(0, kTagU3, "the survivors", 2 * kLen + m * 8, 1.0 + f.max_per_host);
    In u3in(u3b, "survivors");
    if (u3in.u64() == 0) {  // fewer than the threshold sent their update: the round is abandoned
      u3in.done();
      continue;
    }
    std::vector<int> u3(u3in.count(8));
    for (auto& v : u3) v = u3in.index(int64_t(m), "client position");
    u3in.done();
    Out um;
    std::vector<int> answering;
    for (int i : mine)
      if (std::binary_search(u3.begin(), u3.end(), i)) answering.push_back(i);
    // (U3's vectors are the sum the server applies; the unmasking below completes or fails the whole run)
    for (int i : answering)
      if (auto it = pending.find(sampled[size_t(i)]); it != pending.end()) control[it->first] = std::move(it->second);
    um.u64(answering.size());
    for (int i : answering) um.blob(sa[i]->unmask(u3).serialize());
    w.send(0, kTagUnmask, um.take(), per_client);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Server

struct ClientReport {
  int pos = 0;  // position in the sampled list
  Fate fate = Fate::sent;
  double loss = 0;            // without secure aggregation
  uint64_t update_bytes = 0;  // its vector's size on the wire, for the modelled upload
};

// One client's message from its host (run_host's order: position, outcome, [loss, vector], steps, seconds); `update`
// is its vector inside b (none unless it sent).
ClientReport parse_update(const Bytes& b, int host, int expect, bool masked, int64_t* steps, double* seconds,
                          std::pair<const uint8_t*, size_t>* update) {
  In in(b, fmt::format("the update of rank {}", host));
  ClientReport r;
  const int64_t pos = in.i64();
  if (pos != expect)
    throw ProtocolError(fmt::format("fl: rank {} reported client position {}, expected {}", host, pos, expect));
  r.pos = expect;
  const uint64_t fate = in.u64();
  if (fate > 2) throw ProtocolError(fmt::format("fl: rank {} reported outcome {} (allowed 0..2)", host, fate));
  r.fate = Fate(fate);
  if (r.fate == Fate::sent) {
    if (!masked) r.loss = in.f64();
    // (a client checks its own update and loss before sending: a non-finite one here is the peer's fault, and summed
    // it surfaced as a global model the server could not step, blamed on --server-lr)
    if (!std::isfinite(r.loss))
      throw ProtocolError(fmt::format(
          "fl: rank {} reported a loss of {} for its client at position {}; allowed: finite", host, r.loss, expect));
    *update = in.view();
    r.update_bytes = update->second;
  }
  *steps = in.i64();
  *seconds = in.f64();
  in.done();
  // (bounded: the server sums them over the run; an infinite time made the modelled time null in the summary)
  if (*steps < 0 || *steps > (int64_t{1} << 40) || !(*seconds >= 0) || !std::isfinite(*seconds))
    throw ProtocolError(
        fmt::format("fl: rank {} reported {} steps in {} s; allowed: 0 to 2^40 steps in a finite time of 0 s or more",
                    host, *steps, *seconds));
  return r;
}

class MetricsFile {
 public:
  explicit MetricsFile(const std::string& path) {
    if (path.empty()) return;
    f_.open(path, std::ios::trunc);
    if (!f_) throw ConfigError(fmt::format("fl: output: cannot write '{}'", path));
  }
  void line(const nlohmann::json& j) {
    if (!f_.is_open()) return;
    f_ << j.dump() << '\n';
    f_.flush();
    if (!f_) throw Error("fl: output: cannot write metrics.jsonl (disk full?)");
  }

 private:
  std::ofstream f_;
};

nlohmann::json optional(double v) { return v >= 0 ? nlohmann::json(v) : nlohmann::json(); }

nlohmann::json to_json(const RoundRecord& r) {
  return {{"kind", "round"},
          {"round", r.round},
          {"sampled", r.sampled},
          {"aggregated", r.aggregated},
          {"stragglers", r.stragglers},
          {"dropouts", r.dropouts},
          {"partial", r.partial},
          {"abandoned", r.abandoned},
          {"abandon_reason", r.abandon_reason},
          {"secagg_neighbors", r.secagg_neighbors},
          {"train_loss", optional(r.train_loss)},
          {"test_accuracy", optional(r.test_accuracy)},
          {"test_loss", optional(r.test_loss)},
          {"wall_s", r.wall_s},
          {"modelled_s", r.modelled_s},
          {"bytes_down", r.bytes_down},
          {"wire_bytes_down", r.wire_bytes_down},
          {"bytes_up", r.bytes_up},
          {"clipped", r.clipped},
          {"epsilon", optional(r.epsilon)}};
}

// A secret 256-bit key (DP's sampling and noise must not be reproducible from the run's recorded settings, nor from
// what the run releases: each use draws from a ChaCha20 keystream under a key derived from it).
SecretKey secret_key(const FlConfig& c) {
  return c.dp_secret_seed_for_testing ? secret_from_seed(c.dp_secret_seed_for_testing) : random_secret();
}
enum : uint64_t { kSamplingKey = 1, kNoiseKey = 2 };

// The round's clients: fixed-size sampling, or under DP each client independently with probability `fraction`
// (Poisson sampling, what the accountant assumes), from the secret.
std::vector<int> sample_round(const FlConfig& c, int round, const SecretKey& secret) {
  if (!dp_on(c)) return sample_clients(c.clients, c.fraction, c.min_clients, c.seed, uint64_t(round));
  KeyStream g(derive_key(secret, kSamplingKey, uint64_t(round)));
  std::vector<int> out;
  for (int k = 0; k < c.clients; ++k)
    if (g.unit() < c.fraction) out.push_back(k);
  return out;
}

FlResult run_server(const FlConfig& c, coll::Communicator& comm, LocalTrainer& trainer, const Federation& f,
                    const std::function<void(const RoundRecord&)>& on_round) {
  Wire w(comm);
  const int world = comm.size();
  FlResult res;
  res.label_tv_distance = f.tv_distance;
  std::vector<float> global = trainer.initial_weights();
  const size_t n = global.size(), len = f.len;
  std::vector<float> server_control(c.scaffold ? n : 0);  // SCAFFOLD's c
  auto opt = make_server_optimizer(server_opt_config(c), n);
  const bool dp = dp_on(c);
  const SecretKey secret = dp ? secret_key(c) : SecretKey{};
  std::unique_ptr<RdpAccountant> accountant;
  if (c.dp_noise > 0) accountant = std::make_unique<RdpAccountant>(c.dp_noise, c.fraction);
  namespace fs = std::filesystem;
  if (!c.output.empty()) fs::create_directories(c.output);
  std::vector<int> hosts;
  for (int h = 1; h < world; ++h) hosts.push_back(h);
  Stopwatch total;
  double step_s = 0;  // the last measured seconds a local step took
  int first = 0;      // rounds done before this run (a resumed one)
  std::string resumed_dir;  // the checkpoints it resumed from
  if (c.checkpoint_every > 0 && holds_checkpoints(checkpoint_dir(c.output)))
    throw ConfigError(fmt::format(
        "fl: output: '{}' holds an earlier run's checkpoints; allowed: another --output (a resumed run writes to a "
        "folder of its own)",
        checkpoint_dir(c.output)));
  if (!c.resume.empty()) {
    const std::string dir = resume_checkpoint_dir(c.resume);
    resumed_dir = dir;
    ServerCheckpoint s = read_latest_checkpoint(dir);
    check_resume(c, s);
    if (s.weights.size() != n || s.control.size() != server_control.size())
      throw ConfigError(fmt::format("fl: resume: the checkpoint in '{}' holds {} weights, the model has {}", dir,
                                    s.weights.size(), n));
    if (s.samples != f.samples || s.data_hash != f.data_hash)
      throw ConfigError(fmt::format(
          "fl: resume: the training data differ from the checkpoint's ({} samples, labels checksum {:016x}; here {} "
          "and {:016x}); allowed: the same data (data_dir may move, not change)",
          s.samples, s.data_hash, f.samples, f.data_hash));
    global = std::move(s.weights);
    server_control = std::move(s.control);
    opt->load_state(s.optimizer);
    if (accountant) {
      check_dp_ledger_writable(dir);  // (raised after every round below: before round 1, not after its release)
      // Rounds released after this checkpoint by the run that wrote it are released again below, with new noise:
      // both releases count.
      const int64_t released = std::max<int64_t>(s.accountant_steps, read_dp_ledger(dir));
      if (released > s.accountant_steps)
        CONDUIT_LOG_WARN(
            "fl: resume: {} round(s) after the checkpoint were released before (differential privacy's "
            "ledger): counted again, as they will be released again with new noise",
            released - s.accountant_steps);
      accountant->step(released);
    }
    step_s = s.step_s;
    res.rounds_applied = int(s.rounds_applied);
    first = int(s.round);
    CONDUIT_LOG_INFO("fl: resuming after round {} from '{}'", first, dir);
  }
  // (opened once the folder is known to be this run's: it truncates)
  MetricsFile metrics(c.output.empty() ? "" : (fs::path(c.output) / "metrics.jsonl").string());

  for (int round = first; round < c.rounds; ++round) {
    Stopwatch rs;
    const uint64_t sent0 = w.sent, recv0 = w.received, delivered0 = w.delivered;
    RoundRecord rec;
    rec.round = round + 1;
    std::vector<int> sampled = sample_round(c, round, secret);
    // Secure aggregation cannot hide one client's update among fewer than two, and under DP its codec holds at most
    // dp_max_sampled summands: such a round is abandoned.
    const bool too_few = c.secagg && (sampled.size() < 2 || (dp && int(sampled.size()) > dp_max_sampled(c)));
    rec.sampled = int(sampled.size());
    if (too_few) sampled.clear();
    const uint64_t m = sampled.size();
    std::array<uint8_t, 32> graph_seed{};
    const int neighbors = c.secagg ? round_neighbors(c, int(m)) : 0;
    std::map<int, std::vector<int>> by_host;  // host -> positions
    for (size_t i = 0; i < sampled.size(); ++i) by_host[host_of_client(sampled[i], world)].push_back(int(i));
    std::vector<int> active;
    size_t most = 1;
    for (auto& [h, v] : by_host) {
      active.push_back(h);
      most = std::max(most, v.size());
    }
    // (a host's clients this round, for the downloads each of them would make)
    auto clients_of = [&](const std::vector<int>& to) {
      std::vector<uint64_t> out;
      for (int h : to) out.push_back(by_host.count(h) ? by_host[h].size() : 0);
      return out;
    };
    auto caps = [&](uint64_t base, uint64_t per_client) {
      std::vector<uint64_t> out;
      for (int h : active) out.push_back(base + by_host[h].size() * per_client);
      return out;
    };
    {
      Out o;
      o.i64(round);
      o.u64(1);
      o.u64(sampled.size());
      for (int s : sampled) o.i64(s);
      if (c.secagg) {  // (SecAgg+'s graph: unknown to anyone before the round starts)
        if (sodium_init() < 0) throw Error("fl: libsodium cannot start (no entropy source?): SecAgg+ needs randomness");
        randombytes_buf(graph_seed.data(), graph_seed.size());
        o.put(graph_seed.data(), graph_seed.size());
        o.i64(neighbors);
      }
      Bytes hb = o.take();
      w.send_to_clients(hosts, kTagHeader, std::vector<const Bytes*>(hosts.size(), &hb), clients_of(hosts));
      Bytes wb((n + server_control.size()) * 4);
      std::memcpy(wb.data(), global.data(), n * 4);
      if (!server_control.empty()) std::memcpy(wb.data() + n * 4, server_control.data(), n * 4);
      w.send_to_clients(active, kTagWeights, std::vector<const Bytes*>(active.size(), &wb), clients_of(active));
    }

    std::vector<double> sum(len + 1, 0.0);  // the clients' vectors, then the losses
    std::vector<ClientReport> reports;
    int64_t steps_measured = 0;
    double seconds_measured = 0;
    const bool masked = c.secagg;
    std::unique_ptr<SecAggServer> srv;
    size_t masked_len = 0;  // the masked vector's elements (secagg_config)
    // One message a client, in turns of one from each host (a host's in its order): each is summed (or added to
    // secure aggregation's running sum) and released before the next is taken, so the server holds one update at a
    // time, not the round's, and a host's oldest posted update is never behind another host's whole list.
    auto collect_updates = [&] {
      const uint64_t cap = 2 * kLen + 16 + (masked ? masked_len * 4 : 8 + len * 4) + 16;
      const double steps = 1.0 + double(most);
      const Deadline d = Deadline::after(comm.timeout_s() * steps);
      for (size_t turn = 0; turn < most; ++turn)
        for (int h : active) {
          if (turn >= by_host[h].size()) continue;
          const int pos = by_host[h][turn];
          Bytes b = std::move(w.recv_many_until({h}, kTagUpdate, "the client updates", {cap}, d, steps)[0]);
          int64_t st = 0;
          double sec = 0;
          std::pair<const uint8_t*, size_t> u{nullptr, 0};  // the vector, inside b
          ClientReport x = parse_update(b, h, pos, masked, &st, &sec, &u);
          steps_measured += st;
          seconds_measured += sec;
          if (x.fate == Fate::sent && masked) {
            srv->add_masked_input(x.pos, unpack_elements(u.first, u.second, c.secagg_bits, masked_len));
          } else if (x.fate == Fate::sent) {
            if (u.second != len * 4)
              throw ProtocolError(fmt::format("fl: rank {} sent an update of {} bytes for client {}; expected {}", h,
                                              u.second, sampled[size_t(x.pos)], len * 4));
            thread_local std::vector<float> v;
            v.resize(len);
            std::memcpy(v.data(), u.first, len * 4);  // (the vector need not be aligned inside the message)
            for (size_t i = 0; i < len; ++i)
              if (!std::isfinite(v[i]))
                throw ProtocolError(
                    fmt::format("fl: rank {} sent an update for client {} whose element {} is {}; "
                                "allowed: finite values",
                                h, sampled[size_t(x.pos)], i, v[i]));
            if (dp) {
              // The noise and the accountant rest on no update's norm passing dp_clip: the server sees each one in
              // the clear here and holds it to that (a host that does not clip is refused; rounding is clipped).
              const double norm = clip_l2(v.data(), len, c.dp_clip);
              if (norm > c.dp_clip * (1 + 1e-6))
                throw ProtocolError(fmt::format(
                    "fl: rank {} sent an update for client {} of L2 norm {:.6g}; allowed: at most --dp-clip {} "
                    "(the bound differential privacy's noise is scaled to)",
                    h, sampled[size_t(x.pos)], norm, c.dp_clip));
            }
            for (size_t i = 0; i < len; ++i) sum[i] += double(v[i]);
            sum[len] += x.loss;
          }
          reports.push_back(x);
        }
    };

    // (the key exchange's waits span each host's work for every one of its clients, as run_host's do)
    const double per_client = 1.0 + double(most);
    std::unique_ptr<FixedPointCodec> codec;
    if (masked && m > 0) {
      const SecAggConfig scfg = secagg_config(c, int(m), f.len, round, graph_seed, neighbors);
      rec.secagg_neighbors = scfg.neighbors;
      masked_len = scfg.length;
      srv = std::make_unique<SecAggServer>(scfg);
      codec = std::make_unique<FixedPointCodec>(c.secagg_bits, c.secagg_clip, codec_summands(c, int(m)));
      std::vector<Bytes> ab =
          w.recv_many(active, kTagAdvertise, "the advertised keys", caps(kLen, kLen + kAdvertiseMsgBytes), per_client);
      for (size_t k = 0; k < active.size(); ++k) {
        In in(ab[k], fmt::format("the keys of rank {}", active[k]));
        const uint64_t cnt = in.count(8);
        for (uint64_t j = 0; j < cnt; ++j) {
          Bytes b = in.blob();
          AdvertiseMsg a = AdvertiseMsg::parse(b.data(), b.size(), scfg.num_clients);
          if (host_of_client(sampled.at(size_t(a.client)), world) != active[k])
            throw ProtocolError(
                fmt::format("fl: rank {} advertised keys for client {} (not its own)", active[k], a.client));
          srv->add_advertise(a);
        }
        in.done();
      }
      {
        Out o;
        const auto u1 = srv->advertised();
        o.u64(u1.size());
        for (auto& a : u1) o.blob(a.serialize());
        Bytes b = o.take();
        w.send_to_clients(active, kTagU1, std::vector<const Bytes*>(active.size(), &b), clients_of(active));
      }
      std::vector<Bytes> sb = w.recv_many(active, kTagShares, "the key shares",
                                          caps(kLen, 2 * kLen + m * (kLen + kShareMsgBytes)), per_client);
      for (size_t k = 0; k < active.size(); ++k) {
        In in(sb[k], fmt::format("the shares of rank {}", active[k]));
        const uint64_t cnt = in.count(16);
        for (uint64_t j = 0; j < cnt; ++j) {
          const int from = in.index(int64_t(m), "client position");
          if (!std::binary_search(by_host[active[k]].begin(), by_host[active[k]].end(), from))
            throw ProtocolError(fmt::format("fl: rank {} sent shares from client {} (not its own)", active[k], from));
          std::vector<ShareMsg> msgs(in.count(8));
          for (auto& s : msgs) {
            Bytes b = in.blob();
            s = ShareMsg::parse(b.data(), b.size(), scfg.num_clients);
          }
          srv->add_shares(from, msgs);
        }
        in.done();
      }
      std::vector<Bytes>().swap(sb);  // (filed by recipient now: the received copy goes before the inboxes are built)
      {
        const std::vector<int> u2 = srv->u2();
        std::vector<Bytes> boxes;
        // (what the clients in U2 download: each its own inbox and the list U2, with a frame; the hosts' messages
        // carry the list once)
        uint64_t to_clients = 0;
        for (int h : active) {
          Out o;
          o.u64(u2.size());
          for (int v : u2) o.i64(v);
          std::vector<int> here;
          for (int i : by_host[h])
            if (std::binary_search(u2.begin(), u2.end(), i)) here.push_back(i);
          o.u64(here.size());
          for (int i : here) {
            auto box = srv->inbox_for(i);
            Out mine;
            mine.i64(i);
            mine.u64(box.size());
            for (auto& s : box) mine.blob(s.serialize());
            Bytes b = mine.take();
            to_clients += 8 + 8 * (1 + u2.size()) + b.size();
            o.put(b.data(), b.size());
          }
          boxes.push_back(o.take());
        }
        std::vector<const Bytes*> ptrs;
        for (auto& b : boxes) ptrs.push_back(&b);
        w.send_to_clients(active, kTagInbox, ptrs, std::vector<uint64_t>(active.size(), 0));
        w.delivered += to_clients;
      }
      collect_updates();
      int arrived = 0;
      for (auto& r : reports) arrived += r.fate == Fate::sent ? 1 : 0;
      Out o;
      std::vector<int> u3;
      if (arrived >= scfg.threshold) {
        try {
          u3 = srv->survivors();
        } catch (const TooFewClientsError& e) {  // SecAgg+: a neighbourhood kept fewer than t, or U3 split
          CONDUIT_LOG_INFO("fl: round {}: {}", rec.round, e.what());
          rec.abandoned = true;
          rec.abandon_reason = e.what();
        }
      } else {
        rec.abandoned = true;
        rec.abandon_reason = fmt::format("{} of {} sent, fewer than the threshold {}", arrived, m, scfg.threshold);
      }
      if (rec.abandoned) {
        // Bonawitz et al.'s protocol stops here: fewer than t masked vectors (in all, or among one client's
        // neighbours) cannot be unmasked without revealing one. The round is abandoned (nothing applied) and the
        // federation goes on.
        o.u64(0);
      } else {
        o.u64(1);
        o.u64(u3.size());
        for (int v : u3) o.i64(v);
      }
      Bytes b = o.take();
      w.send_to_clients(active, kTagU3, std::vector<const Bytes*>(active.size(), &b), clients_of(active));
      if (!rec.abandoned) {
        std::vector<Bytes> mb =
            w.recv_many(active, kTagUnmask, "the unmasking shares",
                        caps(kLen, kLen + kUnmaskMsgBaseBytes + m * kUnmaskMsgEntryBytes), per_client);
        for (size_t k = 0; k < active.size(); ++k) {
          In in(mb[k], fmt::format("the unmasking shares of rank {}", active[k]));
          const uint64_t cnt = in.count(8);
          for (uint64_t j = 0; j < cnt; ++j) {
            Bytes ub = in.blob();
            UnmaskMsg u = UnmaskMsg::parse(ub.data(), ub.size(), scfg.num_clients);
            if (u.client < 0 || u.client >= int(m) || host_of_client(sampled[size_t(u.client)], world) != active[k])
              throw ProtocolError(fmt::format("fl: rank {} unmasked for client {} (not its own)", active[k], u.client));
            srv->add_unmask(u);
          }
          in.done();
        }
        // (Every survivor in U3 answers: its host committed SCAFFOLD's c_i on U3, so the unmasking completes the round
        // or fails the run; too few answers is a host breaking the protocol.)
        const std::vector<uint32_t> total = srv->finish();
        std::vector<float> dec(len + 1);
        codec->decode(total.data(), len + 1, dec.data());
        for (size_t i = 0; i < len; ++i) sum[i] = double(dec[i]);
        const double top = kTop * c.secagg_clip;
        sum[len] = double(dec[len]) / top * kLossCap;  // the losses' sum
        // The clipped counts' digit sums (each below half the modulus: no wrap), most significant first.
        const uint64_t base = uint64_t(codec->max_level() + 1);
        rec.clipped = 0;
        for (size_t j = total.size(); j-- > len + 1;) rec.clipped = rec.clipped * base + total[j];
      }
    } else if (m > 0) {
      collect_updates();
    }
    if (too_few) {
      rec.abandoned = true;
      rec.abandon_reason = rec.sampled < 2 ? fmt::format("{} sampled, fewer than 2", rec.sampled)
                                           : fmt::format(
                                                 "{} sampled, more than the {} differential privacy's codec "
                                                 "was sized for",
                                                 rec.sampled, dp_max_sampled(c));
    }

    // Who sent, their summed weight, and the modelled round time: each client downloads the weights, computes its
    // steps at its speed (at the seconds a step took here, measured) and uploads its update; the server waits for the
    // slowest it aggregates, and until the deadline when someone was dropped: a straggler, or a dropout (a departed
    // client looks to the server like a slow one; it learns who left only when the deadline passes), an abandoned
    // round's included.
    double wsum = 0, slowest = 0;
    if (steps_measured > 0) step_s = seconds_measured / double(steps_measured);
    const double down_s = double((n + server_control.size()) * 4) * 8 / (c.downlink_mbps * 1e6);
    for (auto& r : reports) {
      const int client = sampled[size_t(r.pos)];
      if (r.fate == Fate::straggler) ++rec.stragglers;
      if (r.fate == Fate::dropout) ++rec.dropouts;
      if (r.fate != Fate::sent) continue;
      ++rec.aggregated;
      const Plan p = plan_client(c, f, client, round);
      if (p.max_steps > 0 && p.steps < full_steps(c, int64_t(f.parts[size_t(client)].size()))) ++rec.partial;
      wsum += dp ? 1.0 : double(f.parts[size_t(client)].size()) / f.mean_examples;
      const double up_s = double(r.update_bytes) * 8 / (c.uplink_mbps * 1e6);
      slowest = std::max(slowest, down_s + double(p.steps) * f.speed[size_t(client)] * step_s + up_s);
    }
    if (c.deadline > 0 && rec.stragglers + rec.dropouts > 0)
      slowest = std::max(slowest, down_s + c.deadline * double(f.reference_steps) * step_s);
    rec.modelled_s = slowest;
    if (rec.aggregated > 0 && !rec.abandoned && !dp) rec.train_loss = sum[len] / rec.aggregated;
    // (the count is exact: the warning fires at more than 1% at any --secagg-bits)
    if (rec.aggregated > 0 && !rec.abandoned && rec.clipped * 100 > uint64_t(rec.aggregated) * len)
      CONDUIT_LOG_WARN(
          "fl: round {}: {:.1f}% of the update elements exceeded --secagg-clip {} and were clipped (the average is "
          "biased towards zero); allowed: a larger --secagg-clip (with more --secagg-bits to keep the resolution)",
          rec.round, 100.0 * double(rec.clipped) / (double(rec.aggregated) * double(len)), c.secagg_clip);
    // (nothing of an abandoned round is applied: no client's update, partial work included, counts as aggregated;
    // its stragglers and dropouts stay, outcomes of the clients sampled)
    if (rec.abandoned) rec.aggregated = rec.partial = 0;

    // Under DP the noisy update is applied whoever sent (an empty sum included): skipping it would tell an observer
    // that nobody took part.
    if (rec.aggregated > 0 || dp) {
      std::vector<float> avg(n);
      if (dp) {
        // DP-FedAvg: noise z * clip on the sum, then the fixed denominator (the expected number of clients), so one
        // client's presence changes the average by at most clip / (q N).
        std::vector<float> s(n);
        for (size_t i = 0; i < n; ++i) s[i] = float(sum[i]);
        if (c.dp_noise > 0)
          add_gaussian_noise(s.data(), n, c.dp_noise * c.dp_clip, derive_key(secret, kNoiseKey, uint64_t(round)));
        const double denom = c.fraction * c.clients;
        for (size_t i = 0; i < n; ++i) avg[i] = float(double(s[i]) / denom);
      } else {
        for (size_t i = 0; i < n; ++i) avg[i] = float(sum[i] / wsum);
      }
      opt->step(global.data(), avg.data(), n);
      // SCAFFOLD: c += sum_k w_k (c_k+ - c_k) / N (the vectors carry s times that); dp is refused with it.
      for (size_t i = 0; i < server_control.size(); ++i) {
        server_control[i] += float(sum[n + i] / (f.control_scale * double(c.clients)));
        if (!std::isfinite(server_control[i]))
          throw Error(fmt::format(
              "fl: round {}: SCAFFOLD's control variate element {} is {} after the clients' changes; allowed: a "
              "smaller --lr",
              rec.round, i, server_control[i]));
      }
      for (size_t i = 0; i < n; ++i)
        if (!std::isfinite(global[i]))
          throw Error(
              fmt::format("fl: round {}: the global model's weight {} is {} after the server's update; "
                          "allowed: a smaller --server-lr{}",
                          rec.round, i, global[i], dp ? ", less --dp-noise or more clients a round" : ""));
    }
    if (rec.aggregated > 0) {
      ++res.rounds_applied;
    } else {
      CONDUIT_LOG_WARN("fl: round {} applied nothing ({} sampled: {} stragglers, {} dropouts{}{})", rec.round,
                       rec.sampled, rec.stragglers, rec.dropouts,
                       rec.abandoned ? "; secure aggregation abandoned it: " : "", rec.abandon_reason);
    }
    if (accountant) {
      accountant->step(1);  // a round counts whether or not anything was applied (the sampling happened)
      rec.epsilon = accountant->epsilon(c.dp_delta);
      // Before this round's model leaves the server (evaluated, sent to the next round's clients): a resume from an
      // earlier checkpoint counts it.
      const int64_t released = accountant->steps();
      if (c.checkpoint_every > 0 && !c.output.empty()) write_dp_ledger(checkpoint_dir(c.output), released);
      // And in the folder resumed from: another resume from there counts this run's releases too.
      if (!resumed_dir.empty()) write_dp_ledger(resumed_dir, std::max(released, read_dp_ledger(resumed_dir)));
    }
    const bool last = round + 1 == c.rounds;
    if (last || (c.eval_every > 0 && (round + 1) % c.eval_every == 0)) {
      EvalResult e = trainer.evaluate(global);
      rec.test_accuracy = e.accuracy;
      rec.test_loss = e.loss;
      res.final_accuracy = e.accuracy;
    }
    rec.bytes_down = w.delivered - delivered0;
    rec.wire_bytes_down = w.sent - sent0;
    rec.bytes_up = w.received - recv0;
    rec.wall_s = rs.seconds();
    metrics.line(to_json(rec));
    if (checkpoint_after(c, round + 1)) {
      ServerCheckpoint s;
      s.round = round + 1;
      s.config_json = config_to_json(c);
      s.weights = global;
      s.control = server_control;
      s.optimizer = opt->save_state();
      s.accountant_steps = accountant ? accountant->steps() : 0;
      s.step_s = step_s;
      s.rounds_applied = res.rounds_applied;
      s.host_files = c.scaffold ? world - 1 : 0;
      s.samples = f.samples;
      s.data_hash = f.data_hash;
      write_server_checkpoint(checkpoint_dir(c.output), s);
    }
    if (on_round) on_round(rec);
    res.rounds.push_back(rec);
  }
  {
    Out o;
    o.i64(c.rounds);
    o.u64(0);
    o.u64(0);
    if (c.secagg) {
      o.put(std::array<uint8_t, 32>{}.data(), 32);
      o.i64(0);
    }
    Bytes hb = o.take();
    w.send_many(hosts, kTagHeader, std::vector<const Bytes*>(hosts.size(), &hb));
  }
  res.weights = std::move(global);
  res.wall_s = total.seconds();
  for (const auto& r : res.rounds) res.bytes_down += r.bytes_down;
  res.wire_bytes_down = w.sent;
  res.bytes_up = w.received;
  if (!c.output.empty()) {
    nlohmann::json s = nlohmann::json::parse(config_to_json(c));
    s["kind"] = "summary";
    s["final_test_accuracy"] = res.final_accuracy;
    s["wall_time_s"] = res.wall_s;
    s["bytes_down"] = res.bytes_down;
    s["wire_bytes_down"] = res.wire_bytes_down;
    s["bytes_up"] = res.bytes_up;
    s["label_tv_distance"] = res.label_tv_distance;
    s["rounds_applied"] = res.rounds_applied;
    s["first_round"] = first + 1;  // (a resumed run's records start after its checkpoint)
    double modelled = 0;
    int sampled = 0, aggregated = 0;
    for (auto& r : res.rounds) {
      modelled += r.modelled_s;
      sampled += r.sampled;
      aggregated += r.aggregated;
    }
    s["modelled_time_s"] = modelled;
    s["sampled"] = sampled;
    s["aggregated"] = aggregated;
    s["epsilon"] = res.rounds.empty() ? nlohmann::json() : optional(res.rounds.back().epsilon);
    write_text_file((fs::path(c.output) / "summary.json").string(), s.dump(2) + "\n");
  }
  return res;
}

}  // namespace

// Secure aggregation's share relay holds a round's encrypted shares, m x (k or m - 1) of them, at once: the server
// twice (as received and filed by recipient, then filed and in the messages to the hosts), the hosts twice between
// them (sent and received). Every pair of 10,000 clients a round is about 10^8 shares, tens of GB at the server.
void check_secagg_memory(const FlConfig& c, double local_host_fraction) {
  if (!c.secagg) return;
  const int m = dp_on(c) ? dp_max_sampled(c) : clients_per_round(c);
  const int k = round_neighbors(c, m);
  const double shares = double(m) * double(k > 0 ? k : m - 1);
  const double per_share = double(kShareMsgBytes) + 64;  // (its framing and a parsed copy's vector and allocation)
  const double need = shares * per_share * (2 + 2 * local_host_fraction);
  const double have = usable_memory_bytes();
  if (have > 0 && need > 0.8 * have)
    throw ConfigError(fmt::format(
        "fl: secagg: {} clients a round with {} would relay {:.3g} key shares a round, {:.1f} GB on this machine, "
        "and it has {:.1f} GB; allowed: --secagg-neighbors auto or an even k (SecAgg+: each client shares with k "
        "others), fewer clients a round, or more machines",
        m, k > 0 ? fmt::format("SecAgg+'s k = {}", k) : std::string("every pair sharing keys"), shares, need / 1e9,
        have / 1e9));
}

FlResult run_federation(const FlConfig& c, coll::CommPtr comm, LocalTrainer& trainer,
                        const std::function<void(const RoundRecord&)>& on_round) {
  check_config(c);
  if (comm->size() != c.workers)
    throw ConfigError(
        fmt::format("fl: workers: {} does not match the communicator's {} ranks", c.workers, comm->size()));
  FlResult res;
  try {
    const Federation f = make_federation(c, trainer, comm->size());
    HostResume resumed;  // (read_host_resume: before the meeting)
    if (comm->rank() != 0 && c.scaffold && !c.resume.empty()) resumed = read_host_resume(c, *comm, f);
    // Every rank has loaded its data (make_federation reads the labels and the model) at its own pace: they meet here
    // under start-up's deadline, so that the first round's waits, of a step or a few, do not fail behind a slow
    // loader (a send that completes only once received, as MPI's large ones, would fail at its first step). They
    // compare what they loaded: a host that read another copy of the data (another folder on another machine) would
    // split the clients otherwise than the server without a word; and what they drew from the seed (the partition,
    // the speed factors, the dropouts), which a rank on another standard library can draw otherwise.
    {
      coll::CollOptions meet;
      meet.timeout_s = startup_timeout_seconds(c.timeout_s);
      constexpr size_t kFacts = 5;
      const int64_t mine[kFacts] = {f.samples, int64_t(f.data_hash), int64_t(f.n), int64_t(f.partition_hash),
                                    int64_t(f.draws_hash)};
      std::vector<int64_t> all(kFacts * size_t(comm->size()));
      comm->allgather(mine, all.data(), kFacts, DType::i64, meet).wait();
      // (the data first: other labels split otherwise as a matter of course)
      for (size_t first : {size_t(0), size_t(3)}) {
        const size_t count = first == 0 ? 3 : 2;
        std::vector<int> differ;
        for (int r = 1; r < comm->size(); ++r)
          if (!std::equal(all.begin() + long(first), all.begin() + long(first + count),
                          all.begin() + long(kFacts * size_t(r) + first)))
            differ.push_back(r);
        if (differ.empty()) continue;
        const size_t r = kFacts * size_t(differ[0]);
        if (first == 0)
          throw ConfigError(fmt::format(
              "fl: rank(s) {} loaded other training labels or a model of another size than rank 0 (rank 0: {} "
              "samples, labels checksum {:016x}, {} weights; rank {}: {}, {:016x}, {}); allowed: the same data set, "
              "--train-limit and --model on every rank",
              fmt::join(differ, ", "), all[0], uint64_t(all[1]), all[2], differ[0], all[r], uint64_t(all[r + 1]),
              all[r + 2]));
        throw ConfigError(fmt::format(
            "fl: rank(s) {} drew another partition of the clients, or other speed factors or dropouts, than rank 0 "
            "from the same seed and settings (rank 0: partition {:016x}, speeds and dropouts {:016x}; rank {}: "
            "{:016x}, {:016x}): the ranks were likely built on different C++ standard libraries, whose gamma, normal "
            "and uniform distributions differ; allowed: one conduit build (one standard library) on every machine",
            fmt::join(differ, ", "), uint64_t(all[3]), uint64_t(all[4]), differ[0], uint64_t(all[r + 3]),
            uint64_t(all[r + 4])));
      }
    }
    if (dp_on(c) && c.secagg) {
      // The clip left after the codec's rounding, known once the model's size is: stop before round 1 when none is
      // left, say so when it costs more than a tenth of the signal.
      const FixedPointCodec codec(c.secagg_bits, c.secagg_clip, dp_max_sampled(c));
      const double bound = dp_clip_bound(c, f.n, &codec);
      if (comm->rank() == 0 && bound < 0.9 * c.dp_clip)
        CONDUIT_LOG_WARN(
            "fl: dp_clip: updates are clipped to {:.3g}, not {} (secure aggregation's rounding at {} bits and "
            "--secagg-clip {} takes the rest of the bound); to keep more of it, allowed: {}",
            bound, c.dp_clip, c.secagg_bits, c.secagg_clip, dp_rounding_remedy(c));
      // The accountant takes one client to change a round's released update by at most dp_clip. A round that secure
      // aggregation abandons (fewer than 2 sampled, more than the codec's most, fewer than its threshold sent)
      // releases noise alone, and one client's presence can decide that, and with it whether the other clients'
      // updates appear: epsilon does not cover those events. A client's presence alone decides with one other client
      // sampled beside it (probability (N-1) q (1-q)^(N-2)) or exactly the codec's most; dropouts and dropped
      // stragglers put rounds near the threshold.
      const double q = c.fraction, others = double(c.clients - 1);
      auto others_sampled = [&](double k) {  // P(k of the others sampled), binomial
        if (k < 0 || k > others) return 0.0;
        if (q >= 1) return k == others ? 1.0 : 0.0;  // (0 x log 0 is not a number)
        return std::exp(std::lgamma(others + 1) - std::lgamma(k + 1) - std::lgamma(others - k + 1) + k * std::log(q) +
                        (others - k) * std::log1p(-q));
      };
      const double decides = others_sampled(1) + others_sampled(dp_max_sampled(c));
      // (partial work drops a client too slow for one step)
      const bool drops = c.dropout > 0 || c.deadline > 0;
      // (warned where it is not negligible beside delta over the run's rounds, or where anything drops)
      // (clipping alone accounts no epsilon: nothing to warn about)
      if (comm->rank() == 0 && c.dp_noise > 0 && (decides * double(c.rounds) > 0.1 * c.dp_delta || drops))
        CONDUIT_LOG_WARN(
            "fl: epsilon does not cover rounds secure aggregation abandons because of how many clients were sampled "
            "or sent, which one client's presence can decide (in {:.2g} of the rounds a client is sampled in, by the "
            "others sampled{}): allowed: a larger fraction x clients{} (docs/federated.md, Differential privacy)",
            decides, drops ? "; dropouts and dropped stragglers add rounds near the threshold" : "",
            drops ? " and no --dropout or --deadline (a deadline drops stragglers, under partial work those too slow "
                    "for one step)"
                  : "");
    }
    if (comm->rank() != 0) {
      res.host_peak_posted_bytes = run_host(c, *comm, trainer, f, std::move(resumed));
      return res;
    }
    check_secagg_memory_here(c, *comm);
    res = run_server(c, *comm, trainer, f, on_round);
  } catch (const std::exception& e) {
    // The others would wait for this rank until their deadline: tell them now.
    comm->transport().abort(fmt::format("fl: rank {} failed: {}", comm->rank(), e.what()));
    throw;
  }
  // (after the hosts were released: they need not hear of it)
  if (res.rounds_applied == 0)
    throw Error(fmt::format(
        "fl: none of the {} rounds aggregated an update (every sampled client was a straggler or dropped out, or too "
        "few were left for secure aggregation): the model learned nothing; allowed: a later --deadline, --stragglers "
        "partial, a lower --dropout or a lower --secagg-threshold",
        c.rounds));
  return res;
}

}  // namespace conduit::fl
