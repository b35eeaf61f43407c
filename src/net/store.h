#pragma once
// Rendezvous key-value stores. Ranks publish their addresses under keys and read their peers'; every blocking
// call has a deadline and throws TimeoutError naming the key it waited for.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/clock.h"

namespace conduit::net {

// Largest key or value a store holds: the TCP store's largest length field trusted on the wire, the file store's
// largest file read as a value.
inline constexpr uint32_t kMaxStoreFieldBytes = 64u << 20;

// Every wait ends by its deadline (TimeoutError): a TCP store server that hangs, a value not yet published, or a
// file-system lock held by a stuck rank cannot keep a caller past the time it was given. The file store's single
// file operations (open, write, rename) are the file system's own: on a hung network mount they block as it does.
// The overloads without one allow CONDUIT_TIMEOUT (300 s).
class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value, const Deadline& deadline) = 0;
  // Blocks until `key` exists, then returns its value.
  virtual std::string get(const std::string& key, const Deadline& deadline) = 0;
  // Atomically adds `delta` to the integer under `key` (absent = 0) and returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta, const Deadline& deadline) = 0;
  // True if `key` exists now (waits for nothing but the store's answer).
  virtual bool check(const std::string& key, const Deadline& deadline) = 0;
  // Claims `key` for this caller: true for the first to ask, false for any later one. By default add(key, 1) == 1;
  // the file store creates the key's file exclusively instead (no lock file: flock is missing on some network file
  // systems, and a shared lock file another user made is not writable).
  virtual bool claim(const std::string& key, const Deadline& deadline) { return add(key, 1, deadline) == 1; }

  void set(const std::string& key, const std::string& value) { set(key, value, default_deadline()); }
  int64_t add(const std::string& key, int64_t delta) { return add(key, delta, default_deadline()); }
  bool check(const std::string& key) { return check(key, default_deadline()); }

 private:
  static Deadline default_deadline();
};

using StorePtr = std::shared_ptr<Store>;

// Served by rank 0 (is_server) on host:port; clients connect (retrying until the deadline).
// Wire format: see tcp_store.cc; every request and reply is validated (magic, lengths <= 64 MiB).
StorePtr make_tcp_store(const std::string& host, int port, bool is_server, const Deadline& connect_deadline);
// A directory on a shared file system; each key is a file written atomically (write + rename). `failure_key`, when
// given, is where a rank that failed publishes why (net/bootstrap.cc): a get waiting for a key that is not there
// ends at once with PeerError carrying that value, not at its deadline.
StorePtr make_file_store(const std::string& dir, const std::string& failure_key = {});
// Test hook: every file store of this process names its temporary files with this host name and pid (as two
// containers sharing the directory may both have); an empty host restores the real ones.
void set_file_store_identity_for_testing(const std::string& host, long pid);

// Collective helpers over any store, for bootstrap: every one of `size` ranks calls them in the same order with
// the same `prefix`.
// `on_value` (when given) sees each other rank's value as it is read, in rank order, and may throw: a rank whose
// value says it is of another job stops this one at once instead of after every value came.
std::vector<std::string> store_allgather(Store& store, const std::string& prefix, int rank, int size,
                                         const std::string& value, const Deadline& deadline,
                                         const std::function<void(int, const std::string&)>& on_value = nullptr);
void store_barrier(Store& store, const std::string& prefix, int rank, int size, const Deadline& deadline);

}  // namespace conduit::net
