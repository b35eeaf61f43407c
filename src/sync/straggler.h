#pragma once
// Straggler injection: `--slow RANK:FACTOR[,RANK:FACTOR...]` makes the chosen ranks' compute FACTOR times slower by
// sleeping (FACTOR - 1) x the CPU time the compute used (the calling thread's CPU clock), not its wall time: when
// more workers than cores share the machine, wall time also holds the time spent waiting for a core, which depends
// on what the other workers do at that moment (under bsp they wait while the straggler computes, under asynchronous
// schemes they compute beside it), and the straggler would be slower under one scheme than under another.
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
  // Sleeps (factor - 1) x the CPU time this thread used since begin(); returns the seconds slept.
  double end();
  double slept_seconds() const { return slept_; }

 private:
  double factor_ = 1;
  double cpu0_ = 0;
  double slept_ = 0;
};

}  // namespace conduit::sync
