// tensorboard.h — TensorBoard event files written without TensorFlow: the records of
// tensorboard's RecordWriter (length, masked CRC-32C of it, data, masked CRC-32C of the data) and
// the Event / Summary protobuf messages a scalar needs, encoded by hand, as torch's SummaryWriter
// writes them (byte for byte: TensorBoard.ScalarRecordIsTorchSummaryWritersBytes).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace actmem {

/// CRC-32C (Castagnoli) of [data, data + n), and TFRecord's masked form of it.
uint32_t crc32c(const void* data, size_t n);
uint32_t masked_crc32c(const void* data, size_t n);

/// One record of an event file around `data` (a serialized Event).
std::string event_record(const std::string& data);
/// A serialized Event holding one scalar summary: wall_time, step, Summary{Value{tag,
/// simple_value}} (float, as TensorBoard keeps it).
std::string scalar_event(const std::string& tag, double value, int64_t step, double wall_time);

/// An event file in `dir` (created): events.out.tfevents.<seconds>.<host>.<pid>.<n>, opened with
/// the file_version event ("brain.Event:2"); scalars are appended and flushed every `queue`
/// events (Megatron's --tensorboard-queue-size) and at close.
class EventFileWriter {
 public:
  explicit EventFileWriter(const std::string& dir, int64_t queue = 1000);
  ~EventFileWriter();
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  void add_scalar(const std::string& tag, double value, int64_t step);
  void flush();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  int64_t queue_, pending_ = 0;
};

}  // namespace actmem
