#include "coll/tuner.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>

#include "coll/algorithms.h"
#include "core/env.h"
#include "core/error.h"
#include "net/wire.h"

namespace conduit::coll {

const char* coll_op_name(CollOp op) {
  switch (op) {
    case CollOp::allreduce: return "allreduce";
    case CollOp::reduce_scatter: return "reduce_scatter";
    case CollOp::allgather: return "allgather";
    case CollOp::broadcast: return "broadcast";
    case CollOp::reduce: return "reduce";
  }
  return "?";
}

namespace {
const char* env_var(CollOp op) {
  switch (op) {
    case CollOp::allreduce: return "CONDUIT_ALLREDUCE";
    case CollOp::reduce_scatter: return "CONDUIT_REDUCE_SCATTER";
    case CollOp::allgather: return "CONDUIT_ALLGATHER";
    case CollOp::broadcast: return "CONDUIT_BROADCAST";
    case CollOp::reduce: return "CONDUIT_REDUCE";
  }
  return "";
}

LinkCost parse_link(const std::string& v, const std::string& what) {
  auto parts = split(v, ',');
  if (parts.size() != 3)
    throw ConfigError(fmt::format("{}: '{}' must be three numbers ALPHA,BETA,GAMMA", what, v));
  double x[3];
  for (int i = 0; i < 3; ++i) {
    char* end = nullptr;
    std::string t = trim(parts[i]);
    x[i] = std::strtod(t.c_str(), &end);
    if (t.empty() || *end != '\0' || !(x[i] >= 0) || !std::isfinite(x[i]))
      throw ConfigError(fmt::format("{}: '{}' is not a non-negative number", what, parts[i]));
  }
  return LinkCost{x[0], x[1], x[2]};
}

double log2i(int p) { return std::ceil(std::log2(std::max(p, 1))); }
bool pow2(int p) { return p > 0 && (p & (p - 1)) == 0; }
}  // namespace

CostModel parse_cost_model(const std::string& text, const std::string& what) {
  CostModel m;
  bool intra = false, inter = false;
  for (auto& part : split(text, ';')) {
    std::string t = trim(part);
    if (t.empty()) continue;
    auto eq = t.find('=');
    std::string k = eq == std::string::npos ? "" : trim(t.substr(0, eq));
    if ((k == "intra" && intra) || (k == "inter" && inter))
      throw ConfigError(fmt::format("{}: '{}' is given twice; allowed: intra=... and inter=... once each", what, k));
    if (k == "intra") {
      m.intra = parse_link(t.substr(eq + 1), what + " intra");
      intra = true;
    } else if (k == "inter") {
      m.inter = parse_link(t.substr(eq + 1), what + " inter");
      inter = true;
    } else {
      throw ConfigError(fmt::format("{}: '{}' is not intra=ALPHA,BETA,GAMMA or inter=ALPHA,BETA,GAMMA", what, t));
    }
  }
  if (!intra && !inter) throw ConfigError(fmt::format("{}: expected intra=... and/or inter=...", what));
  if (!inter) m.inter = m.intra;
  if (!intra) m.intra = m.inter;
  m.source = what;
  return m;
}

std::string format_cost_model(const CostModel& m) {
  return fmt::format("intra={:.3g},{:.3g},{:.3g};inter={:.3g},{:.3g},{:.3g}", m.intra.alpha, m.intra.beta,
                     m.intra.gamma, m.inter.alpha, m.inter.beta, m.inter.gamma);
}

Tuner::Tuner(CostModel model) {
  auto s = std::make_shared<State>();
  s->model = std::move(model);
  s->version = next_version();
  version_.store(s->version, std::memory_order_release);
  state_ = std::move(s);
}

Tuner::Tuner(const Tuner& other) : state_(other.snapshot()) {
  version_.store(state_->version, std::memory_order_release);
}

Tuner& Tuner::operator=(const Tuner& other) {
  if (this == &other) return *this;
  auto s = other.snapshot();  // (before taking our own lock: never two tuners' locks at once)
  std::lock_guard<std::mutex> lk(mu_);
  state_ = std::move(s);
  version_.store(state_->version, std::memory_order_release);
  return *this;
}

std::shared_ptr<const Tuner::State> Tuner::snapshot() const {
  std::lock_guard<std::mutex> lk(mu_);
  return state_;
}

template <class F>
void Tuner::update(F&& change) {
  std::lock_guard<std::mutex> lk(mu_);
  auto s = std::make_shared<State>(*state_);
  change(*s);
  s->version = next_version();
  version_.store(s->version, std::memory_order_release);
  state_ = std::move(s);
}

void Tuner::set_model(const CostModel& m) {
  update([&](State& s) { s.model = m; });
}

CostModel Tuner::model() const { return snapshot()->model; }

bool Tuner::forced_at(CollOp op, size_t bytes) const { return !forced_algorithm(op, bytes).empty(); }

std::string Tuner::forced_algorithm(CollOp op, size_t bytes) const {
  const auto s = snapshot();
  for (const auto& r : s->forced[static_cast<int>(op)])
    if (bytes >= r.lo && bytes < r.hi) return r.algorithm;
  return {};
}

double Tuner::largest_message(CollOp op, const std::string& algo, double bytes, int p, int hosts, bool uniform_hosts,
                              size_t elem_bytes) const {
  return largest_with(*snapshot(), op, algo, bytes, p, hosts, uniform_hosts, elem_bytes);
}

namespace {
constexpr size_t kMaxElementBytes = 8;  // the largest dtype_size (f64, i64)

// The larger half of n bytes split into pp blocks of whole elements (Blocks: the first count % pp blocks one element
// longer), which a halving step's upper rank sends. Up to pp/4 elements over n/2: 4 ranks and 1,048,578 f32 elements
// send 2,097,160 bytes, not 2,097,156. With the element size unknown (0), a bound for every dtype (at most 8 bytes).
double larger_half(double n, int pp, size_t esz) {
  if (esz == 0) return std::ceil(n / 2) + double(kMaxElementBytes) * pp / 4;
  const auto count = static_cast<uint64_t>(n) / esz, q = count / pp, r = count % pp;
  return double((pp / 2) * q + std::min<uint64_t>(r, pp / 2)) * double(esz);
}
// The largest of pp blocks of whole elements: one element over n/pp at most.
double largest_block(double n, int pp, size_t esz) {
  if (esz == 0) return std::ceil(n / pp) + double(kMaxElementBytes);
  return std::ceil(double(static_cast<uint64_t>(n) / esz) / pp) * double(esz);
}
// The smallest: n/pp rounded down to whole elements.
double smallest_block(double n, int pp, size_t esz) {
  if (esz == 0) return std::floor(n / pp);
  return std::floor(double(static_cast<uint64_t>(n) / esz) / pp) * double(esz);
}
}  // namespace

double Tuner::largest_with(const State& s, CollOp op, const std::string& algo, double n, int p, int hosts,
                           bool uniform_hosts, size_t esz) {
  if (p <= 1) return 0;
  const bool p2 = pow2(p);
  switch (op) {
    case CollOp::allreduce:
      // rhd's first halving step sends the larger half; off a power of two its fold sends the whole vector first (rd
      // too)
      if (algo == "rhd") return p2 ? larger_half(n, p, esz) : n;
      if (algo == "rd" || algo == "tree") return n;
      if (algo == "hier") {
        if (hosts <= 1 || hosts >= p) return 0;  // it runs the ring (one host, or one member a host)
        if (!uniform_hosts) return n;  // a tree reduce and broadcast inside hosts
        // The rings inside hosts, and across them, for each local rank's block (n/L in whole elements: two sizes at
        // most), the tuner's pick for that block among H ranks (hierarchical.cc).
        double most = 0;
        for (double part : {largest_block(n, p / hosts, esz), smallest_block(n, p / hosts, esz)}) {
          std::string cross = choose_with(s, CollOp::allreduce, static_cast<size_t>(part), hosts, hosts, false);
          if (cross == "hier") cross = "ring";
          most = std::max(most, largest_with(s, CollOp::allreduce, cross, part, hosts, hosts, false, esz));
        }
        return most;
      }
      return 0;
    case CollOp::reduce_scatter:
      // (even blocks: the halves are exact; uneven ones are the caller's to bound, Communicator's largest_message)
      if (algo == "rh") return p2 ? std::ceil(n / 2) : n;
      return 0;
    case CollOp::allgather:
      if (algo == "rd") return p2 ? std::ceil(n / 2) : 0;  // (else it runs the ring)
      return 0;
    case CollOp::broadcast:
      return algo == "tree" ? n : 0;
    case CollOp::reduce:
      // rsg: every rank's reduced block goes to the root whole (a block is at most one element over n/p)
      return algo == "tree" ? n : largest_block(n, p, esz);
  }
  return 0;
}

std::shared_ptr<Tuner> Tuner::from_env() {
  auto t = std::make_shared<Tuner>();
  if (auto s = env_string("CONDUIT_COST_MODEL")) t->set_model(parse_cost_model(*s, "CONDUIT_COST_MODEL"));
  for (int i = 0; i < kNumCollOps; ++i) {
    CollOp op = static_cast<CollOp>(i);
    if (auto s = env_string(env_var(op))) t->force(op, parse_rules(op, *s, env_var(op)));
  }
  return t;
}

const std::vector<std::string>& Tuner::algorithms(CollOp op) {
  static const std::vector<std::string> ar{"ring", "rhd", "rd", "tree", "hier"};
  static const std::vector<std::string> rs{"ring", "rh"};
  static const std::vector<std::string> ag{"ring", "rd"};
  static const std::vector<std::string> bc{"tree", "chain"};
  static const std::vector<std::string> rd{"tree", "rsg"};
  switch (op) {
    case CollOp::allreduce: return ar;
    case CollOp::reduce_scatter: return rs;
    case CollOp::allgather: return ag;
    case CollOp::broadcast: return bc;
    case CollOp::reduce: return rd;
  }
  return ar;
}

void Tuner::check_algorithm(CollOp op, const std::string& algo) {
  for (auto& a : algorithms(op))
    if (a == algo) return;
  throw ConfigError(fmt::format("unknown {} algorithm '{}': allowed are {}", coll_op_name(op), algo,
                                join(algorithms(op), ", ")));
}

std::vector<ForceRule> Tuner::parse_rules(CollOp op, const std::string& spec, const std::string& what) {
  std::vector<ForceRule> rules;
  for (auto& part : split(spec, ',')) {
    std::string t = trim(part);
    if (t.empty()) continue;
    ForceRule r;
    auto colon = t.find(':');
    r.algorithm = trim(t.substr(0, colon));
    try {
      check_algorithm(op, r.algorithm);
    } catch (const ConfigError& e) {  // (the message named no variable)
      throw ConfigError(fmt::format("{}: {}", what, e.what()));
    }
    if (colon != std::string::npos) {
      std::string range = t.substr(colon + 1);
      auto dash = range.find('-');
      if (dash == std::string::npos)
        throw ConfigError(fmt::format("{}: range '{}' must be LO-HI or LO- (sizes in bytes, K/M/G allowed)", what,
                                      range));
      std::string lo = trim(range.substr(0, dash)), hi = trim(range.substr(dash + 1));
      r.lo = lo.empty() ? 0 : parse_bytes(lo, what);
      r.hi = hi.empty() ? static_cast<size_t>(-1) : parse_bytes(hi, what);
      if (r.hi <= r.lo) throw ConfigError(fmt::format("{}: range '{}' is empty", what, range));
    }
    rules.push_back(r);
  }
  if (rules.empty()) throw ConfigError(fmt::format("{}: no algorithm given", what));
  // The first rule that covers a size wins: an overlap would leave part of a later rule dead without a word.
  for (size_t i = 0; i < rules.size(); ++i)
    for (size_t j = i + 1; j < rules.size(); ++j)
      if (rules[i].lo < rules[j].hi && rules[j].lo < rules[i].hi)
        throw ConfigError(
            fmt::format("{}: the ranges of '{}' and '{}' overlap; allowed: disjoint ranges, e.g. "
                        "tree:0-64K,ring:64K-",
                        what, rules[i].algorithm, rules[j].algorithm));
  return rules;
}

void Tuner::force(CollOp op, std::vector<ForceRule> rules) {
  update([&](State& s) { s.forced[static_cast<int>(op)] = std::move(rules); });
}

uint64_t Tuner::next_version() {
  static std::atomic<uint64_t> counter{0};
  return counter.fetch_add(1, std::memory_order_relaxed) + 1;
}

double Tuner::predict(CollOp op, const std::string& algo, double n, int p, int hosts) const {
  return predict_with(*snapshot(), op, algo, n, p, hosts);
}

double Tuner::predict_with(const State& s, CollOp op, const std::string& algo, double n, int p, int hosts) {
  const CostModel& model = s.model;
  if (p <= 1) return 0;
  // Links: a flat algorithm over several hosts is limited by the inter-host link.
  const LinkCost& l = hosts > 1 ? model.inter : model.intra;
  const double a = l.alpha, b = l.beta, g = l.gamma;
  const double P = p, lg = log2i(p);
  const double frac = (P - 1) / P;
  const bool p2 = pow2(p);
  // The recursive algorithms run among p' = the largest power of two <= p ranks (docs/algorithms.md): rhd's bandwidth
  // terms are (p'-1)/p' (the real p overcharged them: 0.83 for 0.75 at p = 6), plus the fix-up, one extra exchange of
  // the whole vector before and, for allreduce, after; rh returns only the folded rank's block.
  const double Pp = std::exp2(std::floor(std::log2(P))), frac_p = (Pp - 1) / Pp;
  const double fix = p2 ? 0 : 2 * (a + n * b) + n * g;
  const double fix_rh = p2 ? 0 : (a + n * b + n * g) + (a + n / P * b);
  // rh splits by rank's block, and the first r = p - p' of the p' taking part hold two: a halving step among groups of
  // g moves the larger half, g/2 + min(r, g/2) blocks of n/p ((p-1)/p in all at a power of two; 1.0 at p = 5 and 6).
  double rh_frac = 0;
  for (double grp = Pp, r = P - Pp; grp >= 2; grp /= 2) rh_frac += grp / 2 + std::min(r, grp / 2);
  rh_frac /= P;
  switch (op) {
    case CollOp::allreduce:
      if (algo == "ring") return 2 * (P - 1) * a + 2 * frac * n * b + frac * n * g;
      if (algo == "rhd") return 2 * std::floor(std::log2(P)) * a + 2 * frac_p * n * b + frac_p * n * g + fix;
      if (algo == "rd") return std::floor(std::log2(P)) * (a + n * b + n * g) + fix;
      if (algo == "tree") return 2 * lg * (a + n * b) + lg * n * g;
      if (algo == "hier") {
        if (hosts <= 1) return std::numeric_limits<double>::infinity();
        const LinkCost& in = model.intra;
        double L = P / hosts, H = hosts;
        double local_rs = (L - 1) * in.alpha + (L - 1) / L * n * (in.beta + in.gamma);
        // The cross-host step runs what the tuner picks for n/L bytes among H ranks on H hosts (hierarchical.cc: its
        // forcing rules too, hier read as ring), priced so: a ring there overstated small messages' cost (2(H-1)
        // latencies where rd pays log H), and hier was passed over where it won. (A flat algorithm on h > 1 hosts
        // is charged the inter-host link.)
        const int h = static_cast<int>(H);
        std::string cross_algo = choose_with(s, CollOp::allreduce, static_cast<size_t>(n / L), h, h, false);
        if (cross_algo == "hier") cross_algo = "ring";
        double cross = predict_with(s, CollOp::allreduce, cross_algo, n / L, h, h);
        double local_ag = (L - 1) * in.alpha + (L - 1) / L * n * in.beta;
        return local_rs + cross + local_ag;
      }
      break;
    case CollOp::reduce_scatter:
      if (algo == "ring") return (P - 1) * a + frac * n * (b + g);
      if (algo == "rh") return std::floor(std::log2(P)) * a + rh_frac * n * (b + g) + fix_rh;
      break;
    case CollOp::allgather:
      if (algo == "ring") return (P - 1) * a + frac * n * b;
      if (algo == "rd") return p2 ? lg * a + frac * n * b : (P - 1) * a + frac * n * b;  // else it runs the ring
      break;
    case CollOp::broadcast:
      if (algo == "tree") return lg * (a + n * b);
      if (algo == "chain") {
        double segs = std::max(1.0, std::ceil(n / static_cast<double>(ring_segment_bytes())));
        return (P - 1 + segs - 1) * (a + (n / segs) * b);
      }
      break;
    case CollOp::reduce:
      if (algo == "tree") return lg * (a + n * b + n * g);
      if (algo == "rsg") return (P - 1) * a + frac * n * (b + g) + lg * a + frac * n * b;
      break;
  }
  return std::numeric_limits<double>::infinity();
}

std::string Tuner::choose(CollOp op, size_t bytes, int p, int hosts, bool uniform_hosts) const {
  // Training and benchmarks repeat the same sizes: remember the last answer per operation (per thread, so a hit
  // takes no lock: the entry was computed from the state of its version, and version_ names the current one).
  // Predicting every algorithm costs more than a small message's whole exchange on shm.
  struct Entry {
    uint64_t version = 0;
    size_t bytes = 0;
    int p = 0, hosts = 0;
    bool uniform = false;
    std::string algo;
  };
  thread_local Entry cache[kNumCollOps];
  Entry& e = cache[static_cast<int>(op)];
  if (e.version == version_.load(std::memory_order_acquire) && e.bytes == bytes && e.p == p && e.hosts == hosts &&
      e.uniform == uniform_hosts)
    return e.algo;
  const auto s = snapshot();  // one state for the rules and every prediction
  std::string algo = choose_with(*s, op, bytes, p, hosts, uniform_hosts);
  e = Entry{s->version, bytes, p, hosts, uniform_hosts, algo};
  return algo;
}

std::string Tuner::choose_with(const State& s, CollOp op, size_t bytes, int p, int hosts, bool uniform_hosts) {
  for (const auto& r : s.forced[static_cast<int>(op)])
    if (bytes >= r.lo && bytes < r.hi) return r.algorithm;
  return cheapest(s, op, static_cast<double>(bytes), p, hosts, uniform_hosts);
}

std::string Tuner::cheapest(const State& s, CollOp op, double bytes, int p, int hosts, bool uniform_hosts) {
  // The cheapest prediction wins, but an algorithm listed earlier (ring first) keeps the choice while the later one
  // is less than kTieMargin cheaper: for large vectors ring and Rabenseifner predict the same bandwidth term, and
  // measured here ring is faster (each rank sends and receives on different links, segments pipeline), e.g. 94-96%
  // of a shaped 1 Gbit/s link against 65-85% for rhd (docs/cluster.md).
  constexpr double kTieMargin = 0.10;
  std::string best;
  double best_t = std::numeric_limits<double>::infinity();
  const double limit = static_cast<double>(net::max_message_bytes());
  for (const auto& a : algorithms(op)) {
    if (a == "hier" && (hosts <= 1 || !uniform_hosts)) continue;
    // (a 2-rank broadcast took the tree at every size, one message of the whole vector, and failed past the limit
    // where the chain's segments went through)
    if (largest_with(s, op, a, bytes, p, hosts, uniform_hosts, 0) > limit) continue;
    double t = predict_with(s, op, a, bytes, p, hosts);
    if (best.empty() || t < best_t * (1 - kTieMargin)) {
      best_t = t;
      best = a;
    }
  }
  if (!best.empty()) return best;
  // None fits: the one with the smallest message (the call is refused before it runs, Communicator::check_fits).
  double least = std::numeric_limits<double>::infinity();
  for (const auto& a : algorithms(op)) {
    const double m = largest_with(s, op, a, bytes, p, hosts, uniform_hosts, 0);
    if (m < least) least = m, best = a;
  }
  return best;
}

}  // namespace conduit::coll
