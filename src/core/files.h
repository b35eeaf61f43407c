#pragma once
// Writing output files whole: every layer that leaves a file for the user goes through here.
#include <string>

namespace conduit {

// Writes `text` to path.tmp and renames it into place: whole or failing with one line naming the path (a full disk
// never leaves a cut file in place of the old one).
void write_text_file(const std::string& path, const std::string& text);

// fsync(2) of one file or directory (a directory's entries: a rename or a new file in it), so that it survives a
// power loss or a kernel crash, not only a killed process. Error naming the path when it cannot be synced.
void sync_path(const std::string& path);
// sync_path of every file and directory under `dir`, and of `dir` itself (the files first).
void sync_tree(const std::string& dir);

}  // namespace conduit
