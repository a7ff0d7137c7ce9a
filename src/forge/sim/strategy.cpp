#include "forge/sim/strategy.h"

#include <fmt/format.h>

namespace forge::sim {
namespace {

// Selective recompute's modules, short: "attn,mlp,moe,norm,up".
std::string short_modules(uint32_t modules) {
  using nn::RecomputeModule;
  std::string out;
  for (const auto& [module, name] :
       {std::pair{RecomputeModule::core_attn, "attn"}, std::pair{RecomputeModule::mlp_act, "mlp"},
        std::pair{RecomputeModule::moe_act, "moe"}, std::pair{RecomputeModule::norm, "norm"},
        std::pair{RecomputeModule::mla_up_proj, "up"}})
    if (modules & nn::module_bit(module)) {
      if (!out.empty()) out += ',';
      out += name;
    }
  return out;
}

}  // namespace

std::string Strategy::describe() const {
  std::string out = fmt::format("tp{} pp{} dp{}", tp, pp, dp);
  if (cp > 1)
    out += fmt::format(" cp{}{}", cp, cp_comm == parallel::ContextAttention::all_to_all ? ":a2a" : "");
  if (ep > 1) out += fmt::format(" ep{}", ep);
  if (pp > 1)
    out += fmt::format(" {}{}", pipeline::schedule_name(schedule),
                       schedule == pipeline::ScheduleKind::interleaved ? fmt::format("x{}", vpp) : "");
  if (pp > 1 && !pp_layers.empty()) out += " uneven";
  out += fmt::format(" mb{}x{}", micro_batch, grad_accum);
  if (recompute != nn::Recompute::none)
    out += fmt::format(" rc:{}{}{}", nn::recompute_name(recompute),
                       recompute == nn::Recompute::selective && recompute_modules != 0
                           ? fmt::format("[{}]", short_modules(recompute_modules))
                           : "",
                       recompute_layers > 0 ? fmt::format("/{}", recompute_layers) : "");
  if (distributed_optimizer && dp > 1) out += " zero1";
  if (optimizer_offload) out += " offload";
  if (sequence_parallel && tp > 1) out += " sp";
  if (fp8) out += " fp8:" + fp8_recipe;
  if (moe_capacity_factor > 0)
    out += fmt::format(" cf{:g}{}", moe_capacity_factor, moe_pad_to_capacity ? " padded" : "");
  return out;
}

std::string Strategy::set_line() const {
  std::string out = fmt::format("--set parallel.tp={} --set parallel.pp={} --set parallel.dp={}", tp, pp, dp);
  if (cp > 1)
    out += fmt::format(" --set parallel.cp={} --set parallel.cp_comm={}", cp,
                       parallel::context_attention_setting(cp_comm));
  if (ep > 1) out += fmt::format(" --set parallel.ep={}", ep);
  if (pp > 1) out += fmt::format(" --set parallel.schedule={}", pipeline::schedule_name(schedule));
  if (pp > 1 && !pp_layers.empty()) out += " --set parallel.pp_layers=" + pp_layers;
  if (pp > 1 && schedule == pipeline::ScheduleKind::interleaved)
    out += fmt::format(" --set parallel.vpp={}", vpp);
  if (tp > 1) out += fmt::format(" --set parallel.sequence_parallel={}", sequence_parallel);
  if (dp > 1) out += fmt::format(" --set parallel.distributed_optimizer={}", distributed_optimizer);
  if (optimizer_offload) out += " --set train.optimizer_offload=true";
  out += fmt::format(" --set train.micro_batch={} --set train.grad_accum={} --set train.recompute={}",
                     micro_batch, grad_accum, nn::recompute_name(recompute));
  if (recompute != nn::Recompute::none && recompute_layers > 0)
    out += fmt::format(" --set train.recompute_layers={}", recompute_layers);
  if (recompute == nn::Recompute::selective && recompute_modules != 0)
    out += " --set train.recompute_modules=" + nn::recompute_modules_names(recompute_modules);
  if (fp8) out += " --set fp8.recipe=" + fp8_recipe;
  if (moe_capacity_factor > 0)
    out += fmt::format(" --set moe.capacity_factor={:g} --set moe.pad_to_capacity={}", moe_capacity_factor,
                       moe_pad_to_capacity);
  if (ep > 1 && !ep_overlap) out += " --set parallel.ep_overlap=false";
  return out;
}

}  // namespace forge::sim
