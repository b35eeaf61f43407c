// Sharded parameter servers: ps-asp, ps-ssp, ps-bsp.
//
// Layout (n ranks, S shards, d parameters): shard s holds parameters [s*d/S, (s+1)*d/S). colocate=0: the last S
// ranks are servers only (they call serve()), the first n-S are workers; colocate=1: every rank is a worker and
// shard s lives on rank s mod n, served by background threads (one per worker and shard).
//
// Per step a worker pushes its gradient shard to each server (32-byte header + 4*d/S bytes, or the compressor's
// wire size) and pulls the shard back (16-byte header + 4*d/S bytes, or with a pull compressor the compressed
// difference between the server's parameters and the copy it knows the worker holds). The server owns the
// optimizer (SGD with momentum and weight decay). asp/ssp apply each gradient on arrival scaled by 1/W (a round of
// W pushes is then one averaged step); bsp sums the W gradients of a clock and applies their average once, and so
// does ssp with s = 0 without dana (one momentum step a clock: a step a push decayed the momentum by mu^W a round,
// another optimizer than bsp's with momentum). A pull for clock c is released when: asp always; ssp when the slowest
// worker's clock >= c - s; bsp (and ssp with s = 0 without dana) when clock c has been applied. Replies are built
// under the shard's lock at the moment their condition becomes true.
#include "sync/ps.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <system_error>
#include <thread>

#include "compress/collectives.h"
#include "compress/compressor.h"
#include "core/clock.h"
#include "core/cpus.h"
#include "core/error.h"
#include "sync/detail.h"

namespace conduit::sync {

namespace {

using detail::irecv;
using detail::isend;

enum : uint64_t { kInit = 0, kPush = 1, kStop = 2, kPull = 3 };

struct Header {
  uint64_t kind = 0, bytes = 0, clock = 0;
  double lr_scale = 1;  // push: the trainer's lr(t) / lr, for the weight decay (the gradient arrives scaled)
};
struct ReplyHeader {
  uint64_t bytes = 0, raw = 1;
};

// A clock read from a checkpoint: below 2^62 (a step count; a corrupt one near 2^63 turned negative as a signed
// clock, and the next push's clock + 1 check passed it).
int64_t checked_clock(uint64_t v, const char* what) {
  if (v >= (uint64_t{1} << 62))
    throw InvalidArgument(fmt::format(
        "sync ps: the checkpoint's {} is {} (allowed: below 2^62, a step count; the checkpoint is corrupt)", what, v));
  return static_cast<int64_t>(v);
}

compress::CompressorPtr ps_compressor(const std::string& spec, const char* what) {
  // (an empty value, `push_compressor=` or YAML's '', ran uncompressed without a word)
  if (spec.empty()) throw ConfigError(detail::empty_compressor_message(fmt::format("sync ps: {}", what)));
  if (spec == "none") return nullptr;
  compress::CompressorPtr c;
  try {
    c = compress::parse_compressor(spec);
  } catch (const ConfigError& e) {  // (which of the two it was went unsaid)
    throw ConfigError(fmt::format("sync ps: {} '{}': {}", what, spec, e.what()));
  }
  if (c->collective() == compress::Collective::powersgd)
    throw ConfigError(fmt::format("sync ps: {} '{}' needs a collective; use a quantizer or sparsifier", what, spec));
  // A server sums what the workers send and owns the optimizer. signSGD and Signum are decided by a majority vote of
  // the ranks' signs (sign of their sum), which a server summing pushes would not take: it averaged the ±1s into its
  // momentum, every coordinate moving by lr whatever its gradient (train loss 346 after 5 MLP steps against 2.0).
  // DGC and Signum keep their own momentum, which would stack on the servers' (about 10x the step at 0.9).
  std::string base = c->name();  // (the method, without error feedback)
  if (base.rfind("ef:", 0) == 0) base = base.substr(3);
  const bool vote = c->collective() == compress::Collective::majority_vote;
  if (std::string_view(what) == "push_compressor" && (vote || base == "dgc"))
    throw ConfigError(fmt::format(
        "sync ps: {} '{}' {}, which servers that sum pushes and own the momentum do not take; allowed: a quantizer or "
        "sparsifier (e.g. int8, ef:topk, ef:scaled_sign)",
        what, spec,
        !vote              ? "keeps its own momentum (momentum correction)"
        : base == "signum" ? "is a majority vote of the ranks' signs of their own momentum"
                           : "is a majority vote of the ranks' signs"));
  // A pull sends Q(θ - θ̂_w) and both ends add it to θ̂_w: what it leaves out must shrink, as in CHOCO-gossip (an
  // unbiased randk moved θ̂_w by d/k of the difference: 3e8 off θ after 60 pulls; ef:topk's residual sent twice: 889).
  if (std::string_view(what) == "pull_compressor")
    detail::check_difference_compressor("sync ps: pull_compressor",
                                        "the pull of θ - θ̂ (the difference to the "
                                        "worker's copy, as CHOCO-gossip's)",
                                        spec, *c);
  return c;
}

// Every message carries its shard's slot on its host in the tag (bits 5..20, above the message kind's low 5 bits):
// threads serving two shards of one rank never take each other's messages, and messages to other hosts differ by
// peer. The slot, not the shard, and low bits, because the MPI transport keeps only the low 11 bits of a user tag
// (net/mpi_transport.h): shards s and s + 64 on one rank (128 shards co-located on 64 ranks) shared an MPI tag and
// could swap messages unseen (the transport's check sees only requests outstanding at once). Slots stay apart up to
// 64 shards on one rank (PsStrategy::tag_of).

constexpr int64_t kMaxShardsPerRank = 64;

// Serving threads on one rank: one per (shard it holds, worker other than itself), each with its stack, blocked on a
// receive. Unbounded, co-located shards started up to 64 (n - 1) of them, and a process that ran out of threads failed
// setup() with std::system_error "Resource temporarily unavailable", naming nothing.
constexpr int64_t kMaxServingThreads = 1024;

// ssp with s > 0 lets workers drift apart: a worker s clocks ahead may rightly wait for the slowest longer than any
// timeout (worker 0 evaluating alone, a straggler), at its shard and for the reply.
bool ssp_drifts(const PsConfig& c) { return c.mode == "ssp" && c.staleness != 0; }

std::pair<size_t, size_t> shard_range(size_t d, int64_t s, int64_t S) {
  return {size_t(d * s / S), size_t(d * (s + 1) / S)};
}

// The compressors' seeds of shard s's pushes and pulls, the same on the worker and the server: one per shard, so that
// a random method draws independently in each (seed 0 and 1 for every shard drew the same random-k positions in
// every shard of one size: unbiased, but the shards' errors correlated). Shard 0's are what every shard had.
uint64_t push_seed(int64_t s) { return 2 * uint64_t(s); }
uint64_t pull_seed(int64_t s) { return 2 * uint64_t(s) + 1; }

class Shard {
 public:
  // `aborted`: why the transport was aborted, empty while it is not (a wait here ends on it).
  Shard(const PsConfig& cfg, int64_t index, int workers, const compress::Compressor* push,
        const compress::Compressor* pull, std::function<std::string()> aborted)
      : aborted_(std::move(aborted)),
        cfg_(cfg),
        index_(index),
        workers_(workers),
        push_(push),
        pull_(pull),
        clocks_(workers, 0),
        stopped_(workers, false),
        slots_(workers) {}

