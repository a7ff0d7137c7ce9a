// forge convert: a forge checkpoint or a Hugging Face folder in, a Hugging Face folder (or, with
// --to forge, a weights-only forge checkpoint) out.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "forge/core/error.h"
#include "forge/data/tokenizer/tokenizer.h"
#include "forge/models/pretrained.h"

namespace forge::cli {
using namespace forge::models;
using namespace forge::data;
namespace {
namespace fs = std::filesystem;

// Files a Hugging Face folder carries besides the weights; copied when present in the input.
constexpr const char* kCompanionFiles[] = {"tokenizer.json", "tokenizer_config.json",
                                           "generation_config.json", "special_tokens_map.json",
                                           "preprocessor_config.json"};

struct ConvertOptions {
  std::string input, output, to = "hf", dtype = "fp32", max_shard_size = "5GB";
  bool overwrite = false;
  models::SeriesReading reading;
  CLI::Option* dtype_option = nullptr;
  CLI::Option* shard_option = nullptr;
};

// The accepted values are exactly the ones the message (and --help, and the README) lists.
DType export_dtype(const std::string& name) {
  for (const auto& [choice, dtype] :
       {std::pair{"fp32", DType::f32}, std::pair{"bf16", DType::bf16}, std::pair{"fp16", DType::f16}})
    if (name == choice) return dtype;
  fail("convert: --dtype must be fp32, bf16 or fp16, got '{}'", name);
}

// The output replacing its own input (the same folder under another spelling, a link to it, or a folder
// inside the other) would destroy the source: a training checkpoint would lose its optimizer state to a
// weights-only copy of itself.
void check_output_is_not_input(const std::string& input, const std::string& output) {
  std::error_code ec;
  auto normal = [](const std::string& path) {
    std::error_code e;
    fs::path p = fs::weakly_canonical(fs::absolute(path), e);  // resolves links where the path exists
    if (e) p = fs::absolute(path);
    p = p.lexically_normal();
    return p.has_filename() ? p : p.parent_path();  // "dir/" names "dir"
  };
  const fs::path in = normal(input), out = normal(output);
  auto inside = [](const fs::path& inner, const fs::path& outer) {
    return std::mismatch(outer.begin(), outer.end(), inner.begin(), inner.end()).first == outer.end();
  };
  if (in == out || fs::equivalent(input, output, ec))
    fail("convert: --output {} is the input folder {}; write the conversion to another folder", output,
         input);
  if (inside(out, in))
    fail("convert: --output {} lies inside the input folder {}; write the conversion to another folder",
         output, input);
  if (inside(in, out))
    fail("convert: --output {} holds the input folder {}; write the conversion to another folder", output,
         input);
}

int run_convert(const ConvertOptions& o) {
  if (o.input.empty()) fail("convert: --input DIR is required (a forge checkpoint or a Hugging Face folder)");
  if (o.output.empty()) fail("convert: --output DIR is required");
  if (o.to != "hf" && o.to != "forge") fail("convert: --to must be 'hf' or 'forge', got '{}'", o.to);
  check_output_is_not_input(o.input, o.output);
  const bool to_forge = o.to == "forge";
  HfExportOptions options;
  options.overwrite = o.overwrite;
  if (to_forge) {
    // forge checkpoints hold fp32 master weights and one file.
    if (o.dtype_option->count() && export_dtype(o.dtype) != DType::f32)
      fail("convert: --dtype {} does not apply to --to forge (forge checkpoints are fp32)", o.dtype);
    if (o.shard_option->count()) fail("convert: --max-shard-size does not apply to --to forge");
  } else {
    options.dtype = export_dtype(o.dtype);
    try {
      options.max_shard_bytes = parse_byte_size(o.max_shard_size);
    } catch (const Error& e) {
      fail("convert: --max-shard-size: {}", e.what());
    }
  }

  std::unique_ptr<Model> model;
  const PretrainedDir source = read_pretrained(o.input, o.reading, [&](const PretrainedDir& candidate) {
    // A tokenizer is copied only if it loads: a corrupt one would otherwise surface only when the output is
    // used (the error names the file).
    if (const fs::path tokenizer = candidate.dir / "tokenizer.json"; fs::is_regular_file(tokenizer)) {
      try {
        Tokenizer::from_file(tokenizer);
      } catch (const Error& e) {
        fail("convert: refusing to copy a tokenizer that does not load: {}", e.what());
      }
    }
    model = build_model(*candidate.config, nn::ComputeOptions{DType::f32, nn::Recompute::none},
                        StageSpec::whole(), 0.02f, /*with_grads=*/false);
    load_pretrained_weights(candidate, model->params());
  });
  say_source("convert", source);
  for (const char* name : kCompanionFiles)
    if (fs::is_regular_file(source.dir / name)) options.extra_files.push_back(source.dir / name);

  const std::string from = source.describe();
  const double millions = static_cast<double>(model->params().numel()) / 1e6;
  if (to_forge) {
    export_forge_checkpoint(model->params(), source.config_json, o.output, o.overwrite, options.extra_files);
    std::printf("converted %s (%.2fM parameters) to forge checkpoint %s\n", from.c_str(), millions,
                o.output.c_str());
  } else {
    export_hugging_face(model->params(), source.config_json, o.output, options);
    std::printf("converted %s (%.2fM parameters) to Hugging Face folder %s (%s)\n", from.c_str(), millions,
                o.output.c_str(), std::string(dtype_name(options.dtype)).c_str());
  }
  return 0;
}

}  // namespace

void add_convert_command(CLI::App& app, Commands& commands) {
  auto o = std::make_shared<ConvertOptions>();
  auto* convert = app.add_subcommand("convert", "Convert a forge checkpoint or Hugging Face folder (" +
                                                    models::family_names() +
                                                    ") to a Hugging Face folder or a forge checkpoint");
  convert->add_option("-i,--input", o->input, "input directory: a forge checkpoint or a Hugging Face folder");
  convert->add_option("-o,--output", o->output, "output directory (must not exist or be empty)");
  convert
      ->add_option("--to", o->to, "output kind: hf (Hugging Face folder) or forge (weights-only checkpoint)")
      ->capture_default_str();
  o->dtype_option =
      convert->add_option("--dtype", o->dtype, "weight dtype of the Hugging Face output: fp32, bf16 or fp16")
          ->capture_default_str();
  o->shard_option =
      convert
          ->add_option("--max-shard-size", o->max_shard_size,
                       "split weights larger than this into shards, e.g. 5GB, 500MB, 2GiB, 1048576")
          ->capture_default_str();
  add_series_reading_flag(convert, o->reading);
  convert->add_flag("--overwrite", o->overwrite, "replace an existing output folder that holds a model");
  convert->footer(
      "tokenizer.json (which must load), tokenizer_config.json, generation_config.json and\n"
      "special_tokens_map.json are copied when the input has them. Weights must be finite. The output is\n"
      "written under a temporary name and renamed into place; it may not be the input or lie inside it.");
  commands.push_back({convert, [o] { return run_convert(*o); }});
}

}  // namespace forge::cli
