// `conduit fl --resume` end to end, through the binary: what a resume reads is refused before any process starts (by
// rank 0 before it writes anything under an outer launcher), and a refused start leaves the output folder free for the
// retry.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

// wrap: a shell command's start that the command completes, closed by a quote ("sh -c '... && exec ").
std::string run_cli(const std::string& args, int* rc, const std::string& wrap = "") {
  // (as a launcher: an outer launcher's variables would make it one rank)
  const std::string cmd = wrap + "env -u WORLD_SIZE -u RANK -u OMPI_COMM_WORLD_SIZE -u PMI_SIZE -u PMIX_SIZE " +
                          std::string(CONDUIT_BINARY) + " fl " + args + (wrap.empty() ? "" : "'") + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int st = pclose(p);
  *rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return out;
}

std::vector<char> bytes_of(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}
void write_bytes(const fs::path& path, const std::vector<char>& b) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(b.data(), std::streamsize(b.size()));
}

const std::string kFlags =
    "--model mlp --dataset synthetic --synthetic-samples 512 --clients 4 --fraction 0.5 --batch-size 16 --scaffold "
    "--secagg false --progress false ";

// A damaged host file was found by its host once the ranks had started: several lines, and the server had opened
// the new output's metrics.jsonl, so that the retry (the file restored) was refused as a used folder.
TEST(FlResumeProcess, ADamagedHostFileStopsTheCommandBeforeAnyProcessStartsAndTheRetryRuns) {
  const fs::path dir = fs::temp_directory_path() / ("conduit-fl-resume-host-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  int rc = 0;
  std::string o = run_cli(kFlags + "--rounds 2 --checkpoint-every 2 --output " + (dir / "a").string(), &rc);
  if (o.find("built without libtorch") != std::string::npos) GTEST_SKIP() << o;
  ASSERT_EQ(rc, 0) << o;
  const fs::path host = dir / "a" / "checkpoints" / "host-2-2.bin";
  ASSERT_TRUE(fs::exists(host));
  const std::vector<char> good = bytes_of(host);
  std::vector<char> bad = good;
  bad[17] = char(bad[17] ^ 1);  // (the round it says)
  write_bytes(host, bad);
  const std::string resume =
      kFlags + "--rounds 3 --resume " + (dir / "a").string() + " --output " + (dir / "b").string();
  o = run_cli(resume, &rc);
  EXPECT_EQ(rc, 2) << o;
  EXPECT_NE(o.find("host-2-2.bin' fails its checksum"), std::string::npos) << o;
  EXPECT_EQ(std::count(o.begin(), o.end(), '\n'), 1) << o;
  EXPECT_FALSE(fs::exists(dir / "b")) << "the refused start made its output folder";
  // Under an outer launcher rank 0 checks the same before it writes the output folder; every rank stops.
  const std::string launched = std::string(CONDUIT_BINARY) + " launch -n 3 -- " + CONDUIT_BINARY + " fl " + kFlags +
                               "--rounds 3 --resume " + (dir / "a").string() + " --output " + (dir / "c").string() +
                               " 2>&1";
  FILE* p = popen(launched.c_str(), "r");
  o.clear();
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) o.append(buf, n);
  const int st = pclose(p);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) != 0) << o;
  EXPECT_NE(o.find("host-2-2.bin' fails its checksum"), std::string::npos) << o;
  EXPECT_FALSE(fs::exists(dir / "c")) << "rank 0 wrote into the output folder of a refused start";
  write_bytes(host, good);
  o = run_cli(resume, &rc);
  EXPECT_EQ(rc, 0) << o;
  EXPECT_TRUE(fs::exists(dir / "b" / "summary.json")) << o;
  fs::remove_all(dir);
}

// A DP resume raises the ledger of the folder it resumed from: one it cannot write (a read-only copy) failed the run
// once the ranks had started, after the first round's release, leaving metrics.jsonl in the new output. It stops the
// command with one line before any process starts. (Read-only: a bind mount of its own for root, whom a mode does
// not bind; the mode 0555 otherwise.)
TEST(FlResumeProcess, ADpResumeFromAFolderItCannotWriteStopsBeforeAnyProcessStarts) {
  const fs::path dir = fs::temp_directory_path() / ("conduit-fl-resume-dp-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const std::string flags =
      "--model mlp --dataset synthetic --synthetic-samples 512 --clients 20 --fraction 0.5 --batch-size 32 "
      "--secagg false --dp-clip 1 --dp-noise 1 --progress false ";
  int rc = 0;
  std::string o = run_cli(flags + "--rounds 2 --checkpoint-every 2 --output " + (dir / "a").string(), &rc);
  if (o.find("built without libtorch") != std::string::npos) GTEST_SKIP() << o;
  ASSERT_EQ(rc, 0) << o;
  const fs::path ck = dir / "a" / "checkpoints";
  const std::string resume =
      flags + "--rounds 3 --resume " + (dir / "a").string() + " --output " + (dir / "b").string();
  if (::geteuid() == 0) {
    if (std::system("unshare -m true 2>/dev/null") != 0) GTEST_SKIP() << "a read-only mount needs unshare -m";
    o = run_cli(resume, &rc, "unshare -m sh -c 'mount --bind -o ro " + ck.string() + " " + ck.string() + " && exec ");
  } else {
    fs::permissions(ck, fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read | fs::perms::group_exec |
                            fs::perms::others_read | fs::perms::others_exec);
    o = run_cli(resume, &rc);
    fs::permissions(ck, fs::perms::owner_all, fs::perm_options::add);
  }
  EXPECT_EQ(rc, 2) << o;
  EXPECT_NE(o.find("fl: resume: cannot write in '" + ck.string() + "' ("), std::string::npos) << o;
  EXPECT_EQ(std::count(o.begin(), o.end(), '\n'), 1) << o;
  EXPECT_FALSE(fs::exists(dir / "b")) << "the refused start made its output folder";
  fs::remove_all(dir);
}

}  // namespace
