// report.cpp — formatting of bytes, medians and the offload summary.
#include "actmem/base/report.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <ostream>
#include <sstream>

namespace actmem {

void print_offload_summary(std::ostream& os, const std::vector<OffloadSummaryRank>& ranks) {
  // Megatron's post-warmup table: MiB offloaded per rank and group name, and each rank's total.
  std::vector<std::string> names;
  size_t label_width = 6;
  for (const auto& rank : ranks) {
    label_width = std::max(label_width, rank.label.size() + 2);
    for (const auto& r : rank.rows) {
      if (std::find(names.begin(), names.end(), r.name) == names.end()) names.push_back(r.name);
    }
  }
  int width = 12;
  for (const auto& n : names) width = std::max(width, static_cast<int>(n.size()) + 2);
  const int lw = static_cast<int>(label_width);
  const int total_width = lw + width * static_cast<int>(names.size() + 1);
  const std::string title = "Activation Offload Summary (MB)";
  os << std::string(total_width, '=') << "\n"
     << std::string(std::max(0, (total_width - static_cast<int>(title.size())) / 2), ' ') << title
     << "\n"
     << std::string(total_width, '=') << "\n"
     << std::setw(lw) << std::left << "Rank" << std::right;
  for (const auto& n : names) os << std::setw(width) << n;
  os << std::setw(width) << "Total"
     << "\n"
     << std::string(total_width, '-') << "\n";
  os << std::fixed << std::setprecision(2);
  for (const auto& rank : ranks) {
    os << std::setw(lw) << std::left << rank.label << std::right;
    double total = 0;
    for (const auto& n : names) {
      const auto it = std::find_if(rank.rows.begin(), rank.rows.end(),
                                   [&](const OffloadSummaryRow& r) { return r.name == n; });
      const double bytes = it == rank.rows.end() ? 0.0 : static_cast<double>(it->bytes);
      os << std::setw(width) << bytes / 1048576.0;
      total += bytes;
    }
    os << std::setw(width) << total / 1048576.0 << "\n";
  }
  os << std::string(total_width, '=') << "\n";
}

double quantile(std::vector<double> v, double q) {
  TORCH_CHECK(!v.empty(), "actmem::quantile: empty sample");
  TORCH_CHECK(q >= 0.0 && q <= 1.0, "actmem::quantile: q must be in [0, 1], got ", q);
  std::sort(v.begin(), v.end());
  const double at = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<size_t>(std::floor(at));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (at - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

double median(std::vector<double> v) {
  TORCH_CHECK(!v.empty(), "actmem::median: empty sample");
  return quantile(std::move(v), 0.5);
}

double median_standard_error(const std::vector<double>& values) {
  if (values.size() < 3) return std::numeric_limits<double>::infinity();
  const double iqr = quantile(values, 0.75) - quantile(values, 0.25);
  // sqrt(pi / 2) = 1.2533: the median's efficiency relative to the mean of normal draws;
  // 1.349: a normal distribution's IQR in standard deviations.
  return 1.2533141373155 * (iqr / 1.3489795003921) / std::sqrt(static_cast<double>(values.size()));
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto total = static_cast<int64_t>(std::llround(seconds));
  const int64_t h = total / 3600, m = (total / 60) % 60, s = total % 60;
  std::ostringstream os;
  os << std::setfill('0');
  if (h > 0) {
    os << h << "h" << std::setw(2) << m << "m";
  } else if (m > 0) {
    os << m << "m" << std::setw(2) << s << "s";
  } else {
    os << s << "s";
  }
  return os.str();
}

std::string format_bytes(double bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  double v = bytes;
  while (std::fabs(v) >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  std::ostringstream os;
  os << std::fixed << std::setprecision(u == 0 ? 0 : (std::fabs(v) < 10 ? 2 : 1)) << v << ' '
     << units[u];
  return os.str();
}

std::string format_bytes_3sig(double bytes) {
  std::ostringstream os;
  const double mib = bytes / (1024.0 * 1024.0);
  if (mib >= 1024.0) {
    os << std::fixed << std::setprecision(mib >= 10 * 1024.0 ? 1 : 2) << mib / 1024.0 << " GiB";
  } else {
    os << std::fixed << std::setprecision(mib >= 100 ? 0 : 1) << mib << " MiB";
  }
  return os.str();
}

}  // namespace actmem
