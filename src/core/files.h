#pragma once
// Reading the user's input files, and writing output files whole: every layer that leaves a file for the user goes
// through here.
#include <cstdint>
#include <string>

namespace conduit {

// The whole text of an input file the user named (`what`: the flag or key that named it, as errors say it;
// `allowed`: what it should be, "a YAML file"). ConfigError with one line when the path is missing or unreadable, a
// directory, not a regular file (a FIFO would block for ever, /dev/zero fill memory), or over 1 GiB.
std::string read_input_file(const std::string& path, const std::string& what, const std::string& allowed);

// create_directories of an output directory the user named (`what`: the flag or key), as ConfigError with one line
// naming it when it cannot be made (a regular file on its path: "not a directory"; no permission).
void make_output_dir(const std::string& path, const std::string& what);

// Writes `text` to a temporary file beside `path`, syncs it (fsync), renames it into place and syncs the directory:
// whole or failing with one line naming the path (a full disk never leaves a cut file in place of the old one), and
// once it returns, on disk, surviving a power loss or a kernel crash (two fsyncs a file: for files written now and
// then, not a stream of records).
void write_text_file(const std::string& path, const std::string& text);

// fsync(2) of one file or directory (a directory's entries: a rename or a new file in it), so that it survives a
// power loss or a kernel crash, not only a killed process. Error naming the path when it cannot be synced.
void sync_path(const std::string& path);
// sync_path of every file and directory under `dir`, and of `dir` itself (the files first).
void sync_tree(const std::string& dir);

// Raises this process's soft limit on open files (RLIMIT_NOFILE) to `want`, at most its hard limit and as far as the
// kernel allows (fs.nr_open), and returns the soft limit then in force (unchanged where it cannot be raised, or is
// already at least `want`). For a server of many connections: the rendezvous store of a large job ran out of
// descriptors at the default 1024. Only as far as wanted: the processes it starts inherit it, and a hard limit of
// 1e9 made anything that closes every descriptor up to the limit crawl. (`conduit launch` raises it as far as its
// workers need, and gives them the limit they had: see ensure_file_limit there.)
uint64_t raise_open_file_limit(uint64_t want);

}  // namespace conduit
