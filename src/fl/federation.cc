// The federation's round protocol (federation.h). Per round, between the server (rank 0) and each host h that holds
// a sampled client (hosts without one get the header only):
//
//   S -> h  header: round, continue flag, the sampled clients (ids of the whole federation, ascending)
//   S -> h  the global weights (f32)
//   with secure aggregation (ids inside the protocol: positions in the sampled list):
//     h -> S  AdvertiseMsg of each of its sampled clients            (round 0 of Bonawitz et al.)
//     S -> h  U1: every advertised pair of keys
//     h -> S  the encrypted shares of each of its clients              (round 1)
//     S -> h  U2 and the shares addressed to each of its clients
//     h -> S  per client: its outcome (sent / straggler / dropout), statistics, and the masked update   (round 2)
//     S -> h  U3, the clients whose masked update arrived
//     h -> S  UnmaskMsg of each of its clients in U3                   (round 3)
//   without: h -> S  per client: outcome, statistics and the f32 update
//
// An update is the client's delta times its weight w_k = n_k / mean partition size (uniform 1 under differential
// privacy), followed by the weight itself: the server divides the sum by the summed weights (McMahan et al.'s
// average, weighted by samples), which secure aggregation hides client by client.
#include "fl/federation.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "core/clock.h"
#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
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

// The largest framed message a rank accepts: 4 GiB (a model of 1G parameters, or a corrupt length).
constexpr uint64_t kMaxMessage = uint64_t(1) << 32;

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
    uint64_t n = u64();
    need(n);
    Bytes v(b_.begin() + long(pos_), b_.begin() + long(pos_ + n));
    pos_ += n;
    return v;
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

// Framed point-to-point messages over the communicator's transport, with the communicator's deadline and byte
// counts.
class Wire {
 public:
  explicit Wire(coll::Communicator& c) : c_(c) {}
  void send(int peer, uint32_t tag, const Bytes& b) { send_many({peer}, tag, {&b}); }
  // Sends b[i] to peers[i], all at once.
  void send_many(const std::vector<int>& peers, uint32_t tag, const std::vector<const Bytes*>& b) {
    std::vector<uint64_t> sizes(peers.size());
    std::vector<net::RequestPtr> reqs;
    for (size_t i = 0; i < peers.size(); ++i) {
      sizes[i] = b[i]->size();
      reqs.push_back(isend(peers[i], tag, &sizes[i], 8));
      if (!b[i]->empty()) reqs.push_back(isend(peers[i], tag, b[i]->data(), b[i]->size()));
      sent += 8 + b[i]->size();
    }
    net::wait_all_or_give_up(c_.transport(), reqs, Deadline::after(c_.timeout_s()));
  }
  Bytes recv(int peer, uint32_t tag, const char* what) { return std::move(recv_many({peer}, tag, what)[0]); }
  std::vector<Bytes> recv_many(const std::vector<int>& peers, uint32_t tag, const char* what) {
    const Deadline d = Deadline::after(c_.timeout_s());
    std::vector<uint64_t> sizes(peers.size());
    std::vector<net::RequestPtr> reqs;
    for (size_t i = 0; i < peers.size(); ++i) reqs.push_back(irecv(peers[i], tag, &sizes[i], 8));
    wait_or_explain(reqs, d, peers, what);
    std::vector<Bytes> out(peers.size());
    reqs.clear();
    std::vector<int> from;
    for (size_t i = 0; i < peers.size(); ++i) {
      if (sizes[i] > kMaxMessage)
        throw ProtocolError(fmt::format("fl: rank {} announced a {} of {} bytes; allowed: at most {}", peers[i], what,
                                        sizes[i], kMaxMessage));
      out[i].resize(sizes[i]);
      received += 8 + sizes[i];
      if (sizes[i]) {
        reqs.push_back(irecv(peers[i], tag, out[i].data(), sizes[i]));
        from.push_back(peers[i]);
      }
    }
    wait_or_explain(reqs, d, from, what);
    return out;
  }
  uint64_t sent = 0, received = 0;