  void init(std::span<const float> p) {
    std::lock_guard<std::mutex> lk(mu_);
    params_.assign(p.begin(), p.end());
    initial_ = params_;
    momentum_.assign(p.size(), 0.f);
    agg_.assign(p.size(), 0.f);
    if (dana()) vsum_.assign(p.size(), 0.f);
    for (auto& s : slots_) {
      if (dana()) s.velocity.assign(p.size(), 0.f);
      // (seeds per shard, as the workers' states: shards of one size drew the same random-k positions)
      if (push_) s.push_state = push_->make_state(p.size(), push_seed(index_), 0);
      if (pull_) s.pull_state = pull_->make_state(p.size(), pull_seed(index_), 0);
    }
    initialized_ = true;
    cv_.notify_all();
  }

  // Handles one message from worker w; returns the reply (header + payload), empty for stop.
  // drift_s: the wait for slower workers where the workers drift (ssp with s > 0), drift_timeout_s.
  std::pair<ReplyHeader, Bytes> handle(int w, const Header& h, std::span<const uint8_t> payload, double timeout_s,
                                       double drift_s) {
    std::unique_lock<std::mutex> lk(mu_);
    if (!wait_or_abort(lk, timeout_s, [&] { return initialized_; }))
      throw TimeoutError(fmt::format("sync ps shard {}: worker 0 never sent the initial parameters", index_));
    if (shutdown_) throw PeerError(shutdown_message());
    auto& slot = slots_[w];
    check_order(w, h, slot);
    if (h.kind == kStop) {
      stopped_[w] = true;
      maybe_apply_bsp();
      release_ready();
      cv_.notify_all();
      return {};
    }
    if (h.kind == kPull) {
      // The starting point, whatever faster workers have pushed since (asp/ssp apply pushes on arrival).
      slot.pulled = true;
      slot.replica = initial_;
      slot.version = 0;  // initial_ is the shard before any update
      if (cfg_.dc > 0 && !pull_) slot.backup = initial_;
      Bytes b(initial_.size() * 4);
      std::memcpy(b.data(), initial_.data(), b.size());
      if (++initial_pulls_ == workers_) initial_ = {};
      return {ReplyHeader{b.size(), 1}, std::move(b)};
    }
    // Push.
    const size_t d = params_.size();
    grad_.resize(d);
    if (push_) {
      slot.push_state.step = h.clock;
      push_->decompress(payload, slot.push_state, grad_);
    } else {
      if (payload.size() != d * 4)
        throw ProtocolError(
            fmt::format("sync ps shard {}: worker {} pushed {} bytes, expected {}", index_, w, payload.size(), d * 4));
      std::memcpy(grad_.data(), payload.data(), d * 4);
    }
    if (!(h.lr_scale >= 0 && h.lr_scale <= 1e6))
      throw ProtocolError(fmt::format(
          "sync ps shard {}: worker {} pushed a learning-rate scale of {} (allowed: 0..1e6)", index_, w, h.lr_scale));
    const float ratio = static_cast<float>(h.lr_scale);
    clocks_[w] = static_cast<int64_t>(h.clock);
    stats_.pushes++;
    if (per_clock()) {
      // Held per worker and summed in worker order when the clock is complete (summed as they arrived, 3 or more
      // workers' runs were not bit-identical: float addition is not associative).
      if (clock_grads_.empty()) clock_grads_.assign(size_t(workers_), {});
      clock_grads_[size_t(w)].assign(grad_.begin(), grad_.begin() + ptrdiff_t(d));
      bsp_count_++;
      bsp_clock_ = static_cast<int64_t>(h.clock);
      bsp_ratio_ = ratio;  // the same clock on every worker: the same schedule
      maybe_apply_bsp();
    } else {
      if (cfg_.dc > 0) compensate_delay(slot, grad_);
      if (dana())
        apply_dana(slot, grad_, staleness_scale(slot) / float(workers_), ratio, 1.0f / float(workers_));
      else
        apply(grad_, staleness_scale(slot) / float(workers_), ratio, 1.0f / float(workers_));
    }
    slot.waiting = static_cast<int64_t>(h.clock);
    slot.ready = false;
    bool waited = false;
    release_ready();
    cv_.notify_all();
    if (!slot.ready) {
      waited = true;
      // drift_timeout_s where workers drift (the collectives' deadline waited 300 s and then stopped every rank);
      // a worker that dies still ends the wait (the transport aborts). bsp (and ssp with s = 0) keeps the
      // collectives' deadline.
      const double limit = ssp_drifts(cfg_) ? drift_s : timeout_s;
      if (!wait_or_abort(lk, limit, [&] { return slot.ready; })) {
        const int64_t slowest = min_clock();
        std::string behind;  // the workers holding it back (it named only itself)
        for (int v = 0; v < workers_; ++v)
          if (!stopped_[v] && clocks_[v] == slowest) behind += fmt::format("{}{}", behind.empty() ? "" : ", ", v);
        throw TimeoutError(fmt::format(
            "sync ps shard {}: worker {} at clock {} waited {:g} s ({}) for slower workers: worker(s) {} at clock "
            "{}{}",
            index_, w, h.clock, limit, ssp_drifts(cfg_) ? "drift_timeout_s" : "the timeout", behind, slowest,
            ssp_drifts(cfg_) ? " (a worker frozen or hung, or a straggler slower than that, for which raise "
                               "drift_timeout_s)"
                             : ""));
      }
    }
    if (!slot.ready) throw PeerError(shutdown_message());
    if (waited) stats_.waits++;
    slot.waiting = -1;
    slot.ready = false;
    return {slot.reply_header, std::move(slot.reply)};
  }

  // Ends every wait in handle() (with PeerError naming `why` when given): the owner is going away, or serving a
  // worker failed, so the workers waiting here for slower ones would otherwise wait out their deadline.
  void shutdown(const std::string& why = "") {
    std::lock_guard<std::mutex> lk(mu_);
    if (!shutdown_ && !why.empty()) why_ = why;
    shutdown_ = true;
    cv_.notify_all();
  }

