#pragma once
// Straggler injection: `--slow RANK:FACTOR[,RANK:FACTOR...]` makes the chosen ranks' compute FACTOR times slower:
// after forward and backward the rank sleeps until FACTOR x the CPU time the compute used (the calling thread's CPU
// clock) has passed since it began, so its step takes FACTOR x its CPU work. Not FACTOR x its wall time, and the
// sleep is not added on top of the wall time: when more workers than cores share the machine, wall time also holds
// the time spent waiting for a core, which depends on what the other workers do at that moment (under bsp they wait
// while the straggler computes, under asynchronous schemes they compute beside it). A device FACTOR times slower
// is slower than that wait, so the wait is part of the emulated slowness and the straggler's pace is the same under
// every scheme (unless waiting for a core alone takes longer than FACTOR x the CPU time).
//
//   sync::Straggler slow(sync::parse_slow(flag), rank);
//   slow.begin();  forward/backward;  slow.end();   // sleeps on slowed ranks only
#include <map>
#include <string>


namespace conduit::sync {

// "1:3,2:1.5" -> {1: 3.0, 2: 1.5}. ConfigError (one line) on bad syntax, a negative rank, a factor < 1 or a
// repeated rank; `world` > 0 also rejects ranks >= world.
std::map<int, double> parse_slow(const std::string& spec, int world = 0);

class Straggler {
 public:
  Straggler(const std::map<int, double>& factors, int rank);
  double factor() const { return factor_; }
  void begin();
  // Sleeps until factor x the CPU time this thread used since begin() has passed since begin() (no sleep when that
  // much wall time already has); returns the seconds slept.
  double end();
  double slept_seconds() const { return slept_; }

 private:
  double factor_ = 1;
  double cpu0_ = 0;
  double wall0_ = 0;  // steady clock at begin()
  double slept_ = 0;
};

}  // namespace conduit::sync
