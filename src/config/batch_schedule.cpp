// batch_schedule.cpp — constant and stepped global batch sizes (batch_schedule.h).
#include "actmem/config/batch_schedule.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <sstream>

namespace actmem {

namespace {
constexpr const char* kApi = "actmem: --step-batch-size-schedule";
constexpr int64_t kMaxValue = int64_t{1} << 62;  // room to add batches without overflow

// Python's float() of a decimal number: [+-] digits [. digits] [e [+-] digits] (inf, nan,
// hexadecimal and underscores, which float() also reads, are refused here).
bool decimal_number(const std::string& s) {
  size_t i = 0;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
  size_t digits = 0;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i, ++digits;
  if (i < s.size() && s[i] == '.') {
    ++i;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i, ++digits;
  }
  if (digits == 0) return false;
  if (i < s.size() && s[i] == 'E') {
    ++i;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
    size_t exponent = 0;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i, ++exponent;
    if (exponent == 0) return false;
  }
  return i == s.size();
}

// StepBatchsizeNumMicroBatchesCalculator._parse_numeric_value: strip, upper-case, a K/M/B/T
// suffix, int(float(rest) * multiplier) (truncated toward zero).
int64_t parse_number(std::string text, const std::string& entry, const char* what) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  text.erase(0, std::min(text.size(), text.find_first_not_of(" \t\n\v\f\r")));
  for (char& c : text) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double multiplier = 1.0;
  if (!text.empty()) {
    switch (text.back()) {
      case 'T':
        multiplier = 1e12;
        break;
      case 'B':
        multiplier = 1e9;
        break;
      case 'M':
        multiplier = 1e6;
        break;
      case 'K':
        multiplier = 1e3;
        break;
      default:
        break;
    }
    if (multiplier != 1.0) text.pop_back();
  }
  TORCH_CHECK(decimal_number(text), kApi, ": the ", what, " of entry \"", entry,
              "\" is not a number (expected digits with an optional decimal point and exponent, "
              "then an optional K, M, B or T)");
  const double value = std::trunc(std::strtod(text.c_str(), nullptr) * multiplier);
  TORCH_CHECK(std::isfinite(value) && std::fabs(value) <= static_cast<double>(kMaxValue), kApi,
              ": the ", what, " of entry \"", entry, "\" is out of range (at most 2^62)");
  return static_cast<int64_t>(value);
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}
}  // namespace

GlobalBatchSchedule::GlobalBatchSchedule(int64_t batch_size) {
  TORCH_CHECK(batch_size > 0,
              "actmem::GlobalBatchSchedule: the global batch size must be positive, got ",
              batch_size);
  entries_.push_back({0, batch_size});
}

GlobalBatchSchedule GlobalBatchSchedule::parse(const std::string& text, int64_t seq_length) {
  TORCH_CHECK(seq_length > 0,
              "actmem::GlobalBatchSchedule::parse: seq_length must be positive, got ", seq_length);
  // _parse_schedule: commas are spaces; the entries are the words.
  std::string words = text;
  std::replace(words.begin(), words.end(), ',', ' ');
  std::istringstream in(words);
  GlobalBatchSchedule s;
  s.stepped_ = true;
  std::string entry;
  while (in >> entry) {
    const size_t colon = entry.find(':');
    TORCH_CHECK(colon != std::string::npos, kApi, ": invalid schedule entry \"", entry,
                "\"; expected THRESHOLD:BATCH_SIZE (Megatron's format, thresholds in tokens)");
    const int64_t tokens = parse_number(entry.substr(0, colon), entry, "threshold");
    const int64_t batch = parse_number(entry.substr(colon + 1), entry, "batch size");
    TORCH_CHECK(tokens >= 0, kApi, ": the threshold of entry \"", entry,
                "\" is negative; thresholds count the tokens consumed, from 0");
    TORCH_CHECK(batch > 0, kApi, ": batch size must be positive, got ", batch, " in entry \"",
                entry, "\"");
    s.entries_.push_back({tokens / seq_length, batch});
  }
  TORCH_CHECK(!s.entries_.empty(), kApi,
              ": the schedule must have at least one entry, e.g. \"0:256 250B:512\" (a batch "
              "size from each threshold in tokens)");
  std::stable_sort(s.entries_.begin(), s.entries_.end(),
                   [](const Entry& a, const Entry& b) { return a.from_sample < b.from_sample; });
  // _validate_schedule.
  TORCH_CHECK(s.entries_[0].from_sample == 0, kApi,
              ": the first schedule entry must have threshold 0, got ", s.entries_[0].from_sample,
              " samples (thresholds are tokens divided by --seq-length ", seq_length, ")");
  for (size_t i = 1; i < s.entries_.size(); ++i) {
    const Entry &prev = s.entries_[i - 1], &cur = s.entries_[i];
    TORCH_CHECK(cur.from_sample > prev.from_sample, kApi,
                ": schedule thresholds must be strictly increasing, got ", prev.from_sample,
                " before ", cur.from_sample,
                " samples (thresholds are tokens divided by --seq-length ", seq_length,
                ", rounded down)");
    // Megatron's train loop asserts "Number of microbatches should not decrease" when it gets
    // there; refused before the run instead.
    TORCH_CHECK(cur.batch_size >= prev.batch_size, kApi, ": the batch size decreases from ",
                prev.batch_size, " to ", cur.batch_size, " at sample ", cur.from_sample,
                "; Megatron's training loop asserts the number of micro-batches never decreases");
  }
  return s;
}