  // Waits under lk until done() or a shutdown, at most timeout_s: false on the timeout. A transport aborted by a
  // peer's error ends it too (PeerError), looked at every 20 ms: nothing the peer owed will come, and a rank waiting
  // for the initial upload of a worker 0 that failed first waited out the whole timeout (a test saw 20 s).
  template <typename Done>
  bool wait_or_abort(std::unique_lock<std::mutex>& lk, double timeout_s, Done done) {
    const Deadline until = Deadline::after(timeout_s);
    while (!done() && !shutdown_) {
      if (until.expired()) return false;
      cv_.wait_for(lk, std::chrono::milliseconds(20));
      if (!done() && !shutdown_ && aborted_)
        if (std::string why = aborted_(); !why.empty())
          throw PeerError(fmt::format("sync ps shard {}: {}", index_, why));
    }
    return true;
  }

  // Under mu_.
  std::string shutdown_message() const {
    return why_.empty() ? fmt::format("sync ps shard {}: shut down", index_)
                        : fmt::format("sync ps shard {}: stopped: {}", index_, why_);
  }

  // The shard's final parameters, once every worker has stopped (every push applied), within timeout_s (a worker
  // under asp or ssp may rightly train on long after the others stopped: those pass the drift timeout; an error
  // anywhere ends the wait).
  std::vector<float> final_params(double timeout_s) {
    std::unique_lock<std::mutex> lk(mu_);
    if (!wait_or_abort(lk, timeout_s,
                       [&] { return std::find(stopped_.begin(), stopped_.end(), false) == stopped_.end(); })) {
      std::string running;
      for (int w = 0; w < workers_; ++w)
        if (!stopped_[w]) running += (running.empty() ? "" : ", ") + std::to_string(w);
      throw TimeoutError(
          fmt::format("sync ps shard {}: worker(s) {} did not stop within {:g} s of the others (the timeout under bsp, "
                      "drift_timeout_s under asp and ssp)",
                      index_, running, timeout_s));
    }
    if (shutdown_) throw PeerError(shutdown_message());
    return params_;
  }

  // The shard's current parameters into out (its length).
  void copy_params(float* out) {
    std::lock_guard<std::mutex> lk(mu_);
    std::copy(params_.begin(), params_.end(), out);
  }

  PsClockStats stats() {
    std::lock_guard<std::mutex> lk(mu_);
    return stats_;
  }

  void save(detail::Writer& w) {
    std::lock_guard<std::mutex> lk(mu_);
    w.floats(params_);
    w.floats(momentum_);
    w.floats(mean_sq_);
    w.u64(applied_clock_);
    w.u64(version_);
    for (int k = 0; k < workers_; ++k) {
      w.u64(clocks_[k]);
      w.u64(slots_[k].version);
      w.floats(slots_[k].replica);
      w.floats(slots_[k].backup);
      w.bytes(push_ ? slots_[k].push_state.save() : Bytes{});
      w.bytes(pull_ ? slots_[k].pull_state.save() : Bytes{});
      w.floats(slots_[k].velocity);
    }
    w.floats(vsum_);
  }

  void load(detail::Reader& r) {
    std::lock_guard<std::mutex> lk(mu_);
    auto p = r.floats();
    if (initialized_ && p.size() != params_.size())
      throw InvalidArgument(fmt::format("sync ps shard {}: state holds {} parameters, the shard has {}", index_,
                                        p.size(), params_.size()));
    params_ = std::move(p);
    // Every other vector is indexed as the parameters (a corrupt state read out of range).
    const size_t n = params_.size();
    momentum_ = r.floats(n, "momentum");
    mean_sq_ = r.floats(n, "gradients' mean square", true);
    applied_clock_ = checked_clock(r.u64(), "applied clock");
    bsp_clock_ = applied_clock_;
    version_ = r.u64();
    for (int k = 0; k < workers_; ++k) {
      clocks_[k] = checked_clock(r.u64(), "worker clock");
      slots_[k].version = r.u64();
      slots_[k].replica = r.floats(n, "worker replica", true);
      slots_[k].backup = r.floats(n, "delay-compensation backup", true);
      auto ps = r.bytes(), pl = r.bytes();
      if (push_ && !ps.empty()) slots_[k].push_state = compress::TensorState::load(ps);
      if (pull_ && !pl.empty()) slots_[k].pull_state = compress::TensorState::load(pl);
      slots_[k].velocity = r.floats(n, "worker momentum", true);
      if (dana() && slots_[k].velocity.size() != params_.size())
        throw InvalidArgument(fmt::format("sync ps shard {}: the state has no look-ahead momentum (dana) for worker "
                                          "{}; allowed: resume with the dana setting it was saved with",
                                          index_, k));
    }
    vsum_ = r.floats(n, "sum of the workers' momenta", !dana());
    if (!dana()) vsum_.clear();
    agg_.assign(params_.size(), 0.f);
    for (auto& g : clock_grads_) g.clear();
    bsp_count_ = 0;
    initialized_ = true;
    cv_.notify_all();
  }

 private:
  struct Slot {
    int64_t waiting = -1;
    bool ready = false;
    bool pulled = false;  // the one initial pull came
    ReplyHeader reply_header;
    Bytes reply;
    std::vector<float> replica;  // what the worker holds (pull compression)
    std::vector<float> backup;   // what the worker holds (no pull compression), kept for delay compensation
    uint64_t version = 0;        // the shard's version_ when the worker's parameters were read
    compress::TensorState push_state, pull_state;
    std::vector<float> velocity;  // dana: this worker's momentum
  };

  bool dana() const { return cfg_.dana && cfg_.mode != "bsp"; }
  // Each clock's mean applied once: bsp, and ssp with s = 0 without dana (with dana, a push at a time: its momenta,
  // one per worker, sum to bsp's with Nesterov's look-ahead).
  bool per_clock() const { return cfg_.mode == "bsp" || (cfg_.mode == "ssp" && cfg_.staleness == 0 && !cfg_.dana); }

  // A worker's messages come in one order: one pull, then pushes with the clocks 1, 2, 3, ... (each push the next;
  // restored on both sides at a resume), then a stop (after which its thread reads nothing more). Anything else is a
  // corrupt or foreign peer: a second pull re-read the emptied starting point, a push before the pull read the replica
  // out of range, a clock going back lowered the slowest clock other workers wait on, and one leaping ahead (1000 after
  // 3) set bsp's applied clock past every later pull's, which were then released before the other workers pushed: bsp
  // ran as asp without a word (an audit).
  void check_order(int w, const Header& h, const Slot& slot) const {
    if (h.kind == kPull && slot.pulled)
      throw ProtocolError(
          fmt::format("sync ps shard {}: worker {} pulled the starting parameters twice (allowed: "
                      "one pull, then pushes)",
                      index_, w));
    if (h.kind == kPush && !slot.pulled)
      throw ProtocolError(fmt::format(
          "sync ps shard {}: worker {} pushed before its pull (allowed: one pull, then pushes)", index_, w));
    if (h.kind == kPush && h.clock != static_cast<uint64_t>(clocks_[w]) + 1)
      throw ProtocolError(
          fmt::format("sync ps shard {}: worker {} pushed clock {} after clock {} (allowed: the next clock, {})",
                      index_, w, h.clock, clocks_[w], clocks_[w] + 1));
  }

