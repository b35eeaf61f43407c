// The shared-memory fast allreduce, with shm transports of n ranks as threads of this process: results equal a
// reference for every dtype and op over many operations (the two slots are reused thousands of times), every rank
// gets the same bits, and a mismatched call or a silent rank is a clear error within the deadline.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "coll/communicator.h"
#include "coll/verify.h"
#include "core/error.h"
#include "net/shm.h"
#include "net/tags.h"

namespace conduit::coll {
namespace {

// n shm transports made by n threads, exchanging their start-up strings through memory.
class ShmRanks {
 public:
  explicit ShmRanks(int n) : n_(n), slots_(n), sync_(n) {
    static std::atomic<int> jobs{0};
    job_ = "fasttest" + std::to_string(::getpid()) + "x" + std::to_string(jobs++);
  }
  template <typename Fn>
  std::vector<std::string> run(Fn fn, double timeout_s = 20) {
    std::vector<std::string> errors(n_);
    std::vector<std::thread> ts;
    for (int r = 0; r < n_; ++r)
      ts.emplace_back([&, r] {
        try {
          net::AllgatherFn ag = [&, r](const std::string& mine) {
            slots_[r] = mine;
            sync_.arrive_and_wait();
            std::vector<std::string> all = slots_;
            sync_.arrive_and_wait();
            return all;
          };
          auto t = net::make_shm_transport(r, n_, std::vector<int>(n_, 0), job_, ag);
          std::vector<int> members(n_);
          for (int i = 0; i < n_; ++i) members[i] = i;
          CommConfig cfg;
          cfg.timeout_s = timeout_s;
          cfg.measure_cost_model = false;
          auto comm = Communicator::create(t, members, 0, cfg);
          fn(*comm);
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    for (auto& t : ts) t.join();
    return errors;
  }

 private:
  int n_;
  std::string job_;
  std::vector<std::string> slots_;
  std::barrier<> sync_;
};

TEST(ShmFastAllreduce, EqualsTheReferenceForEveryDtypeAndOpOverManyOperations) {
  for (int n : {2, 3, 5}) {
    ShmRanks ranks(n);
    auto errors = ranks.run([&](Communicator& c) {
      for (DType dt : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i8, DType::u8, DType::i32, DType::i64})
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max, ReduceOp::prod})
          for (size_t count : {size_t{1}, size_t{7}, size_t{64}}) {
            if (count * dtype_size(dt) > 1024) continue;
            VerifyCase vc{"allreduce", "", dt, op, count, 0, 20};
            size_t wrong = run_and_verify(c, vc);
            if (wrong)
              throw Error(fmt::format("n={} {} {} count {}: {} wrong", n, dtype_name(dt), reduce_op_name(op), count,
                                      wrong));
          }
      float one = 1;
      auto w = c.allreduce(&one, 1, DType::f32, ReduceOp::sum);
      w.wait();
      if (w.algorithm() != "shm-fast" || one != float(n))
        throw Error(fmt::format("not the fast path: {} ({})", w.algorithm(), one));
      // Thousands of operations with data that changes each time: a slot reused too early would show.
      std::vector<float> x(32);
      for (int it = 0; it < 5000; ++it) {
        for (size_t i = 0; i < x.size(); ++i) x[i] = float(it * 7 + c.rank() * 3 + int(i));
        c.allreduce(x.data(), x.size(), DType::f32, ReduceOp::sum).wait();
        for (size_t i = 0; i < x.size(); ++i) {
          float want = float(n) * float(it * 7 + int(i)) + 3.0f * float(n * (n - 1) / 2);
          if (x[i] != want) throw Error(fmt::format("iteration {} [{}]: {} want {}", it, i, x[i], want));
        }
      }
    });
    for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r << " of " << n;
  }
}

TEST(ShmFastAllreduce, EveryRankGetsTheSameBits) {
  ShmRanks ranks(4);
  std::vector<std::vector<float>> out(4);
  auto errors = ranks.run([&](Communicator& c) {
    std::vector<float> x(200);
    for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(float(i * 13 + c.rank() * 101)) * 1e-3f * float(i + 1);
    c.allreduce(x.data(), x.size(), DType::f32, ReduceOp::sum).wait();
    out[c.rank()] = x;
  });
  for (int r = 0; r < 4; ++r) EXPECT_EQ(errors[r], "");
  for (int r = 1; r < 4; ++r) EXPECT_EQ(out[r], out[0]) << "rank " << r;
}

// A rank waiting in the fast path keeps its messages moving: rank 0 leaves a send larger than the ring unfinished and
// enters an allreduce that rank 1 reaches only after receiving all of it.
TEST(ShmFastAllreduce, WaitingMovesThisRanksPendingSends) {
  ShmRanks ranks(2);
  auto errors = ranks.run(
      [&](Communicator& c) {
        const size_t n = size_t(6) << 20;  // floats: 24 MiB, 12 rings of the default 2 MiB
        std::vector<float> big(n, c.rank() == 0 ? 2.5f : 0.0f);
        uint64_t tag = net::make_tag(net::kUser, c.id(), 7);
        float v = 1;
        if (c.rank() == 0) {
          auto s = c.transport().isend(1, tag, big.data(), n * 4);
          c.allreduce(&v, 1, DType::f32, ReduceOp::sum).wait();
          s->wait(Deadline::after(10));
        } else {
          c.transport().irecv(0, tag, big.data(), n * 4)->wait(Deadline::after(10));
          c.allreduce(&v, 1, DType::f32, ReduceOp::sum).wait();
          if (big[n - 1] != 2.5f) throw Error("the message did not arrive whole");
        }
        if (v != 2) throw Error(fmt::format("allreduce gave {}", v));
      },
      10.0);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(ShmFastAllreduce, MismatchedCallsAndASilentRankAreErrors) {
  ShmRanks ranks(2);
  auto errors = ranks.run([&](Communicator& c) {
    std::vector<float> x(16, 1.0f);
    c.allreduce(x.data(), c.rank() == 0 ? 4 : 8, DType::f32, ReduceOp::sum).wait();
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("contributed"), std::string::npos) << errors[r];
    // (numbered as the communicator numbers its operations: "allreduce #0 ... fast allreduce #1" was one)
    EXPECT_NE(errors[r].find("allreduce #0 on"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("fast allreduce #0:"), std::string::npos) << errors[r];
  }
  ShmRanks silent(3);
  auto t0 = std::chrono::steady_clock::now();
  errors = silent.run(
      [&](Communicator& c) {
        if (c.rank() == 2) return;  // never takes part
        float v = 1;
        c.allreduce(&v, 1, DType::f32, ReduceOp::sum).wait();
      },
      1.0);
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(took, 5);  // the 1 s deadline (a built-in longer one passed under 15)
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("deadline"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank(s) 2"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("allreduce #0 on"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("fast allreduce #0 did not complete"), std::string::npos) << errors[r];
  }
}

// A peer's segment of another size than this rank's is refused before it is mapped (it was mapped at this rank's
// size: SIGBUS past its end, or rings at wrong offsets). Rank 1 is a stand-in: a 4 KiB segment under its name.
TEST(ShmSegments, APeerSegmentOfAnotherSizeIsRefused) {
  const std::string job = fmt::format("sizetest{}", ::getpid());
  const std::string fake = net::shm_segment_name(job, 1);
  net::AllgatherFn ag = [&](const std::string& mine) {
    int fd = ::shm_open(fake.c_str(), O_CREAT | O_RDWR, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(::ftruncate(fd, 4096), 0);
    ::close(fd);
    return std::vector<std::string>{mine, fmt::format("{} 0", ::getpid())};
  };
  try {
    net::make_shm_transport(0, 2, {0, 0}, job, ag);
    ADD_FAILURE() << "a 4 KiB peer segment was mapped";
  } catch (const ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find("of rank 1 is 4096 bytes, this rank's are"), std::string::npos) << e.what();
  }
  ::shm_unlink(fake.c_str());
  net::remove_shm_segments(job, 2);
}

// A peer segment of this rank's size but another layout (another build's: the fast slots' data moved to offset 64)
// is refused before it is used (the size check passed it, and the fast path read the peer's data at wrong offsets).
// Rank 1 is a stand-in: a zeroed segment of rank 0's size under its name.
TEST(ShmSegments, APeerSegmentOfAnotherLayoutIsRefused) {
  const std::string job = fmt::format("layouttest{}", ::getpid());
  const std::string fake = net::shm_segment_name(job, 1);
  net::AllgatherFn ag = [&](const std::string& mine) {
    struct stat st {};
    const int own = ::shm_open(net::shm_segment_name(job, 0).c_str(), O_RDONLY, 0600);
    EXPECT_GE(own, 0);
    EXPECT_EQ(::fstat(own, &st), 0);
    ::close(own);
    int fd = ::shm_open(fake.c_str(), O_CREAT | O_RDWR, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(::ftruncate(fd, st.st_size), 0);
    ::close(fd);
    return std::vector<std::string>{mine, fmt::format("{} 0", ::getpid())};
  };
  try {
    net::make_shm_transport(0, 2, {0, 0}, job, ag);
    ADD_FAILURE() << "a segment of another layout was mapped";
  } catch (const ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find("of rank 1 has layout version 0, this rank's is"), std::string::npos)
        << e.what();
  }
  ::shm_unlink(fake.c_str());
  net::remove_shm_segments(job, 2);
}

// A segment left in /dev/shm by a crashed run of the job: rank 0 says so and how to remove it, and its peers stop at
// once with its error (they waited for rank 0 to their start-up deadline: here the exchange's 10 s).
TEST(ShmSegments, AStaleSegmentStopsEveryRankAtOnceSayingHowToRemoveIt) {
  const std::string job = fmt::format("staletest{}", ::getpid());
  const std::string stale = net::shm_segment_name(job, 0);
  const int fd = ::shm_open(stale.c_str(), O_CREAT | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ::close(fd);
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> slots(2);
  int arrived = 0, round = 0;
  std::vector<std::string> errors(2);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      net::AllgatherFn ag = [&, r](const std::string& mine) {
        std::unique_lock<std::mutex> lk(mu);
        slots[r] = mine;
        const int my_round = round;
        if (++arrived == 2) {
          arrived = 0;
          ++round;
          cv.notify_all();
        } else if (!cv.wait_for(lk, std::chrono::seconds(10), [&] { return round != my_round; })) {
          throw TimeoutError("the other rank never came to the exchange");
        }
        return slots;
      };
      try {
        net::make_shm_transport(r, 2, {0, 0}, job, ag);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::shm_unlink(stale.c_str());
  net::remove_shm_segments(job, 2);
  const std::string hint =
      "a run of it crashed and left it (and its other ranks' segments); allowed: another CONDUIT_JOB_ID, or once no "
      "job uses it, rm -f /dev/shm" +
      stale.substr(0, stale.rfind('-')) + "-{0..1}";
  EXPECT_NE(errors[0].find("shm: cannot create segment " + stale + ": it exists"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find(hint), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("shm: rank 0 could not start: shm: cannot create segment"), std::string::npos) << errors[1];
  EXPECT_NE(errors[1].find(hint), std::string::npos) << errors[1];
  EXPECT_LT(took, 5);
}

// A rank that dies is found while other peers keep writing to the waiting rank: their doorbell rings woke every
// sleep early, which skipped the liveness check, so the death went unseen until the traffic stopped or the deadline
// passed (20 s here). Ranks are processes (the check asks whether the peer's pid lives); rank 1 exits at once,
// rank 2 sends to rank 0 every 0.2 ms until rank 0 is done (10 s at most), rank 0 waits on a receive from rank 1.
// reap_dead_at_once false: rank 1 stays a zombie until rank 0 is done (its parent, a launcher that has not reaped it
// yet): kill(pid, 0) still answers for it, the peer's pidfd does not.
void dead_peer_is_found(bool reap_dead_at_once) {
  const std::string dir = fmt::format("/tmp/conduit-shm-live-{}-{}", ::getpid(), int(reap_dead_at_once));
  const std::string job = fmt::format("livetest{}x{}", ::getpid(), int(reap_dead_at_once));
  std::filesystem::create_directories(dir);
  const std::string result = dir + "/result";
  pid_t kids[3];
  for (int r = 0; r < 3; ++r) {
    pid_t k = ::fork();
    ASSERT_GE(k, 0);
    if (k != 0) {
      kids[r] = k;
      continue;
    }
    int code = 0;
    try {
      int round = 0;
      net::AllgatherFn ag = [&](const std::string& mine) {  // through files: the ranks are processes
        const std::string base = fmt::format("{}/{}_", dir, round++);
        std::ofstream(fmt::format("{}{}.tmp", base, r)) << mine;
        std::filesystem::rename(fmt::format("{}{}.tmp", base, r), fmt::format("{}{}", base, r));
        std::vector<std::string> all(3);
        for (int p = 0; p < 3; ++p) {
          const std::string f = fmt::format("{}{}", base, p);
          for (int i = 0; i < 20000 && !std::filesystem::exists(f); ++i) ::usleep(1000);
          std::ifstream in(f);
          std::stringstream ss;
          ss << in.rdbuf();
          all[size_t(p)] = ss.str();
        }
        return all;
      };
      auto t = net::make_shm_transport(r, 3, {0, 0, 0}, job, ag);
      if (r == 1) ::_exit(0);
      if (r == 2) {
        int v = 7;
        const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (std::chrono::steady_clock::now() < end && !std::filesystem::exists(result)) {
          t->isend(0, net::make_tag(net::kUser, 0, 2), &v, 4)->wait(Deadline::after(5));
          ::usleep(200);  // within rank 0's spin: its waits end on the doorbell before they ever sleep
        }
        ::_exit(0);
      }
      int got = 0;
      const auto t0 = std::chrono::steady_clock::now();
      std::string what = "received";
      try {
        t->irecv(1, net::make_tag(net::kUser, 0, 1), &got, 4)->wait(Deadline::after(20));
      } catch (const std::exception& e) {
        what = e.what();
      }
      const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::ofstream(result + ".tmp") << fmt::format("{:.2f} {}", took, what);
      std::filesystem::rename(result + ".tmp", result);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      code = 1;
    }
    ::_exit(code);
  }
  if (reap_dead_at_once) ::waitpid(kids[1], nullptr, 0);
  int st0 = 0, st2 = 0;
  ::waitpid(kids[0], &st0, 0);
  ::waitpid(kids[2], &st2, 0);
  if (!reap_dead_at_once) ::waitpid(kids[1], nullptr, 0);
  std::ifstream in(result);
  double took = -1;
  std::string what;
  in >> took;
  std::getline(in, what);
  net::remove_shm_segments(job, 3);
  std::filesystem::remove_all(dir);
  EXPECT_EQ(st0, 0);
  EXPECT_NE(what.find("rank 1"), std::string::npos) << what;
  EXPECT_NE(what.find("died"), std::string::npos) << what;
  EXPECT_LT(took, 8) << "found only when rank 2's traffic stopped (10 s) or at the deadline (20 s): " << what;
}

TEST(ShmLiveness, ADeadPeerIsFoundWhileAnotherKeepsWriting) { dead_peer_is_found(true); }
TEST(ShmLiveness, ADeadPeerNobodyReapedYetIsFound) { dead_peer_is_found(false); }

}  // namespace
}  // namespace conduit::coll
