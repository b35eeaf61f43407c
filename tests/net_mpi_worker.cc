// Started by tests/net/mpi_transport_test.cc as `mpirun -np 3 net_mpi_worker`: exercises the MPI transport between
// real processes and prints one "rank R: ok <phase>" line per phase passed, then "rank R: ALL OK". Any failure
// prints "rank R: FAIL ..." and exits 1. Every wait has a deadline, so a broken transport fails instead of hanging.
#define OMPI_SKIP_MPICXX 1  // (the C API only: the C++ bindings are not linked)
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "core/error.h"
#include "net/mpi_transport.h"
#include "net/tags.h"

using namespace conduit;
using namespace conduit::net;

namespace {

int g_rank = -1;

[[noreturn]] void fail(const std::string& what) {
  std::printf("rank %d: FAIL %s\n", g_rank, what.c_str());
  std::fflush(stdout);
  std::exit(1);
}

void check(bool ok, const std::string& what) {
  if (!ok) fail(what);
}

void ok(const char* phase) {
  std::printf("rank %d: ok %s\n", g_rank, phase);
  std::fflush(stdout);
}

void barrier() { mpi_allgather_strings("b"); }

uint8_t pattern(int src, int dst, int msg, size_t i) { return static_cast<uint8_t>(src * 31 + dst * 7 + msg * 13 + i); }

// Every rank sends several messages with distinct tags (different kinds, communicators, sequence numbers, sizes)
// to every other rank; receivers post them in the reverse order. Then 6 messages on one tag arrive in order.
void tags_in_flight(Transport& t) {
  const int n = t.size(), me = t.rank();
  const std::vector<size_t> sizes = {0, 1, 7, 4096, 65536, 3 << 20};
  auto tag_of = [](int m) {
    TagKind kinds[] = {kCollective, kUser, kDebug, kControl};
    return make_tag(kinds[m % 4], static_cast<uint32_t>(m * 3), static_cast<uint32_t>(1000 + m));
  };
  const int kMsgs = static_cast<int>(sizes.size());
  std::vector<std::vector<uint8_t>> out, in;
  std::vector<RequestPtr> reqs;
  std::vector<std::tuple<int, int, size_t>> expect;  // (src, msg, index into in)
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    for (int m = kMsgs - 1; m >= 0; --m) {  // receives first, in reverse order
      in.emplace_back(sizes[m], 0);
      expect.emplace_back(p, m, in.size() - 1);
    }
  }
  for (size_t i = 0; i < expect.size(); ++i) {
    auto [src, m, idx] = expect[i];
    reqs.push_back(t.irecv(src, tag_of(m), in[idx].data(), in[idx].size()));
  }
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    for (int m = 0; m < kMsgs; ++m) {
      out.emplace_back(sizes[m]);
      for (size_t i = 0; i < sizes[m]; ++i) out.back()[i] = pattern(me, p, m, i);
      reqs.push_back(t.isend(p, tag_of(m), out.back().data(), out.back().size()));
    }
  }
  wait_all(reqs, Deadline::after(30));
  for (auto [src, m, idx] : expect) {
    for (size_t i = 0; i < in[idx].size(); ++i) {
      if (in[idx][i] != pattern(src, me, m, i)) fail(fmt::format("tags: message {} from rank {} byte {}", m, src, i));
    }
  }
  // Same-size messages of communicators whose ids differ by multiples of 64 and 512 (the same sequence number),
  // received in the opposite order: each must land in its own buffer.
  {
    const uint32_t comms[] = {5, 5 + 64, 5 + 512, 5 + (1u << 20)};
    std::vector<int64_t> vals(4), got(4, -1);
    std::vector<RequestPtr> rq;
    const int to = (me + 1) % n, from = (me + n - 1) % n;
    for (int i = 3; i >= 0; --i) rq.push_back(t.irecv(from, make_tag(kCollective, comms[i], 0), &got[i], 8));
    for (int i = 0; i < 4; ++i) {
      vals[i] = me * 10 + i;
      rq.push_back(t.isend(to, make_tag(kCollective, comms[i], 0), &vals[i], 8));
    }
    wait_all(rq, Deadline::after(30));
    for (int i = 0; i < 4; ++i) check(got[i] == from * 10 + i, fmt::format("communicator {} got {}", comms[i], got[i]));
  }
  // Two user tags 2^l apart fold onto one MPI tag: with both receives outstanding from one peer MPI could swap their
  // messages, so the second is refused with a ProtocolError; once the first has completed it may be posted.
  {
    const int to = (me + 1) % n, from = (me + n - 1) % n;
    const int l = mpi_route_low_bits(0x7fffffff);
    const uint64_t a = make_tag(kUser, 9, 3), b = make_tag(kUser, 9, 3 + (1u << l));
    int64_t ga = -1, gb = -1, va = me * 7, vb = me * 7 + 1;
    RequestPtr ra = t.irecv(from, a, &ga, 8);
    bool refused = false;
    try {
      t.irecv(from, b, &gb, 8);
    } catch (const ProtocolError& e) {
      refused = std::strstr(e.what(), "folds onto the MPI tag") != nullptr;
    }
    check(refused, "a second receive folding onto an outstanding tag was not refused");
    wait_all({ra, t.isend(to, a, &va, 8)}, Deadline::after(30));
    wait_all({t.irecv(from, b, &gb, 8), t.isend(to, b, &vb, 8)}, Deadline::after(30));
    check(ga == from * 7 && gb == from * 7 + 1, fmt::format("folded tags got {} and {}", ga, gb));
  }
  // FIFO on one tag.
  const uint64_t tag = make_tag(kUser, 5, 77);
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  std::vector<int64_t> sent(6), got(6, -1);
  std::iota(sent.begin(), sent.end(), me * 100);
  reqs.clear();
  for (int i = 0; i < 6; ++i) reqs.push_back(t.irecv(prev, tag, &got[i], sizeof(int64_t)));
  for (int i = 0; i < 6; ++i) reqs.push_back(t.isend(next, tag, &sent[i], sizeof(int64_t)));
  wait_all(reqs, Deadline::after(30));
  for (int i = 0; i < 6; ++i) check(got[i] == prev * 100 + i, fmt::format("fifo: slot {} holds {}", i, got[i]));
  // test() polls without blocking.
  int64_t a = me, b = -1;
  auto r = t.irecv(prev, tag, &b, sizeof(b));
  auto s = t.isend(next, tag, &a, sizeof(a));
  Deadline d = Deadline::after(30);
  while (!(r->test() && s->test())) check(!d.expired(), "test() never completed");
  check(b == prev, "test(): wrong value");
  ok("tags");
}

