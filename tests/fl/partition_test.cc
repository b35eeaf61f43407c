// Partitioners (iid, Dirichlet, shards), label statistics and client sampling: coverage, sizes, heterogeneity,
// determinism and the errors a user sees for impossible or malformed requests.
#include "fl/partition.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "../error_of.h"
#include "core/error.h"

using namespace conduit;
using namespace conduit::fl;

namespace {

// n samples of `classes` interleaved classes (label i % classes), so a partitioner must sort to get shards.
std::vector<int64_t> interleaved(int64_t n, int classes) {
  std::vector<int64_t> labels(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) labels[static_cast<size_t>(i)] = i % classes;
  return labels;
}

void expect_exact_cover(const std::vector<std::vector<int64_t>>& parts, size_t n, int clients) {
  ASSERT_EQ(parts.size(), static_cast<size_t>(clients));
  std::vector<int> seen(n, 0);
  for (const auto& p : parts) {
    EXPECT_FALSE(p.empty());
    EXPECT_TRUE(std::is_sorted(p.begin(), p.end()));
    for (const int64_t i : p) {
      ASSERT_GE(i, 0);
      ASSERT_LT(static_cast<size_t>(i), n);
      ++seen[static_cast<size_t>(i)];
    }
  }
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(seen[i], 1) << "index " << i;
}

using conduit::test::error_of;

}  // namespace

TEST(FlPartition, ParsesSpecsAndPrintsThemBack) {
  EXPECT_EQ(parse_partition("iid").kind, "iid");
  const auto d = parse_partition("dirichlet:0.1");
  EXPECT_EQ(d.kind, "dirichlet");
  EXPECT_DOUBLE_EQ(d.alpha, 0.1);
  const auto s = parse_partition("shards:3");
  EXPECT_EQ(s.kind, "shards");
  EXPECT_EQ(s.shards_per_client, 3);
  EXPECT_DOUBLE_EQ(parse_partition("dirichlet:1e-2").alpha, 0.01);
  for (const std::string spec : {"iid", "dirichlet:0.1", "dirichlet:100", "shards:2"}) {
    EXPECT_EQ(to_string(parse_partition(spec)), spec);
  }
}

