// Shared by the pretrained-model tests: a tiny LLaMA config and model, weight fillers, file helpers and
// a fixture with a private temporary directory.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "forge/models/llama/llama_model.h"
#include "forge/models/pretrained.h"
#include "forge/ckpt/safetensors.h"

namespace forge::pretrained_testing {
using namespace forge::models; using namespace forge::ckpt;

namespace fs = std::filesystem;
using nlohmann::json;

inline const nn::ComputeOptions kFp32{DType::f32, nn::Recompute::none};

inline json tiny_config_json(bool tied) {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_size", 16},
          {"intermediate_size", 24},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 2},
          {"num_key_value_heads", 1},
          {"head_dim", 8},
          {"vocab_size", 32},
          {"tie_word_embeddings", tied},
          {"max_position_embeddings", 16},
          {"rms_norm_eps", 1e-5},
          {"rope_theta", 10000.0},
          {"bos_token_id", 1}};
}

inline std::unique_ptr<LlamaModel> tiny_model(bool tied, uint64_t seed, nn::ComputeOptions options = kFp32) {
  auto model = std::make_unique<LlamaModel>(LlamaConfig::from_json(tiny_config_json(tied), "tiny"), options);
  model->initialize(seed);
  return model;
}

// Overwrites every weight with finite values of every magnitude (fp32 bits with exponents 2^-30..2^17):
// bf16 and fp16 rounding ties, fp16 subnormals and fp16 overflow all occur.
inline void fill_with_wide_values(ParameterStore& params, uint32_t seed) {
  float* w = params.params().f32();
  uint32_t state = seed;
  for (int64_t i = 0; i < params.numel(); ++i) {
    state = state * 1664525u + 1013904223u;
    const uint32_t exponent = 97 + (state >> 8) % 48;  // biased: 2^-30 .. 2^17
    uint32_t bits = (state & 0x80000000u) | (exponent << 23) | ((state * 2654435761u) & 0x7fffffu);
    if (i % 7 == 0) bits = (bits & 0xffff0000u) | 0x8000u;  // an exact bf16 tie
    std::memcpy(&w[i], &bits, 4);
  }
  params.refresh_bf16();
}

inline HfExportOptions with_dtype(DType dtype) {
  HfExportOptions options;
  options.dtype = dtype;
  return options;
}

inline bool bitwise_equal(const ParameterStore& a, const ParameterStore& b) {
  return a.numel() == b.numel() && std::memcmp(a.params().raw(), b.params().raw(), a.params().bytes()) == 0;
}

inline std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

inline json read_json(const fs::path& path) { return json::parse(read_file(path)); }

inline void write_json(const fs::path& path, const json& value) { std::ofstream(path) << value.dump(2); }

// Writes a safetensors file by hand: the 8-byte length, the header text, then `data_bytes` bytes.
inline void write_raw_safetensors(const fs::path& path, const std::string& header, size_t data_bytes) {
  std::ofstream out(path, std::ios::binary);
  const uint64_t length = header.size();
  out.write(reinterpret_cast<const char*>(&length), 8);
  out << header << std::string(data_bytes, '\0');
}

inline std::string fixture(const std::string& name) { return std::string(FORGE_FIXTURE_DIR) + "/" + name; }

class PretrainedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "forge_pretrained_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path path(const std::string& name) const { return dir_ / name; }

  // A Hugging Face folder holding exactly `tensors` in model.safetensors, with `config`.
  fs::path hf_folder(const std::string& name, const json& config,
                     const std::vector<std::pair<std::string, Tensor>>& tensors) const {
    const fs::path folder = path(name);
    fs::create_directories(folder);
    write_json(folder / "config.json", config);
    write_safetensors((folder / "model.safetensors").string(), tensors, {{"format", "pt"}});
    return folder;
  }

  // The parameters of `model` as (name, tensor) pairs, in store order.
  static std::vector<std::pair<std::string, Tensor>> tensors_of(const LlamaModel& model) {
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (int i = 0; i < model.params().count(); ++i)
      tensors.emplace_back(model.params().info(i).name, model.params().param(i));
    return tensors;
  }

  // The names of hidden staging folders left in dir_ (there must be none).
  std::vector<std::string> leftovers() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir_))
      if (entry.path().filename().string().starts_with("."))
        names.push_back(entry.path().filename().string());
    return names;
  }

  fs::path dir_;
};

}  // namespace forge::pretrained_testing
