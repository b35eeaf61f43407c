// Decentralized schemes: dpsgd (with optional CHOCO compressed gossip), sgp (PushSum), adpsgd (pairwise).
//
// Bytes per rank and step (d parameters): dpsgd sends 4d to each of its deg neighbours (ring 2, torus 4,
// exponential ~2 log2 n) and receives as much; with a compressor, wire_bytes(d) + 8 per neighbour instead.
// sgp sends 4(d+1) to each of `peers` out-neighbours. adpsgd: an active rank sends 4(d+1) and receives 4d per step;
// a passive rank sends 4d and receives 4(d+1) per request it answers (rank 0 of an odd ring does both: it answers
// the wrap edge's requests from rank n-1).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "compress/collectives.h"
#include "core/error.h"
#include "sync/detail.h"
#include "sync/schemes.h"

namespace conduit::sync {

using detail::irecv;
using detail::isend;

DpsgdStrategy::DpsgdStrategy(coll::CommPtr comm, Graph graph, compress::CompressorPtr compressor, double gamma,
                             uint64_t seed)
    : Strategy(std::move(comm)), graph_(std::move(graph)), compressor_(std::move(compressor)), gamma_(gamma) {
  nbrs_ = graph_.neighbours(comm_->rank());
  if (compressor_) cstate_ = compressor_->make_state(0, seed, comm_->rank());
}

void DpsgdStrategy::setup(std::span<float> params) {
  Strategy::setup(params);
  inbox_.assign(nbrs_.size(), std::vector<float>(params.size()));
  if (compressor_) {
    hat_.assign(nbrs_.size() + 1, std::vector<float>(params.begin(), params.end()));
    cstate_ = compressor_->make_state(params.size(), cstate_.seed, cstate_.stream);
  }
}

void DpsgdStrategy::after_step(uint64_t, std::span<float> params) {
  if (nbrs_.empty()) return;
  if (!inbox_.empty() && inbox_[0].size() != params.size())
    throw InvalidArgument(fmt::format("sync dpsgd: {} parameters but setup() saw {}", params.size(), inbox_[0].size()));
  if (inbox_.empty()) throw InvalidArgument("sync dpsgd: after_step before setup()");
  Stopwatch sw;
  if (compressor_)
    choco_gossip(params);
  else
    plain_gossip(params);
  stats_.comm_seconds += sw.seconds();
  stats_.rounds += 1;
}

void DpsgdStrategy::plain_gossip(std::span<float> params) {
  auto& c = *comm_;
  std::vector<net::RequestPtr> reqs;
  for (size_t k = 0; k < nbrs_.size(); ++k)
    reqs.push_back(irecv(c, nbrs_[k], detail::kTagGossip, inbox_[k].data(), params.size_bytes()));
  for (int p : nbrs_) reqs.push_back(isend(c, p, detail::kTagGossip, params.data(), params.size_bytes()));
  detail::wait_all(c, reqs);
  stats_.bytes_sent += nbrs_.size() * params.size_bytes();
  stats_.payload_bytes += params.size_bytes();
  stats_.bytes_received += nbrs_.size() * params.size_bytes();
  // Difference form x_i += sum_j W_ij (x_j - x_i), the same x_i <- sum_j W_ij x_j as W_ii = 1 - sum_j W_ij. Rank i's
  // term for j is exactly minus rank j's term for i (W symmetric, and rounding is symmetric under negation), so the
  // terms cancel over the ranks and the mean moves only by the one unbiased rounding of each new x_i. (sum_j W_ij x_j
  // with the weights rounded to f32 scaled the mean by each column's sum, 3 fl(1/3) = 1 + 3e-8 on a ring, every round
  // the replicas differed: a drift of 1e-4 of the mean in a few thousand rounds.)
  const int me = c.rank();
  std::vector<double> wk(nbrs_.size());
  for (size_t k = 0; k < nbrs_.size(); ++k) wk[k] = graph_.weight(me, nbrs_[k]);
  for (size_t i = 0; i < params.size(); ++i) {
    const double xi = params[i];
    double delta = 0;
    for (size_t k = 0; k < nbrs_.size(); ++k) delta += wk[k] * (static_cast<double>(inbox_[k][i]) - xi);
    params[i] = static_cast<float>(xi + delta);
  }
}

void DpsgdStrategy::choco_gossip(std::span<float> params) {
  auto& c = *comm_;
  const size_t d = params.size();
  std::vector<float> diff(d);
  for (size_t i = 0; i < d; ++i) diff[i] = params[i] - hat_[0][i];
  compress::Bytes q;
  compress::check_finite_or_abort(c, diff, compressor_->name(), "gossip");
  compressor_->compress(diff, cstate_, q);
  uint64_t len = q.size();
  const size_t m = nbrs_.size();
  std::vector<uint64_t> lens(m);
  std::vector<net::RequestPtr> reqs;
  for (size_t k = 0; k < m; ++k) reqs.push_back(irecv(c, nbrs_[k], detail::kTagGossipLen, &lens[k], 8));
  for (int p : nbrs_) reqs.push_back(isend(c, p, detail::kTagGossipLen, &len, 8));
  detail::wait_all(c, reqs);
  reqs.clear();
  // Before anything is allocated for them: a length no encoder writes (a corrupt or foreign neighbour).
  const uint64_t most = compress::max_payload_bytes(*compressor_, d, cstate_);
  for (size_t k = 0; k < m; ++k)
    if (lens[k] > most) {
      const std::string why =
          fmt::format("sync dpsgd: neighbour rank {} announced a {} payload of {} bytes for {} parameters (at most {})",
                      nbrs_[k], compressor_->name(), lens[k], d, most);
      c.transport().abort(why);
      throw ProtocolError(why);
    }
  // Every buffer before the first receive: an allocation that failed between two left the first posted into a buffer
  // the exception freed.
  std::vector<compress::Bytes> in(m);
  for (size_t k = 0; k < m; ++k) in[k].resize(lens[k]);
  for (size_t k = 0; k < m; ++k) reqs.push_back(irecv(c, nbrs_[k], detail::kTagGossip, in[k].data(), lens[k]));
  for (int p : nbrs_) reqs.push_back(isend(c, p, detail::kTagGossip, q.data(), q.size()));
  detail::wait_all(c, reqs);
  stats_.bytes_sent += m * (q.size() + 8);
  stats_.payload_bytes += q.size() + 8;
  for (auto l : lens) stats_.bytes_received += l + 8;
  compressor_->decompress_add(q, cstate_, hat_[0]);
  for (size_t k = 0; k < m; ++k) compressor_->decompress_add(in[k], cstate_, hat_[k + 1]);
  const int me = c.rank();
  const float g = static_cast<float>(gamma_);
  for (size_t k = 0; k < m; ++k) {
    const float w = g * static_cast<float>(graph_.weight(me, nbrs_[k]));
    const auto& h = hat_[k + 1];
    for (size_t i = 0; i < d; ++i) params[i] += w * (h[i] - hat_[0][i]);
  }
}

Bytes DpsgdStrategy::save_state() const {
  detail::Writer w;
  w.u64(hat_.size());
  for (const auto& h : hat_) w.floats(h);
  auto cs = compressor_ ? cstate_.save() : Bytes{};
  w.u64(cs.size());
  Bytes out = w.take();
  out.insert(out.end(), cs.begin(), cs.end());
  return out;
}
void DpsgdStrategy::load_state(std::span<const uint8_t> bytes) {
  detail::Reader r(bytes, name());
  uint64_t nh = r.u64();
  if (nh != hat_.size())
    throw InvalidArgument(fmt::format("sync dpsgd: state holds {} public copies, this rank needs {}", nh, hat_.size()));
  const size_t d = hat_.empty() ? 0 : hat_[0].size();
  for (auto& h : hat_) h = r.floats(d, "public copy");
  // The compressor's state follows, to the end.
  uint64_t cs = r.u64();
  if (cs != r.remaining())
    throw InvalidArgument(
        fmt::format("sync dpsgd: the state announces {} bytes of compressor state, {} follow", cs, r.remaining()));
  if (cs && !compressor_)
    throw InvalidArgument("sync dpsgd: the state holds a compressor's state, and this run gossips uncompressed");
  if (cs) cstate_ = compress::TensorState::load(bytes.subspan(bytes.size() - cs));
}

// ---------------------------------------------------------------------------------------------------------------

SgpStrategy::SgpStrategy(coll::CommPtr comm, int peers_per_step) : Strategy(std::move(comm)), peers_(peers_per_step) {}

std::vector<int> SgpStrategy::out_peers(int rank, int n, uint64_t t, int peers_per_step) {
  std::vector<int> offs;
  for (int64_t h = 1; h < n; h *= 2) offs.push_back(int(h));
  std::vector<int> out;
  if (offs.empty()) return out;
  int k = std::min<int>(peers_per_step, int(offs.size()));
  for (int p = 0; p < k; ++p) out.push_back((rank + offs[(t * k + p) % offs.size()]) % n);
  return out;
}

void SgpStrategy::setup(std::span<float> params) {
  Strategy::setup(params);
  x_.assign(params.begin(), params.end());
  z_ = x_;
  w_ = 1;
  in_.resize(params.size() + 1);
}

void SgpStrategy::after_step(uint64_t step, std::span<float> params) {
  if (x_.size() != params.size())
    throw InvalidArgument(fmt::format("sync sgp: {} parameters but setup() saw {}", params.size(), x_.size()));
  const size_t d = params.size();
  for (size_t i = 0; i < d; ++i) x_[i] += params[i] - z_[i];  // the local optimizer's update, on the numerator
  const int n = comm_->size(), me = comm_->rank();
  auto outs = out_peers(me, n, step, peers_);
  if (!outs.empty()) {
    Stopwatch sw;
    // What stays is what was not sent, numerators and weight alike: the sums stay what they were up to one unbiased
    // rounding of each kept numerator. (Kept and sent as x * fl(1/(k+1)), both scaled by (k+1) fl(1/(k+1)) = 1 + 3e-8
    // a step for k = 2; the weight kept in double and sent rounded to f32 drifted apart from them.)
    const double share = 1.0 / static_cast<double>(outs.size() + 1), k = static_cast<double>(outs.size());
    std::vector<float> msg(d + 1);
    for (size_t i = 0; i < d; ++i) {
      msg[i] = static_cast<float>(x_[i] * share);
      x_[i] = static_cast<float>(static_cast<double>(x_[i]) - k * msg[i]);
    }
    msg[d] = static_cast<float>(w_ * share);
    w_ -= k * msg[d];
    // In-peers use the same offsets, backwards.
    std::vector<std::vector<float>> in(outs.size(), std::vector<float>(d + 1));
    std::vector<net::RequestPtr> reqs;
    std::vector<int> from(outs.size());
    for (size_t k = 0; k < outs.size(); ++k) {
      from[k] = ((me - (outs[k] - me)) % n + 2 * n) % n;
      reqs.push_back(irecv(*comm_, from[k], detail::kTagPushSum, in[k].data(), (d + 1) * 4));
    }
    for (int p : outs) reqs.push_back(isend(*comm_, p, detail::kTagPushSum, msg.data(), (d + 1) * 4));
    detail::wait_all(*comm_, reqs);
    // A push-sum weight is a positive share of a positive weight: anything else is the neighbour's fault, and taken
    // it turned every parameter into NaN or inf without a word.
    for (size_t k = 0; k < outs.size(); ++k)
      if (!(std::isfinite(in[k][d]) && in[k][d] > 0)) {
        const std::string why = fmt::format(
            "sync sgp: neighbour rank {} sent a push-sum weight of {}; allowed: a "
            "finite number above 0",
            from[k], in[k][d]);
        comm_->transport().abort(why);
        throw ProtocolError(why);
      }
    for (const auto& m : in) {
      for (size_t i = 0; i < d; ++i) x_[i] += m[i];
      w_ += m[d];
    }
    stats_.bytes_sent += outs.size() * (d + 1) * 4;
    stats_.payload_bytes += (d + 1) * 4;
    stats_.bytes_received += outs.size() * (d + 1) * 4;
    stats_.rounds += 1;
    stats_.comm_seconds += sw.seconds();
  }
  const float inv = static_cast<float>(1.0 / w_);
  for (size_t i = 0; i < d; ++i) params[i] = z_[i] = x_[i] * inv;
}

void SgpStrategy::finish(std::span<float>) {}

Bytes SgpStrategy::save_state() const {
  detail::Writer w;
  w.f64(w_);
  w.floats(x_);
  return w.take();
}
void SgpStrategy::load_state(std::span<const uint8_t> bytes) {
  detail::Reader r(bytes, name());
  w_ = r.f64();
  if (!(w_ > 0) || !std::isfinite(w_))
    throw InvalidArgument(fmt::format("sync sgp: the state's push-sum weight is {} (allowed: finite, > 0)", w_));
  x_ = r.floats(x_.size(), "push-sum numerators");
  r.done();
  z_.resize(x_.size());
  for (size_t i = 0; i < x_.size(); ++i) z_[i] = static_cast<float>(x_[i] / w_);
  in_.resize(x_.size() + 1);
}

// ---------------------------------------------------------------------------------------------------------------

AdpsgdStrategy::AdpsgdStrategy(coll::CommPtr comm, uint64_t seed, bool final_average)
    : Strategy(std::move(comm)), rng_(seed * 1000003 + comm_->rank()), final_average_(final_average) {
  // Every ring neighbour, the wrap edge of an odd ring included; who initiates and who answers: adpsgd_ring_roles.
  nbrs_ = Graph("ring", comm_->size()).neighbours(comm_->rank());
}

AdpsgdStrategy::~AdpsgdStrategy() {
  // finish() was not called (an error stopped this rank): the serving threads block on receives from peers and use
  // this object, so abort the transport (their waits fail at once) and join them before the members go away.
  // An active rank has no threads, but its passive neighbours serve it up to twice the drift timeout and a timeout:
  // one that set up and did not end cleanly aborts either way (across processes its exit closes the sockets).
  if (std::none_of(servers_.begin(), servers_.end(), [](const std::thread& t) { return t.joinable(); }) &&
      (!set_up_ || ended_))
    return;
  comm_->transport().abort("sync adpsgd: stopped before finish() by an error on this rank");
  for (auto& t : servers_)
    if (t.joinable()) t.join();
}

void AdpsgdStrategy::setup(std::span<float> params) {
  Strategy::setup(params);
  const size_t d = params.size();
  send_.resize(d + 1);
  recv_.resize(d);
  shadow_.assign(params.begin(), params.end());
  pending_.assign(d, 0.f);
  set_up_ = true;
  // (the size handed over: read in the thread, shadow_ is under mu_, which load_state takes to replace it)
  for (int p : adpsgd_ring_roles(comm_->rank(), comm_->size()).answers)
    servers_.emplace_back([this, p, d] { serve_peer(p, d); });
}

void AdpsgdStrategy::serve_peer(int peer, size_t d) {
  std::vector<float> req(d + 1), rep(d);
  try {
    for (;;) {
      // The next request may rightly take longer than the timeout (the neighbour evaluating alone, or at a
      // checkpoint waiting up to drift_timeout_s for the others, then writing it): twice that and a timeout more;
      // the wait ends at once with the neighbour (death, lost connection, an abort from any rank).
      auto r = irecv(*comm_, peer, detail::kTagPairReq, req.data(), req.size() * 4);
      detail::wait_drifting(*comm_, {r}, 2 * drift_timeout_s_ + comm_->timeout_s(),
                            fmt::format("sync adpsgd: rank {}: neighbour {}'s next request", comm_->rank(), peer),
                            "2 x drift_timeout_s + timeout_s");
      if (req[d] == 0) {  // the active neighbour finished (its stop is a request's size: counted as one received)
        std::lock_guard<std::mutex> lk(mu_);
        served_received_ += req.size() * 4;
        return;
      }
      // (any other flag, a NaN or a 2 from a corrupt peer, was averaged in as a request)
      if (req[d] != 1)
        throw ProtocolError(
            fmt::format("sync adpsgd: rank {} sent rank {} a pair request flagged {}; "
                        "allowed: 1 (a request) or 0 (a stop)",
                        peer, comm_->rank(), req[d]));
      {
        std::lock_guard<std::mutex> lk(mu_);
        for (size_t i = 0; i < d; ++i) {
          rep[i] = shadow_[i];
          float half = 0.5f * (req[i] - shadow_[i]);
          shadow_[i] += half;
          pending_[i] += half;
        }
        // (counted with the averages they bring, under the lock: a save_state between the two saw one without the
        // other)
        served_received_ += req.size() * 4;
        served_sent_ += d * 4;
        served_rounds_ += 1;
      }
      exchanges_++;
      detail::wait(*comm_, isend(*comm_, peer, detail::kTagPairRep, rep.data(), d * 4));
    }
  } catch (const std::exception& e) {
    stop_serving(peer, e.what());
  } catch (...) {
    stop_serving(peer, "unknown error");
  }
}

// Called from serve_peer's handler: this rank no longer answers `peer`, which waits for the reply to its request (it
// waited out its whole deadline and then reported a bare timeout): the transport is aborted with the cause, as
// PsStrategy's serving threads do. This rank hears it at its next step (apply_pending).
void AdpsgdStrategy::stop_serving(int peer, const char* what) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!error_) error_ = std::current_exception();
  }
  comm_->transport().abort(
      fmt::format("sync adpsgd: rank {} stopped answering rank {}: {}", comm_->rank(), peer, what));
}

