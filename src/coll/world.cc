// The world communicator from the environment, and the start-up measurement of the cost model.
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <numeric>
#include <system_error>
#include <thread>

#include "coll/algorithms.h"
#include "coll/communicator.h"
#include "core/env.h"
#include "core/error.h"
#include "core/log.h"
#include "net/shm.h"
#include "net/tags.h"
#include "net/tcp.h"

namespace conduit::coll {

double ping_pong(Communicator& c, int a, int b, size_t bytes, int iters, const Deadline& d, double budget_s,
                 bool warm_up) {
  auto& t = c.transport();
  uint64_t tag = net::make_tag(net::kControl, c.id(), static_cast<uint32_t>(bytes));
  std::vector<char> buf(std::max<size_t>(bytes, 1));
  // (a failed wait gives its request up: `buf` is freed as the failure unwinds, and a send or receive left posted on
  // it was read or written later by the transport, tcp's progress thread)
  auto wait = [&](net::RequestPtr r) { net::wait_all_or_give_up(t, {std::move(r)}, d); };
  // Rank a leads: the first byte of its message says whether the round is the last, so that b, which cannot see the
  // time a measures, stops with it when the budget ends the rounds early. (An empty message carries no flag: then
  // both run every round.)
  const int first_timed = warm_up ? 1 : 0;
  const int rounds = std::max(iters, 1) + first_timed;
  Stopwatch sw;
  int timed = 0;
  for (int i = 0; i < rounds; ++i) {
    if (i == first_timed) sw.reset();  // (the warm-up round trip, when there is one, is not timed)
    if (c.rank() == a) {
      bool last = i + 1 == rounds;
      // The budget: at least two timed round trips (one when that is all that was asked), this one the last when
      // another after it would take the rounds timed past the budget.
      if (!last && budget_s > 0 && bytes > 0 && timed >= 1) {
        const double spent = sw.seconds();
        last = spent + 2 * spent / timed > budget_s;
      }
      buf[0] = last ? 1 : 0;
      wait(t.isend(c.transport_rank(b), tag, buf.data(), bytes));
      wait(t.irecv(c.transport_rank(b), tag, buf.data(), bytes));
      if (i >= first_timed) ++timed;
      if (last) break;
    } else if (c.rank() == b) {
      wait(t.irecv(c.transport_rank(a), tag, buf.data(), bytes));
      const bool last = bytes > 0 ? buf[0] == 1 : i + 1 == rounds;
      wait(t.isend(c.transport_rank(a), tag, buf.data(), bytes));
      if (i >= first_timed) ++timed;
      if (last) break;
    }
  }
  return timed > 0 ? sw.seconds() / timed / 2 : 0;
}

namespace {

double measure_gamma() {
  const size_t n = 1 << 18;  // 1 MiB of f32
  std::vector<float> a(n, 1.0f), b(n, 2.0f);
  reduce_into(a.data(), b.data(), n, DType::f32, ReduceOp::sum);
  Stopwatch sw;
  int reps = 8;
  for (int i = 0; i < reps; ++i) reduce_into(a.data(), b.data(), n, DType::f32, ReduceOp::sum);
  return sw.seconds() / reps / (n * 4.0);
}

// The start-up measurement's limits. Its message for beta grows from kProbeFirst bytes, doubling, until one
// crosses in kProbeTarget seconds or reaches kProbeMax bytes; it is then timed again for at most kProbeBudget seconds
// of round trips (two at least, six at most). Seven round trips of 1 MiB each way, always, took ~15 MB over the
// link: at 20 Mbit/s 6.4 s of a 7.2 s sweep cell, and at 2 Mbit/s and below more than the 60 s deadline, which
// every `conduit train` and `bench coll` then failed on (an audit).
constexpr size_t kProbeFirst = 1024;
constexpr size_t kProbeMax = 1 << 20;
constexpr double kProbeTarget = 0.02;
constexpr double kProbeBudget = 0.1;
// The tag of the 8-byte message by which rank a tells b the size of the next exchange (0: no more).
constexpr uint32_t kPlanTag = 0xffffffffu;

LinkCost measure_link(Communicator& c, int a, int b, const Deadline& d) {
  // alpha: 8-byte round trips, at most 50 and at most 0.1 s of them
  const double t_small = ping_pong(c, a, b, 8, 50, d, 0.1);
  auto& t = c.transport();
  const uint64_t plan_tag = net::make_tag(net::kControl, c.id(), kPlanTag);
  auto wait = [&](net::RequestPtr r) { net::wait_all_or_give_up(t, {std::move(r)}, d); };
  uint64_t plan = 0;
  if (c.rank() == b) {
    for (;;) {  // the exchanges rank a asks for, each at most six round trips (a ends them)
      wait(t.irecv(c.transport_rank(a), plan_tag, &plan, sizeof plan));
      if (plan == 0) return LinkCost{};
      if (plan > kProbeMax)
        throw ProtocolError(
            fmt::format("rank {} asked for round trips of {} bytes; allowed: 1 to {}", a, plan, kProbeMax));
      ping_pong(c, a, b, plan, 6, d, 0, /*warm_up=*/false);
    }
  }
  if (c.rank() != a) return LinkCost{};
  auto exchange = [&](size_t bytes, int iters, double budget_s) {
    plan = bytes;
    wait(t.isend(c.transport_rank(b), plan_tag, &plan, sizeof plan));
    return ping_pong(c, a, b, bytes, iters, d, budget_s, /*warm_up=*/false);
  };
  size_t big = kProbeFirst;
  double t_big = exchange(big, 1, 0);
  while (t_big < kProbeTarget && big < kProbeMax) {
    big = std::min(kProbeMax, big * 2);
    t_big = exchange(big, 1, 0);
  }
  // (a round trip that alone took the budget is the measurement)
  if (2 * t_big < kProbeBudget) t_big = exchange(big, 6, kProbeBudget);
  plan = 0;
  wait(t.isend(c.transport_rank(b), plan_tag, &plan, sizeof plan));
  LinkCost l;
  l.alpha = std::max(t_small, 1e-7);
  l.beta = std::max((t_big - t_small) / static_cast<double>(big), 1e-12);
  l.gamma = 0;
  return l;
}

}  // namespace

// Measures alpha and beta on one intra-host and one inter-host pair, gamma on rank 0, and gives every rank rank
// 0's numbers (all ranks must choose the same algorithms).
void measure_cost_model(Communicator& c, double start_up_s) {
  const double limit = std::min(60.0, start_up_s);
  Deadline d = Deadline::after(limit);
  CostModel m;
  int intra_peer = -1, inter_peer = -1;
  for (int r = 1; r < c.size(); ++r) {
    if (c.host_of(r) == c.host_of(0) && intra_peer < 0) intra_peer = r;
    if (c.host_of(r) != c.host_of(0) && inter_peer < 0) inter_peer = r;
  }
  // (a failure names the measurement: a bare "receive of 1048576 bytes with rank 1 ... did not complete before the
  // deadline" left a user to guess what start-up was sending)
  auto measure = [&](int peer, const char* where) {
    try {
      return measure_link(c, 0, peer, d);
    } catch (const Error& e) {
      rethrow_with_context(
          e, fmt::format("start-up measurement of the network cost model (round trips between rank 0 and rank {} "
                         "{}, at most {:g} s; CONDUIT_COST_MODEL skips it)",
                         peer, where, limit));
    }
  };
  if (intra_peer > 0) m.intra = measure(intra_peer, "on its host");
  if (inter_peer > 0) m.inter = measure(inter_peer, "on another host");
  if (intra_peer < 0) m.intra = m.inter;
  if (inter_peer < 0) m.inter = m.intra;
  double g = measure_gamma();
  m.intra.gamma = m.inter.gamma = g;
  double v[6] = {m.intra.alpha, m.intra.beta, m.intra.gamma, m.inter.alpha, m.inter.beta, m.inter.gamma};
  CollOptions o;
  o.algorithm = "tree";
  o.timeout_s = start_up_s;  // (the others wait here while rank 0 measures)
  c.broadcast(v, 6, DType::f64, 0, o).wait();
  m.intra = {v[0], v[1], v[2]};
  m.inter = {v[3], v[4], v[5]};
  m.source = "measured";
  c.tuner().set_model(m);
  CONDUIT_LOG_INFO("cost model (measured): {}", format_cost_model(m));
}

CommPtr Communicator::from_env(const CommConfig& cfg) {
  double timeout =
      checked_timeout(cfg.timeout_s, "CommConfig.timeout_s") > 0 ? cfg.timeout_s : default_timeout_seconds();
  // (the store, the transport's connections and calibration: CONDUIT_TIMEOUT when longer than the collectives')
  const double start_up = startup_timeout_seconds(timeout);
  // Settings read when first used, checked before anything starts: a bad ring segment size passed until a ring ran
  // (mid-run, or never where shm's fast path served), a bad tcp budget until a run over tcp.
  (void)ring_segment_bytes();
  (void)net::tcp_unexpected_budget();
  // Conduit's own interface variable names one for Conduit alone: a name that is wrong here is wrong whatever the
  // transport (it passed until a run over tcp). Gloo's and NCCL's may hold their own list syntax for those libraries,
  // read only when tcp is used.
  if (env_string("CONDUIT_SOCKET_IFNAME")) (void)net::tcp_listen_address();
  net::check_shm_environment();
  auto boot = net::bootstrap_from_env(start_up);
  std::string kind = cfg.transport;
  if (kind.empty()) kind = env_string("CONDUIT_TRANSPORT").value_or("auto");
  net::TransportPtr transport;
  try {
    transport = net::make_transport(*boot, kind, start_up);
  } catch (...) {
    // The store (rank 0 serves it) outlives this error by a second: torn down while the exception went up, it
    // failed the other ranks' waits at once, and the launcher stopped this rank on their exit before it printed why
    // (a full /dev/shm was reported only as "connection to the server lost" by the others). A caller that goes on
    // gets the store's port back after that second. (The thread dies with a process that exits on the error, but by
    // then this rank has printed why; waiting here instead held that line back a second, long enough for the
    // launcher to stop this rank when the others failed at start-up too.)
    try {
      std::thread([keep = boot]() mutable {
        std::this_thread::sleep_for(std::chrono::seconds(1));
        keep.reset();
      }).detach();
    } catch (const std::system_error&) {
      // (no thread to spare: the store goes now, and the start-up error, not this one, is what the caller sees)
    }
    throw;
  }
  std::vector<int> members(boot->size);
  std::iota(members.begin(), members.end(), 0);
  auto comm = create(transport, members, 0, cfg);
  comm->bootstrap_ = boot;
  bool given = env_string("CONDUIT_COST_MODEL").has_value();
  if (comm->size() > 1 && cfg.measure_cost_model && !given) measure_cost_model(*comm, start_up);
  return comm;
}

}  // namespace conduit::coll
