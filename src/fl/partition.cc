#include "fl/partition.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <system_error>

#include "core/error.h"

namespace conduit::fl {
namespace {

constexpr const char* kAllowedSpecs =
    "iid, dirichlet:ALPHA (ALPHA a number > 0, at most 1e12) or shards:K (an integer K >= 1)";

constexpr double kMaxDirichletAlpha = 1e12;

[[noreturn]] void bad_spec(const std::string& spec, const std::string& why) {
  throw ConfigError(fmt::format("partition spec '{}': {}; allowed: {}", spec, why, kAllowedSpecs));
}

// SplitMix64's finaliser: spreads (seed, round) into independent-looking generator seeds.
uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A uniform integer in [0, bound) without std::uniform_int_distribution (whose algorithm is implementation-defined):
// Lemire's multiply-and-reject on 64-bit draws, so shuffles and samples are the same on every standard library.
uint64_t uniform_below(std::mt19937_64& rng, uint64_t bound) {
  unsigned __int128 m = static_cast<unsigned __int128>(rng()) * bound;
  auto low = static_cast<uint64_t>(m);
  if (low < bound) {
    const uint64_t threshold = (0 - bound) % bound;
    while (low < threshold) {
      m = static_cast<unsigned __int128>(rng()) * bound;
      low = static_cast<uint64_t>(m);
    }
  }
  return static_cast<uint64_t>(m >> 64);
}

template <class T>
void shuffle(std::vector<T>& v, std::mt19937_64& rng) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[uniform_below(rng, i)]);
}

void check_labels(const std::vector<int64_t>& labels, int num_classes) {
  if (num_classes < 1) throw InvalidArgument(fmt::format("partition: num_classes is {}; allowed: >= 1", num_classes));
  for (size_t i = 0; i < labels.size(); ++i) {
    if (labels[i] < 0 || labels[i] >= num_classes) {
      throw InvalidArgument(
          fmt::format("partition: labels[{}] is {}; allowed: a class in [0, {})", i, labels[i], num_classes));
    }
  }
}

// Cuts `items` into `parts` contiguous pieces whose sizes differ by at most 1 (the first size % parts are larger).
template <class T>
std::vector<std::vector<T>> cut_even(const std::vector<T>& items, size_t parts) {
  std::vector<std::vector<T>> out(parts);
  const size_t base = items.size() / parts, extra = items.size() % parts;
  size_t pos = 0;
  for (size_t i = 0; i < parts; ++i) {
    const size_t len = base + (i < extra ? 1 : 0);
    out[i].assign(items.begin() + static_cast<ptrdiff_t>(pos), items.begin() + static_cast<ptrdiff_t>(pos + len));
    pos += len;
  }
  return out;
}

std::vector<std::vector<int64_t>> partition_iid(size_t n, int clients, std::mt19937_64& rng) {
  std::vector<int64_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  shuffle(idx, rng);
  return cut_even(idx, static_cast<size_t>(clients));
}

std::vector<std::vector<int64_t>> partition_dirichlet(const std::vector<int64_t>& labels, int num_classes, int clients,
                                                      double alpha, std::mt19937_64& rng) {
  // Each class's samples, shuffled once; only the proportions are redrawn.
  std::vector<std::vector<int64_t>> by_class(static_cast<size_t>(num_classes));
  for (size_t i = 0; i < labels.size(); ++i)
    by_class[static_cast<size_t>(labels[i])].push_back(static_cast<int64_t>(i));
  for (auto& c : by_class) shuffle(c, rng);

  const auto k = static_cast<size_t>(clients);
  std::gamma_distribution<double> gamma(alpha, 1.0);
  // cut[c][i] = where client i's slice of class c ends (cut[c][k-1] == class size).
  std::vector<std::vector<size_t>> cut(by_class.size(), std::vector<size_t>(k));
  std::vector<double> p(k);
  std::vector<size_t> sizes(k);
  for (int attempt = 0; attempt < kDirichletTries; ++attempt) {
    std::fill(sizes.begin(), sizes.end(), 0);
    for (size_t c = 0; c < by_class.size(); ++c) {
      const size_t nc = by_class[c].size();
      double sum = 0;
      // Dir(alpha) = independent Gamma(alpha, 1) draws, normalised. With a tiny alpha every draw can underflow to 0;
      // such a draw is repeated (a bounded number of times, then the class goes to one uniformly chosen client).
      for (int g = 0; g < 64 && !(sum > 0 && std::isfinite(sum)); ++g) {
        sum = 0;
        for (auto& x : p) sum += (x = gamma(rng));
      }
      if (!(sum > 0 && std::isfinite(sum))) {
        std::fill(p.begin(), p.end(), 0.0);
        p[uniform_below(rng, k)] = 1.0;
        sum = 1.0;
      }
      double acc = 0;
      size_t prev = 0;
      for (size_t i = 0; i < k; ++i) {
        acc += p[i];
        size_t end = i + 1 == k ? nc : static_cast<size_t>(std::llround(acc / sum * static_cast<double>(nc)));
        end = std::clamp(end, prev, nc);
        cut[c][i] = end;
        sizes[i] += end - prev;
        prev = end;
      }
    }
    if (std::all_of(sizes.begin(), sizes.end(), [](size_t s) { return s > 0; })) {
      std::vector<std::vector<int64_t>> out(k);
      for (size_t i = 0; i < k; ++i) out[i].reserve(sizes[i]);
      for (size_t c = 0; c < by_class.size(); ++c) {
        size_t prev = 0;
        for (size_t i = 0; i < k; ++i) {
          out[i].insert(out[i].end(), by_class[c].begin() + static_cast<ptrdiff_t>(prev),
                        by_class[c].begin() + static_cast<ptrdiff_t>(cut[c][i]));
          prev = cut[c][i];
        }
      }
      return out;
    }
  }
  throw ConfigError(fmt::format(
      "partition dirichlet:{}: {} draws over {} clients and {} samples each left some client without a sample; "
      "allowed: raise alpha or lower the number of clients",
      alpha, kDirichletTries, clients, labels.size()));
}

