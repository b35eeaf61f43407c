#include "core/malloc_tuning.h"

#include <malloc.h>

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/error.h"

namespace conduit {

MallocTuning tune_malloc(const std::function<const char*(const char*)>& getenv) {
  MallocTuning t;
  if (const char* v = getenv("CONDUIT_MALLOC_TUNING"); v != nullptr && *v != '\0') {  // empty: unset, as elsewhere
    std::string s = v;
    for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));  // as env_flag reads
    if (s == "0" || s == "false" || s == "no" || s == "off") {
      t.reason = "CONDUIT_MALLOC_TUNING=" + s;
      return t;
    }
    // (as given, in env_flag's words: 'maybe' for Maybe named a value nobody typed)
    if (s != "1" && s != "true" && s != "yes" && s != "on")
      throw ConfigError(std::string("environment variable CONDUIT_MALLOC_TUNING='") + v +
                        "' is invalid: expected 1/0, true/false, yes/no or on/off");
  }
  if (const char* v = getenv("GLIBC_TUNABLES"); v != nullptr && std::strstr(v, "glibc.malloc.") != nullptr) {
    t.reason = "GLIBC_TUNABLES sets glibc.malloc parameters";
    return t;
  }
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"})
    if (getenv(name) != nullptr) {
      t.reason = std::string(name) + " is set";
      return t;
    }
  // Setting either parameter turns off glibc's dynamic adjustment of both, so both are set.
  if (::mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMallocMmapThreshold)) != 1 ||
      ::mallopt(M_TRIM_THRESHOLD, static_cast<int>(kMallocTrimThreshold)) != 1) {
    t.reason = "mallopt refused the thresholds";
    return t;
  }
  t.applied = true;
  t.mmap_threshold = kMallocMmapThreshold;
  t.trim_threshold = kMallocTrimThreshold;
  return t;
}

MallocTuning tune_malloc() {
  return tune_malloc([](const char* name) { return std::getenv(name); });
}

}  // namespace conduit