void AdpsgdStrategy::apply_pending(std::span<float> params) {
  std::lock_guard<std::mutex> lk(mu_);
  if (error_) std::rethrow_exception(error_);
  const uint64_t served = served_sent_.exchange(0);  // one reply composed per request served
  stats_.bytes_sent += served;
  stats_.payload_bytes += served;
  stats_.bytes_received += served_received_.exchange(0);
  stats_.rounds += served_rounds_.exchange(0);
  for (size_t i = 0; i < params.size(); ++i) {
    params[i] += pending_[i];
    pending_[i] = 0;
    shadow_[i] = params[i];
  }
}

void AdpsgdStrategy::after_step(uint64_t, std::span<float> params) {
  if (shadow_.size() != params.size())
    throw InvalidArgument(fmt::format("sync adpsgd: {} parameters but setup() saw {}", params.size(), shadow_.size()));
  if (nbrs_.empty()) return;
  const PairRoles roles = adpsgd_ring_roles(comm_->rank(), comm_->size());
  if (roles.initiates.empty()) {
    apply_pending(params);
    return;
  }
  // A rank that also answers (rank 0 of an odd ring) takes in what it answered, then holds its answers back until
  // its own exchange is done: it is in one pair at a time, and answers with the model it ends the exchange with.
  std::unique_lock<std::mutex> answering(mu_, std::defer_lock);
  if (!roles.answers.empty()) {
    apply_pending(params);
    answering.lock();
  }
  Stopwatch sw;
  const size_t d = params.size();
  int peer = roles.initiates[std::uniform_int_distribution<size_t>(0, roles.initiates.size() - 1)(rng_)];
  std::memcpy(send_.data(), params.data(), d * 4);
  send_[d] = 1;
  auto r = irecv(*comm_, peer, detail::kTagPairRep, recv_.data(), d * 4);
  detail::wait_all(*comm_, {isend(*comm_, peer, detail::kTagPairReq, send_.data(), (d + 1) * 4), r});
  for (size_t i = 0; i < d; ++i) params[i] = 0.5f * (params[i] + recv_[i]);
  if (answering.owns_lock())  // what it answers next: its model, with what an answer between the two locks left pending
    for (size_t i = 0; i < d; ++i) shadow_[i] = params[i] + pending_[i];
  stats_.bytes_sent += (d + 1) * 4;
  stats_.payload_bytes += (d + 1) * 4;
  stats_.bytes_received += d * 4;
  stats_.rounds += 1;
  stats_.comm_seconds += sw.seconds();
  exchanges_++;
}

