// Strategy defaults, parameter parsing, point-to-point helpers and the factory.
#include "sync/strategy.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstring>
#include <functional>
#include <set>

#include "core/env.h"
#include "core/error.h"
#include "core/log.h"
#include "sync/detail.h"
#include "sync/ps.h"
#include "sync/schemes.h"

namespace conduit::sync {

int Strategy::worker_rank() const { return comm_->rank(); }
void Strategy::set_drift_timeout(double seconds) {
  if (!(seconds >= comm_->timeout_s()) || !std::isfinite(seconds))
    throw InvalidArgument(
        fmt::format("sync {}: drift timeout {} s; allowed: at least the communicator's timeout ({} s)", name(), seconds,
                    comm_->timeout_s()));
  drift_timeout_s_ = seconds;
}
int Strategy::num_workers() const { return comm_->size(); }
void Strategy::serve() {
  throw InvalidArgument(fmt::format("sync {}: serve() is only for dedicated parameter-server ranks", name()));
}
void Strategy::setup(std::span<float> params) {
  // Replicas start from rank 0's parameters.
  if (comm_->size() > 1) comm_->broadcast(params.data(), params.size(), DType::f32, 0, detail::blocking_opts()).wait();
}
bool Strategy::before_step(uint64_t, std::span<float>, std::span<float>) { return true; }
void Strategy::after_step(uint64_t, std::span<float>) {}
void Strategy::finish(std::span<float>) {}
void Strategy::load_state(std::span<const uint8_t> bytes) {
  if (!bytes.empty())
    throw InvalidArgument(
        fmt::format("sync {}: load_state got {} bytes but this scheme keeps no state", name(), bytes.size()));
}

void await_workers(coll::Communicator& workers, double drift_timeout_s) {
  const int n = workers.size(), me = workers.rank();
  if (n <= 1) return;
  uint8_t token = 1;
  std::vector<uint8_t> tokens(size_t(n), 0);
  std::vector<net::RequestPtr> reqs;
  if (me == 0) {
    // Worker 0 tells the others it arrived (it often comes last, after evaluating alone): their wait for its release
    // counts from then, so that worker 0's wait for the arrivals ends first and it names the workers that did not
    // come (counted from their own arrival, the others' timed out first when worker 0's evaluation outlasted a
    // timeout, naming worker 0).
    for (int r = 1; r < n; ++r) reqs.push_back(detail::isend(workers, r, detail::kTagZeroArrived, &token, 1));
    for (int r = 1; r < n; ++r) reqs.push_back(detail::irecv(workers, r, detail::kTagArrive, &tokens[size_t(r)], 1));
    // (at the limit the others hear which workers did not arrive, not only that this one went)
    detail::wait_drifting(workers, reqs, drift_timeout_s, "sync: worker 0: the other workers' arrival",
                          "drift_timeout_s", /*abort_on_timeout=*/true);
    reqs.clear();
    for (int r = 1; r < n; ++r) reqs.push_back(detail::isend(workers, r, detail::kTagRelease, &token, 1));
    detail::wait_all(workers, reqs);  // the others are all waiting: the normal deadline
  } else {
    // The arrival too waits past the drift timeout: a transport that completes a send only once it is matched
    // (inproc) holds it until worker 0 arrives, and worker 0 (which evaluates alone) is often the last. A timeout
    // more than worker 0's wait, so that worker 0, which knows who did not arrive, is the one that says so (these
    // timed out first, naming worker 0).
    uint8_t zero_arrived = 0;
    auto zero = detail::irecv(workers, 0, detail::kTagZeroArrived, &zero_arrived, 1);
    auto release = detail::irecv(workers, 0, detail::kTagRelease, &tokens[0], 1);
    auto arrive = detail::isend(workers, 0, detail::kTagArrive, &token, 1);
    try {
      detail::wait_drifting(
          workers, {zero}, drift_timeout_s + workers.timeout_s(),
          fmt::format("sync: worker {}: worker 0's arrival (it comes last when it evaluates alone)", me),
          "drift_timeout_s + timeout_s");
    } catch (...) {
      net::give_up(workers.transport(), release, "await_workers gave up");
      net::give_up(workers.transport(), arrive, "await_workers gave up");
      throw;
    }
    detail::wait_drifting(workers, {arrive, release}, drift_timeout_s + workers.timeout_s(),
                          fmt::format("sync: worker {}: worker 0's release (worker 0 awaits another worker)", me),
                          "drift_timeout_s + timeout_s from worker 0's arrival");
  }
}

bool same_param_value(const std::string& a, const std::string& b) {
  if (a == b) return true;
  auto flag = [](const std::string& s) { return s == "true" ? "1" : s == "false" ? "0" : s; };
  if (flag(a) == flag(b)) return true;
  char *ae = nullptr, *be = nullptr;
  const double x = std::strtod(a.c_str(), &ae), y = std::strtod(b.c_str(), &be);
  return ae != a.c_str() && *ae == '\0' && be != b.c_str() && *be == '\0' && x == y;
}

namespace detail {

bool ParamReader::changed(const std::string& key) const {
  return !same_param_value(values_.at(key), defaults_.at(key));
}

ParamReader::ParamReader(std::string scheme, const Params& given, const Params& defaults)
    : scheme_(std::move(scheme)), values_(defaults), defaults_(defaults) {
  for (const auto& [k, v] : given) {
    if (!defaults.count(k)) {
      std::string allowed;
      for (const auto& [dk, dv] : defaults) allowed += (allowed.empty() ? "" : ", ") + dk;
      throw ConfigError(
          fmt::format("sync {}: unknown parameter '{}' (allowed: {})", scheme_, k, allowed.empty() ? "none" : allowed));
    }
    values_[k] = v;
  }
}

std::string ParamReader::str(const std::string& key) const { return values_.at(key); }

double ParamReader::real(const std::string& key, double lo, double hi) const {
  const std::string& s = values_.at(key);
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(s.c_str(), &end);
  // (a leading space or sign is refused as the trainer's own readings of these values refuse it: "staleness=+0" ran
  // with s = 0 while the trainer took it for a stale scheme; hex and inf as everywhere else)
  if (!is_decimal(s, true) || s[0] == '+' || *end != '\0' || !std::isfinite(v) || v < lo || v > hi)
    throw ConfigError(
        fmt::format("sync {}: parameter '{}' = '{}' must be a number in [{}, {}]", scheme_, key, s, lo, hi));
  // (underflow: easgd:alpha=1e-400 read as 0, which means "the default", and ps-asp:dc=1e-400 turned compensation off)
  if (errno == ERANGE)
    throw ConfigError(
        fmt::format("sync {}: parameter '{}' = '{}' is too small for a double (allowed: 0, or a "
                    "magnitude of 2.2e-308 or more, within [{}, {}])",
                    scheme_, key, s, lo, hi));
  return v;
}

int64_t ParamReader::integer(const std::string& key, int64_t lo, int64_t hi) const {
  const std::string& s = values_.at(key);
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0])) || s[0] == '+' || *end != '\0' || errno == ERANGE ||
      v < lo || v > hi)  // (out of range saturated: seed=1e20 digits)
    throw ConfigError(
        fmt::format("sync {}: parameter '{}' = '{}' must be an integer in [{}, {}]", scheme_, key, s, lo, hi));
  return v;
}

