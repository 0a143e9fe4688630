#include "worker/layers.h"

#include <cmath>
#include <limits>
#include <numbers>

#include <ATen/ATen.h>

#include "common/error.h"

namespace assay::oracle {

using common::Error;
using common::Json;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto input_dtype = x.scalar_type();
  at::Tensor h = x.to(at::kFloat);
  at::Tensor variance = h.pow(2).mean({-1}, /*keepdim=*/true);
  h = h * at::rsqrt(variance + eps);
  return weight * h.to(input_dtype);
}

at::Tensor rope_inv_freq(double theta, int64_t dim, const Json& scaling, const std::string& where) {
  // Python's `1.0 / t` is t.reciprocal() * 1.0 and `base ** t` is tensor(base, fp32) ** t.
  at::Tensor exponent = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / dim;
  at::Tensor inv_freq = at::reciprocal(at::scalar_tensor(theta, at::kFloat).pow(exponent)) * 1.0;
  std::string type = "default";
  if (!scaling.is_null()) {
    if (!scaling.is_object()) unsupported(where, "rope_scaling", scaling, "not an object");
    type = scaling.contains("rope_type") ? config_string(scaling, "rope_type", "", where)
                                         : config_string(scaling, "type", "default", where);
  }
  if (type == "default") return inv_freq;
  auto number = [&](const char* key) {
    if (!scaling.contains(key) || !scaling[key].is_number()) {
      throw Error("model.bad_config",
                  where + ": rope " + type + " scaling needs a number \"" + key + "\"");
    }
    return scaling[key].get<double>();
  };
  if (type == "linear") return inv_freq / number("factor");
  if (type == "llama3") {
    double factor = number("factor");
    double low_freq_factor = number("low_freq_factor");
    double high_freq_factor = number("high_freq_factor");
    const Json& old = scaling.contains("original_max_position_embeddings")
                          ? scaling["original_max_position_embeddings"]
                          : Json();
    if (!old.is_number_integer()) {
      throw Error("model.bad_config", where +
                                          ": rope llama3 scaling needs an integer "
                                          "\"original_max_position_embeddings\"");
    }
    int64_t old_context_len = old.get<int64_t>();
    double low_freq_wavelen = static_cast<double>(old_context_len) / low_freq_factor;
    double high_freq_wavelen = static_cast<double>(old_context_len) / high_freq_factor;
    at::Tensor wavelen = at::reciprocal(inv_freq) * (2 * std::numbers::pi);
    at::Tensor llama = at::where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq);
    at::Tensor smooth = (at::reciprocal(wavelen) * old_context_len - low_freq_factor) /
                        (high_freq_factor - low_freq_factor);
    at::Tensor smoothed = at::rsub(smooth, 1) * llama / factor + smooth * llama;
    at::Tensor is_medium = (~(wavelen < high_freq_wavelen)) * (~(wavelen > low_freq_wavelen));
    return at::where(is_medium, smoothed, llama);
  }
  unsupported(where, "rope_type", type, "supported: default, linear, llama3");
}

std::pair<at::Tensor, at::Tensor> rotary_cos_sin(const at::Tensor& inv_freq, int64_t seq_len,
                                                 c10::ScalarType dtype, double attention_scaling) {
  at::Tensor position_ids =
      at::arange(seq_len, at::TensorOptions().dtype(at::kLong).device(inv_freq.device()))
          .unsqueeze(0);
  at::Tensor inv_freq_expanded =
      inv_freq.index({at::indexing::None, at::indexing::Slice(), at::indexing::None})
          .to(at::kFloat)
          .expand({position_ids.size(0), -1, 1});
  at::Tensor position_ids_expanded =
      position_ids.index({at::indexing::Slice(), at::indexing::None, at::indexing::Slice()})
          .to(at::kFloat);
  at::Tensor freqs =
      at::matmul(inv_freq_expanded.to(at::kFloat), position_ids_expanded.to(at::kFloat))
          .transpose(1, 2);
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  at::Tensor cos = emb.cos() * attention_scaling;
  at::Tensor sin = emb.sin() * attention_scaling;
  return {cos.to(dtype), sin.to(dtype)};
}

