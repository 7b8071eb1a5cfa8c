// fuzz_util.h — what the fuzz targets share: a scratch directory of the process's own for the
// files an input becomes, writing them, silencing libtorch's warnings, and reading memory from
// instrumented code (libtorch is not built with AddressSanitizer, so a read beyond an allocation
// that only libtorch's kernels make would go unseen).
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include <unistd.h>

namespace actmem::fuzz {

/// A directory for this process's files, on tmpfs where there is one; removed at exit.
class ScratchDir {
 public:
  ScratchDir() {
    const std::filesystem::path base = std::filesystem::is_directory("/dev/shm")
                                           ? std::filesystem::path("/dev/shm")
                                           : std::filesystem::temp_directory_path();
    path_ = (base / ("actmem-fuzz-" + std::to_string(::getpid()))).string();
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

inline const std::string& scratch_dir() {
  static const ScratchDir dir;
  return dir.path();
}

inline std::string scratch(const std::string& name) {
  return scratch_dir() + "/" + name;
}

/// Writes [data, data + size) to `path`, replacing it.
inline void write_file(const std::string& path, const uint8_t* data, size_t size) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
}

/// Reads every byte of [p, p + n) in instrumented code.
inline uint8_t touch(const void* p, size_t n) {
  const volatile uint8_t* b = static_cast<const volatile uint8_t*>(p);
  uint8_t x = 0;
  for (size_t i = 0; i < n; ++i) x ^= b[i];
  return x;
}

/// TORCH_WARN goes nowhere (a damaged cache entry warns on every input).
class SilentWarnings final : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override {}
};
inline void silence_warnings() {
  static SilentWarnings silent;
  c10::WarningUtils::set_warning_handler(&silent);
}

}  // namespace actmem::fuzz