std::vector<std::vector<int64_t>> partition_shards(const std::vector<int64_t>& labels, int clients, int per_client,
                                                   std::mt19937_64& rng) {
  const size_t n = labels.size();
  const size_t num_shards = static_cast<size_t>(clients) * static_cast<size_t>(per_client);
  if (num_shards > n) {
    throw ConfigError(
        fmt::format("partition shards:{}: {} clients x {} shards = {} shards but only {} samples; "
                    "allowed: clients * K <= samples",
                    per_client, clients, per_client, num_shards, n));
  }
  std::vector<int64_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return labels[a] < labels[b]; });
  const auto shards = cut_even(idx, num_shards);
  std::vector<size_t> order(num_shards);
  std::iota(order.begin(), order.end(), 0);
  shuffle(order, rng);
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(clients));
  for (size_t s = 0; s < num_shards; ++s) {
    auto& dst = out[s / static_cast<size_t>(per_client)];
    const auto& src = shards[order[s]];
    dst.insert(dst.end(), src.begin(), src.end());
  }
  return out;
}

}  // namespace

PartitionSpec parse_partition(const std::string& spec) {
  PartitionSpec out;
  const auto colon = spec.find(':');
  const std::string kind = spec.substr(0, colon);
  const bool has_value = colon != std::string::npos;
  const std::string value = has_value ? spec.substr(colon + 1) : std::string();
  if (kind == "iid") {
    if (has_value) bad_spec(spec, "iid takes no parameter");
    out.kind = "iid";
    return out;
  }
  if (kind == "dirichlet") {
    if (value.empty()) bad_spec(spec, "dirichlet needs a concentration ALPHA");
    double alpha = 0;
    const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), alpha);
    if (ec != std::errc() || end != value.data() + value.size()) bad_spec(spec, "ALPHA is not a number");
    if (!std::isfinite(alpha) || alpha <= 0) bad_spec(spec, "ALPHA must be finite and > 0");
    // (a split that large is iid in all but name; near a double's range the Gamma draws' sum overflowed, and every
    // class went whole to one client, the most skewed split there is)
    if (alpha > kMaxDirichletAlpha) bad_spec(spec, "ALPHA above 1e12 (use iid)");
    out.kind = "dirichlet";
    out.alpha = alpha;
    return out;
  }
  if (kind == "shards") {
    if (value.empty()) bad_spec(spec, "shards needs a count K of shards per client");
    int k = 0;
    const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), k);
    if (ec != std::errc() || end != value.data() + value.size()) bad_spec(spec, "K is not an integer");
    if (k < 1) bad_spec(spec, "K must be >= 1");
    out.kind = "shards";
    out.shards_per_client = k;
    return out;
  }
  bad_spec(spec, fmt::format("unknown kind '{}'", kind));
}

std::string to_string(const PartitionSpec& spec) {
  if (spec.kind == "dirichlet") return fmt::format("dirichlet:{}", spec.alpha);
  if (spec.kind == "shards") return fmt::format("shards:{}", spec.shards_per_client);
  return spec.kind;
}

