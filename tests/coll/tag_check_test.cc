// A tag whose kind byte is not a kind is refused where the request is posted, on every transport, and nothing of it
// reaches the link.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>

#include "core/error.h"
#include "net/tags.h"
#include "transport_pair.h"

using namespace conduit;
using namespace conduit::net;

namespace {

using test_util::make_transport_pair;

class InvalidTag : public ::testing::TestWithParam<std::string> {};

// Found by an audit: tcp, shm and inproc queued such a tag. The receiver's frame check (tcp, shm) then failed the
// whole link from the sender as a protocol error, long after the call that was wrong; inproc matched it as any tag.
// MPI alone refused it at the call.
TEST_P(InvalidTag, IsRefusedWhenPostedAndTheLinkKeepsWorking) {
  const std::string kind = GetParam();
  auto t = make_transport_pair(kind);
  ASSERT_TRUE(t[0] && t[1]);
  int value = 42, got = -1;
  auto expect_refused = [&](const char* op, uint64_t tag, const std::function<void()>& post) {
    const std::string want = fmt::format(
        "{}: {} with tag {:#x} is invalid: its kind byte (bits 56..63) is {}; allowed: 1 to 4 (collective, user, "
        "debug, control; see net/tags.h)",
        kind, op, tag, tag >> 56);
    try {
      post();
      ADD_FAILURE() << kind << " " << op << " with tag " << fmt::format("{:#x}", tag) << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(std::string(e.what()), want);
    }
  };
  for (const uint64_t tag : {uint64_t{5}, (uint64_t{5} << 56) | 1, (uint64_t{0xff} << 56) | (uint64_t{3} << 32)}) {
    expect_refused("isend", tag, [&] { t[0]->isend(1, tag, &value, 4); });
    expect_refused(kind == "shm" ? "isend_reduced" : "isend", tag, [&] { t[0]->isend_reduced(1, tag, &value, 4); });
    expect_refused("irecv", tag, [&] { t[1]->irecv(0, tag, &got, 4); });
    expect_refused("irecv_reduce", tag, [&] { t[1]->irecv_reduce(0, tag, &got, 1, DType::i32, ReduceOp::sum); });
  }
  // Nothing was queued: the link carries the next message, both ways, and nobody aborted.
  for (int from = 0; from < 2; ++from) {
    const uint64_t tag = make_tag(kUser, 0, 5);
    got = -1;
    auto r = t[1 - from]->irecv(from, tag, &got, 4);
    auto s = t[from]->isend(1 - from, tag, &value, 4);
    r->wait(Deadline::after(10));
    s->wait(Deadline::after(10));
    EXPECT_EQ(got, 42);
  }
  EXPECT_EQ(t[0]->aborted_reason(), "");
  EXPECT_EQ(t[1]->aborted_reason(), "");
}

INSTANTIATE_TEST_SUITE_P(Transports, InvalidTag, ::testing::Values("tcp", "shm", "inproc"));

}  // namespace