 public:
  // The length a worker's request may announce, checked before anything is allocated for it: none for a pull or a
  // stop; a raw push the shard's size in f32, a compressed one at most compress::max_payload_bytes. Waits for the
  // shard's size (worker 0's upload).
  void check_request(int w, const Header& h, double timeout_s) {
    std::unique_lock<std::mutex> lk(mu_);
    if (!wait_or_abort(lk, timeout_s, [&] { return initialized_; }))
      throw TimeoutError(fmt::format("sync ps shard {}: worker 0 never sent the initial parameters", index_));
    if (shutdown_) throw PeerError(shutdown_message());
    if (h.kind != kPush && h.kind != kPull && h.kind != kStop)
      throw ProtocolError(
          fmt::format("sync ps shard {}: worker {} sent a message of kind {}; allowed: push ({}), "
                      "stop ({}), pull ({})",
                      index_, w, h.kind, uint64_t{kPush}, uint64_t{kStop}, uint64_t{kPull}));
    const uint64_t n = params_.size();
    const uint64_t most = h.kind != kPush ? 0
                          : push_         ? compress::max_payload_bytes(*push_, n, slots_[w].push_state)
                                          : 4 * n;
    if (h.bytes > most || (h.kind == kPush && !push_ && h.bytes != most))
      throw ProtocolError(fmt::format("sync ps shard {}: worker {} announced {} bytes for a {}; allowed: {}{} bytes",
                                      index_, w, h.bytes,
                                      h.kind == kPush   ? "push"
                                      : h.kind == kPull ? "pull"
                                                        : "stop",
                                      h.kind == kPush && push_ ? "at most " : "", most));
  }

 private:
  int64_t min_clock() const {
    int64_t m = INT64_MAX;
    for (int w = 0; w < workers_; ++w)
      if (!stopped_[w]) m = std::min(m, clocks_[w]);
    return m;
  }

  // DC-ASGD-a: g += dc / sqrt(ms) * g*g*(w - w_bak), with ms the running mean square of the gradients this shard
  // received and w_bak the parameters worker `slot` holds (its last reply, or its replica under pull compression).
  void compensate_delay(const Slot& slot, std::vector<float>& g) {
    const std::vector<float>& bak = pull_ ? slot.replica : slot.backup;
    if (bak.size() != g.size()) return;  // resumed without a backup: one uncompensated step
    if (mean_sq_.size() != g.size()) mean_sq_.assign(g.size(), 0.f);
    const float lam = float(cfg_.dc), m = 0.95f;
    for (size_t i = 0; i < g.size(); ++i) {
      mean_sq_[i] = m * mean_sq_[i] + (1 - m) * g[i] * g[i];
      float l = lam / std::sqrt(mean_sq_[i] + 1e-12f);
      g[i] += l * g[i] * g[i] * (params_[i] - bak[i]);
    }
  }

  // Staleness-aware step (Zhang et al., IJCAI 2016, with the nominal staleness as the reference): tau is the number
  // of updates this shard applied since the parameters the gradient was computed on; W workers taking turns give
  // tau = W - 1, and a gradient staler than that is scaled by (W - 1) / tau. 1 when the option is off.
  float staleness_scale(const Slot& slot) {
    const uint64_t tau = version_ - slot.version;
    stats_.max_tau = std::max(stats_.max_tau, tau);
    const uint64_t nominal = uint64_t(std::max(1, workers_ - 1));
    if (!cfg_.staleness_lr || tau <= nominal) return 1.0f;
    stats_.scaled++;
    return float(nominal) / float(tau);
  }

  // One SGD step with momentum. The gradient comes scaled by the trainer's lr(t)/lr (and `scale`); the weight decay
  // is scaled by `lr_ratio`, that lr(t)/lr, so it follows the schedule as torch's SGD does (it decayed at full
  // strength through warm-up and the cosine tail), and by `decay_share`: 1/W for a push of asp/ssp, so that a round
  // of W pushes decays once, as bsp's one averaged step does (each push decayed in full: W times a round).
  void apply(const std::vector<float>& g, float scale, float lr_ratio, float decay_share = 1.0f) {
    ++version_;
    const float lr = float(cfg_.lr), mu = float(cfg_.momentum), wd = float(cfg_.weight_decay) * lr_ratio * decay_share;
    for (size_t i = 0; i < params_.size(); ++i) {
      float gi = scale * g[i] + wd * params_[i];
      momentum_[i] = mu * momentum_[i] + gi;
      params_[i] -= lr * momentum_[i];
    }
  }

  // DANA-Zero: the worker's own momentum; sum_j v_j kept up to date for the look-ahead.
  void apply_dana(Slot& slot, const std::vector<float>& g, float scale, float lr_ratio, float decay_share) {
    ++version_;
    const float lr = float(cfg_.lr), mu = float(cfg_.momentum), wd = float(cfg_.weight_decay) * lr_ratio * decay_share;
    float* v = slot.velocity.data();
    for (size_t i = 0; i < params_.size(); ++i) {
      const float gi = scale * g[i] + wd * params_[i];
      const float nv = mu * v[i] + gi;
      vsum_[i] += nv - v[i];
      v[i] = nv;
      params_[i] -= lr * nv;
    }
  }

  // What a worker computes its next gradient on: the parameters, or with dana their estimated future position.
  const std::vector<float>& send_point() {
    if (!dana()) return params_;
    const float c = float(cfg_.lr) * float(cfg_.momentum);
    lookahead_.resize(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) lookahead_[i] = params_[i] - c * vsum_[i];
    return lookahead_;
  }

  void maybe_apply_bsp() {
    int active = 0;
    for (int w = 0; w < workers_; ++w) active += !stopped_[w];
    if (bsp_count_ == 0 || bsp_count_ < active) return;
    for (auto& g : clock_grads_) {
      if (g.empty()) continue;
      for (size_t i = 0; i < g.size(); ++i) agg_[i] += g[i];
      g.clear();  // (keeps its capacity for the next clock)
    }
    apply(agg_, 1.0f / bsp_count_, bsp_ratio_);
    std::fill(agg_.begin(), agg_.end(), 0.f);
    bsp_count_ = 0;
    applied_clock_ = bsp_clock_;
  }

  bool releasable(int64_t c) const {
    if (per_clock()) return applied_clock_ >= c;
    if (cfg_.staleness < 0) return true;
    int64_t m = min_clock();
    return m == INT64_MAX || c - m <= cfg_.staleness;
  }

