#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace conduit {

// A deadline kept by a thread of its own: `expire` is called once `seconds` have passed, unless this object is
// destroyed first (0 or less: no deadline, no thread). `expire` ends the process (it must not return); it runs with
// no lock held, so a destructor waiting meanwhile is not held up. Time the process spent stopped (Ctrl-Z, SIGSTOP)
// does not count: a wake more than a second later than asked moves the deadline on by the difference.
class ExpiryThread {
 public:
  ExpiryThread(double seconds, std::function<void()> expire);
  ~ExpiryThread();
  ExpiryThread(const ExpiryThread&) = delete;
  ExpiryThread& operator=(const ExpiryThread&) = delete;

 private:
  void watch(double seconds);
  std::function<void()> expire_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace conduit
