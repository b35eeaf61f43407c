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

// AD-PSGD's roles on a ring of n ranks. Every ring edge {i, j} is used, by one exchange at a time: one end initiates
// (sends its model and waits for the answer), the other answers from a background thread. Ranks of different parity:
// the even one initiates (the AD-PSGD paper's bipartite graph). With an odd n >= 3 the wrap edge {n-1, 0} joins two
// even ranks: rank n-1 initiates it and rank 0 answers it, besides initiating with rank 1 (it was dropped, so an odd
// ring was a path). A rank that both initiates and answers holds its answers back during its own exchange. Waits
// only go initiator -> answerer, and the only answerer that initiates (rank 0) waits on rank 1, which initiates
// nothing: no cycle, no deadlock.
struct PairRoles {
  std::vector<int> initiates;  // neighbours this rank sends requests to (ascending)
  std::vector<int> answers;    // neighbours whose requests this rank answers (ascending)
};
PairRoles adpsgd_ring_roles(int rank, int n);

// Eigenvalues of a symmetric n x n matrix (row major), descending (Jacobi rotations).
std::vector<double> symmetric_eigenvalues(std::vector<double> a, int n);
// max(|lambda_2|, |lambda_n|) of a symmetric doubly stochastic matrix: the per-step consensus contraction.
double second_largest_eigenvalue_modulus(const std::vector<double>& w, int n);

}  // namespace conduit::sync