bool ParamReader::flag(const std::string& key) const {
  return choice(key, {"0", "1", "false", "true"}) == "1" || values_.at(key) == "true";
}

std::string ParamReader::choice(const std::string& key, const std::vector<std::string>& allowed) const {
  const std::string& s = values_.at(key);
  for (const auto& a : allowed)
    if (a == s) return s;
  std::string list;
  for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
  throw ConfigError(fmt::format("sync {}: parameter '{}' = '{}' is not one of: {}", scheme_, key, s, list));
}

net::RequestPtr isend(coll::Communicator& c, int peer, uint32_t tag, const void* data, size_t bytes) {
  return c.transport().isend(c.transport_rank(peer), net::make_tag(net::kUser, c.id(), tag), data, bytes);
}
net::RequestPtr irecv(coll::Communicator& c, int peer, uint32_t tag, void* data, size_t bytes) {
  return c.transport().irecv(c.transport_rank(peer), net::make_tag(net::kUser, c.id(), tag), data, bytes);
}
void wait_all(coll::Communicator& c, const std::vector<net::RequestPtr>& reqs) {
  // The buffers go away with the exception (a deadline, or a peer that failed while others are still pending):
  // nothing may move into or out of them afterwards.
  net::wait_all_or_give_up(c.transport(), reqs, Deadline::after(c.timeout_s()));
}
void wait(coll::Communicator& c, const net::RequestPtr& r) { wait_all(c, {r}); }

