// VisionEncoder: a Vision Transformer over image patches (Hugging Face CLIPVisionModel / SiglipVisionModel
// semantics), with explicit backward.
//
// The input is each image cut into non-overlapping patches, flattened channel-major ([channels, patch rows,
// patch columns], the order of the convolution weight [hidden, channels, patch, patch]): [images * patches,
// patch_dim] on the host, patches row-major over the image. The patch embedding is then a GEMM. CLIP puts a
// learned class token before the patches and normalises the embeddings (pre_layrnorm); SigLIP does neither
// and has a bias on the patch embedding. Both add learned position embeddings and run pre-norm layers
// x + attn(ln1(x)), x + fc2(gelu(fc1(ln2(x)))) with biased projections and bidirectional attention.
//
// forward returns the hidden states the caller asks for (index 0: the embeddings, after pre_layrnorm; i:
// after layer i), concatenated along channels: [images * positions, hidden * indices]. Only the layers up to
// the deepest index run. backward takes the gradient of those features and accumulates every weight's
// gradient; the pixels need none, so nothing flows out and B and W run together (the encoder has nothing
// downstream waiting on it).
#pragma once

#include <vector>

#include "forge/kernels/ops.h"
#include "forge/nn/bias.h"
#include "forge/nn/compute.h"
#include "forge/nn/layernorm.h"
#include "forge/nn/linear.h"

namespace forge::nn {

struct VisionEncoderShape {
  int64_t hidden = 0, heads = 0, ffn = 0;
  int64_t patch_dim = 0;     // channels * patch * patch
  int64_t patches = 0;       // per image
  bool class_token = false;  // CLIP
  bool pre_norm = false;     // CLIP's pre_layrnorm
  float eps = 1e-5f;
  ops::GeluKind act = ops::GeluKind::quick;
  int64_t positions() const { return patches + (class_token ? 1 : 0); }
  int64_t head_dim() const { return hidden / heads; }
};

// Parameter ids in the store. q, k and v weights are registered one after another (one fused GEMM), their
// biases likewise.
struct VisionLayerParams {
  int norm1_weight = -1, norm1_bias = -1;
  int q = -1, k = -1, v = -1, q_bias = -1, k_bias = -1, v_bias = -1;
  int out = -1, out_bias = -1;
  int norm2_weight = -1, norm2_bias = -1;
  int fc1 = -1, fc1_bias = -1, fc2 = -1, fc2_bias = -1;
};
struct VisionEncoderParams {
  int class_embedding = -1;  // CLIP
  int patch = -1;            // [hidden, channels, patch, patch] (a [hidden, patch_dim] matrix to the GEMM)
  int patch_bias = -1;       // SigLIP
  int position = -1;         // [positions, hidden]
  int pre_norm_weight = -1, pre_norm_bias = -1;  // CLIP
  std::vector<VisionLayerParams> layers;         // the layers that run (up to the deepest feature index)
};

class VisionEncoder {
 public:
  struct LayerSaved {
    LayerNorm::Saved norm1, norm2;
    GemmOperand qkv_in, out_in, fc1_in, fc2_in;
    Tensor qkv, core, lse;  // q|k|v with biases [rows, 3 hidden]; attention output and log-sum-exp
    Tensor fc1_out;         // before the activation [rows, ffn]
  };
  struct Saved {
    int64_t images = 0;
    std::vector<int64_t> indices;
    GemmOperand patches;
    LayerNorm::Saved pre_norm;
    std::vector<LayerSaved> layers;
  };

  VisionEncoder() = default;
  // options: the GEMM dtype and device (the encoder runs unsplit: no tensor parallelism or FP8).
  VisionEncoder(ParameterStore* store, VisionEncoderParams params, VisionEncoderShape shape,
                const ComputeOptions& options);

  const VisionEncoderShape& shape() const { return shape_; }
  int64_t layers() const { return static_cast<int64_t>(layers_.size()); }

  // patches [images * patches, patch_dim] fp32 on the store's device; indices: hidden states 0 .. layers().
  // saved null: inference (nothing kept).
  Tensor forward(const Tensor& patches, int64_t images, const std::vector<int64_t>& indices,
                 Saved* saved) const;
  // dfeatures: the gradient of forward's output. Accumulates every weight gradient; releases saved.
  void backward(const Tensor& dfeatures, Saved& saved) const;

 private:
  struct Layer {
    LayerNorm norm1, norm2;
    Linear qkv, out, fc1, fc2;
    Bias qkv_bias, out_bias, fc1_bias, fc2_bias;
  };
  Tensor embed(const Tensor& patches, int64_t images, Saved* saved) const;
  Tensor layer_forward(const Layer& l, const Tensor& x, int64_t images, LayerSaved* saved) const;
  // dx of the layer's input, from dy of its output; then its weight gradients.
  Tensor layer_backward(const Layer& l, const Tensor& dy, int64_t images, LayerSaved& saved) const;
  void embed_backward(const Tensor& dx, Saved& saved) const;
  void attention(const Tensor& qkv, int64_t images, Tensor& core, Tensor& lse) const;

  ParameterStore* store_ = nullptr;
  VisionEncoderParams params_;
  VisionEncoderShape shape_;
  ComputeOptions options_;
  Linear patch_;
  Bias patch_bias_;
  LayerNorm pre_norm_;
  std::vector<Layer> layers_;
};

}  // namespace forge::nn
