// plot.cpp — memory_timeline_svg, plan_front_svg, pipeline_schedule_svg and line_chart_svg.
#include "actmem/train/plot.h"

#include "actmem/base/report.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>

namespace actmem {

namespace {
std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}
// The document's start: size, white background, the title at (left, 28).
void open_svg(std::ostringstream& o, double W, double H, double left, const std::string& title) {
  o << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
    << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" viewBox=\"0 0 " << W << " " << H << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"" << left << "\" y=\"28\" font-size=\"16\">" << escape(title) << "</text>\n";
}
// The plot area's bottom and left axes.
void draw_axes(std::ostringstream& o, double left, double top, double pw, double ph) {
  o << "<g class=\"axes\" stroke=\"#444\">\n"
    << "<line x1=\"" << left << "\" y1=\"" << top + ph << "\" x2=\"" << left + pw << "\" y2=\""
    << top + ph << "\"/>\n<line x1=\"" << left << "\" y1=\"" << top << "\" x2=\"" << left
    << "\" y2=\"" << top + ph << "\"/>\n</g>\n";
}
const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                         "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};
}  // namespace

std::string memory_timeline_svg(const std::vector<TimelineSeries>& series,
                                const std::string& title) {
  const double W = 1020, H = 540, left = 100, right = 300, top = 50, bottom = 60;
  const double pw = W - left - right, ph = H - top - bottom;
  double t_max = 1e-9, y_max = 1.0;
  for (const auto& s : series) {
    if (s.entries.empty()) continue;
    const auto base = s.entries.front();
    for (const auto& e : s.entries) {
      t_max = std::max(t_max, e.time_s - base.time_s);
      y_max = std::max(y_max, static_cast<double>(e.current_bytes - base.current_bytes));
      if (e.peak_bytes >= 0)
        y_max = std::max(y_max, static_cast<double>(e.peak_bytes - base.current_bytes));
    }
  }
  y_max *= 1.08;
  auto X = [&](double t) { return left + pw * t / t_max; };
  auto Y = [&](double bytes) { return top + ph * (1.0 - std::max(0.0, bytes) / y_max); };
  std::ostringstream o;
  o << std::fixed << std::setprecision(1);
  open_svg(o, W, H, left, title);
  // Axes and grid.
  draw_axes(o, left, top, pw, ph);
  for (int i = 0; i <= 5; ++i) {
    const double bytes = y_max * i / 5.0;
    o << "<line x1=\"" << left << "\" y1=\"" << Y(bytes) << "\" x2=\"" << left + pw << "\" y2=\""
      << Y(bytes) << "\" stroke=\"#ddd\"/>\n"
      << "<text x=\"" << left - 6 << "\" y=\"" << Y(bytes) + 4 << "\" text-anchor=\"end\">"
      << escape(format_bytes(bytes)) << "</text>\n";
    const double t = t_max * i / 5.0;
    o << "<text x=\"" << X(t) << "\" y=\"" << top + ph + 18 << "\" text-anchor=\"middle\">"
      << std::setprecision(t_max < 0.1 ? 3 : 2) << t * 1e3 << " ms</text>\n"
      << std::setprecision(1);
  }
  o << "<text x=\"" << left + pw / 2 << "\" y=\"" << H - 15
    << "\" text-anchor=\"middle\">time in the step (forward, then backward)</text>\n"
    << "<text x=\"18\" y=\"" << top + ph / 2 << "\" transform=\"rotate(-90 18 " << top + ph / 2
    << ")\" text-anchor=\"middle\">device bytes added by the step</text>\n";
  // Series.
  for (size_t i = 0; i < series.size(); ++i) {
    const auto& s = series[i];
    if (s.entries.empty()) continue;
    const char* color = kColors[i % 10];
    const auto base = s.entries.front();
    o << "<g class=\"series\" data-name=\"" << escape(s.name) << "\" data-peak-bytes=\""
      << s.peak_bytes << "\" stroke=\"" << color
      << "\" fill=\"none\">\n<polyline stroke-width=\"2\" points=\"";
    // Between two marks the window peak is drawn as a spike at the later mark's time.
    for (const auto& e : s.entries) {
      const double t = X(e.time_s - base.time_s);
      if (e.peak_bytes >= 0 && e.peak_bytes > e.current_bytes) {
        o << t << "," << Y(static_cast<double>(e.peak_bytes - base.current_bytes)) << " ";
      }
      o << t << "," << Y(static_cast<double>(e.current_bytes - base.current_bytes)) << " ";
    }
    o << "\"/>\n";
    for (const auto& e : s.entries) {  // layer boundaries
      if (e.label.find("layer") == std::string::npos) continue;
      const double t = X(e.time_s - base.time_s);
      const double y = Y(static_cast<double>(e.current_bytes - base.current_bytes));
      o << "<circle cx=\"" << t << "\" cy=\"" << y << "\" r=\"2.5\" fill=\"" << color
        << "\"><title>" << escape(s.name + ": " + e.label) << "</title></circle>\n";
    }
    o << "</g>\n";
    const double ly = top + 10 + 38.0 * static_cast<double>(i);
    o << "<g class=\"legend\"><line x1=\"" << left + pw + 20 << "\" y1=\"" << ly << "\" x2=\""
      << left + pw + 44 << "\" y2=\"" << ly << "\" stroke=\"" << color << "\" stroke-width=\"3\"/>"
      << "<text x=\"" << left + pw + 50 << "\" y=\"" << ly + 4 << "\">" << escape(s.name)
      << "</text><text x=\"" << left + pw + 50 << "\" y=\"" << ly + 19 << "\" fill=\"#555\">peak "
      << escape(format_bytes(static_cast<double>(s.peak_bytes))) << "</text></g>\n";
  }
  // Layer boundaries of the first series, as labelled dashed lines.
  if (!series.empty() && !series.front().entries.empty()) {
    const auto& first = series.front();
    for (const auto& e : first.entries) {
      if (e.label.rfind("fwd layer", 0) != 0 && e.label.rfind("bwd layer", 0) != 0) continue;
      const double t = X(e.time_s - first.entries.front().time_s);
      o << "<line class=\"boundary\" x1=\"" << t << "\" y1=\"" << top << "\" x2=\"" << t
        << "\" y2=\"" << top + ph << "\" stroke=\"#bbb\" stroke-dasharray=\"3,3\"/>\n"
        << "<text x=\"" << t + 2 << "\" y=\"" << top + 10 << "\" font-size=\"9\" fill=\"#888\">"
        << escape(e.label.substr(0, 3) + e.label.substr(9)) << "</text>\n";
    }
  }
  o << "</svg>\n";
  return o.str();
}