// Rank 0 sends `n` bytes three times to rank 1, which expects 4n/5, then 6n/5, then n: the first two are
// ProtocolErrors; the transport keeps working afterwards.
void size_mismatch(Transport& t, size_t n) {
  const uint32_t comm = 9 + static_cast<uint32_t>(n % 1000);
  const uint64_t tag_a = make_tag(kUser, comm, 1), tag_b = make_tag(kUser, comm, 2), tag_c = make_tag(kUser, comm, 3);
  std::vector<char> msg(n, 'x'), buf(n * 6 / 5);
  if (t.rank() == 0) {
    auto s1 = t.isend(1, tag_a, msg.data(), n);
    auto s2 = t.isend(1, tag_b, msg.data(), n);
    auto s3 = t.isend(1, tag_c, msg.data(), n);
    wait_all({s1, s2, s3}, Deadline::after(30));
  } else if (t.rank() == 1) {
    auto expect_protocol_error = [&](uint64_t tag, size_t bytes, const char* which) {
      auto r = t.irecv(0, tag, buf.data(), bytes);
      try {
        r->wait(Deadline::after(30));
        fail(fmt::format("{} message accepted", which));
      } catch (const ProtocolError& e) {
        std::printf("rank %d: info %s\n", g_rank, e.what());
        check(std::strstr(e.what(), std::to_string(bytes).c_str()) != nullptr,
              fmt::format("error names the size: {}", e.what()));
      } catch (const std::exception& e) {
        fail(fmt::format("{} message: expected ProtocolError, got {}", which, e.what()));
      }
    };
    expect_protocol_error(tag_a, n * 4 / 5, "larger");
    expect_protocol_error(tag_b, n * 6 / 5, "smaller");
    std::fill(buf.begin(), buf.end(), 0);
    auto r = t.irecv(0, tag_c, buf.data(), n);
    r->wait(Deadline::after(30));
    check(buf[0] == 'x' && buf[n - 1] == 'x', "message after the mismatches");
  }
  barrier();
  ok("size-mismatch");
}

