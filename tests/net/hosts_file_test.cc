// `conduit cluster up --hosts-file` beside the link flags (cli/cluster.h's load_hosts_file), without root.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "cli/cluster.h"
#include "core/error.h"

namespace {

namespace cl = conduit::cli::cluster;
namespace fs = std::filesystem;

struct HostsFile {
  fs::path path;
  explicit HostsFile(const std::string& text)
      : path(fs::temp_directory_path() / ("hosts-file-test-" + std::to_string(getpid()) + ".yaml")) {
    std::ofstream(path) << text;
  }
  ~HostsFile() { fs::remove(path); }
};

// The error load_hosts_file gives, or "" when it takes the file.
std::string error_of(const std::string& text, const cl::LinkSpec& base, const cl::LinkGiven& given) {
  HostsFile f(text);
  try {
    cl::load_hosts_file(f.path.string(), 0, base, given);
  } catch (const conduit::ConfigError& e) {
    return e.what();
  }
  return "";
}

// A flag only fills in what the file leaves out: one that every host sets itself applied to none, without a word
// (--bandwidth 10mbit beside hosts that all set theirs gave their rates); refused, in one line naming it. One that
// some host takes is a value as before.
TEST(HostsFile, AFlagThatNoHostTakesIsRefused) {
  cl::LinkSpec base;
  base.rate_bps = 10e6;
  cl::LinkGiven bw;
  bw.bandwidth = "--bandwidth";
  const std::string every = "hosts:\n  - {bandwidth: 1gbit}\n  - {rate: 100mbit}\n";
  const std::string e = error_of(every, base, bw);
  EXPECT_NE(e.find("--bandwidth applies to no host: every host in --hosts-file "), std::string::npos) << e;
  EXPECT_NE(e.find("sets its own bandwidth; allowed: leave --bandwidth out"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  // The same for latency and loss, an explicit 0 included.
  cl::LinkGiven lat;
  lat.latency = "--latency";
  const std::string l =
      error_of("hosts:\n  - {bandwidth: 1gbit, latency: 2ms}\n  - {bandwidth: 1gbit, delay: 0}\n", cl::LinkSpec{}, lat);
  EXPECT_NE(l.find("--latency applies to no host"), std::string::npos) << l;
  cl::LinkGiven loss;
  loss.loss = "--loss";
  const std::string p = error_of("defaults: {bandwidth: 1gbit}\nhosts:\n  - {loss: 1%}\n", cl::LinkSpec{}, loss);
  EXPECT_NE(p.find("--loss applies to no host"), std::string::npos) << p;
  // Taken by one host (an empty entry, or one that leaves it out), or with no hosts list: no error.
  EXPECT_EQ(error_of("hosts:\n  - {bandwidth: 1gbit}\n  - {}\n", base, bw), "");
  EXPECT_EQ(error_of("hosts:\n  - {bandwidth: 1gbit}\n  - ~\n", base, bw), "");
  EXPECT_EQ(error_of("hosts:\n  - {bandwidth: 1gbit}\n  - {latency: 1ms}\n", base, bw), "");
  HostsFile none("defaults: {latency: 1ms}\n");
  EXPECT_EQ(cl::load_hosts_file(none.path.string(), 3, base, bw).size(), 3u);
  // Not given: hosts that all set a value are the file's business.
  EXPECT_EQ(error_of(every, base, cl::LinkGiven{}), "");
}

}  // namespace
