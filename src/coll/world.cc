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

double ping_pong(Communicator& c, int a, int b, size_t bytes, int iters, const Deadline& d) {
  auto& t = c.transport();
  uint64_t tag = net::make_tag(net::kControl, c.id(), static_cast<uint32_t>(bytes));
  std::vector<char> buf(std::max<size_t>(bytes, 1));
  // (a failed wait gives its request up: `buf` is freed as the failure unwinds, and a send or receive left posted on
  // it was read or written later by the transport, tcp's progress thread)
  auto wait = [&](net::RequestPtr r) { net::wait_all_or_give_up(t, {std::move(r)}, d); };
  Stopwatch sw;
  for (int i = 0; i < iters + 1; ++i) {
    if (i == 1) sw.reset();  // the first round trip warms up
    if (c.rank() == a) {
      wait(t.isend(c.transport_rank(b), tag, buf.data(), bytes));
      wait(t.irecv(c.transport_rank(b), tag, buf.data(), bytes));
    } else if (c.rank() == b) {
      wait(t.irecv(c.transport_rank(a), tag, buf.data(), bytes));
      wait(t.isend(c.transport_rank(a), tag, buf.data(), bytes));
    }
  }
  return sw.seconds() / iters / 2;
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

LinkCost measure_link(Communicator& c, int a, int b, const Deadline& d) {
  const size_t big = 1 << 20;
  double t_small = ping_pong(c, a, b, 8, 50, d);
  double t_big = ping_pong(c, a, b, big, 6, d);
  LinkCost l;
  l.alpha = std::max(t_small, 1e-7);
  l.beta = std::max((t_big - t_small) / big, 1e-12);
  l.gamma = 0;
  return l;
}

// Measures alpha and beta on one intra-host and one inter-host pair, gamma on rank 0, and gives every rank rank
// 0's numbers (all ranks must choose the same algorithms).
void calibrate(Communicator& c, double start_up_s) {
  Deadline d = Deadline::after(std::min(60.0, start_up_s));
  CostModel m;
  int intra_peer = -1, inter_peer = -1;
  for (int r = 1; r < c.size(); ++r) {
    if (c.host_of(r) == c.host_of(0) && intra_peer < 0) intra_peer = r;
    if (c.host_of(r) != c.host_of(0) && inter_peer < 0) inter_peer = r;
  }
  if (intra_peer > 0) m.intra = measure_link(c, 0, intra_peer, d);
  if (inter_peer > 0) m.inter = measure_link(c, 0, inter_peer, d);
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

}  // namespace

CommPtr Communicator::from_env(const CommConfig& cfg) {
  double timeout =
      checked_timeout(cfg.timeout_s, "CommConfig.timeout_s") > 0 ? cfg.timeout_s : default_timeout_seconds();
  // (the store, the transport's connections and calibration: CONDUIT_TIMEOUT when longer than the collectives')
  const double start_up = startup_timeout_seconds(timeout);
  // Settings read when first used, checked before anything starts: a bad ring segment size passed until a ring ran
  // (mid-run, or never where shm's fast path served), a bad tcp budget until a run over tcp.
  (void)ring_segment_bytes();
  (void)net::tcp_unexpected_budget();
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
  if (comm->size() > 1 && cfg.measure_cost_model && !given) calibrate(*comm, start_up);
  return comm;
}

}  // namespace conduit::coll