// irecv_reduce (the default staging implementation): dst = dst + incoming, f32.
void reduce(Transport& t) {
  const int n = t.size(), me = t.rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
  const size_t count = 1001;
  std::vector<float> out(count), dst(count);
  for (size_t i = 0; i < count; ++i) {
    out[i] = static_cast<float>(me * 10000 + i);
    dst[i] = 0.5f;
  }
  const uint64_t tag = make_tag(kCollective, 13, 1);
  auto r = t.irecv_reduce(prev, tag, dst.data(), count, DType::f32, ReduceOp::sum);
  auto s = t.isend(next, tag, out.data(), count * sizeof(float));
  wait_all({r, s}, Deadline::after(30));
  for (size_t i = 0; i < count; ++i) {
    if (dst[i] != static_cast<float>(prev * 10000 + i) + 0.5f) fail(fmt::format("reduce: element {} is {}", i, dst[i]));
  }
  ok("reduce");
}

// Several threads post and wait on one transport at once (MPI_THREAD_MULTIPLE, or the serializing lock).
void threads(Transport& t) {
  const int n = t.size(), me = t.rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
  constexpr int kThreads = 4, kIters = 50;
  std::vector<std::thread> ts;
  std::atomic<int> bad{0};
  for (int th = 0; th < kThreads; ++th) {
    ts.emplace_back([&, th] {
      int i = 0;
      try {
        for (i = 0; i < kIters; ++i) {
          const uint64_t tag = make_tag(kCollective, 40 + th, i);
          std::vector<int32_t> out(257 * (th + 1), me * 1000 + i), in(out.size(), -1);
          auto r = t.irecv(prev, tag, in.data(), in.size() * sizeof(int32_t));
          auto s = t.isend(next, tag, out.data(), out.size() * sizeof(int32_t));
          wait_all({r, s}, Deadline::after(30));
          if (in.front() != prev * 1000 + i || in.back() != prev * 1000 + i) bad++;
        }
      } catch (const std::exception& e) {
        std::printf("rank %d: FAIL thread %d iteration %d: %s\n", g_rank, th, i, e.what());
        std::fflush(stdout);
        std::_Exit(1);  // the failed receive may still write into this thread's buffers
      }
    });
  }
  for (auto& x : ts) x.join();
  check(bad.load() == 0, "threads: wrong data or errors");
  ok("threads");
}

// A receive nobody matches times out at its deadline.
void deadline(Transport& t) {
  if (t.rank() == 2 % t.size()) {
    char b[8];
    auto r = t.irecv(0, make_tag(kUser, 11, 1), b, sizeof(b));
    Stopwatch sw;
    try {
      r->wait(Deadline::after(0.3));
      fail("unmatched receive completed");
    } catch (const TimeoutError&) {
    }
    check(sw.seconds() >= 0.29 && sw.seconds() < 3.0, fmt::format("timeout took {:.3f}s", sw.seconds()));
    check(!r->done(), "timed-out request should still be pending");
    // Given up: withdrawn with MPI_Cancel, not aborted; so is a reducing receive (staged through its own buffer).
    check(!give_up(t, r, "worker gave up"), "give_up of an unmatched receive reported success");
    check(r->done() && t.aborted_reason().empty(), "the receive was not withdrawn, or the transport aborted");
    float acc = 1;
    auto rr = t.irecv_reduce(0, make_tag(kUser, 11, 2), &acc, 1, DType::f32, ReduceOp::sum);
    check(!give_up(t, rr, "worker gave up"), "give_up of an unmatched reducing receive reported success");
    check(rr->done() && t.aborted_reason().empty(), "the reducing receive was not withdrawn");
  }
  barrier();
  // The message sent afterwards goes to the next receive of the tag, not into the withdrawn receive's buffer.
  if (t.rank() == 0 && t.size() > 2) {
    uint64_t v = 0x1122334455667788ull;
    t.isend(2, make_tag(kUser, 11, 1), &v, 8)->wait(Deadline::after(10));
  } else if (t.rank() == 2) {
    uint64_t got = 0;
    t.irecv(0, make_tag(kUser, 11, 1), &got, 8)->wait(Deadline::after(10));
    check(got == 0x1122334455667788ull, "the late message did not reach the next receive");
  }
  barrier();
  ok("deadline");
}