std::string plan_front_svg(const std::vector<PlanPoint>& points, double budget_bytes,
                           const std::string& title) {
  const double W = 1020, H = 600, left = 100, right = 40, top = 50, bottom = 60;
  const double pw = W - left - right, ph = H - top - bottom;
  double r_lo = 1.0, r_hi = 1.0, y_hi = std::max(1.0, budget_bytes);
  for (const auto& p : points) {
    r_lo = std::min(r_lo, p.step_ratio);
    r_hi = std::max(r_hi, p.step_ratio);
    y_hi = std::max(y_hi, p.peak_bytes);
  }
  r_hi += 0.05 * (r_hi - r_lo) + 1e-3;
  r_lo -= 0.02 * (r_hi - r_lo);
  y_hi *= 1.08;
  auto X = [&](double r) { return left + pw * (r - r_lo) / (r_hi - r_lo); };
  auto Y = [&](double bytes) { return top + ph * (1.0 - bytes / y_hi); };
  std::ostringstream o;
  o << std::fixed << std::setprecision(1);
  open_svg(o, W, H, left, title);
  draw_axes(o, left, top, pw, ph);
  for (int i = 0; i <= 5; ++i) {
    const double bytes = y_hi * i / 5.0, r = r_lo + (r_hi - r_lo) * i / 5.0;
    o << "<line x1=\"" << left << "\" y1=\"" << Y(bytes) << "\" x2=\"" << left + pw << "\" y2=\""
      << Y(bytes) << "\" stroke=\"#eee\"/>\n<text x=\"" << left - 6 << "\" y=\"" << Y(bytes) + 4
      << "\" text-anchor=\"end\">" << escape(format_bytes(bytes)) << "</text>\n<text x=\"" << X(r)
      << "\" y=\"" << top + ph + 18 << "\" text-anchor=\"middle\">" << std::setprecision(2) << r
      << std::setprecision(1) << "</text>\n";
  }
  o << "<text x=\"" << left + pw / 2 << "\" y=\"" << H - 15
    << "\" text-anchor=\"middle\">predicted step time / plain step time</text>\n"
    << "<text x=\"18\" y=\"" << top + ph / 2 << "\" transform=\"rotate(-90 18 " << top + ph / 2
    << ")\" text-anchor=\"middle\">predicted device peak</text>\n";
  if (budget_bytes > 0) {
    o << "<line class=\"budget\" x1=\"" << left << "\" y1=\"" << Y(budget_bytes) << "\" x2=\""
      << left + pw << "\" y2=\"" << Y(budget_bytes)
      << "\" stroke=\"#d62728\" stroke-dasharray=\"6,4\"/>\n<text x=\"" << left + pw - 4
      << "\" y=\"" << Y(budget_bytes) - 5 << "\" text-anchor=\"end\" fill=\"#d62728\">budget "
      << escape(format_bytes(budget_bytes)) << "</text>\n";
  }
  // The front as a staircase: from each entry the next faster one is reached at a higher peak.
  std::vector<const PlanPoint*> front;
  for (const auto& p : points) {
    if (p.on_front) front.push_back(&p);
  }
  std::sort(front.begin(), front.end(),
            [](const PlanPoint* a, const PlanPoint* b) { return a->peak_bytes < b->peak_bytes; });
  if (!front.empty()) {
    o << "<polyline class=\"front\" fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"2\" points=\"";
    for (size_t i = 0; i < front.size(); ++i) {
      if (i > 0) o << X(front[i - 1]->step_ratio) << "," << Y(front[i]->peak_bytes) << " ";
      o << X(front[i]->step_ratio) << "," << Y(front[i]->peak_bytes) << " ";
    }
    o << "\"/>\n";
  }
  for (const auto& p : points) {
    o << "<circle data-name=\"" << escape(p.name) << "\" data-peak-bytes=\"" << std::setprecision(0)
      << p.peak_bytes << "\" data-step-ratio=\"" << std::setprecision(4) << p.step_ratio
      << std::setprecision(1) << "\" data-front=\"" << (p.on_front ? 1 : 0) << "\" cx=\""
      << X(p.step_ratio) << "\" cy=\"" << Y(p.peak_bytes) << "\" r=\"" << (p.on_front ? 4 : 2.5)
      << "\" fill=\"" << (p.on_front ? "#1f77b4" : "#bbb") << "\"><title>" << escape(p.name)
      << "</title></circle>\n";
    if (p.chosen) {
      o << "<circle class=\"chosen\" cx=\"" << X(p.step_ratio) << "\" cy=\"" << Y(p.peak_bytes)
        << "\" r=\"9\" fill=\"none\" stroke=\"#d62728\" stroke-width=\"2\"/>\n";
    }
    if (p.standard || p.chosen) {
      o << "<text x=\"" << X(p.step_ratio) + 7 << "\" y=\"" << Y(p.peak_bytes) - 6
        << "\" font-size=\"11\" fill=\"" << (p.chosen ? "#d62728" : "#333") << "\">"
        << escape(p.name + (p.chosen ? " (chosen)" : "")) << "</text>\n";
    }
  }
  o << "</svg>\n";
  return o.str();
}