void wait_drifting(coll::Communicator& c, const std::vector<net::RequestPtr>& reqs, double limit_s,
                   const std::string& what, const char* limit_name, bool abort_on_timeout) {
  const auto t0 = std::chrono::steady_clock::now();
  auto waited = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  auto awaited = [&] {  // the global ranks of the requests still pending
    std::set<int> peers;
    for (const auto& r : reqs)
      if (!r->done()) peers.insert(r->peer());
    std::string ranks;
    for (int p : peers) ranks += fmt::format("{}{}", ranks.empty() ? "" : ", ", p);
    return ranks;
  };
  const double note_every = std::max(c.timeout_s(), 10.0);
  double next_note = note_every;
  try {
    for (;;) {
      // A request that failed (a peer's death, behind one still pending, or a timeout of its own) ends the wait at
      // once with its own error (waited for in order, it was seen only when the ones before it completed, and a
      // timeout then blamed a pending one's healthy rank).
      const net::RequestPtr* pending = nullptr;
      // (test(), which drives a transport's progress and rethrows a failure, up to the first pending request; past
      // it a failure only: one full progress pass per request every 50 ms was n^2 work for worker 0's n arrivals)
      for (const auto& r : reqs) {
        if (!pending) {
          if (!r->test()) pending = &r;
        } else if (r->done() && !r->succeeded()) {
          r->test();
        }
      }
      if (!pending) return;
      const double w = waited();
      if (w >= limit_s)
        throw TimeoutError(fmt::format(
            "{}: nothing came from global rank(s) {} within {:g} s ({}; the workers may drift apart by more than a "
            "step, but not this far: a peer frozen or hung, or a straggler slower than that, for which raise "
            "drift_timeout_s)",
            what, awaited(), limit_s, limit_name));
      if (w >= next_note) {
        CONDUIT_LOG_WARN("{}: still waiting on global rank(s) {} after {:.0f} s (gives up at {:g} s, {})", what,
                         awaited(), w, limit_s, limit_name);
        next_note += note_every;
      }
      try {  // a short look at the first pending one: the others' failures are seen within it
        (*pending)->wait(Deadline::after(std::min(0.05, limit_s - w)));
      } catch (const TimeoutError&) {  // (a failure of its own is rethrown by test() above)
      }
    }
  } catch (const Error& e) {
    for (const auto& r : reqs) net::give_up(c.transport(), r, e.what());
    if (abort_on_timeout && dynamic_cast<const TimeoutError*>(&e)) c.transport().abort(e.what());
    throw;
  } catch (...) {
    for (const auto& r : reqs) net::give_up(c.transport(), r, "the wait ended with an exception");
    throw;
  }
}

void allreduce_avg(coll::Communicator& c, std::span<float> buf, SyncStats& stats, double timeout_s) {
  allreduce_f32(c, buf, ReduceOp::avg, stats, timeout_s);
}

void allreduce_f32(coll::Communicator& c, std::span<float> buf, ReduceOp op, SyncStats& stats, double timeout_s) {
  if (c.size() <= 1) return;
  Stopwatch sw;
  coll::CollOptions o = detail::blocking_opts();
  o.timeout_s = timeout_s;
  c.allreduce(buf.data(), buf.size(), DType::f32, op, o).wait();
  stats.comm_seconds += sw.seconds();
  uint64_t b = 2ull * (c.size() - 1) * buf.size_bytes() / c.size();
  stats.bytes_sent += b;
  stats.payload_bytes += buf.size_bytes();
  stats.bytes_received += b;
  stats.rounds += 1;
}

