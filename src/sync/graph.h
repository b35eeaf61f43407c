#pragma once
// Communication graphs for gossip and their mixing matrices.
#include <string>
#include <vector>

namespace conduit::sync {

// An undirected graph over n ranks: ring (i +- 1), torus (rows x cols grid with wrap-around, i +- 1 in each
// dimension), exponential (i +- 2^k for 2^k < n). Mixing weights are Metropolis-Hastings:
// W_ij = 1 / (1 + max(deg i, deg j)) for neighbours, W_ii = 1 - sum_j W_ij; symmetric and doubly stochastic.
class Graph {
 public:
  // rows: torus rows (0: the most square factorization of n).
  Graph(const std::string& kind, int n, int rows = 0);
  const std::string& kind() const { return kind_; }
  int size() const { return n_; }
  const std::vector<int>& neighbours(int i) const { return adj_[i]; }
  double weight(int i, int j) const;
  std::vector<double> mixing_matrix() const;  // n x n, row major
  static const std::vector<std::string>& kinds();

 private:
  std::string kind_;
  int n_;
  std::vector<std::vector<int>> adj_;
};

// Eigenvalues of a symmetric n x n matrix (row major), descending (Jacobi rotations).
std::vector<double> symmetric_eigenvalues(std::vector<double> a, int n);
// max(|lambda_2|, |lambda_n|) of a symmetric doubly stochastic matrix: the per-step consensus contraction.
double second_largest_eigenvalue_modulus(const std::vector<double>& w, int n);

}  // namespace conduit::sync