// A wait without a deadline sleeps between looks as a timed one does: the remaining time of Deadline::never()
// overflowed to a negative sleep and the wait spun its core for as long as it waited.
void wait_without_deadline(Transport& t) {
  const uint64_t tag = make_tag(kUser, 12, 1);
  if (t.rank() == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    int v = 7;
    t.isend(1, tag, &v, 4)->wait(Deadline::after(10));
  } else if (t.rank() == 1) {
    int got = 0;
    timespec c0{}, c1{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c0);
    Stopwatch sw;
    t.irecv(0, tag, &got, 4)->wait(Deadline::never());
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c1);
    const double cpu = static_cast<double>(c1.tv_sec - c0.tv_sec) + 1e-9 * static_cast<double>(c1.tv_nsec - c0.tv_nsec);
    std::printf("rank %d: info waited %.3f s using %.3f s of CPU\n", g_rank, sw.seconds(), cpu);
    check(got == 7, "message");
    check(cpu < 0.5 * sw.seconds(), fmt::format("waited {:.3f} s using {:.3f} s of CPU", sw.seconds(), cpu));
  }
  barrier();
  ok("wait-without-deadline");
}

// Rank 0 aborts; every other rank's pending receive fails with PeerError well before its deadline.
void abort_propagates(Transport& t) {
  char b[8];
  if (t.rank() == 0) {
    auto r = t.irecv(1, make_tag(kUser, 12, 1), b, sizeof(b));
    barrier();
    t.abort("worker test abort");
    try {
      r->wait(Deadline::after(5));
      fail("rank 0: pending receive survived abort");
    } catch (const PeerError&) {
    }
    check(!t.aborted_reason().empty(), "rank 0: aborted_reason empty");
    auto s = t.isend(1, make_tag(kUser, 12, 2), b, sizeof(b));
    check(s->done(), "send after abort should fail at once");
    try {
      s->wait(Deadline::after(1));
      fail("send after abort succeeded");
    } catch (const PeerError&) {
    }
  } else {
    auto r = t.irecv(0, make_tag(kUser, 12, 1), b, sizeof(b));
    barrier();
    Stopwatch sw;
    try {
      r->wait(Deadline::after(20));
      fail("receive from an aborted rank completed");
    } catch (const PeerError& e) {
      std::printf("rank %d: info %s\n", g_rank, e.what());
      check(std::strstr(e.what(), "worker test abort") != nullptr, fmt::format("reason not forwarded: {}", e.what()));
    }
    check(sw.seconds() < 5, fmt::format("abort took {:.2f}s to arrive", sw.seconds()));
    check(t.aborted_reason().find("rank 0") != std::string::npos, "aborted_reason should name rank 0");
  }
  barrier();
  ok("abort");
}

// Sends `value + rank` to the next rank and receives the previous rank's on `t`; checks it.
void ring_exchange(Transport& t, uint64_t tag, uint64_t value, const char* phase) {
  const int n = t.size(), me = t.rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
  uint64_t out = value + static_cast<uint64_t>(me), in = 0;
  wait_all({t.irecv(prev, tag, &in, 8), t.isend(next, tag, &out, 8)}, Deadline::after(30));
  check(in == value + static_cast<uint64_t>(prev), fmt::format("{}: got {:#x} from rank {}", phase, in, prev));
}