  // Builds the replies of every waiting worker whose condition now holds (under the lock).
  void release_ready() {
    for (int w = 0; w < workers_; ++w) {
      auto& s = slots_[w];
      if (s.waiting < 0 || s.ready || !releasable(s.waiting)) continue;
      int64_t m = min_clock();
      if (m != INT64_MAX) stats_.max_gap = std::max(stats_.max_gap, s.waiting - m);
      const std::vector<float>& point = send_point();
      if (pull_) {
        std::vector<float> delta(params_.size());
        for (size_t i = 0; i < delta.size(); ++i) delta[i] = point[i] - s.replica[i];
        // (parameters the updates drove to inf or nan: int8's scale of an inf is inf, and the worker's replica
        // turned nan with no word; the refusal ends the serving, which tells every rank)
        compress::check_finite_input(
            delta, pull_->name(),
            fmt::format("sync ps shard {}: the parameter change pulled by worker {}", index_, w).c_str());
        pull_->compress(delta, s.pull_state, s.reply);
        pull_->decompress_add(s.reply, s.pull_state, s.replica);
        s.reply_header = {s.reply.size(), 0};
      } else {
        s.reply.resize(params_.size() * 4);
        std::memcpy(s.reply.data(), point.data(), s.reply.size());
        s.reply_header = {s.reply.size(), 1};
        if (cfg_.dc > 0) s.backup = point;
      }
      s.version = version_;
      s.ready = true;
    }
  }

  std::function<std::string()> aborted_;
  const PsConfig& cfg_;
  int64_t index_;
  int workers_;
  const compress::Compressor* push_;
  const compress::Compressor* pull_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool initialized_ = false, shutdown_ = false;
  std::string why_;  // why it shut down, when an error did it
  std::vector<float> params_, initial_, momentum_, agg_, grad_, mean_sq_;
  std::vector<std::vector<float>> clock_grads_;  // per_clock(): each worker's gradient of the clock being gathered
  std::vector<float> vsum_, lookahead_;  // dana: sum of the workers' momenta; the last look-ahead built
  int initial_pulls_ = 0;
  std::vector<int64_t> clocks_;
  std::vector<bool> stopped_;
  std::vector<Slot> slots_;
  int bsp_count_ = 0;
  int64_t bsp_clock_ = 0, applied_clock_ = 0;
  float bsp_ratio_ = 1;
  uint64_t version_ = 0;  // updates applied
  PsClockStats stats_;
};

class PsStrategy : public Strategy {
 public:
  PsStrategy(coll::CommPtr comm, const PsConfig& cfg) : Strategy(std::move(comm)), cfg_(cfg) {
    const int n = comm_->size();
    if (!cfg_.colocate && cfg_.servers >= n)
      throw ConfigError(
          fmt::format("sync ps-{}: servers = {} leaves no worker among {} ranks (use fewer servers or "
                      "colocate=1)",
                      cfg_.mode, cfg_.servers, n));
    // Co-located shards: at most 64 on a rank, whose tags' slots the MPI transport keeps apart (see tag_of); each
    // takes a thread per other worker.
    if (cfg_.colocate && (cfg_.servers + n - 1) / n > kMaxShardsPerRank)
      throw ConfigError(fmt::format(
          "sync ps-{}: servers = {} puts {} shards on a rank of {}; allowed: at most {} a "
          "rank (servers <= {})",
          cfg_.mode, cfg_.servers, (cfg_.servers + n - 1) / n, n, kMaxShardsPerRank, int64_t{kMaxShardsPerRank} * n));
    // Refused before any thread starts, on every rank alike (the rank holding the most shards counts).
    const int64_t threads = cfg_.colocate ? (cfg_.servers + n - 1) / n * (n - 1) : n - cfg_.servers;
    if (threads > kMaxServingThreads) {
      if (cfg_.colocate) {
        const int64_t per_rank = std::min(kMaxShardsPerRank, kMaxServingThreads / (n - 1));
        throw ConfigError(fmt::format(
            "sync ps-{}: servers = {} co-located on {} ranks start {} shards x {} other workers = {} serving threads "
            "on a rank; allowed: at most {} a rank ({})",
            cfg_.mode, cfg_.servers, n, (cfg_.servers + n - 1) / n, n - 1, threads, kMaxServingThreads,
            per_rank > 0 ? fmt::format("servers <= {}", per_rank * n)
                         : fmt::format("colocate=0 with servers >= {}", n - kMaxServingThreads)));
      }
      throw ConfigError(fmt::format(
          "sync ps-{}: servers = {} dedicated of {} ranks serve {} workers each, a thread per worker; allowed: at most "
          "{} serving threads a rank (servers >= {})",
          cfg_.mode, cfg_.servers, n, threads, kMaxServingThreads, n - kMaxServingThreads));
    }
    workers_ = cfg_.colocate ? n : n - int(cfg_.servers);
    push_ = ps_compressor(cfg_.push_compressor, "push_compressor");
    pull_ = ps_compressor(cfg_.pull_compressor, "pull_compressor");
    for (int64_t s = 0; s < cfg_.servers; ++s)
      if (host_of(s) == comm_->rank())
        shards_.emplace(s, std::make_unique<Shard>(cfg_, s, workers_, push_.get(), pull_.get(),
                                                   [c = comm_] { return c->transport().aborted_reason(); }));
  }
  ~PsStrategy() override {
    // finish() was not called (an error stopped this rank): the serving threads block on receives from workers, or
    // wait for slower workers inside a shard, and use this object. Abort the transport (their receives fail at once),
    // wake the shards, and join them before the members go away.
    // A worker of dedicated servers has no threads, but its servers wait for its requests up to twice the drift
    // timeout and a timeout: a rank that set up and did not end cleanly aborts either way (across processes its exit
    // closes the sockets).
    if (threads_.empty() && (!started_ || ended_)) return;
    comm_->transport().abort(fmt::format("sync {}: stopped before finish() by an error on this rank", name()));
    for (auto& [s, sh] : shards_) sh->shutdown();
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }

  std::string name() const override { return "ps-" + cfg_.mode; }
  bool workers_drift() const override { return cfg_.mode == "asp" || ssp_drifts(cfg_); }
  void set_lr_scale(double s) override { lr_scale_ = s; }
  bool is_worker() const override { return comm_->rank() < workers_; }
  int worker_rank() const override { return is_worker() ? comm_->rank() : -1; }
  int num_workers() const override { return workers_; }

  void serve() override {
    if (is_worker())
      throw InvalidArgument(
          fmt::format("sync {}: rank {} is a worker; only server ranks serve()", name(), comm_->rank()));
    start_threads();
    join_threads();
    ended_ = true;
  }

