// Every collective, algorithm, dtype and reduction against a simple reference, for 1 to 8 in-process ranks
// (non-powers of two included), with counts 0, 1, odd and larger than the ring segment (set to 4 KiB here).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <thread>
#include <utility>

#include "../error_of.h"
#include "coll/algorithms.h"
#include "coll/communicator.h"
#include "coll/verify.h"
#include "core/dtype.h"
#include "core/error.h"
#include "counting_transport.h"
#include "net/inproc.h"
#include "transport_pair.h"

using namespace conduit;
using namespace conduit::coll;
using conduit::test::error_of;
using conduit::test_util::CountingTransport;

namespace {

const bool kSmallSegments = [] {
  setenv("CONDUIT_RING_SEGMENT_BYTES", "4096", 1);
  return true;
}();

// Runs fn(r) for r = 0..n-1, each on a thread of its own, and returns each one's result; a rank that throws fails
// the test with its error.
template <typename Fn>
std::vector<size_t> on_threads(int n, Fn fn) {
  std::vector<size_t> out(n, 0);
  std::vector<std::string> errors(n);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        out[r] = fn(r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  return out;
}

// Runs fn(comm) on n in-process ranks (2 ranks per emulated host) and returns each rank's result.
template <typename Fn>
std::vector<size_t> on_ranks(int n, Fn fn, int ranks_per_host = 2) {
  CommConfig cfg;
  cfg.timeout_s = 30;
  auto comms = Communicator::inproc(n, ranks_per_host, cfg);
  return on_threads(n, [&](int r) { return fn(*comms[r]); });
}

size_t total(const std::vector<size_t>& v) {
  size_t s = 0;
  for (auto x : v) s += x;
  return s;
}

const DType kAllTypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                           DType::i8,  DType::u8,  DType::i32, DType::i64};
const ReduceOp kAllOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max, ReduceOp::prod};
const size_t kCounts[] = {0, 1, 7, 5003};

class WorldSize : public ::testing::TestWithParam<int> {};

TEST_P(WorldSize, AllreduceEveryAlgorithmTypeAndOp) {
  int n = GetParam();
  for (const std::string algo : {"ring", "rhd", "rd", "tree", "hier"}) {
    auto wrong = on_ranks(n, [&](Communicator& c) {
      size_t w = 0;
      for (DType t : kAllTypes)
        for (ReduceOp op : kAllOps)
          for (size_t count : kCounts) {
            size_t e = run_and_verify(c, {"allreduce", algo, t, op, count, 0, 0});
            if (e) ADD_FAILURE() << algo << " " << dtype_name(t) << " " << reduce_op_name(op) << " count " << count
                                 << ": " << e << " wrong on rank " << c.rank();
            w += e;
          }
      return w;
    });
    EXPECT_EQ(total(wrong), 0u) << algo << " n=" << n;
  }
}

TEST_P(WorldSize, ReduceScatterAllgatherBroadcastReduce) {
  int n = GetParam();
  auto wrong = on_ranks(n, [&](Communicator& c) {
    size_t w = 0;
    for (DType t : {DType::f32, DType::bf16, DType::i32})
      for (size_t count : kCounts) {
        // (equal blocks, as bench coll times them, and blocks of n and n + 1 elements)
        for (const std::string a : {"ring", "rh"})
          for (ReduceOp op : kAllOps) {
            w += run_and_verify(c, {"reduce_scatter", a, t, op, count, 0, 0});
            w += run_and_verify(c, {"reduce_scatterv", a, t, op, count, 0, 0});
          }
        for (const std::string a : {"ring", "rd"}) {
          w += run_and_verify(c, {"allgather", a, t, ReduceOp::sum, count, 0, 0});
          w += run_and_verify(c, {"allgatherv", a, t, ReduceOp::sum, count, 0, 0});
        }
        for (int root = 0; root < c.size(); ++root) {
          for (const std::string a : {"tree", "chain"})
            w += run_and_verify(c, {"broadcast", a, t, ReduceOp::sum, count, root, 0});
          // (every reduction, and the root's output in place of its input: out == in, which communicator.h allows)
          for (const std::string a : {"tree", "rsg"})
            for (ReduceOp op : kAllOps)
              for (const bool in_place : {false, true}) {
                VerifyCase vc{"reduce", a, t, op, count, root, 0};
                vc.in_place = in_place;
                const size_t e = run_and_verify(c, vc);
                if (e)
                  ADD_FAILURE() << "reduce " << a << " " << dtype_name(t) << " " << reduce_op_name(op) << " count "
                                << count << " root " << root << (in_place ? " in place" : "") << ": " << e
                                << " wrong on rank " << c.rank();
                w += e;
              }
        }
      }
    return w;
  });
  EXPECT_EQ(total(wrong), 0u);
}

TEST_P(WorldSize, GatherScatterAlltoallBarrierSendRecv) {
  int n = GetParam();
  auto wrong = on_ranks(n, [&](Communicator& c) {
    size_t w = 0;
    for (DType t : {DType::f64, DType::u8})
      for (size_t count : kCounts) {
        for (int root = 0; root < c.size(); ++root) {
          w += run_and_verify(c, {"gather", "", t, ReduceOp::sum, count, root, 0});
          w += run_and_verify(c, {"scatter", "", t, ReduceOp::sum, count, root, 0});
        }
        w += run_and_verify(c, {"alltoall", "", t, ReduceOp::sum, count, 0, 0});
        w += run_and_verify(c, {"alltoallv", "", t, ReduceOp::sum, count, 0, 0});
        w += run_and_verify(c, {"barrier", "", t, ReduceOp::sum, 0, 0, 0});
        w += run_and_verify(c, {"sendrecv", "", t, ReduceOp::sum, count, 0, 0});
      }
    return w;
  });
  EXPECT_EQ(total(wrong), 0u);
}

TEST_P(WorldSize, TunerChoiceIsCorrectAtEverySize) {
  int n = GetParam();
  auto wrong = on_ranks(n, [&](Communicator& c) {
    size_t w = 0;
    for (size_t count : {size_t{1}, size_t{100}, size_t{20000}, size_t{300000}})
      w += run_and_verify(c, {"allreduce", "", DType::f32, ReduceOp::sum, count, 0, 0});
    return w;
  });
  EXPECT_EQ(total(wrong), 0u);
}

// avg of f16 divides each rank's input first: 4 ranks of 20000 average 20000, where their sum (80000) is past f16's
// 65504 (it came out inf). allreduce (messages and the shm fast path alike take this path), reduce_scatter, reduce.
TEST(Communicator, HalfPrecisionAverageDoesNotOverflowWhereTheSumWould) {
  auto bad = on_ranks(4, [&](Communicator& c) {
    size_t wrong = 0;
    const uint16_t big = f32_to_f16(20000.0f);
    auto check = [&](const std::vector<uint16_t>& v, size_t n) {
      for (size_t i = 0; i < n; ++i) wrong += f16_to_f32(v[i]) != 20000.0f;
    };
    for (size_t count : {size_t(3), size_t(4096)}) {
      std::vector<uint16_t> x(count, big);
      c.allreduce(x.data(), count, DType::f16, ReduceOp::avg).wait();
      check(x, count);
      std::vector<uint16_t> in(count * 4, big), out(count, 0);
      c.reduce_scatter(in.data(), out.data(), count, DType::f16, ReduceOp::avg).wait();
      check(out, count);
      std::vector<uint16_t> root(count, 0);
      c.reduce(x.data(), root.data(), count, DType::f16, ReduceOp::avg, 1).wait();
      if (c.rank() == 1) check(root, count);
      EXPECT_EQ(in[0], big);  // the caller's input is left as it was
    }
    return wrong;
  });
  EXPECT_EQ(total(bad), 0u);
}

