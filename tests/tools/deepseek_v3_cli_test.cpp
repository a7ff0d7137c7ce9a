// The everyday commands on a DeepSeek-V3-family model, end to end through the `forge` binary: train a toy
// DeepseekV3ForCausalLM from its config.json, convert the checkpoint to a Hugging Face folder (fp32 and
// sharded bf16) and back, generate greedily (the same text from the checkpoint and from its fp32 export,
// decoding over MLA's compressed cache), evaluate (the same loss from both), and continue training from the
// Hugging Face folder (model.init_from).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tools/cli_harness.h"

namespace forge::testing::cli::deepseek_v3_cli_test {
namespace {
namespace fs = std::filesystem;

class DeepseekV3Cli : public ScratchDirTest {
 protected:
  void SetUp() override {
    ScratchDirTest::SetUp();
    std::string corpus;
    for (int i = 0; i < 200; ++i)
      corpus += "In the beginning was the word " + std::to_string(i % 13) + ", and the word was light.\n";
    write("corpus.txt", corpus);
    write("deepseek.json", R"({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
      "hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 12, "num_hidden_layers": 3,
      "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24,
      "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
      "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
      "routed_scaling_factor": 2.5, "norm_topk_prob": true, "num_nextn_predict_layers": 1,
      "vocab_size": 300, "max_position_embeddings": 64})");
  }
  std::string train_args(const std::string& run, const std::string& extra = "") const {
    return "train --set model.config=" + path("deepseek.json") + " --set data.corpus=" + path("corpus.txt") +
           " --set data.tokenizer=train --set data.vocab_size=300 --set data.seq_len=32 --set "
           "train.micro_batch=2 --set train.steps=4" +
           " --set train.warmup=1 --set train.dtype=fp32 --set eval.every=0 --set eval.batches=1" +
           " --set data.heldout_fraction=0.05 --set log.peak_gflops=100 --set sample.tokens=0" +
           " --set log.every=1 --set data.cache_dir=" + path("cache") + " --set log.run_dir=" + path(run) +
           extra;
  }
  RunOptions quiet() const { return {Stderr::merged, std::nullopt, "OMP_NUM_THREADS=1"}; }
};

// The text a greedy `forge generate` printed (its stdout, without the speed report on stderr).
std::string greedy_text(const std::string& model) {
  RunOptions o;
  o.stderr_to = Stderr::discarded, o.environment = "OMP_NUM_THREADS=1";
  const Outcome out =
      run_forge("generate --model " + model + " --prompt 'In the' --max-new-tokens 24 --greedy", o);
  EXPECT_EQ(out.status, 0) << out.output;
  return out.output;
}

TEST_F(DeepseekV3Cli, TrainConvertGenerateEvalAndContinue) {
  const Outcome train = run_forge(train_args("run"), quiet());
  ASSERT_EQ(train.status, 0) << train.output;
  EXPECT_NE(train.output.find("| maxvio "), std::string::npos) << train.output;  // the step line's balance
  EXPECT_NE(train.output.find("| mtp "), std::string::npos) << train.output;
  // The auxiliary loss and the drops are off by default, and the step line says nothing of them.
  EXPECT_EQ(train.output.find(" aux "), std::string::npos) << train.output;
  EXPECT_EQ(train.output.find(" drop "), std::string::npos) << train.output;
  const std::string checkpoint = path("run") + "/checkpoint";

  const Outcome to_hf = run_forge("convert --input " + checkpoint + " --output " + path("hf"), quiet());
  ASSERT_EQ(to_hf.status, 0) << to_hf.output;
  std::ifstream config_in(path("hf") + "/config.json");
  const nlohmann::json config = nlohmann::json::parse(config_in);
  EXPECT_EQ(config["architectures"][0], "DeepseekV3ForCausalLM");
  EXPECT_EQ(config["num_nextn_predict_layers"], 1);
  // Sharded bf16, and back to a forge checkpoint.
  const Outcome bf16 = run_forge("convert --input " + checkpoint + " --output " + path("hf_bf16") +
                                     " --dtype bf16 --max-shard-size 40000",
                                 quiet());
  ASSERT_EQ(bf16.status, 0) << bf16.output;
  EXPECT_TRUE(fs::exists(path("hf_bf16") + "/model.safetensors.index.json"));
  const Outcome back = run_forge(
      "convert --input " + path("hf_bf16") + " --output " + path("forge_again") + " --to forge", quiet());
  ASSERT_EQ(back.status, 0) << back.output;

  const std::string text = greedy_text(checkpoint);
  EXPECT_GT(text.size(), std::string("In the").size());
  EXPECT_EQ(greedy_text(path("hf")), text);
  EXPECT_FALSE(greedy_text(path("forge_again")).empty());

  // The run's learnt tokenizer travels with the checkpoint and its export.
  ASSERT_TRUE(fs::exists(path("hf") + "/tokenizer.json"));
  const Outcome data = run_forge("data preprocess --input " + path("corpus.txt") + " --tokenizer " +
                                     path("hf") + "/tokenizer.json --output-prefix " + path("tokens"),
                                 quiet());
  ASSERT_EQ(data.status, 0) << data.output;
  auto eval_loss = [&](const std::string& model) {
    const Outcome e = run_forge("eval --model " + model + " --data " + path("tokens") +
                                    " --seq-len 32 --batch-size 4 --max-sequences 8 --json",
                                quiet());
    EXPECT_EQ(e.status, 0) << e.output;
    const std::string last = e.output.substr(e.output.rfind('{'));
    return nlohmann::json::parse(last)["loss"].get<double>();
  };
  const double loss = eval_loss(checkpoint);
  EXPECT_GT(loss, 0);
  EXPECT_EQ(eval_loss(path("hf")), loss);

  // Training continues from the Hugging Face folder: its first step's loss is that of the converted weights.
  const Outcome more = run_forge(train_args("more", " --set model.init_from=" + path("hf")), quiet());
  ASSERT_EQ(more.status, 0) << more.output;
  EXPECT_NE(more.output.find("step 4/4"), std::string::npos) << more.output;
}

// The classic auxiliary loss and a capacity factor, set from the command line: the step line shows both.
TEST_F(DeepseekV3Cli, AuxLossAndCapacityOnTheStepLine) {
  const Outcome train = run_forge(
      train_args("capped", " --set moe.aux_loss_coeff=0.01 --set moe.capacity_factor=1.0"), quiet());
  ASSERT_EQ(train.status, 0) << train.output;
  EXPECT_NE(train.output.find(" aux "), std::string::npos) << train.output;
  EXPECT_NE(train.output.find(" drop "), std::string::npos) << train.output;
}

TEST_F(DeepseekV3Cli, BadSettingsGetOneLine) {
  expect_one_line_error(train_args("bad", " --set moe.bias_update_rate=-1"), "moe.bias_update_rate");
  expect_one_line_error(train_args("bad", " --set moe.bias_update=mean"), "moe.bias_update");
  expect_one_line_error(train_args("bad", " --set mtp.loss_weight=-0.1"), "mtp.loss_weight");
  expect_one_line_error(train_args("bad", " --set mtp.switch_step=-2"), "mtp.switch_step");
  expect_one_line_error(train_args("bad", " --set moe.aux_loss_coeff=-0.01"), "moe.aux_loss_coeff");
  expect_one_line_error(train_args("bad", " --set moe.aux_loss_coeff=nan"), "moe.aux_loss_coeff");
  expect_one_line_error(train_args("bad", " --set moe.capacity_factor=-1"), "moe.capacity_factor");
  expect_one_line_error(train_args("bad", " --set moe.capacity_factor=inf"), "moe.capacity_factor");
  expect_one_line_error(train_args("bad", " --set moe.pad_to_capacity=true"), "moe.pad_to_capacity");
}

// The GPU path of a DeepSeek-V3 training step, on the host (FORGE_EMULATE_DEVICE=1:
// kernels/emulated_device.h, where host code touching device memory dies and every op's parameters must be
// ones the CUDA backend takes), in bf16 and in FP8 block scaling: every expert's FP8 GEMMs then need their
// rows in multiples of 16, which the sort's padding provides. Widths are multiples of 16 for the same reason.
TEST_F(DeepseekV3Cli, TrainingStepRunsOnTheEmulatedDeviceInFp8) {
  write("deepseek16.json", R"({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
    "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": null,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": true, "num_nextn_predict_layers": 1,
    "vocab_size": 300, "max_position_embeddings": 64})");
  for (const char* fp8 : {"off", "block"}) {
    SCOPED_TRACE(fp8);
    const Outcome o =
        run_forge("bench --model " + path("deepseek16.json") +
                      " --device cuda --batch 2 --seq 32 --grad-accum 2 --steps 1 --warmup 1 --fp8 " + fp8,
                  {Stderr::merged, std::nullopt, "FORGE_EMULATE_DEVICE=1 OMP_NUM_THREADS=1"});
    EXPECT_EQ(o.status, 0) << o.output;
    EXPECT_NE(o.output.find("cuda is emulated on the host"), std::string::npos) << o.output;
  }
}

}  // namespace
}  // namespace forge::testing::cli::deepseek_v3_cli_test
