// strategy.cpp — Strategy (strategy.h).
#include "actmem/config/strategy.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <charconv>
#include <sstream>

namespace actmem {

bool Strategy::recomputes(RecomputeModule m) const {
  return std::find(recompute_modules.begin(), recompute_modules.end(), m) !=
         recompute_modules.end();
}

bool Strategy::offloads(OffloadModule g) const {
  return std::find(offload_modules.begin(), offload_modules.end(), g) != offload_modules.end();
}

std::string join_names(const std::vector<RecomputeModule>& modules, const std::string& sep) {
  std::vector<std::string> names;
  for (const auto m : modules) names.emplace_back(to_string(m));
  return c10::Join(sep, names);
}

std::string join_names(const std::vector<OffloadModule>& groups, const std::string& sep) {
  std::vector<std::string> names;
  for (const auto g : groups) names.emplace_back(to_string(g));
  return c10::Join(sep, names);
}

std::string Strategy::name() const {
  std::vector<std::string> parts;
  if (!recompute_modules.empty())
    parts.push_back("selective " + join_names(recompute_modules, "+"));
  if (full_method != RecomputeMethod::kNone) {
    parts.push_back(std::string("full ") + to_string(full_method) + " " +
                    std::to_string(full_layers));
  }
  if (!offload_modules.empty()) parts.push_back("offload " + join_names(offload_modules, "+"));
  if (offload_layers > 0) parts.push_back("layer offload " + std::to_string(offload_layers));
  return parts.empty() ? "plain" : c10::Join(", ", parts);
}

std::string Strategy::spec() const {
  std::vector<std::string> parts;
  if (!recompute_modules.empty())
    parts.push_back("selective-" + join_names(recompute_modules, "+"));
  if (full_method != RecomputeMethod::kNone) {
    parts.push_back(std::string("full-") + to_string(full_method) + "-" +
                    std::to_string(full_layers));
  }
  if (!offload_modules.empty()) parts.push_back("offload-" + join_names(offload_modules, "+"));
  if (offload_layers > 0) parts.push_back("layer-offload-" + std::to_string(offload_layers));
  return parts.empty() ? "plain" : c10::Join(",", parts);
}

std::string Strategy::flags() const {
  std::vector<std::string> f;
  if (!recompute_modules.empty()) {
    f.push_back("--recompute-granularity selective --recompute-modules " +
                join_names(recompute_modules, " "));
  }
  if (full_method != RecomputeMethod::kNone) {
    f.push_back(std::string("--recompute-granularity full --recompute-method ") +
                to_string(full_method) + " --recompute-num-layers " + std::to_string(full_layers));
  }
  if (!offload_modules.empty()) {
    f.push_back("--fine-grained-activation-offloading --offload-modules " +
                join_names(offload_modules, " "));
  }
  if (offload_layers > 0)
    f.push_back("--cpu-offloading-num-layers " + std::to_string(offload_layers));
  return c10::Join(" ", f);
}

TransformerConfig Strategy::apply(const TransformerConfig& base) const {
  TransformerConfig c = base;
  c.recompute_granularity.clear();
  c.recompute_method.clear();
  c.recompute_num_layers.reset();
  c.recompute_modules.reset();
  c.distribute_saved_activations = false;
  c.moe_layer_recompute = false;
  c.cpu_offloading_num_layers = 0;
  c.fine_grained_activation_offloading = false;
  c.offload_modules.clear();
  if (!recompute_modules.empty()) {
    c.recompute_granularity = "selective";
    std::vector<std::string> names;
    for (const auto m : recompute_modules) names.emplace_back(to_string(m));
    c.recompute_modules = names;
  }
  if (full_method != RecomputeMethod::kNone) {
    c.recompute_granularity = "full";
    c.recompute_method = to_string(full_method);
    c.recompute_num_layers = full_layers;
  }
  if (!offload_modules.empty()) {
    c.fine_grained_activation_offloading = true;
    for (const auto g : offload_modules) c.offload_modules.emplace_back(to_string(g));
  }
  c.cpu_offloading_num_layers = offload_layers;
  return c;
}

bool Strategy::operator==(const Strategy& o) const {
  return recompute_modules == o.recompute_modules && full_method == o.full_method &&
         full_layers == o.full_layers && offload_modules == o.offload_modules &&
         offload_layers == o.offload_layers;
}

namespace {
std::vector<std::string> split(const std::string& text, char sep) {
  if (text.empty()) return {""};
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string part;
  while (std::getline(ss, part, sep)) out.push_back(part);
  if (!text.empty() && text.back() == sep) out.emplace_back();
  return out;
}

std::optional<int64_t> positive(const std::string& text) {
  int64_t n = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (ec != std::errc() || end != text.data() + text.size() || n <= 0) return std::nullopt;
  return n;
}

std::optional<std::string> after(const std::string& text, const std::string& prefix) {
  if (text.rfind(prefix, 0) != 0) return std::nullopt;
  return text.substr(prefix.size());
}
}  // namespace

Strategy parse_strategy(const std::string& text) {
  auto bad = [&text](const std::string& part, const std::string& why) {
    TORCH_CHECK(false, "actmem::parse_strategy: '", part, "' in strategy '", text, "': ", why,
                "; expected parts joined by ',': plain, selective, selective-MOD[+MOD...] (MOD: ",
                recompute_module_list(", "),
                "), full-uniform-N, full-block-N, "
                "offload-GROUP[+GROUP...] (GROUP: ",
                offload_module_list(", "), ") or layer-offload-K");
  };
  Strategy s;
  if (text == "plain") return s;
  for (const std::string& part : split(text, ',')) {
    if (part == "selective") {
      s.recompute_modules = {RecomputeModule::kCoreAttn};  // Megatron's default module
    } else if (const auto modules = after(part, "selective-")) {
      for (const std::string& name : split(*modules, '+')) {
        const auto m = parse_recompute_module(name);
        if (!m) bad(part, "unknown recompute module '" + name + "'");
        s.recompute_modules.push_back(*m);
      }
    } else if (const auto groups = after(part, "offload-")) {
      for (const std::string& name : split(*groups, '+')) {
        const auto g = parse_offload_module(name);
        if (!g) bad(part, "unknown offload group '" + name + "'");
        s.offload_modules.push_back(*g);
      }
    } else if (const auto k = after(part, "layer-offload-")) {
      const auto n = positive(*k);
      if (!n) bad(part, "K must be a positive integer");
      s.offload_layers = *n;
    } else if (const auto rest = after(part, "full-")) {
      const auto dash = rest->find('-');
      const std::string method = rest->substr(0, dash);
      if (dash == std::string::npos || (method != "uniform" && method != "block")) {
        bad(part, "full recompute is full-uniform-N or full-block-N");
      }
      const auto n = positive(rest->substr(dash + 1));
      if (!n) bad(part, "N must be a positive integer");
      s.full_method = method == "uniform" ? RecomputeMethod::kUniform : RecomputeMethod::kBlock;
      s.full_layers = *n;
    } else {
      bad(part, "not a strategy part");
    }
  }
  return s;
}

}  // namespace actmem