// No rank leaves a barrier before every rank entered it (the verify case only called it). The ranks are threads: each
// counts itself in before entering, one of them 20 ms late each round; every rank must see all of that round's
// counts once it leaves. (A barrier returning at once leaves with the late rank's count missing.)
TEST_P(WorldSize, NoRankLeavesABarrierBeforeEveryRankEntered) {
  const int n = GetParam();
  std::atomic<int> arrived{0};
  auto early = on_ranks(n, [&](Communicator& c) {
    size_t e = 0;
    for (int round = 0; round < 3; ++round) {
      if (c.rank() == round % c.size()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      arrived.fetch_add(1);
      c.barrier().wait();
      if (arrived.load() < (round + 1) * c.size()) ++e;
    }
    return e;
  });
  EXPECT_EQ(total(early), 0u);
}

INSTANTIATE_TEST_SUITE_P(Ranks, WorldSize, ::testing::Range(1, 9));

TEST(Communicator, SplitFormsGroupsOrderedByKey) {
  auto wrong = on_ranks(6, [&](Communicator& c) {
    // Odd and even ranks, reversed order inside each group; rank 5 opts out.
    int color = c.rank() == 5 ? -1 : c.rank() % 2;
    auto sub = c.split(color, -c.rank());
    if (c.rank() == 5) return size_t(sub != nullptr);
    size_t w = 0;
    int expected_size = c.rank() % 2 == 0 ? 3 : 2;
    if (sub->size() != expected_size) ++w;
    // Highest old rank first.
    int pos = 0;
    for (int r = 5; r >= 0; --r)
      if (r % 2 == c.rank() % 2 && r != 5) {
        if (r == c.rank() && sub->rank() != pos) ++w;
        ++pos;
      }
    w += run_and_verify(*sub, {"allreduce", "ring", DType::f32, ReduceOp::sum, 1000, 0, 0});
    w += run_and_verify(*sub, {"allreduce", "hier", DType::f32, ReduceOp::sum, 1000, 0, 0});
    return w;
  });
  EXPECT_EQ(total(wrong), 0u);
}

// gather/scatter at a root other than 0 with the block overlapping the whole buffer elsewhere than the root's slot:
// refused (in == out gathered rank 0's block into the root's slot); the in-place form still works. (Only the root
// sees its buffers: its refusal stops the transport, so each is tried on communicators of its own.)
TEST(Communicator, GatherAndScatterRefuseOverlapsButTakeTheInPlaceForm) {
  for (const bool gather : {true, false})
    for (const size_t at : {size_t{0}, size_t{1}}) {
      auto comms = Communicator::inproc(3);
      std::vector<float> all(3 * 4, 0.0f);
      float* block = all.data() + at;
      const std::string what = error_of<InvalidArgument>([&] {
        if (gather)
          comms[2]->gather(block, all.data(), 4, DType::f32, 2);
        else
          comms[2]->scatter(all.data(), block, 4, DType::f32, 2);
      });
      EXPECT_NE(what.find("at the root the block overlaps the whole buffer other than at the root's own slot; "
                          "allowed: separate buffers, or the block at the root's slot (in place)"),
                std::string::npos)
          << what;
    }
  auto wrong = on_ranks(3, [&](Communicator& c) {
    size_t bad = 0;
    std::vector<float> all(3 * 4, 0.0f), mine(4, float(c.rank() + 1));
    if (c.rank() == 2) {
      std::fill(all.begin() + 8, all.end(), 3.0f);  // in place: the root's block at its slot
      c.gather(all.data() + 8, all.data(), 4, DType::f32, 2).wait();
      for (int r = 0; r < 3; ++r)
        for (int k = 0; k < 4; ++k) bad += all[size_t(4 * r + k)] != float(r + 1);
    } else {
      c.gather(mine.data(), nullptr, 4, DType::f32, 2).wait();
    }
    return bad;
  });
  EXPECT_EQ(total(wrong), 0u);
}

// The verification data has no short period in elements or ranks: a block moved to another place or two ranks'
// blocks swapped change the result (the pattern (7r + 3i) mod 11 repeated every 11 of both: with 11 ranks every
// expected max was 5, and rank 0's and rank 11's blocks were equal).
TEST(Verify, InputsHaveNoShortPeriod) {
  for (size_t period : {2, 4, 8, 10, 11, 16, 22, 44}) {
    size_t same = 0;
    for (size_t i = 0; i < 64; ++i)
      same += verify_input(0, i, DType::f32, ReduceOp::sum) == verify_input(0, i + period, DType::f32, ReduceOp::sum);
    EXPECT_LT(same, 20u) << "elements " << period;
  }
  size_t same = 0;
  for (size_t i = 0; i < 64; ++i)
    same += verify_input(0, i, DType::f32, ReduceOp::sum) == verify_input(11, i, DType::f32, ReduceOp::sum);
  EXPECT_LT(same, 20u) << "ranks 0 and 11";
  std::set<double> maxima;
  for (size_t i = 0; i < 64; ++i) {
    double m = -1e9;
    for (int r = 0; r < 11; ++r) m = std::max(m, verify_input(r, i, DType::f32, ReduceOp::max));
    maxima.insert(m);
  }
  EXPECT_GT(maxima.size(), 1u);
  // ... while sums stay exact in the small types at any rank count (random values overflowed u8 from 36 ranks and
  // i8 from 96): a signed sum over ranks is at most 5 in magnitude, an unsigned one 5p + 5.
  for (int p : {11, 48, 256, 1024}) {
    double worst_signed = 0, worst_unsigned = 0;
    for (size_t i = 0; i < 2000; ++i) {
      double sum_s = 0, sum_u = 0;
      for (int r = 0; r < p; ++r) {
        sum_s += verify_input(r, i, DType::i8, ReduceOp::sum);
        sum_u += verify_input(r, i, DType::u8, ReduceOp::sum);
      }
      worst_signed = std::max(worst_signed, std::abs(sum_s));
      worst_unsigned = std::max(worst_unsigned, sum_u);
    }
    EXPECT_LE(worst_signed, 5) << p;
    EXPECT_LE(worst_unsigned, 5.0 * p + 5) << p;
  }
}

// Past 50 ranks u8 sums wrap, as unsigned arithmetic does; the reference wraps them too (it did not, and every
// element of a correct u8 sum or average over 51 or more ranks counted as wrong).
TEST(Verify, UnsignedSumsOverManyRanksAreExpectedWrapped) {
  auto wrong = on_ranks(64, [&](Communicator& c) {
    size_t w = 0;
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg})
      w += run_and_verify(c, {"allreduce", "ring", DType::u8, op, 300, 0, 0});
    return w;
  });
  EXPECT_EQ(total(wrong), 0u);
}

// A forced hierarchical allreduce on one host runs the ring (there is no inter-host level) and says so: the
// algorithm a call reports is the one that moved its data (it reported "hier").
TEST(Communicator, ForcedHierOnOneHostReportsTheRingItRan) {
  auto wrong = on_ranks(
      4,
      [&](Communicator& c) {
        std::vector<float> v(100, 1.0f);
        CollOptions o;
        o.algorithm = "hier";
        Work w = c.allreduce(v.data(), v.size(), DType::f32, ReduceOp::sum, o);
        w.wait();
        size_t bad = v[0] == 4.0f ? 0 : 1;
        if (c.num_hosts() != 1 || w.algorithm() != "ring") {
          ADD_FAILURE() << "hosts " << c.num_hosts() << " algorithm " << w.algorithm();
          ++bad;
        }
        return bad;
      },
      4);
  EXPECT_EQ(total(wrong), 0u);
}

// Data-parallel replicas stay identical only if every rank ends an allreduce with the same bits: with floats whose
// sums round (not the small integers the verifier uses), each algorithm, rank count (powers of two and not, where
// recursive algorithms fold ranks in) and both emulated host layouts give every rank the same result, and it is the
// sum within rounding.
TEST(Communicator, AllreduceOfRoundingFloatsLeavesEveryRankTheSameBits) {
  for (int p : {2, 3, 4, 5, 6, 8})
    for (int per_host : {0, 2})
      for (const std::string algo : {"ring", "rhd", "rd", "tree", "hier"})
        for (size_t count : {size_t{1}, size_t{7}, size_t{5000}}) {
          if (algo == "hier" && (per_host == 0 || p % per_host != 0)) continue;
          std::vector<std::vector<float>> got(static_cast<size_t>(p));
          on_ranks(
              p,
              [&](Communicator& c) {
                std::vector<float> v(count);
                for (size_t i = 0; i < count; ++i)  // (values of many magnitudes: sums round differently by order)
                  v[i] = float(std::sin(1.0 + double(i) * 0.37 + double(c.rank()) * 1.91) *
                               std::pow(10.0, double((i + size_t(c.rank())) % 7) - 3.0));
                CollOptions o;
                o.algorithm = algo;
                c.allreduce(v.data(), count, DType::f32, ReduceOp::sum, o).wait();
                got[size_t(c.rank())] = v;
                return size_t{0};
              },
              per_host);
          const std::string what = fmt::format("{} on {} ranks ({} a host), {} elements", algo, p, per_host, count);
          for (int r = 1; r < p; ++r)
            ASSERT_EQ(std::memcmp(got[size_t(r)].data(), got[0].data(), count * sizeof(float)), 0)
                << what << ": rank " << r << " differs from rank 0";
          for (size_t i = 0; i < count; ++i) {
            double want = 0, mag = 0;
            for (int r = 0; r < p; ++r) {
              const double x = std::sin(1.0 + double(i) * 0.37 + double(r) * 1.91) *
                               std::pow(10.0, double((i + size_t(r)) % 7) - 3.0);
              want += double(float(x));
              mag += std::abs(double(float(x)));
            }
            ASSERT_NEAR(got[0][i], want, 1e-6 * mag + 1e-30) << what << ", element " << i;
          }
        }
}

