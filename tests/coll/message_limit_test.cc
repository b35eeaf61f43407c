// Calls whose messages would be over the message limit (CONDUIT_MAX_MESSAGE_BYTES) are refused before they are
// queued, on every rank, with a line naming the operation, the bytes, the limit and what is allowed; the communicator
// and its transport go on. The limit is read once per process: each such test runs its checks again in a child of
// this binary started with the variable set.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "../error_of.h"
#include "coll/communicator.h"
#include "core/error.h"
#include "forwarding_transport.h"
#include "net/inproc.h"
#include "net/wire.h"

using namespace conduit;
using namespace conduit::coll;
using conduit::test::error_of;

namespace {

constexpr const char* kChild = "CONDUIT_TEST_MESSAGE_LIMIT_CHILD";

// True in the child, which runs the test's checks under CONDUIT_MAX_MESSAGE_BYTES = `limit`; in the parent, runs the
// child and expects it to pass.
bool in_child(const char* limit) {
  if (std::getenv(kChild) != nullptr) return true;
  char self[PATH_MAX] = {};
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (len <= 0) {
    ADD_FAILURE() << "cannot find this test binary";
    return false;
  }
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  // (a child that hangs fails the test: 60 s, its operations time out after 5)
  const std::string cmd = fmt::format("{}=1 CONDUIT_MAX_MESSAGE_BYTES={} timeout 60 '{}' --gtest_filter='{}.{}' 2>&1",
                                      kChild, limit, self, info->test_suite_name(), info->name());
  FILE* f = ::popen(cmd.c_str(), "r");
  if (f == nullptr) {
    ADD_FAILURE() << "cannot run " << cmd;
    return false;
  }
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) out.append(buf, n);
  const int status = ::pclose(f);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_NE(out.find("[  PASSED  ] 1 test"), std::string::npos) << out;
  return false;
}

// (an operation queued by mistake fails in seconds, not after the default deadline)
CommConfig child_config() {
  CommConfig cfg;
  cfg.timeout_s = 5;
  return cfg;
}

// The ranks' small allreduce still runs: nothing was queued or aborted.
void expect_communicators_go_on(std::vector<CommPtr>& comms) {
  std::vector<float> got(comms.size(), 0);
  std::vector<std::thread> ts;
  for (size_t r = 0; r < comms.size(); ++r)
    ts.emplace_back([&, r] {
      float v = 1;
      try {
        comms[r]->allreduce(&v, 1, DType::f32, ReduceOp::sum).wait();
      } catch (const std::exception& e) {
        v = -1;
      }
      got[r] = v;
    });
  for (auto& t : ts) t.join();
  for (size_t r = 0; r < comms.size(); ++r) EXPECT_EQ(got[r], float(comms.size())) << "rank " << r;
  for (auto& c : comms) EXPECT_EQ(c->transport().aborted_reason(), "");
}