 private:
  net::RequestPtr isend(int peer, uint32_t tag, const void* p, size_t n) {
    return c_.transport().isend(c_.transport_rank(peer), net::make_tag(net::kUser, c_.id(), tag), p, n);
  }
  net::RequestPtr irecv(int peer, uint32_t tag, void* p, size_t n) {
    return c_.transport().irecv(c_.transport_rank(peer), net::make_tag(net::kUser, c_.id(), tag), p, n);
  }
  void wait_or_explain(const std::vector<net::RequestPtr>& reqs, const Deadline& d, const std::vector<int>& peers,
                       const char* what) {
    try {
      net::wait_all_or_give_up(c_.transport(), reqs, d);
    } catch (const TimeoutError&) {
      std::string silent;
      for (size_t i = 0; i < reqs.size(); ++i)
        if (!reqs[i]->done()) silent += (silent.empty() ? "" : ", ") + std::to_string(peers[i]);
      throw TimeoutError(
          fmt::format("fl: rank {} waited {:.0f} s (the timeout) for the {} of rank(s) {}; raise "
                      "--timeout if their local training takes longer",
                      c_.rank(), c_.timeout_s(), what, silent));
    }
  }
  coll::Communicator& c_;
};

int host_of_client(int client, int world) { return 1 + client % (world - 1); }

// Per-client facts every rank derives from the config alone.
struct Federation {
  std::vector<std::vector<int64_t>> parts;
  std::vector<double> speed;    // slow-down factor of each client's compute (1: the reference)
  double mean_examples = 0;     // mean partition size
  double max_weight = 1;        // max over clients of n_k / mean_examples
  int64_t reference_steps = 1;  // a speed-1 client's full local work on a mean-sized partition
  double tv_distance = 0;
};

int64_t full_steps(const FlConfig& c, int64_t examples) {
  return int64_t(c.local_epochs) * ((examples + c.batch_size - 1) / c.batch_size);
}

Federation make_federation(const FlConfig& c, LocalTrainer& t) {
  Federation f;
  const std::vector<int64_t> labels = t.train_labels();
  const int classes = t.num_classes();
  f.parts = partition(labels, classes, c.clients, parse_partition(c.partition), c.seed);
  f.tv_distance = mean_label_tv_distance(label_histograms(labels, classes, f.parts));
  f.mean_examples = double(labels.size()) / c.clients;
  for (const auto& p : f.parts) f.max_weight = std::max(f.max_weight, double(p.size()) / f.mean_examples);
  f.reference_steps =
      std::max<int64_t>(1, int64_t(c.local_epochs) * int64_t(std::ceil(f.mean_examples / c.batch_size)));
  f.speed.assign(size_t(c.clients), 1.0);
  if (c.speed_sigma > 0) {
    std::mt19937_64 g(c.seed ^ 0x5eedc11e5eedull);
    std::normal_distribution<double> n(0.0, c.speed_sigma);
    for (auto& s : f.speed) s = std::exp(n(g));
  }
  return f;
}

// What happens to a sampled client this round.
enum class Fate : uint64_t { sent = 0, straggler = 1, dropout = 2 };

struct Plan {
  Fate fate = Fate::sent;
  int64_t max_steps = 0;  // > 0: partial work
};

Plan plan_client(const FlConfig& c, const Federation& f, int client, int round) {
  Plan p;
  if (c.dropout > 0) {
    std::mt19937_64 g(c.seed ^ (uint64_t(round) * 0x9e3779b97f4a7c15ull) ^ (uint64_t(client) << 20) ^ 0xd20);
    if (std::uniform_real_distribution<double>(0, 1)(g) < c.dropout) {
      p.fate = Fate::dropout;
      return p;
    }
  }
  if (c.deadline > 0) {
    const double budget = c.deadline * double(f.reference_steps);
    const int64_t steps = full_steps(c, int64_t(f.parts[size_t(client)].size()));
    if (double(steps) * f.speed[size_t(client)] > budget) {
      if (c.stragglers == "drop") {
        p.fate = Fate::straggler;
      } else {
        p.max_steps = std::max<int64_t>(1, int64_t(std::floor(budget / f.speed[size_t(client)])));
      }
    }
  }
  return p;
}

int secagg_threshold(const FlConfig& c, int sampled) {
  return std::min(sampled, std::max(2, int(std::floor(c.secagg_threshold * sampled)) + 1));
}

