#pragma once
// One YAML document from an input file the user named (config files, hosts files, sweep specs).
#include <fmt/format.h>
#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "core/files.h"

namespace conduit {

// read_input_file's refusals, then ConfigError naming `what` and the path when the text is not valid YAML (with its
// line and column) or holds several documents (a second one after `---` was never read); an empty file, or one of
// comments, is a null node, and an empty document (a trailing `---`) is none.
inline YAML::Node load_yaml_file(const std::string& path, const std::string& what, const std::string& allowed) {
  const std::string text = read_input_file(path, what, allowed);
  std::vector<YAML::Node> docs;
  try {
    docs = YAML::LoadAll(text);
  } catch (const YAML::DeepRecursion& e) {  // (its message says "bad file")
    throw ConfigError(fmt::format("{}: '{}' nests values more than {} levels deep (line {}, column {}); allowed: {}",
                                  what, path, e.depth() - 1, e.mark.line + 1, e.mark.column + 1, allowed));
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format(
        "{}: '{}' is not valid YAML{}: {}; allowed: {}", what, path,
        e.mark.is_null() ? std::string() : fmt::format(" (line {}, column {})", e.mark.line + 1, e.mark.column + 1),
        e.msg, allowed));
  }
  std::vector<YAML::Node> given;
  for (const auto& d : docs)
    if (!d.IsNull()) given.push_back(d);
  if (given.size() > 1)
    throw ConfigError(
        fmt::format("{}: '{}' holds {} YAML documents; allowed: one ({})", what, path, given.size(), allowed));
  return given.empty() ? YAML::Node() : given[0];
}

}  // namespace conduit