void Writer::u64(uint64_t v) {
  size_t p = b_.size();
  b_.resize(p + 8);
  std::memcpy(b_.data() + p, &v, 8);
}
void Writer::f64(double v) {
  uint64_t u;
  std::memcpy(&u, &v, 8);
  u64(u);
}
void Writer::floats(std::span<const float> v) {
  u64(v.size());
  size_t p = b_.size();
  b_.resize(p + v.size_bytes());
  if (!v.empty()) std::memcpy(b_.data() + p, v.data(), v.size_bytes());
}
void Writer::bytes(std::span<const uint8_t> v) {
  u64(v.size());
  b_.insert(b_.end(), v.begin(), v.end());
}
Bytes Reader::bytes() {
  uint64_t n = u64();
  need(n);
  Bytes v(b_.begin() + pos_, b_.begin() + pos_ + n);
  pos_ += n;
  return v;
}
void Reader::need(size_t n) const {
  if (n > b_.size() - pos_)  // (pos_ + n wraps for the lengths a corrupt state announces)
    throw InvalidArgument(
        fmt::format("sync {}: state is truncated ({} bytes, {} more needed at byte {})", what_, b_.size(), n, pos_));
}
uint64_t Reader::u64() {
  need(8);
  uint64_t v;
  std::memcpy(&v, b_.data() + pos_, 8);
  pos_ += 8;
  return v;
}
double Reader::f64() {
  uint64_t u = u64();
  double d;
  std::memcpy(&d, &u, 8);
  return d;
}
std::vector<float> Reader::floats() {
  uint64_t n = u64();
  if (n > (b_.size() - pos_) / 4)
    throw InvalidArgument(fmt::format("sync {}: state is truncated ({} bytes, {} values announced at byte {})", what_,
                                      b_.size(), n, pos_));
  std::vector<float> v(n);
  if (n) std::memcpy(v.data(), b_.data() + pos_, n * 4);
  pos_ += n * 4;
  return v;
}
std::vector<float> Reader::floats(size_t expect, std::string_view field, bool or_empty) {
  std::vector<float> v = floats();
  if (v.size() != expect && !(or_empty && v.empty()))
    throw InvalidArgument(fmt::format("sync {}: the state's {} holds {} values, this model has {}{}", what_, field,
                                      v.size(), expect, or_empty ? " (or none)" : ""));
  return v;
}
void Reader::done() const {
  if (pos_ != b_.size())
    throw InvalidArgument(fmt::format("sync {}: state has {} trailing bytes", what_, b_.size() - pos_));
}

int64_t steps_since(uint64_t saved, const std::string& scheme) {
  if (saved >= static_cast<uint64_t>(INT_MAX))
    throw InvalidArgument(
        fmt::format("sync {}: the state's steps since the last synchronization are {} (allowed: 0 "
                    "to {}, below a period)",
                    scheme, saved, INT_MAX - 1));
  return static_cast<int64_t>(saved);
}

// CHOCO-gossip (Koloskova et al. 2019) moves the public copies by the compressed differences x - x̂: the part not
// sent stays in the difference for the next step, so the compressor must shrink what it is given, as error
// feedback needs, and must not carry error feedback (or momentum) of its own, which would send that part twice.
// Signs without a scale moved every copy by +-1 a coordinate a step (loss 2.3 to 51016 in one step).
std::string empty_compressor_message(std::string_view field) {
  std::string names;
  for (const auto& n : compress::compressor_names())
    if (n != "none") names += (names.empty() ? "" : ", ") + n;
  return fmt::format(
      "{} is empty; allowed: none or a compressor spec ({}, each also as ef:<name>, e.g. int8 or "
      "topk:ratio=0.01)",
      field, names);
}

