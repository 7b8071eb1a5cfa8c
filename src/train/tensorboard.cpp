// tensorboard.cpp — EventFileWriter (tensorboard.h).
#include "actmem/train/tensorboard.h"

#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include <unistd.h>

namespace actmem {

namespace {
std::array<uint32_t, 256> crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k)
      c = (c >> 1) ^ ((c & 1u) ? 0x82F63B78u : 0u);  // reflected 0x1EDC6F41
    t[i] = c;
  }
  return t;
}

// Protocol buffers' wire format, the four pieces an Event with a scalar needs.
void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void key(std::string& out, int field, int wire) {
  varint(out, static_cast<uint64_t>(field << 3 | wire));
}
void bytes_field(std::string& out, int field, const std::string& payload) {
  key(out, field, 2);
  varint(out, payload.size());
  out += payload;
}
template <typename T>
void fixed(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // little-endian on every platform actmem builds for
  out.append(b, sizeof(T));
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string file_version_event(double wall_time) {
  // Event{wall_time = 1, file_version = 3, source_metadata = 10 {writer = 1}}, as
  // tensorboard's EventFileWriter opens every file.
  std::string e;
  key(e, 1, 1);
  fixed(e, wall_time);
  bytes_field(e, 3, "brain.Event:2");
  std::string source;
  bytes_field(source, 1, "actmem");
  bytes_field(e, 10, source);
  return e;
}
}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  static const std::array<uint32_t, 256> table = crc_table();
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  // TFRecord's mask (tensorboard's pywrap_tensorflow.masked_crc32c): rotate right by 15, add.
  const uint32_t x = crc32c(data, n);
  return ((x >> 15) | (x << 17)) + 0xA282EAD8u;
}

std::string event_record(const std::string& data) {
  std::string r;
  const uint64_t length = data.size();
  fixed(r, length);
  fixed(r, masked_crc32c(r.data(), 8));
  r += data;
  fixed(r, masked_crc32c(data.data(), data.size()));
  return r;
}

std::string scalar_event(const std::string& tag, double value, int64_t step, double wall_time) {
  // Summary.Value{tag = 1, simple_value = 2 (float)}; Summary{value = 1};
  // Event{wall_time = 1, step = 2, summary = 5}, fields in number order as protobuf writes them.
  std::string v;
  bytes_field(v, 1, tag);
  key(v, 2, 5);
  fixed(v, static_cast<float>(value));
  std::string summary;
  bytes_field(summary, 1, v);
  std::string e;
  key(e, 1, 1);
  fixed(e, wall_time);
  key(e, 2, 0);
  varint(e, static_cast<uint64_t>(step));
  bytes_field(e, 5, summary);
  return e;
}

EventFileWriter::EventFileWriter(const std::string& dir, int64_t queue) : queue_(queue) {
  TORCH_CHECK(queue >= 1, "actmem: --tensorboard-queue-size must be positive, got ", queue);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TORCH_CHECK(!ec, "actmem: cannot create --tensorboard-dir ", dir, ": ", ec.message());
  static std::atomic<int> uid{0};
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  const double t = now_seconds();
  char name[512];
  std::snprintf(name, sizeof(name), "events.out.tfevents.%010lld.%s.%d.%d",
                static_cast<long long>(t), host, static_cast<int>(::getpid()), uid++);
  path_ = (std::filesystem::path(dir) / name).string();
  file_ = std::fopen(path_.c_str(), "wb");
  TORCH_CHECK(file_ != nullptr, "actmem: cannot write the TensorBoard event file ", path_, ": ",
              std::strerror(errno));
  const std::string first = event_record(file_version_event(t));
  std::fwrite(first.data(), 1, first.size(), file_);
  flush();
}

EventFileWriter::~EventFileWriter() {
  if (file_ != nullptr) {
    std::fflush(file_);
    std::fclose(file_);
  }
}

void EventFileWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  const std::string r = event_record(scalar_event(tag, value, step, now_seconds()));
  TORCH_CHECK(std::fwrite(r.data(), 1, r.size(), file_) == r.size(),
              "actmem: cannot write the TensorBoard event file ", path_, ": ",
              std::strerror(errno));
  if (++pending_ >= queue_) flush();
}

void EventFileWriter::flush() {
  TORCH_CHECK(std::fflush(file_) == 0, "actmem: cannot write the TensorBoard event file ", path_,
              ": ", std::strerror(errno));
  pending_ = 0;
}

}  // namespace actmem
