// fp8.cpp — FP8 scaling, the quantized GEMM and the scaling state (fp8.h, Note [FP8 as actmem
// runs it]).
#include "actmem/model/fp8.h"

#include "actmem/parallel/tensor_parallel.h"
#include "actmem/recompute/recompute.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>

#include <limits>

namespace actmem {

double fp8_max(at::ScalarType fp8_dtype) {
  TORCH_CHECK(fp8_dtype == at::kFloat8_e4m3fn || fp8_dtype == at::kFloat8_e5m2,
              "actmem::fp8_max: expected float8_e4m3fn or float8_e5m2, got ", fp8_dtype);
  return fp8_dtype == at::kFloat8_e4m3fn ? 448.0 : 57344.0;
}

namespace {
// (fp8_max / amax) / 2^margin where amax is positive and finite (fp32's max where that quotient
// overflows), `fallback` elsewhere: TE's compute_scale_from_amax (fallback 1, margin 0) and
// _default_sf_compute (fallback the previous scale).
at::Tensor scale_for(const at::Tensor& amax, double max, int64_t margin,
                     const at::Tensor& fallback) {
  const at::Tensor a = amax.to(at::kFloat);
  const at::Tensor sf = at::div(at::div(at::scalar_tensor(max, a.options()), a),
                                std::ldexp(1.0, static_cast<int>(margin)));
  const at::Tensor fp32_max = at::full({}, std::numeric_limits<float>::max(), a.options());
  return at::where(at::logical_and(at::isfinite(a), a > 0), at::where(at::isinf(sf), fp32_max, sf),
                   fallback);
}
}  // namespace

at::Tensor scale_from_amax(const at::Tensor& amax, double max) {
  return scale_for(amax, max, 0, at::ones({}, at::kFloat));
}

at::Tensor quantize_fp8(const at::Tensor& x, const at::Tensor& scale, at::ScalarType fp8_dtype) {
  const double m = fp8_max(fp8_dtype);
  // Saturating as TE's casts do (libtorch's float8 conversion also saturates E4M3, but not
  // E5M2, which has infinities).
  return (x.to(at::kFloat) * scale).clamp(-m, m).to(fp8_dtype);
}

Fp8Recipe Fp8Recipe::from(const TransformerConfig& c) {
  Fp8Recipe r;
  r.delayed = c.fp8_recipe == "delayed";
  r.hybrid = c.fp8 == "hybrid";
  r.margin = c.fp8_margin;
  r.history_len = c.fp8_amax_history_len;
  r.amax_max = c.fp8_amax_compute_algo == "max";
  r.wgrad = c.fp8_wgrad;
  return r;
}

DelayedScale::DelayedScale(int64_t history_len)
    : history(at::zeros({history_len}, at::kFloat)), scale(at::ones({}, at::kFloat)) {}

void DelayedScale::update(const Fp8Recipe& recipe, double max) {
  // TE's _default_get_amax_and_update_history and _default_sf_compute.
  const at::Tensor amax = recipe.amax_max ? history.max() : history[0].clone();
  scale.copy_(scale_for(amax, max, recipe.margin, scale));
  history.copy_(at::roll(history, -1, 0));
  history[0].fill_(0.0);
}

Fp8Gemm::Fp8Gemm(std::shared_ptr<Fp8Registry> registry)
    : input(registry->recipe().history_len),
      weight(registry->recipe().history_len),
      grad_output(registry->recipe().history_len),
      registry_(std::move(registry)) {}

at::Tensor Fp8Gemm::state() const {
  return at::cat({input.history, input.scale.reshape({1}), weight.history,
                  weight.scale.reshape({1}), grad_output.history, grad_output.scale.reshape({1})});
}

void Fp8Gemm::set_state(const at::Tensor& state) {
  const int64_t n = input.history.numel();
  TORCH_CHECK(state.dim() == 1 && state.numel() == 3 * (n + 1) && state.scalar_type() == at::kFloat,
              "actmem::Fp8Gemm::set_state: expected a float tensor of ", 3 * (n + 1),
              " elements (three amax histories of ", n, " and their scales), got ", state.sizes(),
              " ", state.scalar_type());
  int64_t at = 0;
  for (DelayedScale* d : {&input, &weight, &grad_output}) {
    d->history.copy_(state.slice(0, at, at + n));
    d->scale.copy_(state[at + n]);
    at += n + 1;
  }
}

std::shared_ptr<Fp8Gemm> Fp8Registry::add_gemm(const std::shared_ptr<Fp8Registry>& self) {
  TORCH_CHECK(self.get() == this, "actmem::Fp8Registry::add_gemm: expected the registry itself");
  auto gemm = std::make_shared<Fp8Gemm>(self);
  gemms_.push_back(gemm);
  return gemm;
}

namespace {
// TE's reduce_and_update_fp8_tensors: the amaxes just recorded (entry 0 of each history) reduced
// with max over the amax reduction group (Megatron's get_amax_reduction_group: the tensor- and
// data-parallel ranks; one process here but for data parallelism), then each scale updated.
void reduce_and_update(const std::vector<DelayedScale*>& scales, const Fp8Recipe& recipe,
                       double max) {
  if (scales.empty()) return;
  if (data_parallel_group().size > 1) {
    std::vector<at::Tensor> amaxes;
    for (const DelayedScale* d : scales) amaxes.push_back(d->history[0]);
    const at::Tensor reduced =
        group_all_gather_dim0(data_parallel_group(), at::stack(amaxes).unsqueeze(0)).amax(0);
    for (size_t i = 0; i < scales.size(); ++i) {
      scales[i]->history[0].copy_(reduced[static_cast<int64_t>(i)]);
    }
  }
  for (DelayedScale* d : scales) {
    d->update(recipe, max);
    d->recorded = false;
  }
}
}  // namespace

void Fp8Registry::end_forward() {
  if (!recipe_.delayed) return;
  std::vector<DelayedScale*> scales;
  for (const auto& weak : gemms_) {
    const auto g = weak.lock();
    if (!g || !g->input.recorded) continue;
    scales.push_back(&g->input);
    scales.push_back(&g->weight);
  }
  reduce_and_update(scales, recipe_, fp8_max(recipe_.forward_dtype()));
  ++forward_updates_;
}

void Fp8Registry::end_backward() {
  if (!recipe_.delayed) return;
  std::vector<DelayedScale*> scales;
  for (const auto& weak : gemms_) {
    if (const auto g = weak.lock(); g && g->grad_output.recorded) scales.push_back(&g->grad_output);
  }
  reduce_and_update(scales, recipe_, fp8_max(recipe_.backward_dtype()));
  ++backward_updates_;
}

std::vector<at::Tensor> Fp8Registry::state_tensors() const {
  std::vector<at::Tensor> out;
  for (const auto& weak : gemms_) {
    if (const auto g = weak.lock()) {
      for (const DelayedScale* d : {&g->input, &g->weight, &g->grad_output}) {
        out.push_back(d->history);
        out.push_back(d->scale);
      }
    }
  }
  return out;
}

namespace {

// Records amax(x) into entry 0 of a delayed-scaling history (TE's casts reduce it there).
void record_amax(DelayedScale& d, const at::Tensor& x) {
  d.history[0].copy_(at::maximum(d.history[0], x.abs().max().to(at::kFloat)));
  d.recorded = true;
}

at::Tensor current_scale(const at::Tensor& x, at::ScalarType fp8_dtype) {
  return scale_from_amax(x.abs().max(), fp8_max(fp8_dtype));
}

// The 2-D GEMM a @ b on float8 operands, dequantized by the scalar scale_invs, with fp32
// accumulation and an `out` result (plus bias, rounded once).
at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                     const at::Tensor& b_scale_inv, const at::Tensor& bias, at::ScalarType out) {
  return at::_scaled_mm(a, b, a_scale_inv, b_scale_inv,
                        bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                        /*scale_result=*/std::nullopt, out);
}

struct Fp8LinearFunction : torch::autograd::Function<Fp8LinearFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const at::Tensor& bias, int64_t gemm_ptr,
                            bool save_original_input, bool grad_enabled) {
    auto& gemm = *reinterpret_cast<Fp8Gemm*>(gemm_ptr);
    Fp8Registry& registry = gemm.registry();
    const Fp8Recipe& recipe = registry.recipe();
    const at::ScalarType fwd = recipe.forward_dtype();
    const bool replay = is_recomputing();
    const bool naive = replay && registry.naive_recompute_for_test;
    // A training forward (grad on, or a checkpoint's first forward without it) records; a
    // replay takes what its first forward stashed.
    const bool first_forward = is_checkpointing() && !replay;
    // (A custom function's forward runs with grad off: the caller's mode is passed in.)
    const bool recording = (grad_enabled && !replay) || first_forward || naive;
    at::Tensor x_scale, w_scale;
    bool first = false;
    if (recipe.delayed) {
      if (replay && !naive) {
        TORCH_CHECK(!gemm.recompute_stash.empty(),
                    "actmem::fp8_linear: a recompute replays a GEMM whose forward left no "
                    "scales (the replay order must follow the forwards')");
        Fp8Gemm::Stash s = std::move(gemm.recompute_stash.front());
        gemm.recompute_stash.pop_front();
        x_scale = at::scalar_tensor(s.input_scale, at::kFloat);
        w_scale = at::scalar_tensor(s.weight_scale, at::kFloat);
        first = s.first;
      } else {
        x_scale = gemm.input.scale.clone();
        w_scale = gemm.weight.scale.clone();
        first = recording && registry.take_first();
        if (first_forward) {
          gemm.recompute_stash.push_back({x_scale.item<float>(), w_scale.item<float>(), first});
        }
      }
      if (recording) {
        record_amax(gemm.input, x);
        record_amax(gemm.weight, weight);
      }
    } else {
      x_scale = current_scale(x, fwd);
      w_scale = current_scale(weight, fwd);
    }
    const int64_t in = x.size(-1), out_features = weight.size(0);
    const at::Tensor x2 = x.reshape({-1, in});
    const at::Tensor xq = quantize_fp8(x2, x_scale, fwd);
    const at::Tensor x_scale_inv = at::reciprocal(x_scale);
    const at::Tensor wq = quantize_fp8(weight, w_scale, fwd);
    const bool has_bias = bias.numel() > 0;
    const at::Tensor y = scaled_mm(xq, x_scale_inv, wq.t(), at::reciprocal(w_scale),
                                   has_bias ? bias : at::Tensor(), x.scalar_type());
    // What the backward needs of the input: the quantized copy (the weight gradient in FP8), or
    // the 16-bit input (kept by the caller's request, or for a 16-bit weight gradient).
    const bool keep_original = save_original_input || !recipe.wgrad;
    if (keep_original) {
      ctx->save_for_backward({x, weight, w_scale});
    } else {
      ctx->save_for_backward({xq, weight, w_scale, x_scale_inv});
    }
    ctx->saved_data["gemm"] = gemm_ptr;
    ctx->saved_data["first"] = first;
    ctx->saved_data["original"] = keep_original;
    ctx->saved_data["bias"] = has_bias;
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = out_features;
    return y.view(shape);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto& gemm = *reinterpret_cast<Fp8Gemm*>(ctx->saved_data["gemm"].toInt());
    Fp8Registry& registry = gemm.registry();
    const Fp8Recipe& recipe = registry.recipe();
    const bool original = ctx->saved_data["original"].toBool();
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& weight = saved[1];
    const at::Tensor& w_scale = saved[2];
    const int64_t out_features = weight.size(0), in = weight.size(1);
    const at::Tensor g = grads[0].reshape({-1, out_features});
    const at::ScalarType bwd = recipe.backward_dtype();
    at::Tensor g_scale;
    if (recipe.delayed) {
      g_scale = gemm.grad_output.scale.clone();
      record_amax(gemm.grad_output, g);
    } else {
      g_scale = current_scale(g, bwd);
    }
    const at::Tensor gq = quantize_fp8(g, g_scale, bwd);
    const at::Tensor g_scale_inv = at::reciprocal(g_scale);
    const at::Tensor wq = quantize_fp8(weight, w_scale, recipe.forward_dtype());
    const at::ScalarType act = grads[0].scalar_type();
    at::Tensor dx = scaled_mm(gq, g_scale_inv, wq, at::reciprocal(w_scale), {}, act);
    at::Tensor dw;
    if (recipe.wgrad) {
      at::Tensor xq, x_scale_inv;
      if (original) {
        // Current scaling: the replayed quantization of the same input is the forward's.
        const at::Tensor x2 = saved[0].reshape({-1, in});
        const at::Tensor s = current_scale(x2, recipe.forward_dtype());
        xq = quantize_fp8(x2, s, recipe.forward_dtype());
        x_scale_inv = at::reciprocal(s);
      } else {
        xq = saved[0];
        x_scale_inv = saved[3];
      }
      dw = scaled_mm(gq.t(), g_scale_inv, xq, x_scale_inv, {}, weight.scalar_type());
    } else {
      dw = at::mm(g.t(), saved[0].reshape({-1, in}).to(g.scalar_type())).to(weight.scalar_type());
    }
    at::Tensor db;
    if (ctx->saved_data["bias"].toBool()) db = g.sum(0);
    if (ctx->saved_data["first"].toBool()) registry.end_backward();
    std::vector<int64_t> shape = grads[0].sizes().vec();
    shape.back() = in;
    return {dx.view(shape), dw, db, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool fp8_keeps_recomputed_norm_output(bool delayed_scaling, const LayerPlan& plan) {
  return !delayed_scaling && plan.recomputes(RecomputeModule::kLayernorm);
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      Fp8Gemm& gemm, bool save_original_input) {
  RECORD_FUNCTION("actmem::fp8_linear", std::vector<c10::IValue>());
  TORCH_CHECK(!save_original_input || !gemm.registry().recipe().delayed,
              "actmem::fp8_linear: keeping the original input needs a current-scaling recipe "
              "(delayed scaling would quantize it again with a later scale)");
  // An undefined tensor cannot be an input of a custom function: no bias is an empty one.
  return Fp8LinearFunction::apply(x, weight, bias.defined() ? bias : at::empty({0}, x.options()),
                                  reinterpret_cast<int64_t>(&gemm), save_original_input,
                                  at::GradMode::is_enabled());
}

}  // namespace actmem