Bytes AdpsgdStrategy::save_state() const {
  detail::Writer w;
  std::ostringstream rng;
  rng << rng_;
  const std::string r = rng.str();
  w.bytes(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(r.data()), r.size()));
  std::lock_guard<std::mutex> lk(mu_);
  // Only a rank that answers has neighbours' averages pending (one that only initiates: its copies mean nothing,
  // saved empty).
  const bool answers = !adpsgd_ring_roles(comm_->rank(), comm_->size()).answers.empty();
  w.floats(answers ? pending_ : std::vector<float>{});
  w.floats(answers ? shadow_ : std::vector<float>{});
  // The traffic of requests answered since its last step, not yet in its stats (apply_pending adds it): a resumed run
  // counts it at its first step (it was lost, 7 replies of 4 workers' run short after a resume at step 6).
  w.u64(served_sent_.load());
  w.u64(served_received_.load());
  w.u64(served_rounds_.load());
  return w.take();
}

void AdpsgdStrategy::load_state(std::span<const uint8_t> bytes) {
  if (bytes.empty()) return;  // a checkpoint from before adpsgd kept state: nothing pending, the rng from the seed
  detail::Reader r(bytes, name());
  Bytes rb = r.bytes();
  std::vector<float> pending = r.floats(), shadow = r.floats();
  uint64_t served[3] = {0, 0, 0};  // (a checkpoint from before they were saved has none)
  if (r.remaining() > 0)
    for (uint64_t& v : served) v = r.u64();
  r.done();
  std::lock_guard<std::mutex> lk(mu_);
  // Saved by a rank that only initiates (or by rank 0 of an odd ring in a checkpoint written before it answered the
  // wrap edge's requests: it had none pending).
  const bool none = pending.empty() && shadow.empty();
  if (!none && (pending.size() != pending_.size() || shadow.size() != pending_.size()))
    throw InvalidArgument(fmt::format("sync adpsgd: the state holds {} and {} parameters, this model {}",
                                      pending.size(), shadow.size(), pending_.size()));
  std::istringstream rng(std::string(rb.begin(), rb.end()));
  rng >> rng_;
  if (rng.fail()) throw InvalidArgument("sync adpsgd: its random state is corrupt");  // (the trainer names the file)
  served_sent_ = served[0];
  served_received_ = served[1];
  served_rounds_ = served[2];
  if (none) return;
  pending_ = std::move(pending);
  shadow_ = std::move(shadow);
}