// The weighted update a client contributes: w * delta (DP: clipped to dp_clip first, w = 1), then w.
std::vector<float> weighted_update(const FlConfig& c, const Federation& f, const LocalResult& r) {
  std::vector<float> v(r.delta.size() + 1);
  double w = c.dp_noise > 0 || c.dp_clip > 0 ? 1.0 : double(r.examples) / f.mean_examples;
  std::vector<float> d = r.delta;
  if (c.dp_clip > 0) clip_l2(d.data(), d.size(), c.dp_clip);
  for (size_t i = 0; i < d.size(); ++i) v[i] = float(w * d[i]);
  v.back() = float(w);
  return v;
}

// Secure aggregation carries the weight element scaled into the codec's range.
double weight_scale(const FlConfig& c, const Federation& f) {
  const double wmax = c.dp_noise > 0 || c.dp_clip > 0 ? 1.0 : f.max_weight;
  return c.secagg_clip / wmax;
}

void check_finite(const std::vector<float>& v, int client) {
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i]))
      throw Error(
          fmt::format("fl: client {}'s update holds {} at element {}: its local training diverged; allowed: "
                      "a smaller --lr",
                      client, v[i], i));
}

// ---------------------------------------------------------------------------------------------------------------
// Hosts

void run_host(const FlConfig& c, coll::Communicator& comm, LocalTrainer& trainer, const Federation& f) {
  Wire w(comm);
  const int me = comm.rank(), world = comm.size();
  size_t n_weights = 0;
  for (;;) {
    Bytes hb = w.recv(0, kTagHeader, "round header");
    In h(hb, "round header");
    const int round = int(h.i64());
    const bool go = h.u64() != 0;
    const uint64_t ns = h.count(8);
    std::vector<int> sampled(ns);
    for (auto& s : sampled) {
      s = int(h.i64());
      if (s < 0 || s >= c.clients) throw ProtocolError(fmt::format("fl: round header names client {}", s));
    }
    h.done();
    if (!go) return;
    std::vector<int> mine;  // positions in `sampled`
    for (size_t i = 0; i < sampled.size(); ++i)
      if (host_of_client(sampled[i], world) == me) mine.push_back(int(i));
    if (mine.empty()) continue;
    Bytes wb = w.recv(0, kTagWeights, "global weights");
    if (wb.size() % 4 != 0 || (n_weights && wb.size() != n_weights * 4))
      throw ProtocolError(fmt::format("fl: the global weights are {} bytes; expected {}", wb.size(), n_weights * 4));
    std::vector<float> global(wb.size() / 4);
    std::memcpy(global.data(), wb.data(), wb.size());
    n_weights = global.size();

    std::map<int, std::unique_ptr<SecAggClient>> sa;
    std::map<int, std::vector<ShareMsg>> inbox;
    std::vector<int> u2;
    SecAggConfig scfg;
    if (c.secagg) {
      scfg.num_clients = int(sampled.size());
      scfg.threshold = secagg_threshold(c, scfg.num_clients);
      scfg.bits = c.secagg_bits;
      scfg.length = global.size() + 1;
      scfg.round_id = uint64_t(round);
      Out adv;
      adv.u64(mine.size());
      for (int i : mine) {
        sa[i] = std::make_unique<SecAggClient>(scfg, i);
        adv.blob(sa[i]->advertise().serialize());
      }
      w.send(0, kTagAdvertise, adv.take());
      Bytes ub = w.recv(0, kTagU1, "advertised keys");
      In u(ub, "advertised keys");
      std::vector<AdvertiseMsg> u1(u.count(8));
      for (auto& a : u1) {
        Bytes m = u.blob();
        a = AdvertiseMsg::parse(m.data(), m.size(), scfg.num_clients);
      }
      u.done();
      Out sh;
      sh.u64(mine.size());
      for (int i : mine) {
        std::vector<ShareMsg> s = sa[i]->share_keys(u1);
        sh.i64(i);
        sh.u64(s.size());
        for (auto& m : s) sh.blob(m.serialize());
      }
      w.send(0, kTagShares, sh.take());
      Bytes ib = w.recv(0, kTagInbox, "shares");
      In in(ib, "shares");
      u2.resize(in.count(8));
      for (auto& v : u2) v = int(in.i64());
      const uint64_t nc = in.count(16);
      for (uint64_t k = 0; k < nc; ++k) {
        const int i = int(in.i64());
        if (!sa.count(i)) throw ProtocolError(fmt::format("fl: the server sent shares for client {} (not here)", i));
        const uint64_t nm = in.count(8);
        for (uint64_t j = 0; j < nm; ++j) {
          Bytes m = in.blob();
          inbox[i].push_back(ShareMsg::parse(m.data(), m.size(), scfg.num_clients));
        }
      }
      in.done();
    }

    // Local training, then the update (masked under secure aggregation).
    Out up;
    up.u64(mine.size());
    std::vector<int> sent;
    for (int i : mine) {
      const int client = sampled[size_t(i)];
      Plan p = plan_client(c, f, client, round);
      if (c.secagg && !std::binary_search(u2.begin(), u2.end(), i)) p.fate = Fate::dropout;  // not in U2
      up.i64(i);
      up.u64(uint64_t(p.fate));
      if (p.fate != Fate::sent) continue;
      LocalWork work;
      work.max_steps = p.max_steps;
      work.seed = c.seed ^ (uint64_t(round) << 32) ^ uint64_t(client);
      LocalResult r = trainer.train(global, f.parts[size_t(client)], work);
      if (r.delta.size() != global.size())
        throw Error(
            fmt::format("fl: client {}'s update has {} elements, the model {}", client, r.delta.size(), global.size()));
      check_finite(r.delta, client);
      up.i64(r.examples);
      up.i64(r.steps);
      up.f64(r.loss);
      up.f64(r.compute_s);
      std::vector<float> v = weighted_update(c, f, r);
      if (c.secagg) {
        v.back() = float(double(v.back()) * weight_scale(c, f));
        FixedPointCodec codec(c.secagg_bits, c.secagg_clip, scfg.num_clients);
        std::vector<uint32_t> x(v.size());
        const size_t clipped = codec.encode(v.data(), v.size(), x.data(), work.seed ^ 0xc0dec);
        std::vector<uint32_t> y = sa[i]->mask_input(inbox[i], x.data());
        up.u64(clipped);
        up.blob(pack_elements(y.data(), y.size(), c.secagg_bits));
      } else {
        up.u64(0);
        Bytes b(v.size() * 4);
        std::memcpy(b.data(), v.data(), b.size());
        up.blob(b);
      }
      sent.push_back(i);
    }
    w.send(0, kTagUpdate, up.take());
    if (!c.secagg) continue;
    Bytes u3b = w.recv(0, kTagU3, "survivors");
    In u3in(u3b, "survivors");
    if (u3in.u64() == 0) continue;  // fewer than the threshold sent their update: the round is abandoned
    std::vector<int> u3(u3in.count(8));
    for (auto& v : u3) v = int(u3in.i64());
    u3in.done();
    Out um;
    std::vector<int> answering;
    for (int i : mine)
      if (std::binary_search(u3.begin(), u3.end(), i)) answering.push_back(i);
    um.u64(answering.size());
    for (int i : answering) um.blob(sa[i]->unmask(u3).serialize());
    w.send(0, kTagUnmask, um.take());
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Server

struct ClientReport {
  int pos = 0;  // position in the sampled list
  Fate fate = Fate::sent;
  int64_t examples = 0, steps = 0;
  double loss = 0, compute_s = 0;
  uint64_t clipped = 0;
  Bytes update;
};

std::vector<ClientReport> parse_updates(const Bytes& b, int host, const std::vector<int>& expect) {
  In in(b, fmt::format("updates of rank {}", host));
  const uint64_t n = in.count(16);
  if (n != expect.size())
    throw ProtocolError(
        fmt::format("fl: rank {} reported {} clients, it hosts {} of this round", host, n, expect.size()));
  std::vector<ClientReport> out(n);
  for (uint64_t k = 0; k < n; ++k) {
    auto& r = out[k];
    r.pos = int(in.i64());
    if (r.pos != expect[k])
      throw ProtocolError(fmt::format("fl: rank {} reported client position {}, expected {}", host, r.pos, expect[k]));
    const uint64_t fate = in.u64();
    if (fate > 2) throw ProtocolError(fmt::format("fl: rank {} reported outcome {} (allowed 0..2)", host, fate));
    r.fate = Fate(fate);
    if (r.fate != Fate::sent) continue;
    r.examples = in.i64();
    r.steps = in.i64();
    r.loss = in.f64();
    r.compute_s = in.f64();
    r.clipped = in.u64();
    r.update = in.blob();
  }
  in.done();
  return out;
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
  }

 private:
  std::ofstream f_;
};

nlohmann::json to_json(const RoundRecord& r) {
  nlohmann::json j = {{"round", r.round},           {"sampled", r.sampled},   {"aggregated", r.aggregated},
                      {"stragglers", r.stragglers}, {"dropouts", r.dropouts}, {"partial", r.partial},
                      {"train_loss", r.train_loss}, {"wall_s", r.wall_s},     {"modelled_s", r.modelled_s},
                      {"bytes_down", r.bytes_down}, {"bytes_up", r.bytes_up}, {"clipped", r.clipped},
                      {"abandoned", r.abandoned}};
  j["test_accuracy"] = r.test_accuracy >= 0 ? nlohmann::json(r.test_accuracy) : nlohmann::json();
  j["test_loss"] = r.test_loss >= 0 ? nlohmann::json(r.test_loss) : nlohmann::json();
  j["epsilon"] = r.epsilon >= 0 ? nlohmann::json(r.epsilon) : nlohmann::json();
  return j;
}

FlResult run_server(const FlConfig& c, coll::Communicator& comm, LocalTrainer& trainer, const Federation& f,
                    const std::function<void(const RoundRecord&)>& on_round) {
  Wire w(comm);
  const int world = comm.size();
  FlResult res;
  res.label_tv_distance = f.tv_distance;
  std::vector<float> global = trainer.initial_weights();
  const size_t n = global.size();
  ServerOptConfig oc;
  oc.name = c.server_opt;
  oc.lr = c.server_lr;
  oc.momentum = c.server_momentum;
  oc.beta1 = c.beta1;
  oc.beta2 = c.beta2;
  oc.tau = c.tau;
  auto opt = make_server_optimizer(oc, n);
  const bool dp = c.dp_noise > 0;
  std::unique_ptr<RdpAccountant> accountant;
  if (dp) {
    const int m = int(sample_clients(c.clients, c.fraction, c.min_clients, c.seed, 0).size());
    accountant = std::make_unique<RdpAccountant>(c.dp_noise, double(m) / c.clients);
  }
  namespace fs = std::filesystem;
  if (!c.output.empty()) fs::create_directories(c.output);
  MetricsFile metrics(c.output.empty() ? "" : (fs::path(c.output) / "metrics.jsonl").string());
  std::vector<int> hosts;
  for (int h = 1; h < world; ++h) hosts.push_back(h);
  Stopwatch total;

  for (int round = 0; round < c.rounds; ++round) {
    Stopwatch rs;
    const uint64_t sent0 = w.sent, recv0 = w.received;
    const std::vector<int> sampled = sample_clients(c.clients, c.fraction, c.min_clients, c.seed, uint64_t(round));
    std::map<int, std::vector<int>> by_host;  // host -> positions
    for (size_t i = 0; i < sampled.size(); ++i) by_host[host_of_client(sampled[i], world)].push_back(int(i));
    std::vector<int> active;
    for (auto& [h, v] : by_host) active.push_back(h);
    {
      Out o;
      o.i64(round);
      o.u64(1);
      o.u64(sampled.size());
      for (int s : sampled) o.i64(s);
      Bytes hb = o.take();
      w.send_many(hosts, kTagHeader, std::vector<const Bytes*>(hosts.size(), &hb));
      Bytes wb(n * 4);
      std::memcpy(wb.data(), global.data(), wb.size());
      w.send_many(active, kTagWeights, std::vector<const Bytes*>(active.size(), &wb));
    }

    RoundRecord rec;
    rec.round = round;
    rec.sampled = int(sampled.size());
    std::vector<double> sum(n + 1, 0.0);
    std::vector<ClientReport> reports;
    auto collect_updates = [&](bool masked) {
      std::vector<Bytes> ub = w.recv_many(active, kTagUpdate, "client updates");
      for (size_t k = 0; k < active.size(); ++k) {
        auto r = parse_updates(ub[k], active[k], by_host[active[k]]);
        for (auto& x : r) {
          if (x.fate == Fate::sent && !masked) {
            if (x.update.size() != (n + 1) * 4)
              throw ProtocolError(fmt::format("fl: rank {} sent an update of {} bytes for client {}; expected {}",
                                              active[k], x.update.size(), sampled[size_t(x.pos)], (n + 1) * 4));
            const float* v = reinterpret_cast<const float*>(x.update.data());
            for (size_t i = 0; i <= n; ++i) sum[i] += double(v[i]);
          }
          reports.push_back(std::move(x));
        }
      }
    };

    SecAggConfig scfg;
    scfg.num_clients = int(sampled.size());
    scfg.threshold = secagg_threshold(c, scfg.num_clients);
    scfg.bits = c.secagg_bits;
    scfg.length = n + 1;
    scfg.round_id = uint64_t(round);
    std::unique_ptr<SecAggServer> srv_holder;
    std::unique_ptr<FixedPointCodec> codec_holder;
    if (c.secagg) {
      srv_holder = std::make_unique<SecAggServer>(scfg);
      codec_holder = std::make_unique<FixedPointCodec>(c.secagg_bits, c.secagg_clip, scfg.num_clients);
      SecAggServer& srv = *srv_holder;
      std::vector<Bytes> ab = w.recv_many(active, kTagAdvertise, "advertised keys");
      for (size_t k = 0; k < active.size(); ++k) {
        In in(ab[k], fmt::format("keys of rank {}", active[k]));
        const uint64_t m = in.count(8);
        for (uint64_t j = 0; j < m; ++j) {
          Bytes b = in.blob();
          AdvertiseMsg a = AdvertiseMsg::parse(b.data(), b.size(), scfg.num_clients);
          if (host_of_client(sampled.at(size_t(a.client)), world) != active[k])
            throw ProtocolError(
                fmt::format("fl: rank {} advertised keys for client {} (not its own)", active[k], a.client));
          srv.add_advertise(a);
        }
        in.done();
      }
      {
        Out o;
        const auto u1 = srv.advertised();
        o.u64(u1.size());
        for (auto& a : u1) o.blob(a.serialize());
        Bytes b = o.take();
        w.send_many(active, kTagU1, std::vector<const Bytes*>(active.size(), &b));
      }
      std::vector<Bytes> sb = w.recv_many(active, kTagShares, "key shares");
      for (size_t k = 0; k < active.size(); ++k) {
        In in(sb[k], fmt::format("shares of rank {}", active[k]));
        const uint64_t m = in.count(16);
        for (uint64_t j = 0; j < m; ++j) {
          const int from = int(in.i64());
          if (!std::binary_search(by_host[active[k]].begin(), by_host[active[k]].end(), from))
            throw ProtocolError(fmt::format("fl: rank {} sent shares from client {} (not its own)", active[k], from));
          std::vector<ShareMsg> msgs(in.count(8));
          for (auto& s : msgs) {
            Bytes b = in.blob();
            s = ShareMsg::parse(b.data(), b.size(), scfg.num_clients);
          }
          srv.add_shares(from, msgs);
        }
        in.done();
      }
      {
        const std::vector<int> u2 = srv.u2();
        std::vector<Bytes> boxes;
        for (int h : active) {
          Out o;
          o.u64(u2.size());
          for (int v : u2) o.i64(v);
          std::vector<int> here;
          for (int i : by_host[h])
            if (std::binary_search(u2.begin(), u2.end(), i)) here.push_back(i);
          o.u64(here.size());
          for (int i : here) {
            auto box = srv.inbox_for(i);
            o.i64(i);
            o.u64(box.size());
            for (auto& s : box) o.blob(s.serialize());
          }
          boxes.push_back(o.take());
        }
        std::vector<const Bytes*> ptrs;
        for (auto& b : boxes) ptrs.push_back(&b);
        w.send_many(active, kTagInbox, ptrs);
      }
      collect_updates(true);
      for (auto& r : reports)
        if (r.fate == Fate::sent)
          srv.add_masked_input(r.pos, unpack_elements(r.update.data(), r.update.size(), c.secagg_bits, n + 1));
      int arrived = 0;
      for (auto& r : reports) arrived += r.fate == Fate::sent ? 1 : 0;
      if (arrived < scfg.threshold) {
        // Bonawitz et al.'s protocol stops here: fewer than t masked updates cannot be unmasked without revealing
        // one. The round is abandoned (no update applied) and the federation goes on.
        Out o;
        o.u64(0);
        Bytes b = o.take();
        w.send_many(active, kTagU3, std::vector<const Bytes*>(active.size(), &b));
        rec.abandoned = true;
      } else {
        const std::vector<int> u3 = srv.survivors();
        Out o;
        o.u64(1);
        o.u64(u3.size());
        for (int v : u3) o.i64(v);
        Bytes b = o.take();
        w.send_many(active, kTagU3, std::vector<const Bytes*>(active.size(), &b));
      }
    }
    if (c.secagg && !rec.abandoned) {
      SecAggServer& srv = *srv_holder;
      const FixedPointCodec& codec = *codec_holder;
      std::vector<Bytes> mb = w.recv_many(active, kTagUnmask, "unmasking shares");
      for (size_t k = 0; k < active.size(); ++k) {
        In in(mb[k], fmt::format("unmasking shares of rank {}", active[k]));
        const uint64_t m = in.count(8);
        for (uint64_t j = 0; j < m; ++j) {
          Bytes b = in.blob();
          UnmaskMsg u = UnmaskMsg::parse(b.data(), b.size(), scfg.num_clients);
          if (u.client < 0 || u.client >= int(sampled.size()) ||
              host_of_client(sampled[size_t(u.client)], world) != active[k])
            throw ProtocolError(fmt::format("fl: rank {} unmasked for client {} (not its own)", active[k], u.client));
          srv.add_unmask(u);
        }
        in.done();
      }
      const std::vector<uint32_t> total = srv.finish();
      std::vector<float> dec(n + 1);
      codec.decode(total.data(), n + 1, dec.data());
      for (size_t i = 0; i <= n; ++i) sum[i] = double(dec[i]);
      sum[n] /= weight_scale(c, f);
    }
    if (!c.secagg) collect_updates(false);

    // Statistics and the modelled round time: each client downloads the weights, computes its steps at its speed
    // (the seconds a step took here, measured) and uploads its update; the server waits for the slowest it
    // aggregates, and until the deadline when it drops stragglers.
    double loss_sum = 0, step_s_sum = 0, steps_sum = 0, slowest = 0;
    const double down_s = double(n * 4) * 8 / (c.downlink_mbps * 1e6);
    for (auto& r : reports) {
      if (r.fate == Fate::straggler) ++rec.stragglers;
      if (r.fate == Fate::dropout) ++rec.dropouts;
      if (r.fate != Fate::sent) continue;
      ++rec.aggregated;
      if (r.steps < full_steps(c, r.examples)) ++rec.partial;
      loss_sum += r.loss;
      step_s_sum += r.compute_s;
      steps_sum += double(r.steps);
      rec.clipped += r.clipped;
    }
    const double step_s = steps_sum > 0 ? step_s_sum / steps_sum : 0;
    for (auto& r : reports) {
      if (r.fate != Fate::sent) continue;
      const double up_s = double(r.update.size()) * 8 / (c.uplink_mbps * 1e6);
      slowest = std::max(slowest, down_s + double(r.steps) * f.speed[size_t(sampled[size_t(r.pos)])] * step_s + up_s);
    }
    if (rec.stragglers > 0) slowest = std::max(slowest, down_s + c.deadline * double(f.reference_steps) * step_s);
    rec.modelled_s = slowest;
    rec.train_loss = rec.aggregated ? loss_sum / rec.aggregated : 0;

    if (rec.aggregated > 0 && rec.clipped * 100 > uint64_t(rec.aggregated) * (n + 1))
      CONDUIT_LOG_WARN(
          "fl: round {}: {:.1f}% of the update elements exceeded --secagg-clip {} and were clipped (the average is "
          "biased towards zero); allowed: a larger --secagg-clip (with more --secagg-bits to keep the resolution)",
          round + 1, 100.0 * double(rec.clipped) / (double(rec.aggregated) * double(n + 1)), c.secagg_clip);
    if (rec.abandoned) rec.aggregated = 0;
    if (rec.aggregated > 0) {
      std::vector<float> avg(n);
      if (dp) {
        // DP-FedAvg's fixed denominator (the expected number of clients) and noise on the sum.
        std::vector<float> s(n);
        for (size_t i = 0; i < n; ++i) s[i] = float(sum[i]);
        add_gaussian_noise(s.data(), n, c.dp_noise * c.dp_clip, c.seed ^ (uint64_t(round) << 8) ^ 0xd9);
        for (size_t i = 0; i < n; ++i) avg[i] = s[i] / float(sampled.size());
      } else {
        const double wsum = sum[n];
        if (!(wsum > 0))
          throw ProtocolError(fmt::format("fl: round {}: the aggregated clients' weights sum to {}", round, wsum));
        for (size_t i = 0; i < n; ++i) avg[i] = float(sum[i] / wsum);
      }
      opt->step(global.data(), avg.data(), n);
    }
    if (accountant) {
      accountant->step(1);
      rec.epsilon = accountant->epsilon(c.dp_delta);
    }
    const bool last = round + 1 == c.rounds;
    if (last || (c.eval_every > 0 && (round + 1) % c.eval_every == 0)) {
      EvalResult e = trainer.evaluate(global);
      rec.test_accuracy = e.accuracy;
      rec.test_loss = e.loss;
      res.final_accuracy = e.accuracy;
    }
    rec.bytes_down = w.sent - sent0;
    rec.bytes_up = w.received - recv0;
    rec.wall_s = rs.seconds();
    metrics.line(to_json(rec));
    if (on_round) on_round(rec);
    res.rounds.push_back(rec);
  }
  {
    Out o;
    o.i64(c.rounds);
    o.u64(0);
    o.u64(0);
    Bytes hb = o.take();
    w.send_many(hosts, kTagHeader, std::vector<const Bytes*>(hosts.size(), &hb));
  }
  res.weights = std::move(global);
  res.wall_s = total.seconds();
  res.bytes_down = w.sent;
  res.bytes_up = w.received;
  if (!c.output.empty()) {
    nlohmann::json s = nlohmann::json::parse(config_to_json(c));
    s["final_test_accuracy"] = res.final_accuracy;
    s["wall_time_s"] = res.wall_s;
    s["bytes_down"] = res.bytes_down;
    s["bytes_up"] = res.bytes_up;
    s["label_tv_distance"] = res.label_tv_distance;
    double modelled = 0;
    for (auto& r : res.rounds) modelled += r.modelled_s;
    s["modelled_time_s"] = modelled;
    s["epsilon"] = res.rounds.empty() || res.rounds.back().epsilon < 0 ? nlohmann::json()
                                                                       : nlohmann::json(res.rounds.back().epsilon);
    write_text_file((fs::path(c.output) / "summary.json").string(), s.dump(2) + "\n");
  }
  return res;
}

}  // namespace

FlResult run_federation(const FlConfig& c, coll::CommPtr comm, LocalTrainer& trainer,
                        const std::function<void(const RoundRecord&)>& on_round) {
  check_config(c);
  if (comm->size() < 2)
    throw ConfigError(
        fmt::format("fl: workers: {} process(es); allowed: at least 2 (the server and a client host)", comm->size()));
  try {
    const Federation f = make_federation(c, trainer);
    if (comm->rank() == 0) return run_server(c, *comm, trainer, f, on_round);
    run_host(c, *comm, trainer, f);
    return {};
  } catch (const std::exception& e) {
    // The others would wait for this rank until their deadline: tell them now.
    comm->transport().abort(fmt::format("fl: rank {} failed: {}", comm->rank(), e.what()));
    throw;
  }
}

}  // namespace conduit::fl
