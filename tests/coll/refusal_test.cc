// A call refused for what only its own rank can see (a null buffer, a root's overlapping buffers, alltoallv's counts
// of its own blocks, its CollOptions::timeout_s) stops the other ranks at once, naming the refusal, rather than
// leaving them in the call until their deadline; and the refusing rank's next collective cannot take the refused
// call's tag (it did, and took a peer's block of the refused gather as an allreduce's data: a wrong sum, returned as
// success). Over inproc, tcp and shm.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "coll/communicator.h"
#include "core/error.h"
#include "transport_pair.h"

using namespace conduit;
using namespace conduit::coll;

namespace {

// What one rank saw: the error of its call (empty: it returned) and of the collective it calls next.
struct Outcome {
  std::string call, next;
  bool call_threw_invalid = false;  // an InvalidArgument from the call itself
  bool timed_out = false;           // either ended in a TimeoutError
  bool next_returned = false;
  float next_value = 0;  // what the next collective returned: an element of its result
  double seconds = 0;
};

using Call = std::function<void(Communicator&, bool refusing)>;
using Next = std::function<float(Communicator&)>;

// The next collective of the first test: a sum, whose success on any rank is wrong (the refusing rank is not in it).
Next next_allreduce(const std::string& algo = "") {
  return [algo](Communicator& c) {
    std::vector<float> x(4, float(c.rank() + 1));
    CollOptions o;
    o.algorithm = algo;
    c.allreduce(x.data(), x.size(), DType::f32, ReduceOp::sum, o).wait();
    return x[0];
  };
}

// Each rank on a thread of its own over a fresh transport world of `kind`: `call(c, refusing)`, then `next(c)`.
std::vector<Outcome> run_world(const std::string& kind, int n, int refusing, bool debug, const Call& call,
                               const Next& next = next_allreduce()) {
  auto ts = net::test_util::make_transport_world(kind, n);
  CommConfig cfg;
  cfg.timeout_s = 5;  // (without the refusal reaching them, the others fail at this deadline)
  cfg.debug_collectives = debug;
  std::vector<int> members(n);
  for (int r = 0; r < n; ++r) members[size_t(r)] = r;
  std::vector<Outcome> out(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      Outcome& o = out[size_t(r)];
      auto c = Communicator::create(ts[size_t(r)], members, 0, cfg);
      const auto start = std::chrono::steady_clock::now();
      try {
        call(*c, r == refusing);
      } catch (const InvalidArgument& e) {
        o.call = e.what();
        o.call_threw_invalid = true;
      } catch (const TimeoutError& e) {
        o.call = e.what();
        o.timed_out = true;
      } catch (const std::exception& e) {
        o.call = e.what();
      }
      try {
        o.next_value = next(*c);
        o.next_returned = true;
      } catch (const TimeoutError& e) {
        o.next = e.what();
        o.timed_out = true;
      } catch (const std::exception& e) {
        o.next = e.what();
      }
      o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
  for (auto& t : threads) t.join();
  return out;
}

struct Case {
  const char* name;
  int refusing;
  std::string cause;  // in the refusing rank's error, and in the others'
  Call call;
};

std::vector<Case> cases() {
  const DType f = DType::f32;
  const ReduceOp sum = ReduceOp::sum;
  auto buf = [](size_t n) { return std::vector<float>(n, 1.0f); };
  return {
      {"allreduce null", 1,
       "allreduce: null buffer for 4 elements (allowed: a buffer of that many, or null with a "
       "count of 0)",
       [=](Communicator& c, bool bad) {
         auto a = buf(4);
         c.allreduce(bad ? nullptr : a.data(), 4, f, sum).wait();
       }},
      {"allreduce timeout", 2, "CollOptions.timeout_s = -1",
       [=](Communicator& c, bool bad) {
         auto a = buf(4);
         CollOptions o;
         if (bad) o.timeout_s = -1;
         c.allreduce(a.data(), 4, f, sum, o).wait();
       }},
      {"broadcast null", 2, "broadcast: null buffer for 4 elements",
       [=](Communicator& c, bool bad) {
         auto a = buf(4);
         c.broadcast(bad ? nullptr : a.data(), 4, f, 0).wait();
       }},
      {"reduce null output at the root", 0, "reduce output: null buffer for 4 elements",
       [=](Communicator& c, bool bad) {
         auto a = buf(4), b = buf(4);
         c.reduce(a.data(), bad ? nullptr : b.data(), 4, f, sum, 0).wait();
       }},
      {"reduce null input", 1, "reduce input: null buffer for 4 elements",
       [=](Communicator& c, bool bad) {
         auto a = buf(4), b = buf(4);
         c.reduce(bad ? nullptr : a.data(), b.data(), 4, f, sum, 0).wait();
       }},
      {"gather null output at the root", 0, "gather output: null buffer for 12 elements",
       [=](Communicator& c, bool bad) {
         auto a = buf(4), all = buf(12);
         c.gather(a.data(), bad ? nullptr : all.data(), 4, f, 0).wait();
       }},
      {"gather overlap at the root", 1, "gather: at the root the block overlaps the whole buffer",
       [=](Communicator& c, bool bad) {
         auto a = buf(4), all = buf(12);
         c.gather(bad ? all.data() : a.data(), all.data(), 4, f, 1).wait();  // (the root's slot is all + 4)
       }},
      {"scatter null input at the root", 2, "scatter input: null buffer for 12 elements",
       [=](Communicator& c, bool bad) {
         auto a = buf(4), all = buf(12);
         c.scatter(bad ? nullptr : all.data(), a.data(), 4, f, 2).wait();
       }},
      {"scatter null output", 0, "scatter output: null buffer for 4 elements",
       [=](Communicator& c, bool bad) {
         auto a = buf(4), all = buf(12);
         c.scatter(all.data(), bad ? nullptr : a.data(), 4, f, 2).wait();
       }},
      {"reduce_scatter null output", 1, "reduce_scatter output: null buffer for 4 elements",
       [=](Communicator& c, bool bad) {
         auto in = buf(12), out = buf(4);
         c.reduce_scatter(in.data(), bad ? nullptr : out.data(), 4, f, sum).wait();
       }},
      {"allgather null input", 2, "allgather input: null buffer for 4 elements",
       [=](Communicator& c, bool bad) {
         auto in = buf(4), out = buf(12);
         c.allgather(bad ? nullptr : in.data(), out.data(), 4, f).wait();
       }},
      {"alltoallv own block", 0, "alltoallv: rank 0 sends 1 elements to itself but expects 2; allowed: the same count",
       [=](Communicator& c, bool bad) {
         auto in = buf(3), out = buf(4);
         c.alltoallv(in.data(), {1, 1, 1}, out.data(),
                     bad ? std::vector<size_t>{2, 1, 1} : std::vector<size_t>{1, 1, 1}, f)
             .wait();
       }},
      {"alltoall in place", 1, "alltoall: the input and output buffers overlap; allowed: separate buffers",
       [=](Communicator& c, bool bad) {
         auto in = buf(3), out = buf(3);
         c.alltoall(in.data(), bad ? in.data() : out.data(), 1, f).wait();
       }},
      {"alltoallv null output", 2, "alltoallv output: null buffer for 3 elements",
       [=](Communicator& c, bool bad) {
         auto in = buf(3), out = buf(3);
         c.alltoallv(in.data(), {1, 1, 1}, bad ? nullptr : out.data(), {1, 1, 1}, f).wait();
       }},
  };
}

class OneRankRefusal : public ::testing::TestWithParam<std::string> {};

// The refusing rank gets its refusal from the call and fails its next collective; every other rank fails promptly
// (well within the 5 s deadline) with an error naming the refusal, in the call or in the allreduce after it. (They
// waited out their deadline and blamed the refusing rank as silent.) With debug mode too: the refused call is not
// compared as a mismatch.
TEST_P(OneRankRefusal, TheOtherRanksFailAtOnceNamingIt) {
  const int n = 3;
  for (const bool debug : {false, true}) {
    if (debug && GetParam() != "inproc") continue;
    for (const Case& k : cases()) {
      SCOPED_TRACE(fmt::format("{} over {}{}", k.name, GetParam(), debug ? " (debug mode)" : ""));
      const auto out = run_world(GetParam(), n, k.refusing, debug, k.call);
      for (int r = 0; r < n; ++r) {
        const Outcome& o = out[size_t(r)];
        EXPECT_FALSE(o.timed_out) << "rank " << r << ": " << o.call << " / " << o.next;
        EXPECT_FALSE(o.next_returned) << "rank " << r << "'s next allreduce returned a sum of " << o.next_value;
        EXPECT_LT(o.seconds, 4.0) << "rank " << r;
        if (r == k.refusing) {
          EXPECT_TRUE(o.call_threw_invalid) << o.call;
          EXPECT_NE(o.call.find(k.cause), std::string::npos) << o.call;
          EXPECT_EQ(o.call.find("refused on this rank"), std::string::npos) << o.call;  // (its own error, as it was)
          EXPECT_NE(o.next.find("aborted earlier"), std::string::npos) << o.next;
          EXPECT_NE(o.next.find(k.cause), std::string::npos) << o.next;
        } else {
          const std::string& first = o.call.empty() ? o.next : o.call;
          EXPECT_NE(first.find(fmt::format("rank {} aborted", k.refusing)), std::string::npos) << first;
          EXPECT_NE(first.find("refused on this rank: " + k.cause), std::string::npos) << first;
        }
      }
    }
  }
}

// The audit's sequences, where the refusing rank's caller goes on: its next collective took the refused call's tag
// (the refused call took no sequence number) and met a peer's message of the refused call as its own, returning a
// wrong result as success. Now it fails, and so do the others, naming the refusal.
TEST_P(OneRankRefusal, TheNextCollectiveCannotTakeTheRefusedCallsTag) {
  // A gather's root refuses a null output while rank 1 sends its block (10s); both gather again (rank 1 sends 20s):
  // the root's second gather took rank 1's first block.
  auto out = run_world(
      GetParam(), 2, 0, false,
      [](Communicator& c, bool bad) {
        std::vector<float> mine(4, 10.0f * float(c.rank())), all(8);
        c.gather(mine.data(), bad ? nullptr : all.data(), 4, DType::f32, 0).wait();
      },
      [](Communicator& c) {
        std::vector<float> mine(4, 20.0f * float(c.rank())), all(8, -1.0f);
        c.gather(mine.data(), all.data(), 4, DType::f32, 0).wait();
        return all[4];
      });
  EXPECT_TRUE(out[0].call_threw_invalid) << out[0].call;
  EXPECT_NE(out[0].call.find("gather output: null buffer for 8 elements"), std::string::npos) << out[0].call;
  EXPECT_FALSE(out[0].next_returned) << "the root's next gather returned rank 1's block as " << out[0].next_value
                                     << " (20 is right)";
  EXPECT_NE(out[0].next.find("gather output: null buffer"), std::string::npos) << out[0].next;
  // (rank 1's gathers only send: one may complete before the refusal reaches it)
  EXPECT_FALSE(out[1].timed_out) << out[1].call << " / " << out[1].next;
  // A rank refuses an allreduce's null buffer while rank 1 sums 7s; both then sum 1s and 2s by recursive doubling:
  // the refusing rank's sum met rank 1's refused one (8, returned, as rank 1's refused sum returned 8 too).
  out = run_world(
      GetParam(), 2, 0, false,
      [](Communicator& c, bool bad) {
        std::vector<float> x(4, 7.0f);
        CollOptions o;
        o.algorithm = "rd";
        c.allreduce(bad ? nullptr : x.data(), x.size(), DType::f32, ReduceOp::sum, o).wait();
      },
      next_allreduce("rd"));
  EXPECT_NE(out[0].call.find("allreduce: null buffer for 4 elements"), std::string::npos) << out[0].call;
  for (int r = 0; r < 2; ++r) {
    const Outcome& o = out[size_t(r)];
    EXPECT_FALSE(o.next_returned) << "rank " << r << "'s allreduce returned a sum of " << o.next_value
                                  << " (3 is right)";
    EXPECT_FALSE(o.timed_out) << "rank " << r << ": " << o.call << " / " << o.next;
    const std::string& first = o.call.empty() ? o.next : o.call;
    EXPECT_NE(first.find("allreduce: null buffer"), std::string::npos) << "rank " << r << ": " << first;
  }
}

// One rank alone is told nothing: its refusal stops nothing (there is no one to wait), and it goes on.
TEST(OneRankRefusal, ASingleRankGoesOnAfterARefusal) {
  auto comms = Communicator::inproc(1);
  float x = 2;
  EXPECT_THROW(comms[0]->allreduce(nullptr, 1, DType::f32, ReduceOp::sum), InvalidArgument);
  comms[0]->allreduce(&x, 1, DType::f32, ReduceOp::sum).wait();
  EXPECT_EQ(x, 2.0f);
  EXPECT_EQ(comms[0]->transport().aborted_reason(), "");
}

// Refusals every rank makes alike on the arguments the ranks agree on stay local: the communicator goes on.
TEST(OneRankRefusal, RefusalsEveryRankMakesAlikeStopNothing) {
  auto comms = Communicator::inproc(2);
  std::vector<float> b(8, 1.0f);
  const size_t huge = (size_t(1) << 62) + 1;
  for (auto& c : comms) {
    EXPECT_THROW(c->allreduce(b.data(), huge, DType::f32, ReduceOp::sum), InvalidArgument);
    EXPECT_THROW(c->broadcast(b.data(), 4, DType::f32, 5), InvalidArgument);
    EXPECT_THROW(c->allreduce(b.data(), 4, DType::f32, static_cast<ReduceOp>(9)), InvalidArgument);
    EXPECT_THROW(c->reduce_scatter(b.data(), b.data() + 4, std::vector<size_t>{1, 2, 3}, DType::f32, ReduceOp::sum),
                 InvalidArgument);
  }
  std::vector<float> got(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      float v = 1;
      comms[size_t(r)]->allreduce(&v, 1, DType::f32, ReduceOp::sum).wait();
      got[size_t(r)] = v;
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(got, (std::vector<float>{2.0f, 2.0f}));
}

INSTANTIATE_TEST_SUITE_P(Transports, OneRankRefusal, ::testing::Values("inproc", "tcp", "shm"));

}  // namespace