  void setup(std::span<float> params) override {
    if (!is_worker())
      throw InvalidArgument(fmt::format("sync {}: rank {} is a server: call serve()", name(), comm_->rank()));
    d_ = params.size();
    start_threads();
    const int me = comm_->rank();
    if (me == 0) {
      std::vector<net::RequestPtr> reqs;
      std::vector<Header> hs(cfg_.servers);
      for (int64_t s = 0; s < cfg_.servers; ++s) {
        auto [lo, hi] = shard_range(d_, s, cfg_.servers);
        if (host_of(s) == me) {
          shards_.at(s)->init(params.subspan(lo, hi - lo));
          continue;
        }
        hs[s] = {kInit, (hi - lo) * 4, d_};
        reqs.push_back(isend(*comm_, host_of(s), tag_of(detail::kTagPsInit, s), &hs[s], sizeof(Header)));
        reqs.push_back(isend(*comm_, host_of(s), tag_of(detail::kTagPsInit, s), params.data() + lo, (hi - lo) * 4));
      }
      detail::wait_all(*comm_, reqs);
    }
    exchange(kPull, params, {});
    push_states_.clear();
    for (int64_t s = 0; s < cfg_.servers; ++s) {
      auto [lo, hi] = shard_range(d_, s, cfg_.servers);
      if (push_) push_states_.push_back(push_->make_state(hi - lo, push_seed(s), me));
      if (pull_) pull_states_.push_back(pull_->make_state(hi - lo, pull_seed(s), 0));
    }
  }

  bool before_step(uint64_t, std::span<float> params, std::span<float> grads) override {
    if (params.size() != d_ || grads.size() != d_)
      throw InvalidArgument(fmt::format("sync {}: {} parameters and {} gradients but setup() saw {}", name(),
                                        params.size(), grads.size(), d_));
    exchange(kPush, params, grads);
    return false;
  }

  void finish(std::span<float> params) override {
    if (finished_) return;
    finished_ = true;
    exchange(kStop, params, {});
    join_threads();
    // Co-located shards: once this rank's server threads have every worker's stop, all pushes are applied; one
    // allreduce of the shards each rank hosts gives every worker the servers' final model (what pushes after its
    // own last pull changed, e.g. a slow worker's last steps under asp). Dedicated servers send it in reply to the
    // stop. (One rank alone holds every shard: with dana its last pull was the look-ahead point, not the parameters.)
    if (cfg_.colocate) {
      std::vector<float> full(d_, 0.f);
      for (auto& [s, sh] : shards_) sh->copy_params(full.data() + shard_range(d_, s, cfg_.servers).first);
      // Its volume is counted once, as sent: the trainer adds a parameter server worker's receives (its pulls) to
      // the bytes on the wire, and counted in bytes_received too it was there twice. It is no push: not a payload.
      const uint64_t received = stats_.bytes_received, payload = stats_.payload_bytes;
      if (comm_->size() > 1) detail::allreduce_f32(*comm_, full, ReduceOp::sum, stats_);
      stats_.bytes_received = received;
      stats_.payload_bytes = payload;
      std::copy(full.begin(), full.end(), params.begin());
    }
    ended_ = true;
  }

  // Worker side (clock, compressor states) and the shards served in this process (co-located servers). On resume:
  // setup() on every rank, a barrier (every initial pull served), load_state(), a barrier, then the next step.
  // Dedicated server ranks are not checkpointed.
  Bytes save_state() const override {
    detail::Writer w;
    w.u64(clock_);
    w.u64(push_states_.size());
    for (const auto& st : push_states_) w.bytes(st.save());
    w.u64(pull_states_.size());
    for (const auto& st : pull_states_) w.bytes(st.save());
    w.u64(shards_.size());
    for (const auto& [s, sh] : shards_) {
      w.u64(s);
      sh->save(w);
    }
    return w.take();
  }

  void load_state(std::span<const uint8_t> bytes) override {
    detail::Reader r(bytes, name());
    clock_ = static_cast<uint64_t>(checked_clock(r.u64(), "clock"));
    if (r.u64() != push_states_.size())
      throw InvalidArgument(fmt::format("sync {}: state's push compressor states do not match", name()));
    for (auto& st : push_states_) st = compress::TensorState::load(r.bytes());
    if (r.u64() != pull_states_.size())
      throw InvalidArgument(fmt::format("sync {}: state's pull compressor states do not match", name()));
    for (auto& st : pull_states_) st = compress::TensorState::load(r.bytes());
    uint64_t ns = r.u64();
    if (ns != shards_.size())
      throw InvalidArgument(
          fmt::format("sync {}: state holds {} shards, rank {} serves {}", name(), ns, comm_->rank(), shards_.size()));
    for (uint64_t k = 0; k < ns; ++k) {
      int64_t s = static_cast<int64_t>(r.u64());
      auto it = shards_.find(s);
      if (it == shards_.end())
        throw InvalidArgument(
            fmt::format("sync {}: state holds shard {}, not served by rank {}", name(), s, comm_->rank()));
      it->second->load(r);
    }
    r.done();
  }

  PsClockStats clock_stats() const {
    PsClockStats out;
    for (const auto& [s, sh] : shards_) {
      auto st = sh->stats();
      out.max_gap = std::max(out.max_gap, st.max_gap);
      out.pushes += st.pushes;
      out.waits += st.waits;
      out.max_tau = std::max(out.max_tau, st.max_tau);
      out.scaled += st.scaled;
    }
    return out;
  }

 private:
  int host_of(int64_t shard) const {
    const int n = comm_->size();
    return cfg_.colocate ? int(shard % n) : n - int(cfg_.servers) + int(shard);
  }
  // The tag of a message of kind `base` about `shard`: its slot among its host's shards (host_of's order) in bits
  // 5..20 (see above).
  uint32_t tag_of(uint32_t base, int64_t shard) const {
    const int64_t slot = cfg_.colocate ? shard / comm_->size() : 0;
    return base | (uint32_t(slot & 0xffff) << 5);
  }

  void start_threads() {
    if (started_) return;
    started_ = true;
    // Below kMaxServingThreads, the process may still run out (its limit on threads, ulimit -u; the ranks of other
    // jobs): said naming the setting. Those started are stopped and joined by the destructor.
    try {
      for (auto& [s, sh] : shards_)
        for (int w = 0; w < workers_; ++w)
          if (w != comm_->rank()) threads_.emplace_back([this, s = s, w] { serve_worker(s, w); });
    } catch (const std::system_error& e) {
      throw Error(fmt::format(
          "sync {}: rank {} could not start serving thread {} ({} shards here x {} other workers): "
          "{}; allowed: fewer servers or workers, or a higher limit on threads (ulimit -u)",
          name(), comm_->rank(), threads_.size() + 1, shards_.size(), is_worker() ? workers_ - 1 : workers_, e.what()));
    }
  }

  void join_threads() {
    for (auto& t : threads_) t.join();
    threads_.clear();
    if (error_) std::rethrow_exception(error_);
  }

