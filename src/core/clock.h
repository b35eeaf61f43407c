#pragma once
#include <algorithm>
#include <chrono>
#include <cstdint>

namespace conduit {

using Clock = std::chrono::steady_clock;
using Seconds = std::chrono::duration<double>;

inline double now_seconds() {
  return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
}

inline uint64_t now_micros_wall() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A point in time after which a blocking operation gives up. Default-constructed: never.
class Deadline {
 public:
  Deadline() : at_(Clock::time_point::max()) {}
  explicit Deadline(Clock::time_point at) : at_(at) {}
  // Not positive, or NaN (a caller's bug: converting it is undefined): already expired, so nothing waits on it.
  static Deadline after(double seconds) {
    if (!(seconds > 0)) return Deadline(Clock::now());
    if (seconds > 1e9) return Deadline();
    return Deadline(Clock::now() + std::chrono::duration_cast<Clock::duration>(Seconds(seconds)));
  }
  static Deadline never() { return Deadline(); }
  bool expired() const { return at_ != Clock::time_point::max() && Clock::now() >= at_; }
  bool is_never() const { return at_ == Clock::time_point::max(); }
  Clock::time_point at() const { return at_; }
  double remaining_seconds() const {
    if (is_never()) return 1e18;
    return std::chrono::duration<double>(at_ - Clock::now()).count();
  }
  // The time left, but at least zero and at most `cap`, as a D: for a pause between polls. Cast to an integer
  // duration as it is, remaining_seconds() overflows for never() (1e18 s is past any int64 count of nanoseconds or
  // microseconds: undefined, in practice a negative pause, so a poll loop without a deadline spun a core).
  template <class D>
  D remaining_at_most(D cap) const {
    const double cap_s = std::chrono::duration<double>(cap).count();
    const double left = std::max(0.0, std::min(remaining_seconds(), cap_s));
    return std::chrono::duration_cast<D>(Seconds(left));
  }
  Deadline min(const Deadline& o) const { return at_ < o.at_ ? *this : o; }

 private:
  Clock::time_point at_;
};

class Stopwatch {
 public:
  Stopwatch() : start_(Clock::now()) {}
  double seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }
  void reset() { start_ = Clock::now(); }

 private:
  Clock::time_point start_;
};

}  // namespace conduit