// 4 ranks, 1,048,578 f32 (4,194,312 bytes) under a limit of 2,097,156: rhd's upper ranks send the larger half,
// 2,097,160 bytes (blocks of whole elements), not n/2. Forced, the call is refused before it is queued; chosen by a
// cost model that favours rhd, the ring runs instead. (Both passed the checks, which took n/2, and the message failed
// mid-run, aborting the job.)
TEST(MessageLimit, RhdsLargerHalfIsCheckedAgainstTheLimit) {
  if (!in_child("2097156")) return;
  setenv("CONDUIT_COST_MODEL", "intra=1e-3,1e-12,1e-12", 1);  // (latency-bound: rhd where its messages fit)
  auto comms = Communicator::inproc(4, 0, child_config());
  const size_t count = 1048578;
  std::vector<std::vector<float>> bufs(4, std::vector<float>(count, 1.0f));
  CollOptions rhd;
  rhd.algorithm = "rhd";
  for (int r = 0; r < 4; ++r)
    EXPECT_EQ(
        error_of<ConfigError>([&] { comms[r]->allreduce(bufs[r].data(), count, DType::f32, ReduceOp::sum, rhd); }),
        "allreduce of 4194312 bytes over 4 ranks: algorithm rhd sends a message of 2097160 bytes, over "
        "CONDUIT_MAX_MESSAGE_BYTES = 2097156; allowed: ring (its messages fit), or a larger "
        "CONDUIT_MAX_MESSAGE_BYTES")
        << "rank " << r;
  std::vector<std::string> ran(4);
  std::vector<std::thread> ts;
  for (int r = 0; r < 4; ++r)
    ts.emplace_back([&, r] {
      try {
        Work w = comms[r]->allreduce(bufs[r].data(), count, DType::f32, ReduceOp::sum);
        w.wait();
        ran[r] = w.algorithm();
      } catch (const std::exception& e) {
        ran[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(ran[r], "ring") << "rank " << r;
    EXPECT_EQ(bufs[r][count - 1], 4.0f) << "rank " << r;
  }
  // (a smaller vector's halves fit: rhd is still the model's choice there)
  EXPECT_EQ(comms[0]->tuner().choose(CollOp::allreduce, 4194296, 4, 1, false), "rhd");
  expect_communicators_go_on(comms);
}

// gather, scatter, alltoall(v) and point-to-point send blocks as single messages: one over the limit is refused
// before the call is queued, on the receiving rank too (the sending rank's isend failed inside the operation and
// aborted the transport for every communicator; a receive over the limit waited out its deadline).
TEST(MessageLimit, BlocksOverTheLimitAreRefusedBeforeTheCallIsQueued) {
  if (!in_child("2M")) return;
  auto comms = Communicator::inproc(3, 0, child_config());
  const size_t count = (2 << 20) / 4 + 1;  // f32: 2,097,156 bytes
  std::vector<float> block(count), all(3 * count);
  const std::string over =
      "is one message of 2097156 bytes, over CONDUIT_MAX_MESSAGE_BYTES = 2097152; allowed: up to "
      "2097152 bytes (smaller calls), or a larger CONDUIT_MAX_MESSAGE_BYTES on every rank";
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(error_of<ConfigError>([&] { comms[r]->gather(block.data(), all.data(), count, DType::f32, 0); }),
              "gather over 3 ranks: each rank's block " + over);
    EXPECT_EQ(error_of<ConfigError>([&] { comms[r]->scatter(all.data(), block.data(), count, DType::f32, 0); }),
              "scatter over 3 ranks: each rank's block " + over);
  }
  // (alltoall: every rank sees every block's size and refuses alike, without aborting, as alltoallv must)
  std::vector<float> blocks(3 * count), got(3 * count);
  for (int r = 0; r < 3; ++r)
    EXPECT_EQ(error_of<ConfigError>([&] { comms[r]->alltoall(blocks.data(), got.data(), count, DType::f32); }),
              "alltoall over 3 ranks: each block " + over);
  EXPECT_EQ(error_of<ConfigError>([&] { comms[0]->send(block.data(), count, DType::f32, 1, 7); }),
            "send to rank 1 (tag 7) " + over);
  EXPECT_EQ(error_of<ConfigError>([&] { comms[1]->recv(block.data(), count, DType::f32, 0, 7); }),
            "recv from rank 0 (tag 7) " + over);
  expect_communicators_go_on(comms);
  // alltoallv: rank 0 sends rank 1 the large block, every other block is one element. Only ranks 0 and 1 know that
  // block's size: rank 2, in the call with blocks that fit, hears rank 0's refusal at once (it waited out its
  // deadline) while rank 0 keeps its own error (its call takes its place in the order and stops the transport).
  auto more = Communicator::inproc(3, 0, child_config());
  std::vector<size_t> send0{1, count, 1}, recv0{1, 1, 1}, ones{1, 1, 1};
  std::vector<float> out(count + 2), out2(3);
  std::string third;
  std::thread rank2([&] {
    third = error_of<PeerError>([&] { more[2]->alltoallv(all.data(), ones, out2.data(), ones, DType::f32).wait(); });
  });
  EXPECT_EQ(error_of<ConfigError>([&] { more[0]->alltoallv(all.data(), send0, out.data(), recv0, DType::f32); }),
            "alltoallv: rank 0's block for rank 1 " + over);
  rank2.join();
  EXPECT_NE(third.find("rank 0 aborted: alltoall #0 on rank 0 of 3 (inproc) failed after "), std::string::npos)
      << third;
  EXPECT_NE(third.find("refused on this rank: alltoallv: rank 0's block for rank 1 " + over), std::string::npos)
      << third;
  std::vector<size_t> recv1{count, 1, 1};
  EXPECT_EQ(error_of<ConfigError>([&] { more[1]->alltoallv(all.data(), ones, out.data(), recv1, DType::f32); }),
            "alltoallv: rank 1's block from rank 0 " + over);
}

// A transport that refuses, once told to, every message over 16 bytes, as tcp and shm refuse one over the limit.
class RefusingTransport : public test_util::ForwardingTransport {
 public:
  using ForwardingTransport::ForwardingTransport;
  const char* name() const override { return "refusing"; }
  net::RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override {
    if (refuse_) net::check_message_size(bytes, 16);  // (a ConfigError, as theirs)
    return inner_->isend(peer, tag, data, bytes);
  }
  std::atomic<bool> refuse_{false};
};

// This rank's own error inside an operation keeps its type: a message refused by this rank's setting is a ConfigError
// (it was raised as a PeerError, which blames the other ranks); the others hear of it as a PeerError.
TEST(MessageLimit, ARanksOwnErrorInsideAnOperationKeepsItsType) {
  auto inner = net::make_inproc_world(3, 0);
  std::vector<std::string> errors(3), types(3);
  std::vector<std::thread> ts;
  for (int r = 0; r < 3; ++r)
    ts.emplace_back([&, r] {
      CommConfig cfg;
      cfg.timeout_s = 20;
      std::vector<float> x(64, 1.0f);
      try {
        auto t = std::make_shared<RefusingTransport>(inner[r]);
        auto c = Communicator::create(t, {0, 1, 2}, 0, cfg);
        t->refuse_ = r == 0;
        CollOptions tree;
        tree.algorithm = "tree";
        c->allreduce(x.data(), x.size(), DType::f32, ReduceOp::sum, tree).wait();
      } catch (const ConfigError& e) {
        types[r] = "ConfigError";
        errors[r] = e.what();
      } catch (const PeerError& e) {
        types[r] = "PeerError";
        errors[r] = e.what();
      } catch (const std::exception& e) {
        types[r] = "other";
        errors[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(types[0], "ConfigError") << errors[0];
  EXPECT_NE(errors[0].find("a message of 256 bytes is over CONDUIT_MAX_MESSAGE_BYTES = 16"), std::string::npos)
      << errors[0];
  for (int r = 1; r < 3; ++r) EXPECT_EQ(types[r], "PeerError") << "rank " << r << ": " << errors[r];
}

}  // namespace
