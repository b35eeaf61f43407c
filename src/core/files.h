#pragma once
// Writing output files whole: every layer that leaves a file for the user goes through here.
#include <string>

namespace conduit {

// Writes `text` to path.tmp and renames it into place: whole or failing with one line naming the path (a full disk
// never leaves a cut file in place of the old one).
void write_text_file(const std::string& path, const std::string& text);

}  // namespace conduit
