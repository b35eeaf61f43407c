#pragma once
// Conduit's error hierarchy. Every error message is one line naming what went wrong, where (rank, peer, op,
// sequence number when known) and what is allowed or what to do.
#include <stdexcept>
#include <string>

namespace conduit {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A configuration value, CLI flag, file or environment variable is invalid.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// An argument passed to an API is invalid (bad count, rank out of range, dtype mismatch...).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A deadline expired before an operation completed.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// A peer died, closed its connection or aborted.
class PeerError : public Error {
 public:
  using Error::Error;
};

// A frame or message violated the wire protocol (bad magic, version, length, tag).
class ProtocolError : public Error {
 public:
  using Error::Error;
};

// Ranks called collectives inconsistently (caught by CONDUIT_DEBUG_COLLECTIVES=1).
class MismatchError : public Error {
 public:
  using Error::Error;
};

// The operation is not available here (missing kernel support, transport not compiled in...).
class UnsupportedError : public Error {
 public:
  using Error::Error;
};

// Rethrows `e` as its class among Error and its direct subclasses above (a deeper subclass as its parent here), with
// `context` before its message ("pipeline stage 1 of 2: receiving ...: recv from rank 0 ... timed out"): a caller
// that knows what the operation was for names it, and whoever catches a kind of error still catches it.
[[noreturn]] inline void rethrow_with_context(const Error& e, const std::string& context) {
  const std::string m = context + ": " + e.what();
  if (dynamic_cast<const TimeoutError*>(&e)) throw TimeoutError(m);
  if (dynamic_cast<const PeerError*>(&e)) throw PeerError(m);
  if (dynamic_cast<const ProtocolError*>(&e)) throw ProtocolError(m);
  if (dynamic_cast<const MismatchError*>(&e)) throw MismatchError(m);
  if (dynamic_cast<const InvalidArgument*>(&e)) throw InvalidArgument(m);
  if (dynamic_cast<const ConfigError*>(&e)) throw ConfigError(m);
  if (dynamic_cast<const UnsupportedError*>(&e)) throw UnsupportedError(m);
  throw Error(m);
}

}  // namespace conduit
