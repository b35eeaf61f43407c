#pragma once
// Straggler injection: `--slow RANK:FACTOR[@P][,...]` makes the chosen ranks' compute FACTOR times slower: after
// forward and backward the rank sleeps until FACTOR x the CPU time the compute used (the calling thread's CPU clock)
// has passed since it began, so its step takes FACTOR x its CPU work. Not FACTOR x its wall time, and the sleep is
// not added on top of the wall time: when more workers than cores share the machine, wall time also holds the time
// spent waiting for a core, which depends on what the other workers do at that moment (under bsp they wait while the
// straggler computes, under asynchronous schemes they compute beside it). A device FACTOR times slower is slower than
// that wait, so the wait is part of the emulated slowness and the straggler's pace is the same under every scheme
// (unless waiting for a core alone takes longer than FACTOR x the CPU time).
//
// RANK `*` means every rank (a rank named on its own overrides it). `@P` makes the slowdown transient: each step of
// that rank is slowed with probability P, independently, drawn from the run's seed and the rank (the same steps are
// slowed under every scheme with the same seed). `--slow 3:3` is a persistent straggler; `--slow '*:3@0.25'` is a
// cluster whose every worker has a 3x slower step a quarter of the time (interference, preemption, thermal limits).
//
//   sync::Straggler slow(sync::parse_slow(flag), rank, seed);
//   slow.begin();  forward/backward;  slow.end();   // sleeps on slowed steps only
#include <cstdint>
#include <map>
#include <random>
#include <string>

namespace conduit::sync {

struct Slowdown {
  double factor = 1;
  double probability = 1;  // of each step being slowed
  bool operator==(const Slowdown&) const = default;
};

// The key of `*` (every rank) in parse_slow's map.
constexpr int kEveryRank = -1;

// "1:3,2:1.5@0.5,*:2@0.1" -> {1: 3x always, 2: 1.5x half of the steps, every other rank: 2x a tenth of the steps}.
// ConfigError (one line) on bad syntax, a negative rank, a factor outside [1, 1000], a probability outside (0, 1] or
// a repeated rank; `world` > 0 also rejects ranks >= world.
std::map<int, Slowdown> parse_slow(const std::string& spec, int world = 0);

class Straggler {
 public:
  Straggler(const std::map<int, Slowdown>& plan, int rank, uint64_t seed = 0);
  // The configured factor (1 when this rank is never slowed).
  double factor() const { return s_.factor; }
  // Whether the step begun last is slowed (always for a persistent straggler).
  bool slowed() const { return slowed_; }
  void begin();
  // Advances the draws past `steps` steps already taken (a resumed run slows the steps an uninterrupted run would).
  void skip(int64_t steps);
  // On a slowed step, sleeps until factor x the CPU time this thread used since begin() has passed since begin()
  // (no sleep when that much wall time already has); returns the seconds slept (0 on a step that is not slowed).
  double end();
  double slept_seconds() const { return slept_; }
  int64_t slowed_steps() const { return slowed_steps_; }

 private:
  Slowdown s_;
  std::mt19937_64 rng_;
  bool slowed_ = false;
  double cpu0_ = 0;
  double wall0_ = 0;  // steady clock at begin()
  double slept_ = 0;
  int64_t slowed_steps_ = 0;
};

}  // namespace conduit::sync