void check_difference_compressor(std::string_view field, std::string_view method, const std::string& spec,
                                 const compress::Compressor& c) {
  if (c.stateful())
    throw ConfigError(fmt::format(
        "{} '{}' has error feedback or momentum of its own, and {} already keeps what it did not send; allowed: a "
        "compressor without state (topk, randk:unbiased=0, threshold, int8, uint8, fp16, bf16, natural, "
        "scaled_sign, qsgd with small buckets)",
        field, spec, method));
  if (auto g = compress::input_growth(spec)) {
    // (a scheme's parameter: an example with parameters goes in brackets, as the scheme reads it; pasted without
    // them, its second parameter was read as the scheme's and refused)
    std::string fix = g->fix;
    const size_t eg = fix.find("(e.g. ");
    const size_t end = eg == std::string::npos ? eg : fix.find(')', eg);
    if (end != std::string::npos && fix.substr(eg, end - eg).find(',') != std::string::npos)
      fix = fix.substr(0, eg + 6) + "[" + fix.substr(eg + 6, end - eg - 6) + "]" + fix.substr(end);
    throw ConfigError(
        fmt::format("{} '{}': {} needs a compressor whose error is smaller than its input, but {}; "
                    "allowed: {}",
                    field, spec, method, g->why, fix));
  }
}

}  // namespace detail