// A transport made after another one went never sees the old one's traffic. Rank 1 destroys its first transport;
// rank 0 then sends on its own a message nobody receives and aborts it (an abort notice to every rank); every rank
// makes a second transport, and rank 1's receive of the same tag must wait for the new message. OpenMPI gives a
// freed communicator's context id to the next one made, and keeps a message for an unknown context id until a
// communicator with that id appears: the old message completed the new receive, the old notice aborted the new
// transport.
void stale_messages() {
  const int n = mpi_world_size();
  const std::vector<int> hosts(n, 0);
  const uint64_t tag = make_tag(kUser, 21, 1);
  const uint64_t stale = 0x5157a1e5157a1e00ull, fresh = 0x600d600d600d6000ull;
  {
    auto t1 = make_mpi_transport(hosts);
    if (g_rank == 1) t1.reset();
    barrier();
    if (g_rank == 0) {
      t1->isend(1, tag, &stale, 8)->wait(Deadline::after(10));  // 8 bytes: sent eagerly, complete unreceived
      t1->abort("the first transport's abort");
    }
  }
  auto t2 = make_mpi_transport(hosts);
  if (g_rank == 1) {
    uint64_t got = 0;
    auto r = t2->irecv(0, tag, &got, 8);
    try {
      r->wait(Deadline::after(1.0));
      fail(fmt::format("stale: the destroyed transport's message ({:#x}) reached the new transport", got));
    } catch (const TimeoutError&) {
    } catch (const PeerError& e) {
      fail(fmt::format("stale: the destroyed transport's abort reached the new transport: {}", e.what()));
    }
    check(!give_up(*t2, r, "stale test gave up"), "stale: give_up of the unmatched receive reported success");
  }
  barrier();
  if (g_rank == 0) {
    t2->isend(1, tag, &fresh, 8)->wait(Deadline::after(10));
  } else if (g_rank == 1) {
    uint64_t got = 0;
    t2->irecv(0, tag, &got, 8)->wait(Deadline::after(10));
    check(got == fresh, fmt::format("stale: the new transport's message is {:#x}, expected {:#x}", got, fresh));
  }
  ring_exchange(*t2, make_tag(kUser, 21, 2), fresh, "stale");
  check(t2->aborted_reason().empty(), "stale: the new transport was aborted: " + t2->aborted_reason());
  barrier();
  ok("stale-messages");
}

// A send in flight when its transport aborts is finished (within the 2 s a matched receive gets) before it fails,
// since its caller then frees or reuses the buffer. Rank 1 has matched rank 0's 1 MiB message (it was posted first,
// and over shared memory the message's head arrives before the abort notice) when rank 0 aborts and overwrites its
// buffer at once: rank 1 must receive the message whole. The rest of a large message leaves as the receiver asks for
// it, and it left from the overwritten buffer.
void abort_waits_for_sends() {
  const int n = mpi_world_size();
  auto t = make_mpi_transport(std::vector<int>(n, 0));
  const uint64_t tag = make_tag(kUser, 22, 1);
  const size_t kBytes = size_t{1} << 20;  // (rendezvous; fewer fragments to move in the 2 s on a busy machine)
  std::vector<uint8_t> buf(kBytes, 0);
  if (g_rank == 0) {
    for (size_t i = 0; i < kBytes; ++i) buf[i] = pattern(0, 1, 5, i);
    barrier();  // rank 1's receive is posted
    auto s = t->isend(1, tag, buf.data(), kBytes);
    t->abort("abort with a send in flight");
    check(s->done(), "abort-sends: the send did not fail with the abort");
    std::fill(buf.begin(), buf.end(), uint8_t{0xEE});  // what a caller does with a failed send's buffer
  } else if (g_rank == 1) {
    auto r = t->irecv(0, tag, buf.data(), kBytes);
    barrier();
    try {
      r->wait(Deadline::after(20));
    } catch (const PeerError&) {  // the abort fails it, whole or not
    }
    size_t wrong = 0, first = kBytes;
    for (size_t i = 0; i < kBytes; ++i)
      if (buf[i] != pattern(0, 1, 5, i) && wrong++ == 0) first = i;
    check(wrong == 0, fmt::format("abort-sends: {} of {} bytes wrong, the first at {} ({:#x}): the send was read "
                                  "after the abort failed it",
                                  wrong, kBytes, first, first < kBytes ? buf[first] : 0));
  } else {
    barrier();
  }
  barrier();
  ok("abort-waits-for-sends");
}

// More transports one after another than the 16 whose communicators are kept after they go (the oldest are freed
// on the way): each works.
void many_transports() {
  const int n = mpi_world_size();
  for (int i = 0; i < 18; ++i) {
    auto t = make_mpi_transport(std::vector<int>(n, 0));
    ring_exchange(*t, make_tag(kUser, 23, static_cast<uint32_t>(i)), 1000u * static_cast<uint64_t>(i), "many");
  }
  barrier();
  ok("many-transports");
}