// Likewise a forced recursive-doubling allgather on 3 ranks (not a power of two) runs the ring and says so.
TEST(Communicator, ForcedRdAllgatherOffAPowerOfTwoReportsTheRingItRan) {
  auto wrong = on_ranks(3, [&](Communicator& c) {
    std::vector<float> in(5, float(c.rank())), out(15, -1.0f);
    CollOptions o;
    o.algorithm = "rd";
    Work w = c.allgather(in.data(), out.data(), in.size(), DType::f32, o);
    w.wait();
    size_t bad = 0;
    for (size_t i = 0; i < out.size(); ++i) bad += out[i] != float(i / 5);
    if (w.algorithm() != "ring") {
      ADD_FAILURE() << "algorithm " << w.algorithm();
      ++bad;
    }
    return bad;
  });
  EXPECT_EQ(total(wrong), 0u);
}

// Communicators from splits never share an id with one their members already use (ids came from a hash of the
// parent's id, the split count and the color: split #1 of color 0 and split #2 of color 3145728 collided, as did
// small colors after ~1700 splits), so their tags stay apart and concurrent operations on them cannot swap messages.
TEST(Communicator, SplitsGetIdsNoMemberUses) {
  auto wrong = on_ranks(4, [&](Communicator& c) {
    std::set<uint32_t> seen{c.id()};
    size_t w = 0;
    std::vector<CommPtr> keep;
    for (int i = 0; i < 40; ++i) {
      // Colors that collided before, and a nested split of a split.
      const int color = i % 3 == 0 ? 0 : i % 3 == 1 ? 3145728 : c.rank() % 2;
      auto sub = c.split(color, c.rank());
      if (!seen.insert(sub->id()).second) ++w;
      if (i % 10 == 0) {
        auto nested = sub->split(0, sub->rank());
        if (!seen.insert(nested->id()).second) ++w;
        keep.push_back(nested);
      }
      keep.push_back(sub);
    }
    // The two halves of a split by parity got different ids, and every communicator still works.
    auto a = c.split(c.rank() % 2, 0), b = c.split(0, 0);
    if (a->id() == b->id()) ++w;
    w += run_and_verify(*a, {"allreduce", "ring", DType::f32, ReduceOp::sum, 100, 0, 0});
    w += run_and_verify(*b, {"allreduce", "ring", DType::f32, ReduceOp::sum, 100, 0, 0});
    return w;
  });
  EXPECT_EQ(total(wrong), 0u);
}

// The host groups of two communicators never share an id (hashed, parents 114 and 349 gave their host-6 local
// groups one id, and parents 2129 and 3676 their host-0 ones), nor with a split's; parents too large are refused.
TEST(Communicator, HostGroupIdsAreDistinctPerParentAndRole) {
  std::set<uint32_t> seen;
  const uint32_t bound = 0x800000u / 3;
  for (uint32_t parent : {0u, 1u, 2u, 114u, 349u, 2129u, 3676u, bound - 1})
    for (int role = 0; role < 3; ++role) {
      const uint32_t id = host_group_comm_id(parent, role);
      EXPECT_TRUE(seen.insert(id).second) << parent << " " << role;
      EXPECT_GE(id, 0x800000u);   // above every split's id
      EXPECT_LT(id, 0x1000000u);  // inside the 24 bits of a tag's communicator id
    }
  // A host group's own collectives run (each chose its algorithm by building host groups of its own, which a host
  // group's id cannot have); hier on 2 hosts x 2 ranks still builds the parent's.
  auto wrong = on_ranks(4, [&](Communicator& c) {
    size_t w = run_and_verify(c, {"allreduce", "hier", DType::f32, ReduceOp::sum, 1000, 0, 0});
    auto& g = c.host_groups();
    w += run_and_verify(*g.local, {"allreduce", "", DType::f32, ReduceOp::sum, 1000, 0, 0});
    w += run_and_verify(*g.cross, {"allreduce", "", DType::f32, ReduceOp::sum, 1000, 0, 0});
    // hier forced where every host holds one member (the cross group) runs the ring: it built host groups of a host
    // group and failed mid-operation, aborting the transport (CONDUIT_ALLREDUCE=hier reached here)
    w += run_and_verify(*g.cross, {"allreduce", "hier", DType::f32, ReduceOp::sum, 1000, 0, 0});
    w += run_and_verify(*g.local, {"allreduce", "hier", DType::f32, ReduceOp::sum, 1000, 0, 0});
    return w;
  });
  EXPECT_EQ(total(wrong), 0u);
  EXPECT_THROW(host_group_comm_id(bound, 0), InvalidArgument);
  EXPECT_THROW(host_group_comm_id(0x800005u, 1), InvalidArgument);  // a host group's own host groups
  EXPECT_THROW(host_group_comm_id(5, 3), InvalidArgument);
}

// consecutive_host_ranks: K where every host holds K of the members in consecutive ranks, each group on a host of its
// own; 0 for hosts of unequal counts, interleaved hosts, or a host whose ranks come in two groups (splits reorder the
// members to make these).
TEST(Communicator, ConsecutiveHostRanksNeedEqualHostsInConsecutiveRanks) {
  auto reordered = [](int n, int per_host, std::vector<int> order) {
    std::vector<int> k(size_t(n), -1);
    on_ranks(
        n,
        [&](Communicator& c) {
          const int key = int(std::find(order.begin(), order.end(), c.rank()) - order.begin());
          auto s = c.split(0, key);
          k[size_t(c.rank())] = s->consecutive_host_ranks();
          return size_t(0);
        },
        per_host);
    for (int r = 1; r < n; ++r) EXPECT_EQ(k[size_t(r)], k[0]) << "rank " << r << " came to another K";
    return k[0];
  };
  EXPECT_EQ(reordered(4, 2, {0, 1, 2, 3}), 2);
  EXPECT_EQ(reordered(6, 3, {0, 1, 2, 3, 4, 5}), 3);
  EXPECT_EQ(reordered(4, 1, {0, 1, 2, 3}), 1);
  EXPECT_EQ(reordered(4, 4, {0, 1, 2, 3}), 4);              // (one host)
  EXPECT_EQ(reordered(4, 3, {0, 1, 2, 3}), 0);              // hosts of 3 and 1
  EXPECT_EQ(reordered(4, 2, {0, 2, 1, 3}), 0);              // hosts 0, 1, 0, 1
  EXPECT_EQ(reordered(6, 3, {0, 1, 3, 4, 2, 5}), 0);        // hosts 0, 0, 1, 1, 0, 1
  EXPECT_EQ(reordered(8, 4, {0, 1, 4, 5, 2, 3, 6, 7}), 0);  // hosts 0, 0, 1, 1, 0, 0, 1, 1: host 0 twice
}

TEST(Communicator, MissingRankTimesOutNamingOpSequenceAndSilentRank) {
  CommConfig cfg;
  cfg.timeout_s = 0.5;
  auto comms = Communicator::inproc(3, 0, cfg);
  std::vector<std::string> msgs(2);
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      std::vector<float> b(16, 1.0f);
      CollOptions o;
      o.algorithm = "ring";
      try {
        comms[r]->allreduce(b.data(), b.size(), DType::f32, ReduceOp::sum, o).wait();
      } catch (const TimeoutError& e) {
        msgs[r] = std::string("timeout: ") + e.what();
      } catch (const PeerError& e) {
        msgs[r] = std::string("peer: ") + e.what();
      }
    });
  for (auto& t : ts) t.join();
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 5.0);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(msgs[r].find("allreduce #0"), std::string::npos) << msgs[r];
  }
  // One of them times out first and aborts; the other learns of it at once. Rank 0 waits for rank 2 (its ring
  // predecessor) and must name it either way.
  EXPECT_TRUE(msgs[0].rfind("timeout: ", 0) == 0 || msgs[1].rfind("timeout: ", 0) == 0) << msgs[0] << " | " << msgs[1];
  EXPECT_NE(msgs[0].find("rank(s) 2"), std::string::npos) << msgs[0];
  // The communicator is unusable afterwards and says so at once.
  std::vector<float> b(4);
  EXPECT_THROW(comms[0]->allreduce(b.data(), 4, DType::f32, ReduceOp::sum).wait(), PeerError);
}