  // One thread per (local shard, remote worker).
  void serve_worker(int64_t s, int w) {
    auto& shard = *shards_.at(s);
    try {
      const double t = comm_->timeout_s();
      if (w == 0) {  // the initial parameters come first
        Header h;
        detail::wait(*comm_, irecv(*comm_, 0, tag_of(detail::kTagPsInit, s), &h, sizeof h));
        // The model's size travels in the clock field: the shard's size follows from it.
        const auto [lo, hi] = shard_range(h.clock <= (uint64_t{1} << 40) ? h.clock : 0, s, cfg_.servers);
        const uint64_t want = 4 * static_cast<uint64_t>(hi - lo);
        if (h.kind != kInit || h.clock > (uint64_t{1} << 40) || h.bytes != want)
          throw ProtocolError(
              fmt::format("sync {}: shard {}: worker 0 sent kind {} with {} bytes for a model of {} "
                          "parameters; allowed: the initial parameters (kind {}), 4 bytes each of "
                          "the shard's {} of at most 2^40",
                          name(), s, h.kind, h.bytes, h.clock, uint64_t{kInit}, want / 4));
        // Before anything is allocated for it: the shard held (parameters, momentum, the sum of pushes, the
        // initial copy) within what this process may use (a bogus size had std::bad_alloc as its only message).
        const double memory = usable_memory_bytes();
        if (memory > 0 && 4.0 * double(want) > memory)
          throw ProtocolError(
              fmt::format("sync {}: shard {}: worker 0 sent a model of {} parameters, whose shard of "
                          "{} bytes this process cannot hold four times ({:.0f} bytes usable); "
                          "allowed: more servers or a smaller model",
                          name(), s, h.clock, want, memory));
        std::vector<float> p(h.bytes / 4);
        detail::wait(*comm_, irecv(*comm_, 0, tag_of(detail::kTagPsInit, s), p.data(), h.bytes));
        shard.init(p);
      }
      Bytes payload;
      for (;;) {
        Header h;
        // Waiting for the worker's next request has twice the drift timeout and a timeout more: a worker may rightly
        // send none for longer than the timeout (evaluating alone, up to the drift timeout; at a checkpoint, waiting
        // up to the drift timeout for the others, then a barrier, the copies' evaluation and the files). The other
        // workers' waits for this one, not this, are what find a frozen worker first. The wait ends at once when the
        // worker does: its death or lost connection fails the receive, and an error on any rank aborts the transports
        // (this rank's too, in ~PsStrategy).
        net::RequestPtr r = irecv(*comm_, w, tag_of(detail::kTagPsHeader, s), &h, sizeof h);
        detail::wait_drifting(
            *comm_, {r}, 2 * drift_timeout_s_ + t,
            fmt::format("sync {}: rank {}: shard {}: worker {}'s next request", name(), comm_->rank(), s, w),
            "2 x drift_timeout_s + timeout_s");
        shard.check_request(w, h, t);
        payload.resize(h.bytes);
        if (h.bytes) detail::wait(*comm_, irecv(*comm_, w, tag_of(detail::kTagPsPayload, s), payload.data(), h.bytes));
        auto [rh, reply] = shard.handle(w, h, payload, t, drift_timeout_s_);
        if (h.kind == kStop && cfg_.colocate) return;  // (finish() allreduces the final model)
        if (h.kind == kStop) {
          // The servers' final model to the worker (raw), once every worker's pushes are in: what it held was its
          // last pull, without the pushes that came after it (other workers' under asp/ssp) and, with dana, the
          // look-ahead point rather than the parameters.
          const std::vector<float> last = shard.final_params(workers_drift() ? drift_timeout_s_ : t);
          rh = ReplyHeader{last.size() * 4, 1};
          detail::wait_all(*comm_, {isend(*comm_, w, tag_of(detail::kTagPsReplyHeader, s), &rh, sizeof rh),
                                    isend(*comm_, w, tag_of(detail::kTagPsReply, s), last.data(), rh.bytes)});
          return;
        }
        detail::wait_all(*comm_, {isend(*comm_, w, tag_of(detail::kTagPsReplyHeader, s), &rh, sizeof rh),
                                  isend(*comm_, w, tag_of(detail::kTagPsReply, s), reply.data(), reply.size())});
      }
    } catch (const std::exception& e) {
      stop_serving(s, w, e.what());
    } catch (...) {
      stop_serving(s, w, "unknown error");
    }
  }

  // Called from serve_worker's handler: this rank can no longer serve worker w. The workers waiting in a local shard
  // for it (this rank's own among them) fail now with the cause, and the other ranks' transports are told, instead
  // of all waiting out their deadlines.
  void stop_serving(int64_t s, int w, const char* what) {
    {
      std::lock_guard<std::mutex> lk(err_mu_);
      if (!error_) error_ = std::current_exception();
    }
    std::string why = fmt::format("serving worker {} failed: {}", w, what);
    for (auto& [i, other] : shards_) other->shutdown(why);
    comm_->transport().abort(fmt::format("sync {}: shard {} {}", name(), s, why));
  }

