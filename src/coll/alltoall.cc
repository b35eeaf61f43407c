// alltoall(v), pairwise: at step k rank r sends its block for (r+k) and receives the block from (r-k); all steps
//   are posted at once so the transport streams them. messages per rank p-1; time (p-1)α + Σ bytes·β.
// barrier, dissemination (Hensgen, Finkel & Manber): ceil(log p) rounds; in round k rank r signals r+2^k and
//   waits for r-2^k. time ceil(log p)·α.
#include <cstring>

#include "coll/algorithms.h"
#include "core/error.h"

namespace conduit::coll {

void pairwise_alltoallv(Ctx& c, const char* in, const std::vector<size_t>& send_bytes, char* out,
                        const std::vector<size_t>& recv_bytes) {
  const int p = c.size(), r = c.rank();
  std::vector<size_t> soff(p, 0), roff(p, 0);
  for (int i = 1; i < p; ++i) {
    soff[i] = soff[i - 1] + send_bytes[i - 1];
    roff[i] = roff[i - 1] + recv_bytes[i - 1];
  }
  std::vector<net::RequestPtr> reqs;
  for (int k = 1; k < p; ++k) {
    int from = (r - k + p) % p;
    reqs.push_back(c.recv(from, out + roff[from], recv_bytes[from]));
  }
  for (int k = 1; k < p; ++k) {
    int to = (r + k) % p;
    reqs.push_back(c.send(to, in + soff[to], send_bytes[to]));
  }
  if (send_bytes[r] != recv_bytes[r])
    throw InvalidArgument("alltoallv: a rank's count for itself must be equal in send_counts and recv_counts");
  if (send_bytes[r]) std::memmove(out + roff[r], in + soff[r], send_bytes[r]);
  c.wait_all(reqs);
}

void dissemination_barrier(Ctx& c) {
  const int p = c.size(), r = c.rank();
  for (int k = 1; k < p; k <<= 1) {
    auto rq = c.recv((r - k + p) % p, nullptr, 0);
    auto sq = c.send((r + k) % p, nullptr, 0);
    c.wait(rq);
    c.wait(sq);
  }
}

}  // namespace conduit::coll
