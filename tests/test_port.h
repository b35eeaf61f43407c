#pragma once
// A loopback port for a test whose server binds it some time after the port is chosen (a rank started late, a client
// that connects first). One below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range): a port the
// kernel handed out for `bind 0` could be handed to another process's outgoing connection before the server binds
// it, and a client retrying a connect to a port inside that range can be given that very port as its own and connect
// to itself. Where the range leaves no room below it, a port from `bind 0`.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>

namespace conduit::test {

inline bool port_binds(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  close(fd);
  return ok;
}

inline int port_from_kernel() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

inline int unused_port() {
  int lo = 32768, hi = 60999;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> lo >> hi;
  constexpr int kFirst = 20000;  // (below: ports services commonly listen on)
  const int span = lo - kFirst;
  if (span < 1000) return port_from_kernel();
  // Processes of tests running at once start from different places (their pids), and each call from the next one.
  static int calls = 0;
  const int start = static_cast<int>((static_cast<unsigned>(getpid()) * 7919u + static_cast<unsigned>(calls++) * 131u) %
                                     static_cast<unsigned>(span));
  for (int i = 0; i < span; ++i) {
    const int port = kFirst + (start + i) % span;
    if (port_binds(port)) return port;
  }
  return port_from_kernel();
}

}  // namespace conduit::test