  // Sends one message (push, pull or stop) to every shard and applies the replies to params.
  void exchange(uint64_t kind, std::span<float> params, std::span<const float> grads) {
    Stopwatch sw;
    const int me = comm_->rank();
    const int64_t S = cfg_.servers;
    if (kind == kPush) clock_++;
    std::vector<Header> hs(S);
    std::vector<Bytes> payloads(S);
    std::vector<ReplyHeader> rhs(S);
    std::vector<Bytes> replies(S);
    std::vector<net::RequestPtr> sends, rrecv, precv;
    // Every request posted here reads or writes the buffers above, which an exception frees: whatever ends the
    // exchange early gives up all of them first. (The wait for the sends gave up only the sends: a server's death or
    // its deadline left the receives of the other servers' reply headers posted into `rhs`, where a later reply
    // landed in freed memory.)
    auto give_up_all = [&](const std::string& why) {
      for (const auto* reqs : {&sends, &rrecv, &precv})
        for (const auto& r : *reqs) net::give_up(comm_->transport(), r, why);
    };
    try {
      for (int64_t s = 0; s < S; ++s) {
        auto [lo, hi] = shard_range(d_, s, S);
        if (kind == kPush) {
          if (push_) {
            compress::check_finite_or_abort(
                *comm_, grads.subspan(lo, hi - lo), push_->name(),
                fmt::format("parameter-server push to shard {} (elements from {})", s, lo).c_str());
            push_->compress(grads.subspan(lo, hi - lo), push_states_[s], payloads[s]);
          } else {
            payloads[s].resize((hi - lo) * 4);
            std::memcpy(payloads[s].data(), grads.data() + lo, (hi - lo) * 4);
          }
        }
        hs[s] = {kind, payloads[s].size(), kind == kPush ? clock_ : 0,  // = the push state's step after compress
                 kind == kPush ? lr_scale_ : 1.0};
        // Every push is a payload, its own rank's shard's too (it does not cross the wire, but leaving it out made an
        // uncompressed exchange's compression_ratio W/(W-1)); the stop message is none.
        if (kind == kPush) stats_.payload_bytes += sizeof(Header) + payloads[s].size();
        if (host_of(s) == me) continue;
        int h = host_of(s);
        sends.push_back(isend(*comm_, h, tag_of(detail::kTagPsHeader, s), &hs[s], sizeof(Header)));
        if (!payloads[s].empty())
          sends.push_back(isend(*comm_, h, tag_of(detail::kTagPsPayload, s), payloads[s].data(), payloads[s].size()));
        if (kind != kStop || !cfg_.colocate)  // (dedicated servers answer a stop with the final model)
          rrecv.push_back(irecv(*comm_, h, tag_of(detail::kTagPsReplyHeader, s), &rhs[s], sizeof(ReplyHeader)));
        stats_.bytes_sent += sizeof(Header) + payloads[s].size();
      }
      // Local shards (co-located) are served on this thread, after the remote pushes left. When that throws (an ssp
      // wait past the deadline), the other ranks hear why.
      try {
        for (int64_t s = 0; s < S; ++s) {
          if (host_of(s) != me) continue;
          auto [rh, reply] = shards_.at(s)->handle(me, hs[s], payloads[s], comm_->timeout_s(), drift_timeout_s_);
          rhs[s] = rh;
          replies[s] = std::move(reply);
        }
      } catch (const std::exception& e) {
        give_up_all(e.what());
        // The other ranks hear the cause (this rank's destructor then aborted with "stopped before finish() by an
        // error on this rank", and they heard only that); an abort that came first keeps its own.
        comm_->transport().abort(fmt::format("sync {}: rank {}: {}", name(), comm_->rank(), e.what()));
        throw;
      }
      detail::wait_all(*comm_, sends);
      if (kind == kStop && cfg_.colocate) {
        stats_.comm_seconds += sw.seconds();
        return;
      }
      // The replies to a push wait for slower workers under ssp: drift_timeout_s there, as at the shard (a dead shard
      // or worker aborts the transport, which ends the wait at once); so does the final model under asp and ssp, sent
      // once every worker stopped (bsp's workers stop together: the deadline holds).
      if (ssp_drifts(cfg_) || (kind == kStop && workers_drift())) {  // (asp replies at once: it keeps the deadline)
        // (a timeout past the shards' own waits, so that a shard, which knows which workers are behind, says so; at
        // the limit the others hear which rank went silent, not only that this one stopped)
        detail::wait_drifting(*comm_, rrecv, drift_timeout_s_ + comm_->timeout_s(),
                              fmt::format("sync {}: rank {}: the servers' {}", name(), comm_->rank(),
                                          kind == kStop ? "final model" : "replies to its push"),
                              "drift_timeout_s + timeout_s", /*abort_on_timeout=*/true);
      } else
        detail::wait_all(*comm_, rrecv);
      // A reply is the shard raw (its size in f32) or, with a pull compressor, that compressor's payload (at most
      // compressed_cap): every header is checked before any receive is posted (a receive posted for an earlier shard
      // would be left writing into a reply buffer freed by the error).
      for (int64_t s = 0; s < S; ++s) {
        if (host_of(s) == me) continue;
        auto [lo, hi] = shard_range(d_, s, S);
        const uint64_t raw_bytes = 4 * static_cast<uint64_t>(hi - lo);
        // (The starting point at setup comes raw, before the pull states exist.)
        const bool compressed = pull_ && size_t(s) < pull_states_.size() && kind != kStop;
        const uint64_t cap = compressed ? compress::max_payload_bytes(*pull_, hi - lo, pull_states_[size_t(s)]) : 0;
        const bool ok =
            rhs[s].raw == 1 ? rhs[s].bytes == raw_bytes : rhs[s].raw == 0 && compressed && rhs[s].bytes <= cap;
        if (!ok)
          throw ProtocolError(
              fmt::format("sync {}: shard {} replied {} bytes, raw = {}; allowed: {} bytes raw{}", name(), s,
                          rhs[s].bytes, rhs[s].raw, raw_bytes,
                          compressed ? fmt::format(", or compressed (raw = 0) at most {}", cap) : std::string()));
      }
      for (int64_t s = 0; s < S; ++s) {
        if (host_of(s) == me) continue;
        replies[s].resize(rhs[s].bytes);
        precv.push_back(irecv(*comm_, host_of(s), tag_of(detail::kTagPsReply, s), replies[s].data(), rhs[s].bytes));
        stats_.bytes_received += sizeof(ReplyHeader) + rhs[s].bytes;
      }
      detail::wait_all(*comm_, precv);
      for (int64_t s = 0; s < S; ++s) {
        auto [lo, hi] = shard_range(d_, s, S);
        auto dst = params.subspan(lo, hi - lo);
        if (rhs[s].raw) {
          if (replies[s].size() != dst.size_bytes())
            throw ProtocolError(fmt::format("sync {}: shard {} sent {} bytes, expected {}", name(), s,
                                            replies[s].size(), dst.size_bytes()));
          std::memcpy(dst.data(), replies[s].data(), dst.size_bytes());
        } else {
          pull_states_[s].step++;  // in step with the server's state after its compress
          pull_->decompress_add(replies[s], pull_states_[s], dst);
        }
      }
      if (kind != kStop) stats_.rounds++;
    } catch (const std::exception& e) {
      give_up_all(e.what());
      throw;
    } catch (...) {
      give_up_all(fmt::format("sync {}: rank {}: the exchange ended with an exception", name(), me));
      throw;
    }
    stats_.comm_seconds += sw.seconds();
  }

  PsConfig cfg_;
  int workers_ = 0;
  size_t d_ = 0;
  compress::CompressorPtr push_, pull_;
  std::map<int64_t, std::unique_ptr<Shard>> shards_;
  std::vector<std::thread> threads_;
  std::mutex err_mu_;
  std::exception_ptr error_;
  std::vector<compress::TensorState> push_states_, pull_states_;
  uint64_t clock_ = 0;
  bool started_ = false, finished_ = false;
  bool ended_ = false;  // finish() or serve() returned normally
  double lr_scale_ = 1;
};

}  // namespace

StrategyPtr make_ps_strategy(coll::CommPtr comm, const PsConfig& cfg) {
  return std::make_unique<PsStrategy>(std::move(comm), cfg);
}

PsClockStats ps_clock_stats(const Strategy& s) {
  auto* ps = dynamic_cast<const PsStrategy*>(&s);
  if (!ps) throw InvalidArgument(fmt::format("sync: {} is not a parameter-server scheme", s.name()));
  return ps->clock_stats();
}

}  // namespace conduit::sync