// The start-up has a deadline: the other ranks make a transport while the last rank does not come, and fail with a
// TimeoutError naming the step (MPI_Comm_idup waited forever). Then the last rank joins the collective they gave up
// on (an MPI_Comm_idup of MPI_COMM_WORLD: blocking and nonblocking collectives do not match) while they wait in
// MPI_Recv, starting no collective of their own: the idup's later rounds start from MPI's progress, and must start
// on MPI_COMM_WORLD before anything else does. Then every rank makes a transport that works.
void absent_rank() {
  const int n = mpi_world_size(), last = n - 1;
  const std::vector<int> hosts(n, 0);
  constexpr int kGaveUp = 4242, kJoined = 4243;
  int token = 1;
  if (g_rank != last) {
    Stopwatch sw;
    try {
      make_mpi_transport(hosts, Deadline::after(1.0));
      fail("absent: a transport was made without the last rank");
    } catch (const TimeoutError& e) {
      std::printf("rank %d: info %s\n", g_rank, e.what());
      check(std::strstr(e.what(), "MPI_Comm_idup 1 of 65") != nullptr &&
                std::strstr(e.what(), "CONDUIT_TIMEOUT") != nullptr,
            fmt::format("absent: the error names neither the step nor the setting: {}", e.what()));
    }
    check(sw.seconds() >= 0.9 && sw.seconds() < 10, fmt::format("absent: gave up after {:.2f} s", sw.seconds()));
    MPI_Send(&token, 1, MPI_INT, last, kGaveUp, MPI_COMM_WORLD);
    MPI_Recv(&token, 1, MPI_INT, last, kJoined, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  } else {
    for (int r = 0; r < last; ++r) MPI_Recv(&token, 1, MPI_INT, r, kGaveUp, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    MPI_Comm late = MPI_COMM_NULL;
    MPI_Request req = MPI_REQUEST_NULL;
    MPI_Comm_idup(MPI_COMM_WORLD, &late, &req);
    MPI_Wait(&req, MPI_STATUS_IGNORE);
    MPI_Comm_free(&late);
    for (int r = 0; r < last; ++r) MPI_Send(&token, 1, MPI_INT, r, kJoined, MPI_COMM_WORLD);
  }
  barrier();
  auto t = make_mpi_transport(hosts);
  ring_exchange(*t, make_tag(kUser, 24, 1), 77, "absent");
  barrier();
  ok("absent-rank");
}

}  // namespace

// A program that started MPI below MPI_THREAD_SERIALIZED: Conduit calls MPI from its communicators' worker threads,
// so its transport is refused with the reason (it warned and went on).
int funneled() {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  if (provided >= MPI_THREAD_SERIALIZED) {
    std::printf("rank 0: SKIP funneled: the library gave level %d\n", provided);
  } else {
    try {
      make_mpi_transport({});
      std::printf("rank 0: FAIL a transport at thread level %d was made\n", provided);
    } catch (const ConfigError& e) {
      const bool named = std::strstr(e.what(), "MPI_THREAD_SERIALIZED") != nullptr;
      std::printf("rank 0: %s funneled: %s\n", named ? "ok" : "FAIL", e.what());
    }
  }
  std::fflush(stdout);
  MPI_Finalize();
  return 0;
}

int main() {
  if (std::getenv("CONDUIT_TEST_MPI_FUNNELED")) return funneled();
  try {
    check(mpi_launched(), "not started by mpirun");
    mpi_init_once();
    g_rank = mpi_world_rank();
    check(mpi_world_size() >= 2, "needs at least 2 ranks");
    auto names = mpi_allgather_strings(fmt::format("r{}", g_rank));
    for (int i = 0; i < mpi_world_size(); ++i) check(names[i] == fmt::format("r{}", i), "allgather_strings");
    {
      auto t = make_mpi_transport({});
      check(t->rank() == g_rank && t->size() == mpi_world_size(), "rank/size");
      check(t->num_hosts() == 1, "one host expected");
      check(std::string(t->name()) == "mpi", "name");
      tags_in_flight(*t);
      threads(*t);
      size_mismatch(*t, 100);
      size_mismatch(*t, 5000);
      reduce(*t);
      deadline(*t);
      wait_without_deadline(*t);
      // A second transport (another communicator pair) works next to the first.
      {
        std::vector<int> hosts(mpi_world_size(), 0);
        auto t2 = make_mpi_transport(hosts);
        tags_in_flight(*t2);
      }
      abort_propagates(*t);
    }
    stale_messages();
    abort_waits_for_sends();
    many_transports();
    absent_rank();
    std::printf("rank %d: ALL OK\n", g_rank);
    std::fflush(stdout);
    return 0;
  } catch (const std::exception& e) {
    fail(fmt::format("exception: {}", e.what()));
  }
}
