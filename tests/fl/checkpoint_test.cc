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
#include "fl/server_opt.h"

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
  EXPECT_NE(e.find("server-1.bin' has format version 1, an earlier conduit's without a checksum (or the file is "
                   "damaged); allowed: a "
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

// What a resume reads is checked whole before anything starts (conduit fl's parent, rank 0 under an outer launcher):
// the hosts' files too, which the ranks read only once started (a bad one stopped a host mid-start, after the server
// had opened the output's metrics.jsonl, so that a retry into it was refused), and the server optimizer's state.
TEST(Checkpoint, EverythingAResumeReadsIsCheckedBeforeAnythingStarts) {
  TempDir d;
  FlConfig c;
  c.scaffold = true;
  c.server_opt = "fedadam";
  c.server_lr = 0.01;
  c.rounds = 5;
  ServerCheckpoint s = small_server(2);
  s.config_json = config_to_json(c);
  s.control = {0.0f, 0.0f, 0.0f};
  auto opt = make_server_optimizer(server_opt_config(c), 3);
  s.optimizer = opt->save_state();
  s.host_files = 2;
  c.resume = d.path;
  auto write_all = [&](const std::vector<float>& host2, size_t width) {
    write_server_checkpoint(d.path, s);
    write_host_checkpoint(d.path, 1, 2, {{0, {0.1f, 0.2f, 0.3f}}}, 3);
    write_host_checkpoint(d.path, 2, 2, {{1, host2}}, width);
  };
  write_all({0.4f, 0.5f, 0.6f}, 3);
  EXPECT_EQ(check_resume_files(c).round, 2);
  write_all({0.4f, 0.5f, 0.6f, 0.7f}, 4);
  std::string e = error_of<ProtocolError>([&] { check_resume_files(c); });
  EXPECT_NE(e.find("host-2-2.bin' is of round 2, rank 2, 4 weights; expected round 2, rank 2, 3"), std::string::npos)
      << e;
  write_all({0.4f, std::nanf(""), 0.6f}, 3);
  e = error_of<ProtocolError>([&] { check_resume_files(c); });
  EXPECT_NE(e.find("host-2-2.bin' holds a value that is not finite (nan, float 1 of client 1's"), std::string::npos)
      << e;
  write_all({0.4f, 0.5f, 0.6f}, 3);
  flip(d.path + "/host-1-2.bin", 30);
  e = error_of<ProtocolError>([&] { check_resume_files(c); });
  EXPECT_NE(e.find("host-1-2.bin' fails its checksum"), std::string::npos) << e;
  // A second moment below 0 (FedAdam's v: the second of its two buffers, the last 3 floats of its state).
  write_all({0.4f, 0.5f, 0.6f}, 3);
  const float negative = -1.0f;
  std::memcpy(s.optimizer.data() + s.optimizer.size() - 4, &negative, 4);
  write_server_checkpoint(d.path, s);
  e = error_of<ProtocolError>([&] { check_resume_files(c); });
  EXPECT_NE(e.find("server-2.bin' holds a server optimizer state that is not one: fedadam: load_state: element 2 of "
                   "state buffer 1 is -1"),
            std::string::npos)
      << e;
}

}  // namespace
}  // namespace conduit::fl