TEST(FlPartition, RejectsMalformedSpecsNamingThem) {
  for (const std::string spec :
       {"dirichlet:-1", "dirichlet:0", "dirichlet:abc", "dirichlet:", "dirichlet", "dirichlet:inf", "dirichlet:nan",
        "dirichlet:1x", "dirichlet:1.7e308", "dirichlet:1.1e12", "shards:0", "shards:-2", "shards:2.5",
        "shards:", "shards", "foo", "", "iid:3", "IID"}) {
    EXPECT_THROW(parse_partition(spec), ConfigError) << spec;
    const std::string msg = error_of([&] { parse_partition(spec); });
    EXPECT_NE(msg.find("'" + spec + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("allowed"), std::string::npos) << msg;
  }
}

TEST(FlPartition, EverySpecCoversEveryIndexExactlyOnce) {
  const auto labels = interleaved(1003, 10);
  for (const std::string spec :
       {"iid", "dirichlet:0.5", "dirichlet:0.1", "dirichlet:100", "dirichlet:1e12", "shards:2", "shards:5"}) {
    for (const int clients : {1, 7, 10, 50}) {
      SCOPED_TRACE(spec + " over " + std::to_string(clients));
      expect_exact_cover(partition(labels, 10, clients, parse_partition(spec), 42), labels.size(), clients);
    }
  }
}

TEST(FlPartition, IidSizesDifferByAtMostOne) {
  const auto labels = interleaved(1003, 10);
  const auto parts = partition(labels, 10, 10, parse_partition("iid"), 1);
  size_t lo = labels.size(), hi = 0;
  for (const auto& p : parts) {
    lo = std::min(lo, p.size());
    hi = std::max(hi, p.size());
  }
  EXPECT_LE(hi - lo, 1u);
  // Shuffled, not contiguous: the first client does not simply get 0..100.
  EXPECT_NE(parts[0].back(), static_cast<int64_t>(parts[0].size()) - 1);
}

TEST(FlPartition, SmallDirichletAlphaIsFarMoreHeterogeneous) {
  // 10 classes x 1000 samples over 10 clients. With alpha = 0.1 most clients are dominated by one or two classes
  // (the mean TV distance from the global mix is around 0.6); alpha = 100 and iid differ from it only by sampling
  // noise (about 0.04).
  const auto labels = interleaved(10000, 10);
  const double tv_small =
      mean_label_tv_distance(labels, 10, partition(labels, 10, 10, parse_partition("dirichlet:0.1"), 3));
  const double tv_large =
      mean_label_tv_distance(labels, 10, partition(labels, 10, 10, parse_partition("dirichlet:100"), 3));
  const double tv_iid = mean_label_tv_distance(labels, 10, partition(labels, 10, 10, parse_partition("iid"), 3));
  EXPECT_GT(tv_small, 0.4);
  EXPECT_LT(tv_large, 0.1);
  EXPECT_LT(tv_iid, 0.1);
  EXPECT_GT(tv_small, 4 * tv_large);
  EXPECT_GT(tv_small, 4 * tv_iid);
  // The largest alpha taken is as even as iid (near a double's range, a sum that overflowed gave each class whole to
  // one client: TV 0.9 here).
  EXPECT_LT(mean_label_tv_distance(labels, 10, partition(labels, 10, 10, parse_partition("dirichlet:1e12"), 3)), 0.1);
}

TEST(FlPartition, TwoShardsPerClientGiveAtMostTwoLabels) {
  // McMahan et al.'s pathological non-iid split: 10 classes x 100 samples, 10 clients x 2 shards of 50, each shard
  // inside one class once the samples are sorted by label.
  const auto labels = interleaved(1000, 10);
  const auto parts = partition(labels, 10, 10, parse_partition("shards:2"), 9);
  const auto hist = label_histograms(labels, 10, parts);
  for (size_t i = 0; i < hist.size(); ++i) {
    const auto distinct = std::count_if(hist[i].begin(), hist[i].end(), [](int64_t c) { return c > 0; });
    EXPECT_GE(distinct, 1);
    EXPECT_LE(distinct, 2) << "client " << i;
    EXPECT_EQ(parts[i].size(), 100u);
  }
  EXPECT_GT(mean_label_tv_distance(hist), 0.75);
}

TEST(FlPartition, DeterministicPerSeedAndDifferentAcrossSeeds) {
  const auto labels = interleaved(2000, 10);
  for (const std::string spec : {"iid", "dirichlet:0.3", "shards:2"}) {
    const auto s = parse_partition(spec);
    EXPECT_EQ(partition(labels, 10, 20, s, 5), partition(labels, 10, 20, s, 5)) << spec;
    EXPECT_NE(partition(labels, 10, 20, s, 5), partition(labels, 10, 20, s, 6)) << spec;
  }
}

TEST(FlPartition, RejectsImpossibleRequests) {
  const auto labels = interleaved(20, 4);
  EXPECT_THROW(partition(labels, 4, 21, PartitionSpec{}, 0), ConfigError);
  EXPECT_NE(error_of([&] { partition(labels, 4, 21, PartitionSpec{}, 0); }).find("21 clients"), std::string::npos);
  EXPECT_THROW(partition(labels, 4, 11, parse_partition("shards:2"), 0), ConfigError);
  EXPECT_NO_THROW(partition(labels, 4, 10, parse_partition("shards:2"), 0));
  EXPECT_THROW(partition(labels, 4, 0, PartitionSpec{}, 0), InvalidArgument);
  EXPECT_THROW(partition(labels, 0, 2, PartitionSpec{}, 0), InvalidArgument);
  EXPECT_THROW(partition({}, 4, 1, PartitionSpec{}, 0), ConfigError);
  // A spec built by hand is validated too.
  PartitionSpec bad;
  bad.kind = "dirichlet";
  bad.alpha = -1;
  EXPECT_THROW(partition(labels, 4, 2, bad, 0), ConfigError);
  bad.kind = "nope";
  EXPECT_THROW(partition(labels, 4, 2, bad, 0), ConfigError);
}

TEST(FlPartition, LabelsOutOfRangeAreNamedByIndex) {
  auto labels = interleaved(20, 4);
  labels[13] = 4;
  EXPECT_THROW(partition(labels, 4, 2, PartitionSpec{}, 0), InvalidArgument);
  EXPECT_NE(error_of([&] { partition(labels, 4, 2, PartitionSpec{}, 0); }).find("labels[13]"), std::string::npos);
  labels[13] = -1;
  EXPECT_THROW(partition(labels, 4, 2, PartitionSpec{}, 0), InvalidArgument);
}

TEST(FlPartition, DirichletGivesUpWithAnActionableError) {
  // alpha = 0.001 puts each class on about one client: 10 classes cannot feed 100 clients.
  const auto labels = interleaved(1000, 10);
  const std::string msg = error_of([&] { partition(labels, 10, 100, parse_partition("dirichlet:0.001"), 0); });
  EXPECT_NE(msg.find("raise alpha"), std::string::npos) << msg;
  EXPECT_THROW(partition(labels, 10, 100, parse_partition("dirichlet:0.001"), 0), ConfigError);
}

TEST(FlPartition, HistogramsAndTvDistanceByHand) {
  const std::vector<int64_t> labels = {0, 0, 1, 1};
  const auto split = label_histograms(labels, 2, {{0, 1}, {2, 3}});
  EXPECT_EQ(split, (std::vector<std::vector<int64_t>>{{2, 0}, {0, 2}}));
  EXPECT_DOUBLE_EQ(mean_label_tv_distance(split), 0.5);  // each client: 0.5 * (|1 - .5| + |0 - .5|)
  EXPECT_DOUBLE_EQ(mean_label_tv_distance(labels, 2, {{0, 2}, {1, 3}}), 0.0);
  // Empty clients are ignored; no samples at all gives 0.
  EXPECT_DOUBLE_EQ(mean_label_tv_distance(labels, 2, {{0, 1}, {}, {2, 3}}), 0.5);
  EXPECT_DOUBLE_EQ(mean_label_tv_distance({{0, 0}, {0, 0}}), 0.0);
  EXPECT_THROW(label_histograms(labels, 2, {{0, 4}}), InvalidArgument);
  EXPECT_THROW(mean_label_tv_distance({{1, 0}, {1}}), InvalidArgument);
}

TEST(FlSampleClients, SizesAreFractionOrMinimumCappedAtAll) {
  EXPECT_EQ(sample_clients(100, 0.1, 1, 0, 0).size(), 10u);
  EXPECT_EQ(sample_clients(100, 0.01, 5, 0, 0).size(), 5u);
  EXPECT_EQ(sample_clients(7, 0.5, 1, 0, 0).size(), 4u);  // round(3.5) = 4
  EXPECT_EQ(sample_clients(10, 1.0, 1, 0, 0), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(sample_clients(10, 0.3, 10, 0, 0).size(), 10u);
  EXPECT_EQ(sample_clients(1, 1.0, 1, 0, 0), (std::vector<int>{0}));
}

TEST(FlSampleClients, DistinctSortedInRangeAndDeterministicPerRound) {
  for (uint64_t round = 0; round < 50; ++round) {
    const auto s = sample_clients(1000, 0.05, 1, 17, round);
    ASSERT_EQ(s.size(), 50u);
    EXPECT_TRUE(std::is_sorted(s.begin(), s.end()));
    EXPECT_EQ(std::set<int>(s.begin(), s.end()).size(), s.size());
    EXPECT_GE(s.front(), 0);
    EXPECT_LT(s.back(), 1000);
    EXPECT_EQ(s, sample_clients(1000, 0.05, 1, 17, round));
  }
  EXPECT_NE(sample_clients(1000, 0.05, 1, 17, 0), sample_clients(1000, 0.05, 1, 17, 1));
  EXPECT_NE(sample_clients(1000, 0.05, 1, 17, 0), sample_clients(1000, 0.05, 1, 18, 0));
}

TEST(FlSampleClients, CoverageIsRoughlyUniformOverManyRounds) {
  // 100 clients, 10 per round, 2000 rounds: each client is expected 200 times with standard deviation
  // sqrt(2000 * 0.1 * 0.9) = 13.4; the band [140, 260] is 4.5 standard deviations wide on each side.
  std::vector<int> count(100, 0);
  for (uint64_t round = 0; round < 2000; ++round) {
    for (const int c : sample_clients(100, 0.1, 1, 3, round)) ++count[static_cast<size_t>(c)];
  }
  for (size_t c = 0; c < count.size(); ++c) {
    EXPECT_GE(count[c], 140) << "client " << c;
    EXPECT_LE(count[c], 260) << "client " << c;
  }
}

TEST(FlSampleClients, RejectsBadArguments) {
  EXPECT_THROW(sample_clients(10, 0.0, 1, 0, 0), ConfigError);
  EXPECT_THROW(sample_clients(10, 1.5, 1, 0, 0), ConfigError);
  EXPECT_THROW(sample_clients(10, -0.1, 1, 0, 0), ConfigError);
  EXPECT_THROW(sample_clients(10, std::nan(""), 1, 0, 0), ConfigError);
  EXPECT_THROW(sample_clients(10, 0.5, 0, 0, 0), ConfigError);
  EXPECT_THROW(sample_clients(10, 0.5, 11, 0, 0), ConfigError);
  EXPECT_THROW(sample_clients(0, 0.5, 1, 0, 0), ConfigError);
  EXPECT_NE(error_of([] { sample_clients(10, 1.5, 1, 0, 0); }).find("fraction"), std::string::npos);
}
