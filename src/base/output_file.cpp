// output_file.cpp — check_distinct_files and OutputFile (POSIX file descriptors, so that every
// write, flush and close reports its own error).
#include "actmem/base/output_file.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <optional>
#include <utility>

namespace actmem {

namespace {

struct Identity {
  dev_t dev = 0;
  ino_t ino = 0;
  std::string name;  // empty for an existing file; the file name inside directory (dev, ino)
  bool operator==(const Identity& o) const {
    return dev == o.dev && ino == o.ino && name == o.name;
  }
};

// What `path` names (Note [Outputs never destroy inputs]); nullopt when neither the file nor
// its directory exists (opening it fails later with its own message).
std::optional<Identity> identity_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) return Identity{st.st_dev, st.st_ino, {}};
  const std::filesystem::path p(path);
  const std::filesystem::path dir = p.has_parent_path() ? p.parent_path() : ".";
  if (::stat(dir.c_str(), &st) != 0) return std::nullopt;
  return Identity{st.st_dev, st.st_ino, p.filename().string()};
}

std::string errno_text(int err) {
  return std::strerror(err);
}

}  // namespace

void check_distinct_files(const std::vector<NamedPath>& inputs,
                          const std::vector<NamedPath>& outputs) {
  std::vector<std::pair<const NamedPath*, Identity>> seen;
  for (const auto& in : inputs) {
    if (in.path.empty() || in.path == "-") continue;
    if (auto id = identity_of(in.path)) seen.emplace_back(&in, *id);
  }
  const NamedPath* stdout_output = nullptr;
  for (const auto& out : outputs) {
    if (out.path.empty()) continue;
    if (out.path == "-") {
      TORCH_CHECK(stdout_output == nullptr, "actmem: ", out.flag, " and ", stdout_output->flag,
                  " both write to standard output ('-'); give one of them a file");
      stdout_output = &out;
      continue;
    }
    const auto id = identity_of(out.path);
    if (!id) continue;
    for (const auto& [named, other] : seen) {
      TORCH_CHECK(!(other == *id), "actmem: ", out.flag, " '", out.path,
                  "' names the same file as ", named->flag, " '", named->path,
                  "'; writing it would destroy ",
                  named->flag == "--data" ? "the input"
                                          : "the "
                                            "other output",
                  ": give ", out.flag, " another path");
    }
    seen.emplace_back(&out, *id);
  }
}

OutputFile::OutputFile(NamedPath target) : target_(std::move(target)) {
  if (is_stdout()) {
    std::cout.flush();  // what the program printed before stays before our records
    fd_ = STDOUT_FILENO;
    return;
  }
  fd_ = ::open(target_.path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, "actmem: cannot write ", target_.flag, " '", target_.path,
              "': ", errno_text(errno));
  struct stat st {};
  seekable_ = ::fstat(fd_, &st) == 0 && S_ISREG(st.st_mode);
}

OutputFile::~OutputFile() {
  if (fd_ >= 0 && !is_stdout()) ::close(fd_);
}

OutputFile::OutputFile(OutputFile&& other) noexcept
    : target_(std::move(other.target_)),
      fd_(std::exchange(other.fd_, -1)),
      seekable_(other.seekable_),
      written_(other.written_),
      last_record_(std::move(other.last_record_)) {}

OutputFile& OutputFile::operator=(OutputFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0 && !is_stdout()) ::close(fd_);
    target_ = std::move(other.target_);
    fd_ = std::exchange(other.fd_, -1);
    seekable_ = other.seekable_;
    written_ = other.written_;
    last_record_ = std::move(other.last_record_);
  }
  return *this;
}

int write_fully(int fd, const void* data, size_t size, size_t* written) {
  const char* p = static_cast<const char*>(data);
  size_t done = 0;
  int err = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, p + done, size - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (!(n < 0 && errno == EINTR)) {
      err = n < 0 ? errno : ENOSPC;
      break;
    }
  }
  if (written != nullptr) *written = done;
  return err;
}

void OutputFile::write(std::string_view record, const std::string& what) {
  TORCH_CHECK(fd_ >= 0, "actmem::OutputFile::write: ", target_.flag, " '", target_.path,
              "' is not open");
  size_t done = 0;
  if (const int err = write_fully(fd_, record.data(), record.size(), &done)) {
    // Note [Whole records or nothing]: drop the partial record.
    const bool cut = done > 0 && seekable_ && ::ftruncate(fd_, written_) == 0 &&
                     ::lseek(fd_, written_, SEEK_SET) == written_;
    std::string held =
        last_record_.empty() ? std::string("no complete record") : "records up to " + last_record_;
    if (done > 0 && !cut) held += " and part of the next";
    TORCH_CHECK(false, "actmem: writing ", target_.flag, " '", target_.path, "' failed",
                what.empty() ? std::string() : " at " + what, ": ", errno_text(err),
                "; the file holds ", held);
  }
  written_ += static_cast<int64_t>(record.size());
  if (!what.empty()) last_record_ = what;
}

void OutputFile::close() {
  if (fd_ < 0) return;
  const int fd = std::exchange(fd_, -1);
  if (fd == STDOUT_FILENO) {
    // Standard output: make sure it reached its destination (a full disk behind a redirect).
    TORCH_CHECK(::fsync(fd) == 0 || errno == EINVAL || errno == EROFS, "actmem: writing ",
                target_.flag, " to standard output failed: ", errno_text(errno));
    return;
  }
  const bool synced = !seekable_ || ::fsync(fd) == 0;
  const int sync_err = errno;
  const bool closed = ::close(fd) == 0;
  const int close_err = errno;
  TORCH_CHECK(synced && closed, "actmem: writing ", target_.flag, " '", target_.path,
              "' failed when closing it: ", errno_text(synced ? close_err : sync_err));
}

}  // namespace actmem