std::string pipeline_schedule_svg(const std::vector<std::vector<PipelineEvent>>& stages,
                                  const std::string& title) {
  const double left = 70, right = 250, top = 50, row = 34, gap = 10, W = 1020;
  const double pw = W - left - right;
  const double H = top + static_cast<double>(stages.size()) * (row + gap) + 50;
  double t_max = 1e-9;
  for (const auto& events : stages) {
    for (const auto& e : events) t_max = std::max(t_max, e.end_s);
  }
  auto X = [&](double t) { return left + pw * t / t_max; };
  // Under the interleaved schedule each model chunk gets its own shade (darker = earlier chunk).
  bool interleaved = false;
  for (const auto& events : stages) {
    for (const auto& e : events) interleaved = interleaved || e.chunk > 0;
  }
  auto fill = [](const PipelineEvent& e) {
    static const char* const kForward[] = {"#4c78a8", "#7fa6cf", "#a9c6e4", "#cddff0"};
    static const char* const kBackward[] = {"#f58518", "#f7a457", "#fac28e", "#fcdcbc"};
    const size_t shade = static_cast<size_t>(std::min<int64_t>(std::max<int64_t>(e.chunk, 0), 3));
    return e.forward ? kForward[shade] : kBackward[shade];
  };
  std::ostringstream o;
  o << std::fixed << std::setprecision(1);
  open_svg(o, W, H, left, title);
  for (size_t s = 0; s < stages.size(); ++s) {
    const double y = top + static_cast<double>(s) * (row + gap);
    double busy = 0.0;
    int64_t held = 0, most = 0;
    o << "<g data-stage=\"" << s << "\">\n<text x=\"" << left - 8 << "\" y=\"" << y + row / 2 + 4
      << "\" text-anchor=\"end\">stage " << s << "</text>\n";
    for (const auto& e : stages[s]) {
      busy += e.end_s - e.start_s;
      held += e.forward ? 1 : -1;
      most = std::max(most, held);
      const double x0 = X(e.start_s), w = std::max(0.5, X(e.end_s) - x0);
      o << "<rect data-stage=\"" << s << "\" data-op=\"" << (e.forward ? 'F' : 'B')
        << "\" data-microbatch=\"" << e.microbatch << "\" data-chunk=\"" << e.chunk << "\" x=\""
        << x0 << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << row << "\" fill=\""
        << fill(e) << "\" stroke=\"white\"/>\n";
      if (w >= 14) {
        o << "<text x=\"" << x0 + w / 2 << "\" y=\"" << y + row / 2 + 4
          << "\" text-anchor=\"middle\" fill=\"white\">" << (e.forward ? 'F' : 'B') << e.microbatch
          << "</text>\n";
      }
    }
    o << "<text x=\"" << left + pw + 10 << "\" y=\"" << y + row / 2 + 4 << "\">busy "
      << std::setprecision(0) << 100.0 * busy / t_max << "%, at most " << most
      << (interleaved ? " chunk-micro-batches" : "") << " in flight</text>\n</g>\n"
      << std::setprecision(1);
  }
  // Time axis, milliseconds.
  const double axis_y = top + static_cast<double>(stages.size()) * (row + gap);
  o << "<line x1=\"" << left << "\" y1=\"" << axis_y << "\" x2=\"" << left + pw << "\" y2=\""
    << axis_y << "\" stroke=\"#444\"/>\n";
  for (int i = 0; i <= 5; ++i) {
    const double t = t_max * i / 5.0;
    o << "<text x=\"" << X(t) << "\" y=\"" << axis_y + 16 << "\" text-anchor=\"middle\">"
      << std::setprecision(t_max < 0.05 ? 1 : 0) << 1e3 * t << std::setprecision(1) << "</text>\n";
  }
  o << "<text x=\"" << left + pw / 2 << "\" y=\"" << axis_y + 34
    << "\" text-anchor=\"middle\">ms from the step's start (F forward, B backward of micro-batch n"
    << (interleaved ? "; lighter = later model chunk" : "") << ")</text>\n</svg>\n";
  return o.str();
}