// Collectives are non-blocking and queue: a rank may submit the next one before its worker has started the last.
// Rank 1 queues Z, A, B, C and D at once while its worker is held in Z (rank 0 joins Z only 100 ms later); rank 0
// lets its worker start A before it submits the rest. The ranks must still agree on every message's tag: when
// sequence numbers were taken at submit, on the caller's thread, rank 0 numbered A's ring steps before B and rank 1
// after, and both waited for each other until the deadline.
TEST(Communicator, OperationsQueuedAtDifferentPacesMatchAcrossRanks) {
  for (bool debug : {false, true}) {
    CommConfig cfg;
    cfg.timeout_s = 5;
    cfg.debug_collectives = debug;
    auto comms = Communicator::inproc(2, 0, cfg);
    std::vector<std::string> errors(2);
    std::vector<std::vector<float>> results(2);
    std::vector<std::thread> ts;
    for (int r = 0; r < 2; ++r)
      ts.emplace_back([&, r] {
        std::vector<float> z(16, 1.0f), a(100000, 1.0f + r), b(100000, 10.0f * (1 + r)), g(2 * 1000),
            d(1000, 100.0f * (1 + r));
        std::vector<float> mine(1000, float(r));
        CollOptions o;
        o.algorithm = "ring";
        try {
          if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
          Work wz = comms[r]->allreduce(z.data(), z.size(), DType::f32, ReduceOp::sum, o);
          Work wa = comms[r]->allreduce(a.data(), a.size(), DType::f32, ReduceOp::sum, o);
          if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
          Work wb = comms[r]->allreduce(b.data(), b.size(), DType::f32, ReduceOp::sum, o);
          Work wc = comms[r]->allgather(mine.data(), g.data(), mine.size(), DType::f32);
          Work wd = comms[r]->allreduce(d.data(), d.size(), DType::f32, ReduceOp::sum);
          for (Work* w : {&wz, &wa, &wb, &wc, &wd}) w->wait();
          results[r] = {z.front(), a.front(), a.back(), b.front(), b.back(), g.front(), g.back(), d.front()};
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    for (auto& t : ts) t.join();
    for (int r = 0; r < 2; ++r) {
      ASSERT_EQ(errors[r], "") << "rank " << r << (debug ? " (debug)" : "");
      EXPECT_EQ(results[r], (std::vector<float>{2, 3, 3, 30, 30, 0, 1, 300})) << "rank " << r;
    }
  }
}

// Runs call(comm, rank) on n in-process ranks in debug mode; returns each rank's error message ("" when none).
std::vector<std::string> debug_errors(int n, const std::function<void(Communicator&, int)>& call) {
  CommConfig cfg;
  cfg.timeout_s = 10;
  cfg.debug_collectives = true;
  auto comms = Communicator::inproc(n, 0, cfg);
  std::vector<std::string> msgs(static_cast<size_t>(n));
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        call(*comms[size_t(r)], r);
      } catch (const Error& e) {
        msgs[size_t(r)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  return msgs;
}

TEST(Communicator, DebugModeReportsMismatchedCalls) {
  auto msgs = debug_errors(3, [](Communicator& c, int r) {
    std::vector<float> b(100, 1.0f);
    c.allreduce(b.data(), r == 2 ? 50 : 100, DType::f32, ReduceOp::sum).wait();
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(msgs[r].find("mismatch"), std::string::npos) << "rank " << r << ": " << msgs[r];
  }
  EXPECT_NE(msgs[0].find("rank 2 called allreduce(dtype=f32, count=50"), std::string::npos) << msgs[0];
}

// Debug mode compares the algorithm a call forces (rd on one rank and tree on the others finished with different
// sums, no error); an op code outside ReduceOp is refused before anything is sent (it reduced nothing).
TEST(Communicator, DebugModeComparesForcedAlgorithmsAndOpsAreChecked) {
  auto msgs = debug_errors(2, [](Communicator& c, int r) {
    std::vector<float> b(4, float(r + 1));
    CollOptions o;
    o.algorithm = r == 0 ? "rd" : "tree";
    c.allreduce(b.data(), b.size(), DType::f32, ReduceOp::sum, o).wait();
  });
  EXPECT_NE(msgs[0].find("forcing different algorithms"), std::string::npos) << msgs[0];
  EXPECT_NE(msgs[1].find("mismatch"), std::string::npos) << msgs[1];
  CommConfig cfg;
  cfg.debug_collectives = true;
  auto fresh = Communicator::inproc(1, 0, cfg);
  std::vector<float> b(4, 1.0f);
  try {
    fresh[0]->allreduce(b.data(), b.size(), DType::f32, static_cast<ReduceOp>(7)).wait();
    ADD_FAILURE() << "op 7 taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("reduction op code 7 is not one (allowed: sum, avg, min, max, prod)"),
              std::string::npos)
        << e.what();
  }
}

// Debug mode also compares the per-rank counts of reduce_scatter and allgatherv (totals alone let {2, 1} meet {1, 2})
// and pairs alltoallv's send counts with the receive counts their peers give; matching calls pass.
TEST(Communicator, DebugModeComparesPerRankCountsAndAlltoallPairs) {
  std::vector<float> in(8, 1.0f), out(8);
  auto m = debug_errors(2, [&](Communicator& c, int r) {
    c.allgatherv(in.data(), out.data(), r == 0 ? std::vector<size_t>{2, 1} : std::vector<size_t>{1, 2}, DType::f32)
        .wait();
  });
  EXPECT_NE(m[0].find("with different per-rank counts (the same total)"), std::string::npos) << m[0];
  EXPECT_NE(m[1].find("mismatch"), std::string::npos) << m[1];
  m = debug_errors(2, [&](Communicator& c, int r) {
    c.reduce_scatter(in.data(), out.data(), r == 0 ? std::vector<size_t>{3, 1} : std::vector<size_t>{1, 3}, DType::f32,
                     ReduceOp::sum)
        .wait();
  });
  EXPECT_NE(m[0].find("different per-rank counts"), std::string::npos) << m[0];
  // Rank 0 sends rank 1 two elements; rank 1 expects three from rank 0.
  m = debug_errors(2, [&](Communicator& c, int r) {
    c.alltoallv(in.data(), r == 0 ? std::vector<size_t>{1, 2} : std::vector<size_t>{1, 1}, out.data(),
                r == 0 ? std::vector<size_t>{1, 1} : std::vector<size_t>{3, 1}, DType::f32)
        .wait();
  });
  EXPECT_NE(m[0].find("alltoall's counts do not pair up"), std::string::npos) << m[0];
  EXPECT_NE(m[1].find("alltoall's counts do not pair up"), std::string::npos) << m[1];
  m = debug_errors(2, [&](Communicator& c, int r) {  // uneven but paired: rank 0 sends 2 to rank 1, which expects 2
    c.alltoallv(in.data(), r == 0 ? std::vector<size_t>{1, 2} : std::vector<size_t>{3, 1}, out.data(),
                r == 0 ? std::vector<size_t>{1, 3} : std::vector<size_t>{2, 1}, DType::f32)
        .wait();
    c.allgatherv(in.data(), out.data(), {2, 1}, DType::f32).wait();
  });
  EXPECT_EQ(m, (std::vector<std::string>{"", ""}));
}

TEST(Communicator, BadArgumentsAreRejectedWithClearErrors) {
  auto comms = Communicator::inproc(1);
  std::vector<float> b(4);
  EXPECT_THROW(comms[0]->broadcast(b.data(), 4, DType::f32, 3), InvalidArgument);
  CollOptions o;
  o.algorithm = "bogus";
  try {
    comms[0]->allreduce(b.data(), 4, DType::f32, ReduceOp::sum, o);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("allowed are ring, rhd, rd, tree, hier"), std::string::npos) << e.what();
  }
  // Operations with one algorithm take its name or none (another was taken without a word).
  auto one_algorithm = [&](const char* algo, auto&& call) {
    CollOptions forced;
    forced.algorithm = algo;
    try {
      call(forced).wait();
      return std::string();
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
  };
  std::vector<float> out(4);
  auto gather = [&](const CollOptions& f) { return comms[0]->gather(b.data(), out.data(), 4, DType::f32, 0, f); };
  auto scatter = [&](const CollOptions& f) { return comms[0]->scatter(b.data(), out.data(), 4, DType::f32, 0, f); };
  auto alltoall = [&](const CollOptions& f) { return comms[0]->alltoall(b.data(), out.data(), 4, DType::f32, f); };
  auto barrier = [&](const CollOptions& f) { return comms[0]->barrier(f); };
  EXPECT_EQ(one_algorithm("ring", gather), "unknown gather algorithm 'ring': allowed is linear (or none given)");
  EXPECT_EQ(one_algorithm("linear", gather), "");
  EXPECT_EQ(one_algorithm("tree", scatter), "unknown scatter algorithm 'tree': allowed is linear (or none given)");
  EXPECT_EQ(one_algorithm("ring", alltoall), "unknown alltoall algorithm 'ring': allowed is pairwise (or none given)");
  EXPECT_EQ(one_algorithm("pairwise", alltoall), "");
  EXPECT_EQ(one_algorithm("tree", barrier),
            "unknown barrier algorithm 'tree': allowed is dissemination (or none given)");
  EXPECT_EQ(one_algorithm("", barrier), "");
  EXPECT_THROW(comms[0]->allgatherv(b.data(), b.data(), {1, 2}, DType::f32), InvalidArgument);
  EXPECT_THROW(comms[0]->allreduce(nullptr, 4, DType::f32, ReduceOp::sum), InvalidArgument);
  // Counts whose bytes no buffer can have (they wrapped: 2^62 + 1 floats became 4 bytes, so the shm fast path read
  // past the buffer and point-to-point moved nothing and succeeded) are refused before anything runs.
  const size_t huge = (size_t(1) << 62) + 1;
  try {
    comms[0]->allreduce(b.data(), huge, DType::f32, ReduceOp::sum);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("more than a buffer can hold (allowed: up to"), std::string::npos) << e.what();
  }
  EXPECT_THROW(comms[0]->broadcast(b.data(), huge, DType::f64, 0), InvalidArgument);
  EXPECT_THROW(comms[0]->allgatherv(b.data(), b.data(), {huge}, DType::f32), InvalidArgument);
  auto two = Communicator::inproc(2);
  EXPECT_THROW(two[0]->send(b.data(), huge, DType::f32, 1, 7), InvalidArgument);
  EXPECT_THROW(two[0]->allgatherv(b.data(), b.data(), {size_t(1) << 60, size_t(1) << 60}, DType::f32),
               InvalidArgument);  // each fits, the sum does not
  EXPECT_THROW(two[0]->gather(b.data(), b.data(), size_t(1) << 60, DType::f32, 0), InvalidArgument);
  // alltoall in place: its receives would overwrite what it has not sent yet.
  EXPECT_THROW(two[0]->alltoall(b.data(), b.data(), 1, DType::f32), InvalidArgument);
}

}  // namespace

namespace {
TEST(Communicator, PointToPointHonoursItsDeadline) {
  auto comms = Communicator::inproc(2);
  float x = 0;
  CollOptions o;
  o.timeout_s = 0.3;
  auto w = comms[0]->recv(&x, 1, DType::f32, 1, 77, o);
  EXPECT_FALSE(w.test());
  auto t0 = std::chrono::steady_clock::now();
  try {
    w.wait();
    FAIL() << "no timeout";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("recv from rank 1 (tag 77)"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 3.0);
  // A matching send completes both sides.
  float y = 4.5f, z = 0;
  auto r = comms[1]->recv(&z, 1, DType::f32, 0, 5);
  comms[0]->send(&y, 1, DType::f32, 1, 5).wait();
  r.wait();
  EXPECT_EQ(z, 4.5f);
  EXPECT_THROW(comms[0]->send(&y, 1, DType::f32, 0, 5), InvalidArgument);
}
}  // namespace

namespace {

// Found by a review of the collectives.
TEST(CollectiveEdges, ReduceScatterNeverWritesTheCallersInput) {
  // A rank whose block is empty may pass out = nullptr; the operation then reduced in place inside its const input.
  on_ranks(3, [](Communicator& c) {
    std::vector<float> in(4, float(c.rank() + 1));
    const std::vector<float> before = in;
    std::vector<float> out(2);
    CollOptions o;
    o.blocking = true;
    c.reduce_scatter(in.data(), c.rank() == 1 ? nullptr : out.data(), {2, 0, 2}, DType::f32, ReduceOp::sum, o).wait();
    EXPECT_EQ(in, before) << "rank " << c.rank();
    if (c.rank() != 1) {
      EXPECT_EQ(out[0], 6.0f);
    }
    return size_t{0};
  });
}

TEST(CollectiveEdges, MinAndMaxGiveEveryRankTheSameBitsForNanAndSignedZeros) {
  // rd reduces in place on both sides of a pair: each rank favoured its own -0 or NaN.
  for (const std::string algo : {"ring", "rhd", "rd", "tree"}) {
    for (ReduceOp op : {ReduceOp::min, ReduceOp::max}) {
      std::vector<std::vector<uint32_t>> bits(2);
      on_ranks(2, [&](Communicator& c) {
        const float nan = std::numeric_limits<float>::quiet_NaN();
        std::vector<float> v =
            c.rank() == 0 ? std::vector<float>{-0.0f, nan, 1.0f} : std::vector<float>{0.0f, 1.0f, nan};
        CollOptions o;
        o.blocking = true;
        o.algorithm = algo;
        c.allreduce(v.data(), v.size(), DType::f32, op, o).wait();
        bits[c.rank()].resize(v.size());
        std::memcpy(bits[c.rank()].data(), v.data(), v.size() * 4);
        return size_t{0};
      });
      EXPECT_EQ(bits[0], bits[1]) << algo << " " << reduce_op_name(op);
      // ... and the same whichever rank holds the NaN: it propagates, and min keeps -0, max +0.
      EXPECT_EQ(bits[0][0], op == ReduceOp::min ? 0x80000000u : 0u) << algo;
      float got[3];
      std::memcpy(got, bits[0].data(), sizeof got);
      EXPECT_TRUE(std::isnan(got[1]) && std::isnan(got[2])) << algo << " " << reduce_op_name(op);
    }
  }
}

// Sum and prod of two NaNs give the first operand's NaN on x86: rd's pair reduced in place as op(own, partner) on
// both sides, so a +NaN on one rank and inf - inf's -NaN on the other left the two ranks with different bits.
TEST(CollectiveEdges, SumAndProdGiveEveryRankTheSameBitsForTwoNans) {
  for (const std::string algo : {"ring", "rhd", "rd", "tree"}) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::prod}) {
      std::vector<uint32_t> bits(2);
      on_ranks(2, [&](Communicator& c) {
        const uint32_t mine = c.rank() == 0 ? 0x7fc00000u : 0xffc00000u;  // +NaN, and the -NaN inf - inf makes
        float v;
        std::memcpy(&v, &mine, 4);
        CollOptions o;
        o.blocking = true;
        o.algorithm = algo;
        c.allreduce(&v, 1, DType::f32, op, o).wait();
        std::memcpy(&bits[c.rank()], &v, 4);
        return size_t{0};
      });
      EXPECT_EQ(bits[0], bits[1]) << algo << " " << reduce_op_name(op);
    }
  }
}

TEST(CollectiveEdges, PollingAReceivePastItsDeadlineFails) {
  // test() only polled: a receive that never arrives stayed "not yet" forever; wait() was the only way to fail.
  CommConfig cfg;
  cfg.timeout_s = 0.2;
  auto comms = Communicator::inproc(2, 0, cfg);
  float x = 0;
  Work w = comms[0]->recv(&x, 1, DType::f32, 1, 77);
  const auto t0 = std::chrono::steady_clock::now();
  bool failed = false;
  while (std::chrono::steady_clock::now() - t0 < std::chrono::seconds(3)) {
    try {
      if (w.test()) break;
    } catch (const TimeoutError&) {
      failed = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(failed);
}

TEST(CollectiveEdges, CommunicatorMembersMustBeDistinctTransportRanks) {
  auto ts = net::make_inproc_world(2, 0);
  EXPECT_THROW(Communicator::create(ts[0], {0, 0}, 7, {}), InvalidArgument);
  EXPECT_THROW(Communicator::create(ts[0], {0, 5}, 7, {}), InvalidArgument);
  EXPECT_NO_THROW(Communicator::create(ts[0], {1, 0}, 7, {}));
  // Between the splits' ids and the host groups' (it left no id for later splits and could not form host groups).
  EXPECT_THROW(Communicator::create(ts[0], {1, 0}, 0x2AAAAA, {}), InvalidArgument);
  // The host groups' ids (0x800001 is the world's cross-host group), an id past a tag's 24 bits (1 << 24 wrapped to
  // the world's 0), and id 0 for a group other than the world in order: each shared another communicator's tags.
  EXPECT_THROW(Communicator::create(ts[0], {0, 1}, 0x800001, {}), InvalidArgument);
  EXPECT_THROW(Communicator::create(ts[0], {0, 1}, 1u << 24, {}), InvalidArgument);
  EXPECT_THROW(Communicator::create(ts[0], {1, 0}, 0, {}), InvalidArgument);
  EXPECT_THROW(Communicator::create(ts[0], {0}, 0, {}), InvalidArgument);
  EXPECT_NO_THROW(Communicator::create(ts[0], {0, 1}, 0, {}));
}

// Shapes the suite above leaves out: worlds above 8 ranks, 3 to 5 ranks a host, and hosts holding unequal numbers
// of ranks (13 at 4 a host: the last host holds one), where the hierarchical allreduce goes through each host's
// leader instead of its local and cross groups.
struct Shape {
  int ranks, per_host;
};
class Shapes : public ::testing::TestWithParam<Shape> {};

TEST_P(Shapes, EveryCollectiveIsCorrect) {
  const auto [n, per_host] = GetParam();
  auto wrong = on_ranks(
      n,
      [&](Communicator& c) {
        size_t w = 0;
        for (const std::string algo : {"ring", "rhd", "rd", "tree", "hier"})
          for (DType t : {DType::f32, DType::bf16, DType::i32})
            for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max})
              for (size_t count : kCounts) {
                size_t e = run_and_verify(c, {"allreduce", algo, t, op, count, 0, 0});
                if (e)
                  ADD_FAILURE() << algo << " " << dtype_name(t) << " " << reduce_op_name(op) << " count " << count
                                << ": " << e << " wrong on rank " << c.rank();
                w += e;
              }
        for (size_t count : kCounts) {
          for (const std::string a : {"ring", "rh"}) {
            w += run_and_verify(c, {"reduce_scatter", a, DType::f32, ReduceOp::sum, count, 0, 0});
            w += run_and_verify(c, {"reduce_scatterv", a, DType::f32, ReduceOp::sum, count, 0, 0});
          }
          for (const std::string a : {"ring", "rd"}) {
            w += run_and_verify(c, {"allgather", a, DType::f32, ReduceOp::sum, count, 0, 0});
            w += run_and_verify(c, {"allgatherv", a, DType::i32, ReduceOp::sum, count, 0, 0});
          }
          for (int root : {0, n / 2, n - 1}) {
            for (const std::string a : {"tree", "chain"})
              w += run_and_verify(c, {"broadcast", a, DType::f32, ReduceOp::sum, count, root, 0});
            for (const std::string a : {"tree", "rsg"})
              w += run_and_verify(c, {"reduce", a, DType::f32, ReduceOp::avg, count, root, 0});
            w += run_and_verify(c, {"gather", "", DType::f64, ReduceOp::sum, count, root, 0});
            w += run_and_verify(c, {"scatter", "", DType::f64, ReduceOp::sum, count, root, 0});
          }
          w += run_and_verify(c, {"alltoall", "", DType::u8, ReduceOp::sum, count, 0, 0});
          w += run_and_verify(c, {"alltoallv", "", DType::u8, ReduceOp::sum, count, 0, 0});
          w += run_and_verify(c, {"barrier", "", DType::f32, ReduceOp::sum, 0, 0, 0});
          w += run_and_verify(c, {"sendrecv", "", DType::f32, ReduceOp::sum, count, 0, 0});
        }
        // The hierarchical allreduce runs as itself (on one host it reports the ring it ran).
        std::vector<float> v(1000, 1.0f);
        CollOptions o;
        o.algorithm = "hier";
        o.blocking = c.rank() % 2 == 0;
        Work op = c.allreduce(v.data(), v.size(), DType::f32, ReduceOp::sum, o);
        op.wait();
        if (v[999] != static_cast<float>(n)) ++w;
        if (op.algorithm() != "hier") {
          ADD_FAILURE() << "rank " << c.rank() << ": hier ran as " << op.algorithm();
          ++w;
        }
        if (c.num_hosts() != (n + per_host - 1) / per_host) ++w;
        return w;
      },
      per_host);
  EXPECT_EQ(total(wrong), 0u);
}

INSTANTIATE_TEST_SUITE_P(Worlds, Shapes,
                         ::testing::Values(Shape{9, 3}, Shape{12, 3}, Shape{16, 4}, Shape{13, 4}, Shape{10, 5}),
                         [](const auto& info) {
                           return fmt::format("{}RanksAt{}AHost", info.param.ranks, info.param.per_host);
                         });

// Communicators over one transport used at the same time from different threads, as training does (the data-parallel
// exchange on its communication thread, tensor-parallel collectives on the compute thread): the world, a second
// communicator over the same ranks in reverse order and one of ranks 1 to 3, each driven by its own thread on every
// member, mixing background and blocking operations. Every result must be right on every transport.
class ConcurrentCommunicators : public ::testing::TestWithParam<std::string> {};

TEST_P(ConcurrentCommunicators, OperationsOfDifferentCommunicatorsInterleaveCorrectly) {
  constexpr int n = 4, kRounds = 25;
  auto transports = net::test_util::make_transport_world(GetParam(), n);
  CommConfig cfg;
  cfg.timeout_s = 60;
  const auto wrong = on_threads(n, [&](int r) {
    std::vector<CommPtr> comms{Communicator::create(transports[r], {0, 1, 2, 3}, 0, cfg),
                               Communicator::create(transports[r], {3, 2, 1, 0}, 1, cfg)};
    if (r != 0) comms.push_back(Communicator::create(transports[r], {1, 2, 3}, 2, cfg));
    // (each communicator driven from a thread of its own)
    const auto w = on_threads(static_cast<int>(comms.size()), [&](int k) {
      Communicator& c = *comms[size_t(k)];
      const char* algos[] = {"ring", "rhd", "tree"};
      size_t bad = 0;
      for (int i = 0; i < kRounds; ++i) {
        const size_t count = 1 + static_cast<size_t>((i * 7919 + k * 104729) % 20000);
        bad += run_and_verify(c, {"allreduce", algos[(i + k) % 3], DType::f32, ReduceOp::sum, count, 0, 0});
        bad += run_and_verify(c, {"allgather", "", DType::i32, ReduceOp::sum, count / 3, 0, 0});
        bad += run_and_verify(c, {"broadcast", "", DType::f64, ReduceOp::sum, count / 5, i % c.size(), 0});
        // Blocking: on this thread, not the communicator's worker.
        std::vector<float> v(257, static_cast<float>(c.rank() + 1));
        CollOptions o;
        o.blocking = true;
        c.allreduce(v.data(), v.size(), DType::f32, ReduceOp::max, o).wait();
        if (v[256] != static_cast<float>(c.size())) ++bad;
      }
      return bad;
    });
    size_t bad = 0;
    for (size_t x : w) bad += x;
    return bad;
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(wrong[r], 0u) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Transports, ConcurrentCommunicators, ::testing::Values("inproc", "tcp", "shm"));

// A world of 12 over the real transports (tcp's 66 connections, shm's 132 rings on one host): each pattern once.
class TwelveRanks : public ::testing::TestWithParam<std::string> {};

TEST_P(TwelveRanks, EveryPatternIsCorrect) {
  constexpr int n = 12;
  // Rings of 64 KiB: the default 2 MiB's 132 rings need 264 MiB of /dev/shm (a container's default is 64 MiB).
  const char* had = std::getenv("CONDUIT_SHM_RING_BYTES");
  const std::string before = had ? had : "";
  setenv("CONDUIT_SHM_RING_BYTES", "65536", 1);
  auto transports = net::test_util::make_transport_world(GetParam(), n);
  if (had)
    setenv("CONDUIT_SHM_RING_BYTES", before.c_str(), 1);
  else
    unsetenv("CONDUIT_SHM_RING_BYTES");
  CommConfig cfg;
  cfg.timeout_s = 60;
  const auto wrong = on_threads(n, [&](int r) {
    auto c = Communicator::create(transports[r], {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, 0, cfg);
    size_t bad = 0;
    for (size_t count : {size_t{1}, size_t{5003}, size_t{100000}}) {
      for (const std::string a : {"ring", "rhd", "rd", "tree"})
        bad += run_and_verify(*c, {"allreduce", a, DType::f32, ReduceOp::sum, count, 0, 0});
      bad += run_and_verify(*c, {"reduce_scatter", "", DType::bf16, ReduceOp::avg, count, 0, 0});
      bad += run_and_verify(*c, {"reduce_scatterv", "", DType::bf16, ReduceOp::avg, count, 0, 0});
      bad += run_and_verify(*c, {"allgather", "", DType::i32, ReduceOp::sum, count, 0, 0});
      bad += run_and_verify(*c, {"broadcast", "", DType::f64, ReduceOp::sum, count, 7, 0});
      bad += run_and_verify(*c, {"reduce", "", DType::f32, ReduceOp::max, count, 11, 0});
      bad += run_and_verify(*c, {"gather", "", DType::u8, ReduceOp::sum, count, 5, 0});
      bad += run_and_verify(*c, {"scatter", "", DType::u8, ReduceOp::sum, count, 3, 0});
      bad += run_and_verify(*c, {"alltoall", "", DType::i64, ReduceOp::sum, count / 12 + 1, 0, 0});
      bad += run_and_verify(*c, {"sendrecv", "", DType::f32, ReduceOp::sum, count, 0, 0});
      bad += run_and_verify(*c, {"barrier", "", DType::f32, ReduceOp::sum, 0, 0, 0});
    }
    return bad;
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(wrong[r], 0u) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Transports, TwelveRanks, ::testing::Values("tcp", "shm"));

// Which partner gets which share of the data: the order the simulator's patterns assume (sim/collective.cc, tested
// there against the same shares). 8 ranks, n bytes a rank; bytes rank r sends to r ^ 1, r ^ 2 and r ^ 4:
//   rhd allreduce: n/2 + n/2 to the nearest, n/4 + n/4, n/8 + n/8 (MPICH's order: the largest halves between
//     neighbouring ranks, which a host holds together; it sent them to the farthest until 2026-12-06);
//   rh reduce-scatter of 8 blocks: T/8, T/4, T/2 (the block a rank keeps decides: the farthest partner first);
//   rd allgather of blocks B: B, 2B, 4B; and a binomial broadcast from rank 0 sends to 4, then 2, then 1.
TEST(AlgorithmShape, EachPartnerGetsTheShareThePatternsAssume) {
  const int n = 8;
  auto inner = net::make_inproc_world(n, 2);
  std::vector<std::shared_ptr<CountingTransport>> ts;
  for (auto& t : inner) ts.push_back(std::make_shared<CountingTransport>(t));
  CommConfig cfg;
  cfg.timeout_s = 30;
  const size_t count = 4096;  // f32 elements: 16 KiB a rank, 2 KiB blocks
  const size_t B = count * 4 / n;
  std::vector<std::vector<std::vector<size_t>>> sent(n);  // [rank][case][peer]
  const auto wrong = on_threads(n, [&](int r) {
    auto c = Communicator::create(ts[r], {0, 1, 2, 3, 4, 5, 6, 7}, 0, cfg);
    size_t bad = 0;
    ts[r]->take();
    bad += run_and_verify(*c, {"allreduce", "rhd", DType::f32, ReduceOp::sum, count, 0, 0});
    sent[r].push_back(ts[r]->take());
    bad += run_and_verify(*c, {"reduce_scatter", "rh", DType::f32, ReduceOp::sum, count / n, 0, 0});
    sent[r].push_back(ts[r]->take());
    bad += run_and_verify(*c, {"allgather", "rd", DType::f32, ReduceOp::sum, count / n, 0, 0});
    sent[r].push_back(ts[r]->take());
    bad += run_and_verify(*c, {"broadcast", "tree", DType::f32, ReduceOp::sum, count, 0, 0});
    sent[r].push_back(ts[r]->take());
    return bad;
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(wrong[r], 0u);
    ASSERT_EQ(sent[r].size(), 4u);
    const size_t N = count * 4;
    // (each verify case also runs a small exchange of its own: compare the partners' shares, which dwarf it)
    auto near = [&](size_t got, size_t want) { return got >= want && got < want + 64; };
    EXPECT_TRUE(near(sent[r][0][r ^ 1], N)) << r << ": " << sent[r][0][r ^ 1];
    EXPECT_TRUE(near(sent[r][0][r ^ 2], N / 2)) << r << ": " << sent[r][0][r ^ 2];
    EXPECT_TRUE(near(sent[r][0][r ^ 4], N / 4)) << r << ": " << sent[r][0][r ^ 4];
    EXPECT_TRUE(near(sent[r][1][r ^ 1], N / 8)) << r;
    EXPECT_TRUE(near(sent[r][1][r ^ 2], N / 4)) << r;
    EXPECT_TRUE(near(sent[r][1][r ^ 4], N / 2)) << r;
    EXPECT_TRUE(near(sent[r][2][r ^ 1], B)) << r;
    EXPECT_TRUE(near(sent[r][2][r ^ 2], 2 * B)) << r;
    EXPECT_TRUE(near(sent[r][2][r ^ 4], 4 * B)) << r;
  }
  // The broadcast's tree: 0 -> 4, 0 -> 2, 4 -> 6, then 0 -> 1, 2 -> 3, 4 -> 5, 6 -> 7.
  for (int r = 0; r < n; ++r)
    for (int peer = 0; peer < n; ++peer) {
      const bool edge = (r % 2 == 0) && peer > r &&
                        ((r == 0 && (peer == 4 || peer == 2 || peer == 1)) || (r == 4 && (peer == 6 || peer == 5)) ||
                         (r == 2 && peer == 3) || (r == 6 && peer == 7));
      EXPECT_EQ(sent[r][3][peer] >= count * 4, edge) << r << " -> " << peer << ": " << sent[r][3][peer];
    }
  // 6 ranks, rh reduce-scatter of blocks of Bb bytes: 0 -> 1 and 2 -> 3 fold the whole vector; participants 1, 3,
  // 4, 5 halve ranges that cover their ranks' blocks (1: blocks 0-1, 3: 2-3); the folded ranks get their block.
  auto inner6 = net::make_inproc_world(6, 2);
  std::vector<std::shared_ptr<CountingTransport>> ts6;
  for (auto& t : inner6) ts6.push_back(std::make_shared<CountingTransport>(t));
  const size_t block = 1024, Bb = block * 4;
  std::vector<std::vector<size_t>> sent6(6);
  on_threads(6, [&](int r) {
    auto c = Communicator::create(ts6[r], {0, 1, 2, 3, 4, 5}, 0, cfg);
    ts6[r]->take();
    const size_t bad = run_and_verify(*c, {"reduce_scatter", "rh", DType::f32, ReduceOp::sum, block, 0, 0});
    sent6[r] = ts6[r]->take();
    return bad;
  });
  const std::map<std::pair<int, int>, size_t> want = {
      {{0, 1}, 6 * Bb}, {{2, 3}, 6 * Bb}, {{1, 4}, 2 * Bb}, {{4, 1}, 4 * Bb}, {{3, 5}, 2 * Bb}, {{5, 3}, 4 * Bb},
      {{1, 3}, 2 * Bb}, {{3, 1}, 2 * Bb}, {{4, 5}, Bb},     {{5, 4}, Bb},     {{1, 0}, Bb},     {{3, 2}, Bb}};
  for (int r = 0; r < 6; ++r)
    for (int peer = 0; peer < 6; ++peer) {
      auto it = want.find({r, peer});
      const size_t w = it == want.end() ? 0 : it->second;
      EXPECT_TRUE(sent6[r][peer] >= w && sent6[r][peer] < w + 64) << r << " -> " << peer << ": " << sent6[r][peer];
    }
}

// allgatherv_sent (what compressed allgathers count as sent) against the bytes each rank put on the wire, with blocks
// of different sizes: the ring forwards all but its successor's block, recursive doubling its group's.
TEST(AlgorithmShape, AllgathervSentIsWhatEachRankSends) {
  CommConfig cfg;
  cfg.timeout_s = 30;
  for (auto [n, algo] : {std::pair{3, "ring"}, std::pair{5, "ring"}, std::pair{4, "ring"}, std::pair{4, "rd"},
                         std::pair{8, "rd"}, std::pair{6, "rd"}}) {
    auto inner = net::make_inproc_world(n, 2);
    std::vector<std::shared_ptr<CountingTransport>> ts;
    for (auto& t : inner) ts.push_back(std::make_shared<CountingTransport>(t));
    std::vector<size_t> counts;
    for (int r = 0; r < n; ++r) counts.push_back(size_t(100 + 1000 * r * r));  // bytes
    size_t total = 0;
    for (auto c : counts) total += c;
    std::vector<uint64_t> wire(n), claimed(n);
    std::vector<std::string> ran(n);
    const auto wrong = on_threads(n, [&](int r) {
      std::vector<int> members(n);
      std::iota(members.begin(), members.end(), 0);
      auto c = Communicator::create(ts[r], members, 0, cfg);
      std::vector<uint8_t> in(counts[r], uint8_t(r + 1)), out(total);
      ts[r]->take();
      CollOptions o;
      o.algorithm = algo;
      Work w = c->allgatherv(in.data(), out.data(), counts, DType::u8, o);
      w.wait();
      for (auto b : ts[r]->take()) wire[r] += b;
      ran[r] = w.algorithm();
      claimed[r] = allgatherv_sent(ran[r], counts, r);
      size_t at = 0, bad = 0;
      for (int q = 0; q < n; at += counts[q], ++q)
        for (size_t j = 0; j < counts[q]; ++j) bad += out[at + j] != uint8_t(q + 1);
      return bad;
    });
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(wrong[r], 0u) << n << " ranks, " << algo << ", rank " << r;
      EXPECT_EQ(claimed[r], wire[r]) << n << " ranks, " << algo << " (ran " << ran[r] << "), rank " << r;
      // (the bug this replaced: (size - 1) x the rank's own block)
      if (r == 0) {
        EXPECT_NE(claimed[r], uint64_t(n - 1) * counts[r]);
      }
    }
  }
}

// No algorithm sends a message larger than the tuner's bound for its call (given the element size: blocks are whole
// elements, the first count % p one longer): the message limit is checked against that bound before a call is queued,
// and a message over it aborted the job. rhd's upper rank sends the larger half, up to p/4 elements over n/2, and
// hier's cross-host step the largest local block: they were bounded by n/2 and n/L bytes. Algorithms bounded by 0
// send ring segments (tuner.h), checked against the limit at start-up: none of their messages may be larger than
// ring_segment_bytes() (4 KiB here, under the largest calls' 8 KiB). (Only bounds over 0 were checked, and the
// segmented algorithms were not among the cases.)
TEST(AlgorithmShape, NoMessageIsLargerThanTheTunersBound) {
  CommConfig cfg;
  cfg.timeout_s = 30;
  const std::pair<CollOp, const char*> cases[] = {
      {CollOp::allreduce, "rhd"},     {CollOp::allreduce, "rd"},    {CollOp::allreduce, "tree"},
      {CollOp::allreduce, "hier"},    {CollOp::allreduce, "ring"},  {CollOp::reduce_scatter, "ring"},
      {CollOp::reduce_scatter, "rh"}, {CollOp::allgather, "rd"},    {CollOp::allgather, "ring"},
      {CollOp::broadcast, "tree"},    {CollOp::broadcast, "chain"}, {CollOp::reduce, "tree"},
      {CollOp::reduce, "rsg"}};
  ASSERT_EQ(ring_segment_bytes(), 4096u);
  for (int n : {2, 4, 6, 8}) {
    auto inner = net::make_inproc_world(n, 2);
    std::vector<std::shared_ptr<CountingTransport>> ts;
    for (auto& t : inner) ts.push_back(std::make_shared<CountingTransport>(t));
    std::vector<std::string> over(n);
    const auto wrong = on_threads(n, [&](int r) {
      std::vector<int> members(n);
      std::iota(members.begin(), members.end(), 0);
      auto c = Communicator::create(ts[r], members, 0, cfg);
      size_t bad = 0;
      for (const auto& [op, algo] : cases)
        for (DType dt : {DType::u8, DType::f32, DType::f64})
          for (size_t count : {1, 3, 5, 6, 7, 13, 1029}) {
            ts[r]->take_largest();
            const char* name = op == CollOp::allreduce ? "allreduce" : coll_op_name(op);
            bad += run_and_verify(*c, {name, algo, dt, ReduceOp::sum, count, 0, 0});
            const size_t esz = dtype_size(dt), largest = ts[r]->take_largest();
            // (allgather: the output; reduce_scatter: the input, count elements a rank's block)
            const bool whole = op == CollOp::allgather || op == CollOp::reduce_scatter;
            const size_t bytes = count * esz * (whole ? n : 1);
            const double bound =
                c->tuner().largest_message(op, algo, double(bytes), n, c->num_hosts(), c->hosts_uniform_multi(), esz);
            const double most = bound > 0 ? bound : double(ring_segment_bytes());  // (0: ring segments)
            if (double(largest) > most && over[r].empty())
              over[r] = fmt::format("{} {} of {} x {}: a message of {} bytes, bound {}{}", coll_op_name(op), algo,
                                    count, dtype_name(dt), largest, bound,
                                    bound > 0 ? "" : fmt::format(" (ring segments of {})", ring_segment_bytes()));
            // The bound without the element size (the tuner's own choice) holds for every dtype.
            const double any =
                c->tuner().largest_message(op, algo, double(bytes), n, c->num_hosts(), c->hosts_uniform_multi());
            if (bound > 0 && any < bound && over[r].empty())
              over[r] = fmt::format("{} {} of {} x {}: {} bytes without the element size, {} with it", coll_op_name(op),
                                    algo, count, dtype_name(dt), any, bound);
          }
      return bad;
    });
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(wrong[r], 0u) << n << " ranks, rank " << r;
      EXPECT_EQ(over[r], "") << n << " ranks, rank " << r;
    }
  }
}

// A transport whose receives complete without their data (it lands in a scratch buffer of the transport's).
class DroppingTransport : public test_util::ForwardingTransport {
 public:
  using ForwardingTransport::ForwardingTransport;
  const char* name() const override { return "dropping"; }
  net::RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes) override {
    std::lock_guard<std::mutex> lk(mu_);
    scratch_.push_back(std::make_unique<char[]>(std::max<size_t>(bytes, 1)));
    return inner_->irecv(peer, tag, scratch_.back().get(), bytes);
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<char[]>> scratch_;
};

// run_and_verify counts every element an algorithm never wrote as wrong, those expected to be 0 too: its outputs
// started as zeros, and at small counts a block that was never written could pass. Here no received data arrives.
TEST(Verify, ElementsNoAlgorithmWroteAreCountedWrong) {
  const int n = 3;
  const size_t count = 64;
  auto inner = net::make_inproc_world(n, 0);
  std::vector<std::shared_ptr<DroppingTransport>> ts;
  for (auto& t : inner) ts.push_back(std::make_shared<DroppingTransport>(t));
  CommConfig cfg;
  cfg.timeout_s = 30;
  std::vector<CommPtr> comms(n);
  on_threads(n, [&](int r) {
    comms[r] = Communicator::create(ts[r], {0, 1, 2}, 0, cfg);
    return size_t{0};
  });
  // What each rank should have received from the others, in elements (root 0).
  const std::pair<const char*, std::vector<size_t>> cases[] = {{"gather", {(n - 1) * count, 0, 0}},
                                                               {"scatter", {0, count, count}},
                                                               {"allgather", std::vector<size_t>(n, (n - 1) * count)},
                                                               {"alltoall", std::vector<size_t>(n, (n - 1) * count)},
                                                               {"sendrecv", std::vector<size_t>(n, 2 * count)}};
  for (const auto& [op, want] : cases)
    for (DType dt : {DType::f32, DType::u8, DType::i8}) {
      const auto wrong = on_threads(n, [&](int r) {
        return run_and_verify(*comms[r], {op, op == std::string("allgather") ? "ring" : "", dt, ReduceOp::sum, count});
      });
      EXPECT_EQ(wrong, want) << op << " " << dtype_name(dt);
    }
}

}  // namespace

namespace {
// A split group's errors number its ranks as the group does, its transport's as the transport does: the group's
// own description and its list of silent peers give both (a timeout read "rank 0 of 2" beside "rank 3").
TEST(Communicator, ASplitGroupsTimeoutNamesItsRanksAsTheTransportDoes) {
  auto comms = Communicator::inproc(4);
  std::vector<std::string> msgs(4);
  on_threads(4, [&](int r) {
    auto sub = comms[r]->split(r % 2, r);
    if (r != 1) return size_t(0);
    std::vector<float> x(64, 1.0f);
    CollOptions o;
    o.timeout_s = 0.3;
    o.algorithm = "ring";
    try {
      sub->allreduce(x.data(), x.size(), DType::f32, ReduceOp::sum, o).wait();
    } catch (const TimeoutError& e) {
      msgs[r] = e.what();
    }
    return size_t(0);
  });
  EXPECT_NE(msgs[1].find("on rank 0 of 2 (inproc rank 1 of 4)"), std::string::npos) << msgs[1];
  EXPECT_NE(msgs[1].find("no data yet from rank(s) 1 (inproc rank(s) 3)"), std::string::npos) << msgs[1];
  // The world communicator keeps the short form.
  EXPECT_EQ(comms[2]->describe(), "rank 2 of 4 (inproc)");
}
}  // namespace

namespace {
// A negative or nan timeout is refused, naming the field (it quietly became the default: 300 s, or the
// communicator's); 0 stays the default. So is one under a millisecond (it expired before anything moved).
TEST(Communicator, ANegativeOrNanTimeoutIsRefused) {
  for (double bad : {-1.0, std::nan(""), 1e-12, 0.0009}) {
    CommConfig cfg;
    cfg.timeout_s = bad;
    try {
      Communicator::inproc(2, 2, cfg);
      ADD_FAILURE() << "CommConfig.timeout_s = " << bad << " accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("CommConfig.timeout_s"), std::string::npos) << e.what();
    }
    auto comms = Communicator::inproc(2);
    float x = 1;
    CollOptions o;
    o.timeout_s = bad;
    try {
      comms[0]->allreduce(&x, 1, DType::f32, ReduceOp::sum, o);
      ADD_FAILURE() << "CollOptions.timeout_s = " << bad << " accepted by allreduce";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("CollOptions.timeout_s"), std::string::npos) << e.what();
    }
    EXPECT_THROW(comms[0]->send(&x, 1, DType::f32, 1, 3, o), InvalidArgument);
  }
}
}  // namespace