void AdpsgdStrategy::finish(std::span<float> params) {
  if (finished_) return;
  finished_ = true;
  const PairRoles roles = adpsgd_ring_roles(comm_->rank(), comm_->size());
  // Stops first, then the answering threads: the rank that does both (rank 0 of an odd ring) waits there only for
  // rank n-1, which answers nobody.
  if (!roles.initiates.empty()) {
    std::vector<float> stop(shadow_.size() + 1, 0.f);
    std::vector<net::RequestPtr> reqs;
    for (int p : roles.initiates) reqs.push_back(isend(*comm_, p, detail::kTagPairReq, stop.data(), stop.size() * 4));
    detail::wait_all(*comm_, reqs);
    stats_.bytes_sent += roles.initiates.size() * stop.size() * 4;  // (on the wire like any request: 4(d+1) bytes)
  }
  if (!roles.answers.empty()) {
    for (auto& t : servers_) t.join();
    servers_.clear();
    apply_pending(params);
  }
  // Gossip leaves the replicas close, not equal, and asynchronous workers end unevenly: one average (as local SGD's
  // finish) makes every worker end with the consensus model that AD-PSGD's analysis is about.
  if (final_average_ && comm_->size() > 1) detail::allreduce_avg(*comm_, params, stats_);
  ended_ = true;
}

}  // namespace conduit::sync