namespace {

struct Entry {
  Params defaults;
  std::function<StrategyPtr(const detail::ParamReader&, coll::CommPtr)> make;
};

compress::CompressorPtr optional_compressor(const std::string& spec, const char* scheme) {
  // (an empty value, `dpsgd:compressor=`, ran uncompressed without a word)
  if (spec.empty()) throw ConfigError(detail::empty_compressor_message(fmt::format("sync {}: compressor", scheme)));
  if (spec == "none") return nullptr;
  try {
    return compress::parse_compressor(spec);
  } catch (const ConfigError& e) {  // (named neither the scheme nor its field)
    throw ConfigError(fmt::format("sync {}: compressor '{}': {}", scheme, spec, e.what()));
  }
}

const std::map<std::string, Entry>& registry() {
  static const std::map<std::string, Entry> r = [] {
    std::map<std::string, Entry> m;
    m["bsp"] = {{}, [](const detail::ParamReader&, coll::CommPtr c) -> StrategyPtr {
                  return std::make_unique<BspStrategy>(std::move(c));
                }};
    m["local"] = {
        {{"period", "8"}, {"warmup", "0"}, {"adaptive", "0"}, {"max_period", "64"}, {"target", "0.01"}},
        [](const detail::ParamReader& p, coll::CommPtr c) -> StrategyPtr {
          const int64_t period = p.integer("period", 1, 1 << 20), max_period = p.integer("max_period", 1, 1 << 20);
          if (p.flag("adaptive") && max_period < period)
            throw ConfigError(
                fmt::format("sync local: max_period = {} is below period = {}; allowed with "
                            "adaptive=1: max_period >= period (it bounds the period's growth)",
                            max_period, period));
          const double target = p.real("target", 0, 1e9);
          // (taken without a word, they changed nothing: the period is fixed without adaptive=1)
          for (const char* k : {"max_period", "target"})
            if (!p.flag("adaptive") && p.changed(k))
              throw ConfigError(
                  fmt::format("sync local: {} = {} steers the adaptive period, which is off; allowed: "
                              "adaptive=1 with it, or leave {} out",
                              k, p.str(k), k));
          return std::make_unique<LocalSgdStrategy>(std::move(c), period, p.integer("warmup", 0, int64_t(1) << 50),
                                                    p.flag("adaptive"), max_period, target);
        }};
    m["diloco"] = {{{"period", "100"}, {"outer_lr", "0.7"}, {"momentum", "0.9"}, {"nesterov", "1"}},
                   [](const detail::ParamReader& p, coll::CommPtr c) -> StrategyPtr {
                     return std::make_unique<DilocoStrategy>(
                         std::move(c), p.integer("period", 1, 1 << 24),
                         p.real("outer_lr", 1e-9, 100) /* 0 never moves: at least 1e-9 */,
                         p.real("momentum", 0, 0.9999), p.flag("nesterov"));
                   }};
    m["easgd"] = {{{"period", "4"}, {"alpha", "0"}}, [](const detail::ParamReader& p, coll::CommPtr c) -> StrategyPtr {
                    double a = p.real("alpha", 0, 1);
                    const int n = c->size();
                    // (1e-300 became 0 in f32, where it is applied: no elastic force, and the run ended on the
                    // untrained centre; a small alpha that f32 holds only pulls slowly)
                    if (a > 0 && static_cast<float>(a) == 0.0f)
                      throw ConfigError(fmt::format(
                          "sync easgd: alpha = {} is 0 in f32, where it is applied (no elastic force at all); allowed: "
                          "0 (the default 0.9/n) or a value f32 holds (from about 1.4e-45) below 2/(n+1) = {:.4g}",
                          a, 2.0 / (n + 1)));
                    if (a == 0) a = 0.9 / n;  // the paper's beta = 0.9 split over p workers
                    // Each round scales the gap between the workers' mean and the centre by 1 - (n + 1) alpha: at
                    // alpha >= 2 / (n + 1) it grows without bound (alpha = 1 with 2 workers: inf loss at step 24).
                    if (a >= 2.0 / (n + 1))
                      throw ConfigError(fmt::format(
                          "sync easgd: alpha = {} diverges with {} workers (each round scales the gap between their "
                          "mean and the centre by 1 - (n+1)*alpha = {:.3g}); allowed: 0 < alpha < 2/(n+1) = {:.4g}, "
                          "default 0.9/n = {:.4g}",
                          a, n, 1 - (n + 1) * a, 2.0 / (n + 1), 0.9 / n));
                    return std::make_unique<EasgdStrategy>(std::move(c), p.integer("period", 1, 1 << 24), a);
                  }};
    m["dpsgd"] = {{{"graph", "ring"}, {"rows", "0"}, {"compressor", "none"}, {"gamma", "0.5"}, {"seed", "0"}},
                  [](const detail::ParamReader& p, coll::CommPtr c) -> StrategyPtr {
                    std::string kind = p.choice("graph", Graph::kinds());
                    int n = c->size();
                    auto comp = optional_compressor(p.str("compressor"), "dpsgd");
                    // CHOCO compresses one flat buffer: PowerSGD has no matrix there and would send it raw.
                    if (comp && comp->collective() == compress::Collective::powersgd)
                      throw ConfigError(fmt::format(
                          "sync dpsgd: compressor '{}' needs the layers' matrices, which gossip's flat buffer does not "
                          "have; allowed: a quantizer or sparsifier (e.g. topk, qsgd, int8)",
                          p.str("compressor")));
                    if (comp)
                      detail::check_difference_compressor("sync dpsgd: compressor", "CHOCO-gossip", p.str("compressor"),
                                                          *comp);
                    const double gamma = p.real("gamma", 1e-6, 1);
                    const int64_t seed = p.integer("seed", 0, INT64_MAX);
                    // (taken without a word, they changed nothing: plain gossip has no step size and draws nothing)
                    for (const char* k : {"gamma", "seed"})
                      if (!comp && p.changed(k))
                        throw ConfigError(
                            fmt::format("sync dpsgd: {} = {} applies to compressed (CHOCO) gossip, and "
                                        "this gossip is uncompressed; allowed: compressor=... with it, "
                                        "or leave {} out",
                                        k, p.str(k), k));
                    if (kind != "torus" && p.integer("rows", 0, n) != 0)
                      throw ConfigError(
                          fmt::format("sync dpsgd: rows = {} applies to graph=torus, not graph={}; "
                                      "allowed with {}: rows=0 (the default)",
                                      p.integer("rows", 0, n), kind, kind));
                    return std::make_unique<DpsgdStrategy>(c, Graph(kind, n, p.integer("rows", 0, n)), std::move(comp),
                                                           gamma, seed);
                  }};
    m["sgp"] = {{{"peers", "1"}}, [](const detail::ParamReader& p, coll::CommPtr c) -> StrategyPtr {
                  // Out-peers are drawn from the offsets 1, 2, 4, ... below n: at most that many differ.
                  int offsets = 0;
                  for (int64_t h = 1; h < c->size(); h *= 2) ++offsets;
                  const int64_t peers = p.integer("peers", 1, 32);
                  if (peers > std::max(offsets, 1))
                    throw ConfigError(
                        fmt::format("sync sgp: peers = {} with {} workers; allowed: 1 to {} (the "
                                    "offsets 1, 2, 4, ... below the worker count)",
                                    peers, c->size(), std::max(offsets, 1)));
                  return std::make_unique<SgpStrategy>(std::move(c), static_cast<int>(peers));
                }};
    m["adpsgd"] = {{{"seed", "0"}, {"final_average", "1"}},
                   [](const detail::ParamReader& p, coll::CommPtr c) -> StrategyPtr {
                     return std::make_unique<AdpsgdStrategy>(std::move(c), p.integer("seed", 0, INT64_MAX),
                                                             p.flag("final_average"));
                   }};
    for (std::string mode : {"asp", "ssp", "bsp"}) {
      Params d = {{"servers", "1"},           {"colocate", "0"},     {"lr", "0.1"},
                  {"momentum", "0.9"},        {"weight_decay", "0"}, {"push_compressor", "none"},
                  {"pull_compressor", "none"}};
      if (mode == "ssp") d["staleness"] = "3";
      if (mode != "bsp") d["dc"] = "0", d["staleness_lr"] = "0", d["dana"] = "0";
      m["ps-" + mode] = {d, [mode](const detail::ParamReader& p, coll::CommPtr c) -> StrategyPtr {
                           PsConfig cfg;
                           cfg.mode = mode;
                           cfg.staleness =
                               mode == "ssp" ? p.integer("staleness", 0, 1 << 30) : (mode == "bsp" ? 0 : -1);
                           cfg.servers = p.integer("servers", 1, 65536);
                           cfg.colocate = p.flag("colocate");
                           cfg.lr = p.real("lr", kPsMinLr, kPsMaxLr);
                           cfg.momentum = p.real("momentum", 0, kPsMaxMomentum);
                           cfg.weight_decay = p.real("weight_decay", 0, 1e6);
                           if (mode != "bsp") {
                             cfg.dc = p.real("dc", 0, 1e6);
                             cfg.staleness_lr = p.flag("staleness_lr");
                             cfg.dana = p.flag("dana");
                           }
                           if (mode == "ssp" && cfg.staleness == 0 && !cfg.dana && (cfg.dc > 0 || cfg.staleness_lr))
                             throw ConfigError(fmt::format(
                                 "sync ps-ssp: staleness=0 applies each clock's mean gradient once, as ps-bsp, so no "
                                 "gradient is stale and {} would do nothing; allowed with staleness=0: dc=0 and "
                                 "staleness_lr=0 (or dana=1, which applies a push at a time)",
                                 cfg.dc > 0 ? "dc" : "staleness_lr"));
                           cfg.push_compressor = p.str("push_compressor");
                           cfg.pull_compressor = p.str("pull_compressor");
                           return make_ps_strategy(std::move(c), cfg);
                         }};
    }
    return m;
  }();
  return r;
}

}  // namespace