std::vector<std::vector<int64_t>> partition(const std::vector<int64_t>& labels, int num_classes, int clients,
                                            const PartitionSpec& spec, uint64_t seed) {
  if (clients < 1) throw InvalidArgument(fmt::format("partition: clients is {}; allowed: >= 1", clients));
  check_labels(labels, num_classes);
  if (labels.size() < static_cast<size_t>(clients)) {
    throw ConfigError(
        fmt::format("partition {}: {} samples cannot give each of {} clients one; allowed: at most {} "
                    "clients for this data set",
                    to_string(spec), labels.size(), clients, labels.size()));
  }
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int64_t>> out;
  if (spec.kind == "iid") {
    out = partition_iid(labels.size(), clients, rng);
  } else if (spec.kind == "dirichlet") {
    if (!std::isfinite(spec.alpha) || spec.alpha <= 0) {
      throw ConfigError(fmt::format("partition dirichlet: alpha is {}; allowed: finite and > 0", spec.alpha));
    }
    out = partition_dirichlet(labels, num_classes, clients, spec.alpha, rng);
  } else if (spec.kind == "shards") {
    if (spec.shards_per_client < 1) {
      throw ConfigError(fmt::format("partition shards: K is {}; allowed: an integer >= 1", spec.shards_per_client));
    }
    out = partition_shards(labels, clients, spec.shards_per_client, rng);
  } else {
    throw ConfigError(fmt::format("partition kind '{}' is unknown; allowed: iid, dirichlet, shards", spec.kind));
  }
  for (auto& part : out) std::sort(part.begin(), part.end());
  return out;
}

std::vector<std::vector<int64_t>> label_histograms(const std::vector<int64_t>& labels, int num_classes,
                                                   const std::vector<std::vector<int64_t>>& parts) {
  check_labels(labels, num_classes);
  std::vector<std::vector<int64_t>> hist(parts.size(), std::vector<int64_t>(static_cast<size_t>(num_classes), 0));
  for (size_t i = 0; i < parts.size(); ++i) {
    for (const int64_t j : parts[i]) {
      if (j < 0 || static_cast<uint64_t>(j) >= labels.size()) {
        throw InvalidArgument(
            fmt::format("label_histograms: client {} holds sample index {}; allowed: [0, {})", i, j, labels.size()));
      }
      ++hist[i][static_cast<size_t>(labels[static_cast<size_t>(j)])];
    }
  }
  return hist;
}

double mean_label_tv_distance(const std::vector<std::vector<int64_t>>& histograms) {
  if (histograms.empty()) return 0.0;
  const size_t classes = histograms[0].size();
  std::vector<double> global(classes, 0.0);
  double total = 0;
  for (size_t i = 0; i < histograms.size(); ++i) {
    if (histograms[i].size() != classes) {
      throw InvalidArgument(
          fmt::format("mean_label_tv_distance: client {} has {} classes, client 0 has {}; allowed: "
                      "the same number for every client",
                      i, histograms[i].size(), classes));
    }
    for (size_t c = 0; c < classes; ++c) {
      global[c] += static_cast<double>(histograms[i][c]);
      total += static_cast<double>(histograms[i][c]);
    }
  }
  if (total <= 0) return 0.0;
  for (auto& g : global) g /= total;
  double sum = 0;
  int64_t counted = 0;
  for (const auto& h : histograms) {
    const double n = std::accumulate(h.begin(), h.end(), 0.0, [](double a, int64_t b) { return a + double(b); });
    if (n <= 0) continue;
    double tv = 0;
    for (size_t c = 0; c < classes; ++c) tv += std::abs(static_cast<double>(h[c]) / n - global[c]);
    sum += 0.5 * tv;
    ++counted;
  }
  return counted ? sum / static_cast<double>(counted) : 0.0;
}

double mean_label_tv_distance(const std::vector<int64_t>& labels, int num_classes,
                              const std::vector<std::vector<int64_t>>& parts) {
  return mean_label_tv_distance(label_histograms(labels, num_classes, parts));
}

std::vector<int> sample_clients(int num_clients, double fraction, int min_clients, uint64_t seed, uint64_t round) {
  if (num_clients < 1) {
    throw ConfigError(fmt::format("client sampling: num_clients is {}; allowed: >= 1", num_clients));
  }
  if (!(fraction > 0 && fraction <= 1)) {
    throw ConfigError(fmt::format("client sampling: fraction is {}; allowed: (0, 1]", fraction));
  }
  if (min_clients < 1 || min_clients > num_clients) {
    throw ConfigError(fmt::format("client sampling: min_clients is {}; allowed: [1, {}] (the number of clients)",
                                  min_clients, num_clients));
  }
  const auto wanted = static_cast<int64_t>(std::llround(fraction * static_cast<double>(num_clients)));
  const int k = static_cast<int>(std::min<int64_t>(num_clients, std::max<int64_t>(min_clients, wanted)));
  std::vector<int> out;
  out.reserve(static_cast<size_t>(k));
  if (k == num_clients) {
    for (int i = 0; i < num_clients; ++i) out.push_back(i);
    return out;
  }
  // Floyd's algorithm: a uniformly random k-subset of [0, n) in O(k log k), however large n is.
  std::mt19937_64 rng(mix64(mix64(seed) ^ round));
  std::set<int> chosen;
  for (int j = num_clients - k; j < num_clients; ++j) {
    const int t = static_cast<int>(uniform_below(rng, static_cast<uint64_t>(j) + 1));
    chosen.insert(chosen.count(t) ? j : t);
  }
  out.assign(chosen.begin(), chosen.end());
  return out;
}

}  // namespace conduit::fl