at::Tensor rotate_half(const at::Tensor& x) {
  int64_t half = x.size(-1) / 2;
  at::Tensor x1 = x.slice(-1, 0, half);
  at::Tensor x2 = x.slice(-1, half);
  return at::cat({-x2, x1}, -1);
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor c = cos.unsqueeze(1);
  at::Tensor s = sin.unsqueeze(1);
  return (x * c) + (rotate_half(x) * s);
}

at::Tensor repeat_kv(const at::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) return x;
  int64_t b = x.size(0), kv = x.size(1), t = x.size(2), d = x.size(3);
  return x.unsqueeze(2).expand({b, kv, n_rep, t, d}).reshape({b, kv * n_rep, t, d});
}

at::Tensor additive_causal_mask(int64_t seq_len, c10::ScalarType dtype, int64_t window) {
  at::Tensor q = at::arange(seq_len, at::kLong).unsqueeze(1);
  at::Tensor k = at::arange(seq_len, at::kLong).unsqueeze(0);
  at::Tensor visible = k <= q;
  if (window > 0) visible = visible.logical_and(k > q - window);
  double min = dtype == at::kBFloat16 ? -3.3895313892515355e38
               : dtype == at::kHalf   ? -65504.0
               : dtype == at::kFloat  ? static_cast<double>(std::numeric_limits<float>::lowest())
                                      : std::numeric_limits<double>::lowest();
  at::Tensor zero = at::scalar_tensor(0.0, at::TensorOptions().dtype(dtype));
  return at::where(visible, zero, at::Scalar(min)).unsqueeze(0).unsqueeze(0);
}

at::Tensor eager_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& mask, double scaling) {
  int64_t n_rep = q.size(1) / k.size(1);
  at::Tensor keys = repeat_kv(k, n_rep);
  at::Tensor values = repeat_kv(v, n_rep);
  at::Tensor w = at::matmul(q, keys.transpose(2, 3)) * scaling;
  w = w + mask.slice(3, 0, keys.size(-2));
  w = at::softmax(w, -1, at::kFloat).to(q.scalar_type());
  at::Tensor out = at::matmul(w, values);
  return out.transpose(1, 2).contiguous();
}

void unsupported(const std::string& where, const std::string& key, const Json& value,
                 const std::string& why) {
  throw Error("model.unsupported",
              where + ": " + key + " = " + value.dump() + " is not supported (" + why + ")");
}

namespace {
const Json* field(const Json& c, const std::string& key) {
  if (!c.is_object() || !c.contains(key) || c[key].is_null()) return nullptr;
  return &c[key];
}
[[noreturn]] void bad(const std::string& where, const std::string& key, const char* want,
                      const Json& got) {
  throw Error("model.bad_config", where + ": " + key + " must be " + want + ", got " + got.dump());
}
}  // namespace

int64_t config_int(const Json& c, const std::string& key, const std::string& where) {
  const Json* v = field(c, key);
  if (!v) throw Error("model.bad_config", where + ": missing " + key);
  if (!v->is_number_integer()) bad(where, key, "an integer", *v);
  return v->get<int64_t>();
}

int64_t config_int(const Json& c, const std::string& key, int64_t fallback,
                   const std::string& where) {
  return field(c, key) ? config_int(c, key, where) : fallback;
}

double config_double(const Json& c, const std::string& key, double fallback,
                     const std::string& where) {
  const Json* v = field(c, key);
  if (!v) return fallback;
  if (!v->is_number()) bad(where, key, "a number", *v);
  return v->get<double>();
}

bool config_bool(const Json& c, const std::string& key, bool fallback, const std::string& where) {
  const Json* v = field(c, key);
  if (!v) return fallback;
  if (!v->is_boolean()) bad(where, key, "a boolean", *v);
  return v->get<bool>();
}

std::string config_string(const Json& c, const std::string& key, const std::string& fallback,
                          const std::string& where) {
  const Json* v = field(c, key);
  if (!v) return fallback;
  if (!v->is_string()) bad(where, key, "a string", *v);
  return v->get<std::string>();
}

}  // namespace assay::oracle