size_t GlobalBatchSchedule::entry_at(int64_t consumed_samples) const {
  const auto next = std::upper_bound(entries_.begin(), entries_.end(), consumed_samples,
                                     [](int64_t c, const Entry& e) { return c < e.from_sample; });
  return static_cast<size_t>(std::max<std::ptrdiff_t>(next - entries_.begin() - 1, 0));
}

int64_t GlobalBatchSchedule::at(int64_t consumed_samples) const {
  return entries_[entry_at(consumed_samples)].batch_size;
}

int64_t GlobalBatchSchedule::largest() const {
  int64_t most = 0;
  for (const Entry& e : entries_) most = std::max(most, e.batch_size);
  return most;
}

int64_t GlobalBatchSchedule::samples_after(int64_t steps, int64_t from_samples) const {
  TORCH_CHECK(steps >= 0 && from_samples >= 0,
              "actmem::GlobalBatchSchedule::samples_after: expected non-negative steps and "
              "samples, got ",
              steps, " and ", from_samples);
  int64_t consumed = from_samples;
  while (steps > 0) {
    const size_t i = entry_at(consumed);
    const int64_t batch = entries_[i].batch_size;
    // The steps at this size: all that are left, or those until the next threshold is reached.
    int64_t k = steps;
    if (i + 1 < entries_.size()) {
      k = std::min(k, ceil_div(entries_[i + 1].from_sample - consumed, batch));
    }
    TORCH_CHECK(k <= (kMaxValue - consumed) / batch, "actmem: ", steps, " steps of ", batch,
                " samples from sample ", consumed, " overflow the sample count");
    consumed += k * batch;
    steps -= k;
  }
  return consumed;
}

int64_t GlobalBatchSchedule::iterations_for(int64_t train_samples) const {
  TORCH_CHECK(train_samples > 0, "actmem: --train-samples must be positive, got ", train_samples);
  if (!stepped_) return train_samples / entries_[0].batch_size;
  // update_train_iters: while consumed < train_samples, one more step at the size then in effect.
  int64_t consumed = 0, iterations = 0;
  while (consumed < train_samples) {
    const size_t i = entry_at(consumed);
    const int64_t batch = entries_[i].batch_size;
    const int64_t until = i + 1 < entries_.size()
                              ? std::min(train_samples, entries_[i + 1].from_sample)
                              : train_samples;
    const int64_t k = ceil_div(until - consumed, batch);
    consumed += k * batch;
    iterations += k;
  }
  return iterations;
}

std::vector<int64_t> GlobalBatchSchedule::sizes_used(int64_t steps, int64_t from_samples) const {
  std::vector<int64_t> sizes;
  int64_t consumed = from_samples;
  while (steps > 0) {
    const size_t i = entry_at(consumed);
    const int64_t batch = entries_[i].batch_size;
    if (sizes.empty() || sizes.back() != batch) sizes.push_back(batch);
    int64_t k = steps;
    if (i + 1 < entries_.size()) {
      k = std::min(k, ceil_div(entries_[i + 1].from_sample - consumed, batch));
    }
    consumed = samples_after(k, consumed);
    steps -= k;
  }
  return sizes;
}

}  // namespace actmem
