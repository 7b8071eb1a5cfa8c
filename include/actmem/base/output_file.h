// output_file.h — the files a command writes (JSON logs, traces, plots): checked against the
// inputs and each other by file identity, opened before any work starts, every write checked.
//
// Note [Outputs never destroy inputs]
// `--data d.txt --log-json d.txt` used to truncate the corpus before reading it. Paths are
// compared by what they name, not by their spelling: an existing file by (device, inode), so a
// symlink, a hard link or "./d.txt" are caught as well; a file that does not exist yet by its
// directory's identity plus its name. The commands open their outputs (creating or truncating
// them) only after this check, and before the first training step, so an unwritable path fails
// in a second instead of after the work is done.
//
// Note [Whole records or nothing]
// A write that fails half-way (a full file system) would leave half a JSON line that every
// reader chokes on. OutputFile::write() writes one record with as many write(2) calls as it
// takes and, when one fails, cuts a regular file back to the end of the last complete record
// before it throws; so the file always ends with a whole record. (Standard output and other
// non-seekable files cannot be cut back; the error still names the last complete record.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace actmem {

/// A path named by a flag, for error messages: {"--data", "d.txt"}.
struct NamedPath {
  std::string flag;
  std::string path;
};

/// Throws "actmem: --log-json 'x' names the same file as --data 'y'" when an output names the
/// same file as an input or another output (by identity, see Note [Outputs never destroy
/// inputs]). Empty paths and "-" (standard output) are skipped; two "-" outputs are refused.
void check_distinct_files(const std::vector<NamedPath>& inputs,
                          const std::vector<NamedPath>& outputs);

/// Writes all `size` bytes of `data` to `fd`, with as many write(2) calls as it takes (retrying
/// on EINTR). Returns 0, or the errno of the call that failed (ENOSPC when one wrote nothing);
/// `written`, when given, receives the bytes written before the failure.
int write_fully(int fd, const void* data, size_t size, size_t* written = nullptr);

/// A file opened for writing at construction (created or truncated; "-" is standard output).
/// Every write is checked; errors throw c10::Error naming the flag, the path and errno's text.
class OutputFile {
 public:
  OutputFile() = default;
  /// Opens `target.path` for writing; throws when it cannot be opened.
  explicit OutputFile(NamedPath target);
  ~OutputFile();
  OutputFile(OutputFile&& other) noexcept;
  OutputFile& operator=(OutputFile&& other) noexcept;
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  bool is_open() const { return fd_ >= 0; }
  bool is_stdout() const { return target_.path == "-"; }
  const std::string& path() const { return target_.path; }
  /// Appends `record` entirely, or cuts the file back to its previous end and throws (Note
  /// [Whole records or nothing]). `what` names the record in the error ("iteration 12").
  void write(std::string_view record, const std::string& what = "");
  /// Flushes to stable storage where that applies and closes; throws on failure. Idempotent.
  void close();
  /// Bytes of complete records written so far.
  int64_t bytes_written() const { return written_; }

 private:
  NamedPath target_;
  int fd_ = -1;
  bool seekable_ = false;
  int64_t written_ = 0;
  std::string last_record_;  // `what` of the last complete record, for error messages
};

}  // namespace actmem
