// Loads libconduit-torch.so on first use: see torch/plugin.h.
#ifdef CONDUIT_WITH_TORCH
#include "cli/torch_plugin.h"

#include <dlfcn.h>
#include <fmt/format.h>

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
    if (!a || a->abi != train::kTorchApiAbi) {
      failure = fmt::format("{} is from another conduit build (interface {}, this binary needs {}): rebuild", path,
                            a ? a->abi : 0, train::kTorchApiAbi);
      return;
    }
    api = a;
  });
  if (!api) throw Error(failure);
  return *api;
}

}  // namespace conduit::cli
#endif
