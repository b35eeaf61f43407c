#pragma once
// Federated data: how a labelled data set is split over simulated clients (statistical heterogeneity), and which
// clients take part in a round (client sampling).
//
// Partitions (sample indices 0..labels.size()-1 over `clients` clients; every index goes to exactly one client and
// every client gets at least one):
//
//   iid            shuffled, then cut into near-equal parts (sizes differ by at most 1).
//   dirichlet:A    for each class c, proportions p_c ~ Dir(A, ..., A) over the clients; class c's shuffled samples
//                  are cut by p_c. Small A (0.1) gives clients dominated by one or two classes and very unequal
//                  sizes; large A (100) approaches iid. This is the per-class form popularised by Yurochkin et al.
//                  2019 and used by most FL benchmarks to reproduce Hsu, Qi, Brown 2019 ("Measuring the effects of
//                  non-identical data distribution"); Hsu et al. draw each client's class mix q ~ Dir(A p) instead.
//                  A draw that leaves a client empty is redrawn (kDirichletTries times at most).
//   shards:K       sort by label, cut into clients*K near-equal shards, give each client K random shards
//                  (McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from Decentralized Data":
//                  200 shards of 300 MNIST digits, 2 per client).
//
// All randomness comes from std::mt19937_64 seeded with `seed` (whose output the standard fixes). Shuffles and
// client sampling draw integers with their own unbiased reduction, so iid, shards and sample_clients are the same on
// every platform; the Dirichlet draws use std::gamma_distribution, whose algorithm is implementation-defined, so a
// Dirichlet partition is reproducible for a seed on one standard library (libstdc++ here), not across them.
//
// Client sampling (sample_clients) lives here too: it decides which of the partitioned clients train in a round.
#include <cstdint>
#include <string>
#include <vector>

namespace conduit::fl {

struct PartitionSpec {
  std::string kind = "iid";   // "iid" | "dirichlet" | "shards"
  double alpha = 0.5;         // dirichlet concentration, finite > 0
  int shards_per_client = 2;  // shards: K >= 1
};

// How many times a Dirichlet partition is redrawn when a draw leaves some client without samples.
inline constexpr int kDirichletTries = 1000;

// "iid" | "dirichlet:ALPHA" (ALPHA finite > 0) | "shards:K" (integer K >= 1). ConfigError naming the spec otherwise.
PartitionSpec parse_partition(const std::string& spec);
// The inverse of parse_partition: "iid", "dirichlet:0.1", "shards:2".
std::string to_string(const PartitionSpec& spec);

// Splits indices 0..labels.size()-1 over `clients` clients (see the top of this file). Each client's indices are
// returned in ascending order. Deterministic for (labels, num_classes, clients, spec, seed).
// InvalidArgument: num_classes < 1, clients < 1, a label outside [0, num_classes) (naming its index).
// ConfigError: fewer samples than clients, clients*K shards more than the samples, an invalid spec, or a Dirichlet
// alpha too small to give every client a sample within kDirichletTries draws.
std::vector<std::vector<int64_t>> partition(const std::vector<int64_t>& labels, int num_classes, int clients,
                                            const PartitionSpec& spec, uint64_t seed);

// hist[i][c] = how many of client i's samples have label c. InvalidArgument for an index outside labels or a label
// outside [0, num_classes).
std::vector<std::vector<int64_t>> label_histograms(const std::vector<int64_t>& labels, int num_classes,
                                                   const std::vector<std::vector<int64_t>>& parts);

// Heterogeneity summary for reports: the mean over non-empty clients of the total-variation distance
// 0.5 * sum_c |p_i(c) - p(c)| between client i's label distribution and the distribution of all the clients'
// samples together. 0 when every client has the global label mix; 1 - 1/C when each of C equally common classes
// sits on its own clients; it can only approach 1 when one class dominates the whole data set.
// 0 when there are no samples. InvalidArgument if the histograms have different numbers of classes.
double mean_label_tv_distance(const std::vector<std::vector<int64_t>>& histograms);
double mean_label_tv_distance(const std::vector<int64_t>& labels, int num_classes,
                              const std::vector<std::vector<int64_t>>& parts);

// The clients that train in round `round`: max(min_clients, round(fraction * num_clients)) distinct ids in
// [0, num_clients), capped at num_clients, sorted ascending, uniformly random among subsets of that size and
// deterministic per (seed, round). ConfigError: num_clients < 1, fraction outside (0, 1], min_clients outside
// [1, num_clients].
std::vector<int> sample_clients(int num_clients, double fraction, int min_clients, uint64_t seed, uint64_t round);

}  // namespace conduit::fl
