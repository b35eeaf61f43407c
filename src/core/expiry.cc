#include "core/expiry.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>

namespace conduit {

ExpiryThread::ExpiryThread(double seconds, std::function<void()> expire) : expire_(std::move(expire)) {
  if (seconds > 0) thread_ = std::thread([this, seconds] { watch(seconds); });
}

ExpiryThread::~ExpiryThread() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void ExpiryThread::watch(double seconds) {
  using Clock = std::chrono::steady_clock;
  const auto slice = std::chrono::milliseconds(500);
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  std::unique_lock<std::mutex> lock(mu_);
  while (!done_) {
    const auto before = Clock::now();
    if (before >= deadline) {
      lock.unlock();
      expire_();
      std::_Exit(124);  // (expire_ returned, which it must not: the deadline still ends the process)
    }
    const auto asked = std::min<Clock::duration>(slice, deadline - before);
    cv_.wait_for(lock, asked);
    const auto late = Clock::now() - before - asked;
    if (late > std::chrono::seconds(1)) deadline += late;  // (stopped that long)
  }
}

}  // namespace conduit
