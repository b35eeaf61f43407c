// Loads libconduit-torch.so on first use: see torch/plugin.h.
#ifdef CONDUIT_WITH_TORCH
#include "cli/torch_plugin.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <mutex>

#include "core/error.h"

namespace conduit::cli {

const train::TorchApi& torch_api() {
  static std::once_flag once;
  static const train::TorchApi* api = nullptr;
  static std::string failure;
  std::call_once(once, [] {
    std::error_code ec;
    auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (ec) {
      failure = fmt::format("cannot find this binary's folder (/proc/self/exe: {}) to load {}", ec.message(),
                            train::kTorchModuleName);
      return;
    }
    const std::string path = (exe.parent_path() / train::kTorchModuleName).string();
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      failure = fmt::format("this command needs libtorch, which conduit loads from {} beside its binary: {}",
                            train::kTorchModuleName, e ? e : "dlopen failed");
      return;
    }
    using Entry = const train::TorchApi* (*)();
    auto entry = reinterpret_cast<Entry>(dlsym(h, train::kTorchApiSymbol));
    if (!entry) {
      failure = fmt::format("{} has no {} (not a conduit torch module)", path, train::kTorchApiSymbol);
      return;
    }
    const train::TorchApi* a = entry();
    // The abi number first: only a table of this layout has a token and sizes where this binary looks for them.
    const bool same_abi = a != nullptr && a->abi == train::kTorchApiAbi;
    const char* token = same_abi && a->token != nullptr ? a->token : "?";
    if (!same_abi || a->token == nullptr || std::strcmp(a->token, CONDUIT_TORCH_API_TOKEN) != 0 ||
        a->config_size != sizeof(train::TrainConfig) || a->result_size != sizeof(train::TrainResult)) {
      failure = fmt::format(
          "{} is from another conduit build (interface {} {}, this binary's {} {}): install the "
          "module built with this binary beside it",
          path, a ? a->abi : 0, token, train::kTorchApiAbi, CONDUIT_TORCH_API_TOKEN);
      return;
    }
    api = a;
  });
  if (!api) throw Error(failure);
  return *api;
}

}  // namespace conduit::cli
#endif