std::string line_chart_svg(const std::vector<CurveSeries>& series, const std::string& title,
                           const std::string& x_label, const std::string& y_label) {
  const double W = 900, H = 500, left = 80, right = 220, top = 50, bottom = 60;
  const double pw = W - left - right, ph = H - top - bottom;
  double x_max = 1e-9, y_min = 1e300, y_max = -1e300;
  for (const auto& s : series) {
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      x_max = std::max(x_max, s.x[i]);
      y_min = std::min(y_min, s.y[i]);
      y_max = std::max(y_max, s.y[i]);
    }
  }
  if (y_min > y_max) y_min = 0, y_max = 1;
  const double pad = std::max((y_max - y_min) * 0.05, 1e-9);
  y_min -= pad, y_max += pad;
  auto X = [&](double x) { return left + pw * x / x_max; };
  auto Y = [&](double y) { return top + ph * (1.0 - (y - y_min) / (y_max - y_min)); };
  std::ostringstream o;
  o << std::fixed << std::setprecision(1);
  open_svg(o, W, H, left, title);
  draw_axes(o, left, top, pw, ph);
  for (int i = 0; i <= 5; ++i) {
    const double y = y_min + (y_max - y_min) * i / 5.0, x = x_max * i / 5.0;
    o << "<line x1=\"" << left << "\" y1=\"" << Y(y) << "\" x2=\"" << left + pw << "\" y2=\""
      << Y(y) << "\" stroke=\"#ddd\"/>\n"
      << "<text x=\"" << left - 6 << "\" y=\"" << Y(y) + 4 << "\" text-anchor=\"end\">"
      << std::setprecision(2) << y << std::setprecision(1) << "</text>\n"
      << "<text x=\"" << X(x) << "\" y=\"" << top + ph + 18 << "\" text-anchor=\"middle\">"
      << std::setprecision(0) << x << std::setprecision(1) << "</text>\n";
  }
  o << "<text x=\"" << left + pw / 2 << "\" y=\"" << H - 16 << "\" text-anchor=\"middle\">"
    << escape(x_label) << "</text>\n"
    << "<text x=\"18\" y=\"" << top + ph / 2
    << "\" text-anchor=\"middle\" transform=\"rotate(-90 18 " << top + ph / 2 << ")\">"
    << escape(y_label) << "</text>\n";
  for (size_t k = 0; k < series.size(); ++k) {
    const auto& s = series[k];
    const char* colour = kColors[k % (sizeof(kColors) / sizeof(kColors[0]))];
    o << "<polyline data-name=\"" << escape(s.name) << "\" fill=\"none\" stroke=\"" << colour
      << "\" stroke-width=\"2\" points=\"";
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      o << (i ? " " : "") << X(s.x[i]) << "," << Y(s.y[i]);
    }
    o << "\"/>\n";
    const double ly = top + 20 + 22 * static_cast<double>(k);
    o << "<line x1=\"" << left + pw + 16 << "\" y1=\"" << ly << "\" x2=\"" << left + pw + 40
      << "\" y2=\"" << ly << "\" stroke=\"" << colour << "\" stroke-width=\"2\"/>\n"
      << "<text x=\"" << left + pw + 46 << "\" y=\"" << ly + 4 << "\">" << escape(s.name)
      << "</text>\n";
  }
  o << "</svg>\n";
  return o.str();
}

}  // namespace actmem
