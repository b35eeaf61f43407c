// The shared-memory fast allreduce, with shm transports of n ranks as threads of this process: results equal a
// reference for every dtype and op over many operations (the two slots are reused thousands of times), every rank
// gets the same bits, and a mismatched call or a silent rank is a clear error within the deadline.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <barrier>
#include <cmath>
#include <mutex>
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
    EXPECT_NE(errors[r].find("allreduce #"), std::string::npos) << errors[r];
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
  EXPECT_LT(took, 15);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("deadline"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank(s) 2"), std::string::npos) << errors[r];
  }
}

}  // namespace
}  // namespace conduit::coll
