// Checkpoint files (fl/checkpoint.h): the CRC-32 each carries, checked before its fields are read, the refusal of the
// earlier format without one, and the values no sound run writes (a file whose checksum holds was still written by
// something: a run that went wrong, another tool).
#include "fl/checkpoint.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "../error_of.h"
#include "core/error.h"

namespace conduit::fl {
namespace {

using conduit::test::error_of;

struct TempDir {
  std::string path;
  TempDir() {
    char t[] = "/tmp/conduit-fl-ck-test-XXXXXX";
    path = ::mkdtemp(t);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

std::vector<char> bytes_of(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}
void write_bytes(const std::string& path, const std::vector<char>& b) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(b.data(), std::streamsize(b.size()));
}
// Flips the lowest bit of byte `at`.
void flip(const std::string& path, size_t at) {
  std::vector<char> b = bytes_of(path);
  ASSERT_LT(at, b.size());
  b[at] = char(b[at] ^ 1);
  write_bytes(path, b);
}

ServerCheckpoint small_server(int64_t round = 1) {
  ServerCheckpoint s;
  s.round = round;
  s.config_json = "{}";
  s.weights = {1.0f, 2.0f, 3.0f};
  return s;
}

// A bit that changed after the file was written (a damaged disk or copy) read as another finite weight, c_i or
// ledger count: the resume went on from a model nobody trained. Each file kind is refused naming the file.
TEST(Checkpoint, AByteChangedAfterWritingFailsTheChecksumNamingTheFile) {
  TempDir d;
  write_server_checkpoint(d.path, small_server());
  EXPECT_EQ(read_latest_checkpoint(d.path).weights, small_server().weights);
  // (magic, version, round, the settings' length and 2 bytes, the weights' length: weight 0 starts at byte 42)
  flip(d.path + "/server-1.bin", 42 + 2);
  std::string e = error_of<ProtocolError>([&] { read_latest_checkpoint(d.path); });
  EXPECT_NE(e.find("server-1.bin' fails its checksum (CRC-32 "), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;

  const std::map<int, std::vector<float>> control = {{0, {0.5f, 0.25f}}, {3, {-1.0f, 2.0f}}};
  write_host_checkpoint(d.path, 1, 1, control, 2);
  auto all = [](int) { return true; };
  EXPECT_EQ(read_host_checkpoints(d.path, 1, 2, 4, all), control);
  // (magic, version, round, rank, width, count: client 0's id at byte 48, its c_i after it)
  flip(d.path + "/host-1-1.bin", 48 + 8 + 1);
  e = error_of<ProtocolError>([&] { read_host_checkpoints(d.path, 1, 2, 4, all); });
  EXPECT_NE(e.find("host-1-1.bin' fails its checksum"), std::string::npos) << e;

  write_dp_ledger(d.path, 4);
  EXPECT_EQ(read_dp_ledger(d.path), 4);
  flip(d.path + "/dp-ledger.bin", 16);  // (the count: 5)
  e = error_of<ProtocolError>([&] { read_dp_ledger(d.path); });
  EXPECT_NE(e.find("dp-ledger.bin' fails its checksum"), std::string::npos) << e;

  // A file cut anywhere is refused too (a cut in its last bytes leaves the end mark in place).
  write_server_checkpoint(d.path, small_server(2));
  std::vector<char> b = bytes_of(d.path + "/server-2.bin");
  b.resize(b.size() - 2);
  write_bytes(d.path + "/server-2.bin", b);
  e = error_of<ProtocolError>([&] { read_latest_checkpoint(d.path); });
  EXPECT_NE(e.find("server-2.bin' fails its checksum"), std::string::npos) << e;
}

// Format version 1 carried no checksum: its files are refused with a line saying so, not read unchecked.
TEST(Checkpoint, TheEarlierFormatWithoutAChecksumIsRefusedWithOneLine) {
  TempDir d;
  write_server_checkpoint(d.path, small_server());
  std::vector<char> b = bytes_of(d.path + "/server-1.bin");
  const uint64_t one = 1;
  std::memcpy(b.data() + 8, &one, 8);
  write_bytes(d.path + "/server-1.bin", b);
  const std::string e = error_of<ProtocolError>([&] { read_latest_checkpoint(d.path); });
  EXPECT_NE(e.find("server-1.bin' has format version 1, an earlier conduit's without a checksum; allowed: a "
                   "checkpoint this version of conduit wrote"),
            std::string::npos)
      << e;
}

// Values no sound run writes, in files whose checksum holds: an infinite step time (it passed as >= 0 and made the
// modelled round times infinite) and a c_i that is not finite (it corrected every gradient of its client with nan).
TEST(Checkpoint, AnInfiniteStepTimeOrANonFiniteControlVariateIsRefused) {
  for (double step : {double(INFINITY), std::nan(""), -1.0}) {
    TempDir d;
    ServerCheckpoint s = small_server();
    s.step_s = step;
    write_server_checkpoint(d.path, s);
    const std::string e = error_of<ProtocolError>([&] { read_latest_checkpoint(d.path); });
    EXPECT_NE(e.find("server-1.bin' holds inconsistent fields"), std::string::npos) << e;
  }
  for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    TempDir d;
    write_host_checkpoint(d.path, 1, 1, {{2, {0.5f, bad}}}, 2);
    const std::string e =
        error_of<ProtocolError>([&] { read_host_checkpoints(d.path, 1, 2, 4, [](int) { return false; }); });
    EXPECT_NE(e.find("host-1-1.bin' holds a value that is not finite"), std::string::npos) << e;
    EXPECT_NE(e.find("float 1 of client 2's control variate"), std::string::npos) << e;
  }
}

}  // namespace
}  // namespace conduit::fl