std::vector<std::string> strategy_names() {
  std::vector<std::string> v;
  for (const auto& [k, e] : registry()) v.push_back(k);
  return v;
}

Params strategy_defaults(const std::string& name) {
  auto it = registry().find(name);
  if (it == registry().end()) make_strategy(name, {}, nullptr);  // throws the one-line error
  return it->second.defaults;
}

StrategyPtr make_strategy(const std::string& name, const Params& params, coll::CommPtr comm) {
  auto it = registry().find(name);
  if (it == registry().end()) {
    std::string list;
    for (const auto& n : strategy_names()) list += (list.empty() ? "" : ", ") + n;
    throw ConfigError(fmt::format("sync: unknown scheme '{}' (allowed: {})", name, list));
  }
  detail::ParamReader reader(name, params, it->second.defaults);
  if (!comm) throw InvalidArgument(fmt::format("sync {}: no communicator", name));
  return it->second.make(reader, std::move(comm));
}

StrategyPtr parse_strategy(const std::string& spec, coll::CommPtr comm) {
  auto colon = spec.find(':');
  std::string name = spec.substr(0, colon);
  Params p;
  if (colon != std::string::npos) {
    try {
      p = parse_key_values(spec.substr(colon + 1), [&](const std::string& kv) {
        return fmt::format("sync: '{}' in '{}' is not key=value (e.g. local:period=8,warmup=100)", kv, spec);
      });
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      if (what.rfind("sync: ", 0) == 0) throw;
      throw ConfigError(fmt::format("sync: {} (in '{}')", what, spec));
    }
  }
  return make_strategy(name, p, std::move(comm));
}

}  // namespace conduit::sync
