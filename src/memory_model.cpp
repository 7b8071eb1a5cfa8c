// memory_model.cpp — the paper's formulas, Megatron's theoretical terms and the exact predictor.
#include "actmem/memory_model.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <map>

namespace actmem {

namespace {
PaperShape shape(double s, double b, double h, double a, double L, double ffn, double v, double t,
                 double p, bool sp, std::optional<double> vpp = std::nullopt) {
  PaperShape m;
  m.s = s, m.b = b, m.h = h, m.a = a, m.L = L, m.ffn = ffn, m.v = v, m.t = t, m.p = p, m.sp = sp;
  m.vpp = vpp;
  return m;
}

const std::map<std::string, PaperShape>& presets() {
  static const std::map<std::string, PaperShape> table = {
      // The seed's worked example (§6): s=4096, b=2, h=4096, a=32, L=32, ffn=14336 (SwiGLU),
      // TP=2 with SP, PP=2 (16 layers per stage). Vocabulary 32000.
      {"7b", shape(4096, 2, 4096, 32, 32, 14336, 32000, 2, 2, true)},
      // Korthikanti et al. Table 3 (s = 2048, v = 51200, ffn = 4h), with SP as in the paper.
      {"22b", shape(2048, 4, 6144, 64, 48, 4 * 6144, 51200, 8, 1, true)},
      {"175b", shape(2048, 1, 12288, 96, 96, 4 * 12288, 51200, 8, 8, true, 3.0)},
      {"530b", shape(2048, 1, 20480, 128, 105, 4 * 20480, 51200, 8, 35, true, 3.0)},
      {"1t", shape(2048, 1, 25600, 160, 128, 4 * 25600, 51200, 8, 64, true)},
  };
  return table;
}

// Megatron's interleave and in-flight factors, shared by both of its formulas.
double pipeline_factor(const PaperShape& m) {
  if (m.vpp) return 1.0 + (m.p - 1.0) / (m.p * *m.vpp);
  if (m.p > 1 && m.num_microbatches) return std::min(1.0, *m.num_microbatches / m.p);
  return 1.0;
}
}  // namespace

std::vector<std::string> paper_preset_names() {
  std::vector<std::string> names;
  for (const auto& [name, _] : presets()) names.push_back(name);
  return names;
}

PaperShape paper_preset(const std::string& name) {
  const auto it = presets().find(name);
  if (it == presets().end()) {
    std::string known;
    for (const auto& n : paper_preset_names()) known += (known.empty() ? "" : ", ") + n;
    TORCH_CHECK(false, "actmem::paper_preset: unknown preset '", name, "'; known: ", known);
  }
  return it->second;
}

LayerBytes paper_layer_bytes(const PaperShape& m) {
  TORCH_CHECK(m.s > 0 && m.b > 0 && m.h > 0 && m.a > 0 && m.t >= 1 && m.ffn > 0,
              "actmem::paper_layer_bytes: sizes must be positive and t >= 1");
  const double sbh = m.sbh(), t = m.t;
  const double sq = 5.0 * m.a * m.s / m.h;          // the s^2 term, in units of sbh
  const double lin_sel = 18.0 + 4.0 * m.ffn / m.h;  // Megatron's selective term (34 at ffn = 4h)
  LayerBytes r;
  if (t == 1.0 || m.sp) {
    // eq. (1) / eq. (4): the paper's 34 (as in the seed's worked example) plus the s^2 term.
    r.none = sbh * (34.0 + sq) / t;
    r.selective = sbh * lin_sel / t;
    r.full = 2.0 * sbh / (m.sp ? t : 1.0);
    r.s2_fraction = sq / (34.0 + sq);
  } else {
    // eq. (2): layer norms and dropouts (10 sbh) replicated on every tensor-parallel rank.
    r.none = sbh * (10.0 + 24.0 / t + sq / t);
    r.selective = sbh * (10.0 + (lin_sel - 10.0) / t);
    r.full = 2.0 * sbh;
    r.s2_fraction = (sq / t) / (10.0 + 24.0 / t + sq / t);
  }
  return r;
}

double megatron_activation_memory(const PaperShape& m) {
  const double sbh = m.sbh();
  double a = sbh * (18.0 + 4.0 * m.ffn / m.h) * m.L;
  a += 8.0 * m.s * m.b * m.p + sbh * m.p;  // int64 input ids and the embedding dropout mask
  a *= pipeline_factor(m);
  if (m.p == 1) a += sbh * 4.0 * (1.0 + m.v / m.h);  // output-layer input and fp32 logits
  return a / m.t;
}

double megatron_activation_memory_without_sp(const PaperShape& m) {
  const double sbh = m.sbh();
  double a = sbh * (10.0 + 24.0 / m.t) * m.L;
  a += 8.0 * m.s * m.b * m.p + sbh * m.p;
  a *= pipeline_factor(m);
  if (m.p == 1) a += 2.0 * (m.s * m.b * m.v / m.t + sbh);
  return a * 1.05;
}

double offload_round_trip_seconds(double bytes, double gbps) {
  TORCH_CHECK(gbps > 0, "actmem::offload_round_trip_seconds: bandwidth must be positive, got ", gbps);
  return 2.0 * bytes / (gbps * 1e9);
}

}  // namespace actmem
