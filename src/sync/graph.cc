#include "sync/graph.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace conduit::sync {

const std::vector<std::string>& Graph::kinds() {
  static const std::vector<std::string> k = {"ring", "torus", "exponential"};
  return k;
}

Graph::Graph(const std::string& kind, int n, int rows) : kind_(kind), n_(n), adj_(n) {
  if (n < 1) throw InvalidArgument(fmt::format("sync graph: {} ranks", n));
  auto add = [&](int i, int j) {
    j = ((j % n) + n) % n;
    if (j != i && std::find(adj_[i].begin(), adj_[i].end(), j) == adj_[i].end()) adj_[i].push_back(j);
  };
  if (kind == "ring") {
    for (int i = 0; i < n; ++i) add(i, i - 1), add(i, i + 1);
  } else if (kind == "exponential") {
    for (int i = 0; i < n; ++i)
      for (int64_t h = 1; h < n; h *= 2) add(i, i + int(h)), add(i, i - int(h));
  } else if (kind == "torus") {
    if (rows == 0) {
      rows = 1;
      for (int r = 1; r * r <= n; ++r)
        if (n % r == 0) rows = r;
    }
    if (rows < 1 || n % rows != 0) {
      std::string divisors;
      for (int r = 1; r <= n; ++r)
        if (n % r == 0) divisors += (divisors.empty() ? "" : ", ") + std::to_string(r);
      throw ConfigError(fmt::format(
          "sync dpsgd: torus rows = {} does not divide the {} ranks; allowed: 0 (the most square grid) or {}", rows, n,
          divisors));
    }
    int cols = n / rows;
    for (int i = 0; i < n; ++i) {
      int a = i / cols, b = i % cols;
      add(i, ((a + 1) % rows) * cols + b), add(i, ((a - 1 + rows) % rows) * cols + b);
      add(i, a * cols + (b + 1) % cols), add(i, a * cols + (b - 1 + cols) % cols);
    }
  } else {
    throw ConfigError(fmt::format("sync dpsgd: unknown graph '{}' (allowed: ring, torus, exponential)", kind));
  }
  for (auto& a : adj_) std::sort(a.begin(), a.end());
}

double Graph::weight(int i, int j) const {
  if (i == j) {
    double s = 0;
    for (int k : adj_[i]) s += weight(i, k);
    return 1.0 - s;
  }
  if (std::find(adj_[i].begin(), adj_[i].end(), j) == adj_[i].end()) return 0;
  return 1.0 / (1.0 + std::max(adj_[i].size(), adj_[j].size()));
}

std::vector<double> Graph::mixing_matrix() const {
  std::vector<double> w(size_t(n_) * n_);
  for (int i = 0; i < n_; ++i)
    for (int j = 0; j < n_; ++j) w[size_t(i) * n_ + j] = weight(i, j);
  return w;
}

PairRoles adpsgd_ring_roles(int rank, int n) {
  if (n < 1 || rank < 0 || rank >= n)
    throw InvalidArgument(fmt::format("sync adpsgd: rank {} of {} ranks (allowed: 0 <= rank < ranks)", rank, n));
  PairRoles roles;
  std::vector<int> nbrs;  // the ring's (without building one: this runs every step)
  for (int j : {(rank + n - 1) % n, (rank + 1) % n})
    if (j != rank && std::find(nbrs.begin(), nbrs.end(), j) == nbrs.end()) nbrs.push_back(j);
  std::sort(nbrs.begin(), nbrs.end());
  for (int j : nbrs) {
    // Same parity only on the wrap edge of an odd ring: its higher end (n - 1) initiates.
    const bool initiate = (rank % 2 != j % 2) ? rank % 2 == 0 : rank > j;
    (initiate ? roles.initiates : roles.answers).push_back(j);
  }
  return roles;
}

std::vector<double> symmetric_eigenvalues(std::vector<double> a, int n) {
  auto at = [&](int i, int j) -> double& { return a[size_t(i) * n + j]; };
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0;
    for (int i = 0; i < n; ++i)
      for (int j = i + 1; j < n; ++j) off += at(i, j) * at(i, j);
    if (off < 1e-22) break;
    for (int p = 0; p < n; ++p)
      for (int q = p + 1; q < n; ++q) {
        if (std::abs(at(p, q)) < 1e-300) continue;
        double theta = (at(q, q) - at(p, p)) / (2 * at(p, q));
        double t = (theta >= 0 ? 1 : -1) / (std::abs(theta) + std::sqrt(theta * theta + 1));
        double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int k = 0; k < n; ++k) {  // A <- A J (columns p, q)
          double kp = at(k, p), kq = at(k, q);
          at(k, p) = c * kp - s * kq;
          at(k, q) = s * kp + c * kq;
        }
        for (int k = 0; k < n; ++k) {  // A <- J^T A (rows p, q)
          double pk = at(p, k), qk = at(q, k);
          at(p, k) = c * pk - s * qk;
          at(q, k) = s * pk + c * qk;
        }
      }
  }
  std::vector<double> ev(n);
  for (int i = 0; i < n; ++i) ev[i] = at(i, i);
  std::sort(ev.rbegin(), ev.rend());
  return ev;
}

double second_largest_eigenvalue_modulus(const std::vector<double>& w, int n) {
  if (n < 2) return 0;
  auto ev = symmetric_eigenvalues(w, n);
  return std::max(std::abs(ev[1]), std::abs(ev[n - 1]));
}

}  // namespace conduit::sync
