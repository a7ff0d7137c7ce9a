#include "forge/parallel/layout.h"

#include "forge/core/error.h"

namespace forge::parallel {
namespace {

void check_size(std::string_view key, int value) {
  if (value < 1) fail("parallel.{} must be >= 1, got {}", key, value);
}

}  // namespace

const char* dim_name(Dim dim) {
  switch (dim) {
    case Dim::tp:
      return "tp";
    case Dim::cp:
      return "cp";
    case Dim::dp:
      return "dp";
    case Dim::pp:
      return "pp";
    case Dim::ep:
      return "ep";
    case Dim::expert_dp:
      return "expert_dp";
    case Dim::dp_cp:
      return "dp_cp";
    case Dim::model_parallel:
      return "model_parallel";
    case Dim::world:
      return "world";
  }
  return "?";
}

Layout::Layout(const LayoutSpec& spec, int world_size, int world_rank) {
  check_size("tp", spec.tp);
  check_size("cp", spec.cp);
  check_size("pp", spec.pp);
  check_size("ep", spec.ep);
  if (spec.dp < 0) fail("parallel.dp must be >= 1 (or 0 = derived from the world size), got {}", spec.dp);
  if (world_size < 1) fail("parallel layout: the world size must be >= 1, got {}", world_size);
  if (world_rank < 0 || world_rank >= world_size)
    fail("parallel layout: rank {} is outside the world of {} ranks", world_rank, world_size);

  // 64-bit products: a wild config must get the error below, not an overflow that happens to match.
  const int64_t per_replica = int64_t{spec.tp} * spec.cp * spec.pp;
  int64_t dp = spec.dp;
  if (dp == 0) {
    if (world_size % per_replica != 0)
      fail(
          "parallel layout tp={} x cp={} x pp={} = {} ranks per data-parallel replica does not divide "
          "the job's {} ranks (mpirun -np)",
          spec.tp, spec.cp, spec.pp, per_replica, world_size);
    dp = world_size / per_replica;
  } else if (per_replica * dp != world_size) {
    fail("parallel layout tp={} x cp={} x dp={} x pp={} = {} ranks, but the job has {} (mpirun -np)", spec.tp,
         spec.cp, dp, spec.pp, per_replica * dp, world_size);
  }
  if ((dp * spec.cp) % spec.ep != 0)
    fail(
        "parallel.ep = {} does not divide dp x cp = {} x {} = {} (expert-parallel groups are carved "
        "from the data- and context-parallel ranks)",
        spec.ep, dp, spec.cp, dp * spec.cp);

  world_size_ = world_size;
  world_rank_ = world_rank;
  tp_ = spec.tp;
  cp_ = spec.cp;
  dp_ = static_cast<int>(dp);
  pp_ = spec.pp;
  ep_ = spec.ep;
  coordinates_ = coordinates_of(world_rank);
}

int Layout::size(Dim dim) const {
  switch (dim) {
    case Dim::tp:
      return tp_;
    case Dim::cp:
      return cp_;
    case Dim::dp:
      return dp_;
    case Dim::pp:
      return pp_;
    case Dim::ep:
      return ep_;
    case Dim::expert_dp:
      return expert_dp();
    case Dim::dp_cp:
      return dp_ * cp_;
    case Dim::model_parallel:
      return tp_ * pp_;
    case Dim::world:
      return world_size_;
  }
  return 0;
}

Coordinates Layout::coordinates_of(int world_rank) const {
  if (world_rank < 0 || world_rank >= world_size_)
    fail("parallel layout: rank {} is outside the world of {} ranks", world_rank, world_size_);
  Coordinates c;
  int rest = world_rank;
  c.tp = rest % tp_;
  rest /= tp_;
  c.cp = rest % cp_;
  rest /= cp_;
  c.dp = rest % dp_;
  c.pp = rest / dp_;
  const int flat = c.cp + cp_ * c.dp;  // position among the dp x cp ranks, cp fastest
  c.ep = flat % ep_;
  c.expert_dp = flat / ep_;
  return c;
}

int Layout::coordinate_of(int world_rank, Dim dim) const {
  const Coordinates c = coordinates_of(world_rank);
  switch (dim) {
    case Dim::tp:
      return c.tp;
    case Dim::cp:
      return c.cp;
    case Dim::dp:
      return c.dp;
    case Dim::pp:
      return c.pp;
    case Dim::ep:
      return c.ep;
    case Dim::expert_dp:
      return c.expert_dp;
    case Dim::dp_cp:
      return c.cp + cp_ * c.dp;
    case Dim::model_parallel:
      return c.tp + tp_ * c.pp;
    case Dim::world:
      return world_rank;
  }
  return 0;
}

int Layout::rank_of(int tp_rank, int cp_rank, int dp_rank, int pp_rank) const {
  if (tp_rank < 0 || tp_rank >= tp_ || cp_rank < 0 || cp_rank >= cp_ || dp_rank < 0 || dp_rank >= dp_ ||
      pp_rank < 0 || pp_rank >= pp_)
    fail("parallel layout: coordinates tp {}, cp {}, dp {}, pp {} are outside tp {} x cp {} x dp {} x pp {}",
         tp_rank, cp_rank, dp_rank, pp_rank, tp_, cp_, dp_, pp_);
  return tp_rank + tp_ * (cp_rank + cp_ * (dp_rank + dp_ * pp_rank));
}

std::vector<int> Layout::group_ranks_of(int world_rank, Dim dim) const {
  const Coordinates c = coordinates_of(world_rank);
  std::vector<int> ranks;
  ranks.reserve(size(dim));
  // Rank of the (cp, dp) position `flat` (cp fastest) at this rank's tp and pp.
  auto at_flat = [&](int flat) { return rank_of(c.tp, flat % cp_, flat / cp_, c.pp); };
  switch (dim) {
    case Dim::tp:
      for (int i = 0; i < tp_; ++i) ranks.push_back(rank_of(i, c.cp, c.dp, c.pp));
      break;
    case Dim::cp:
      for (int i = 0; i < cp_; ++i) ranks.push_back(rank_of(c.tp, i, c.dp, c.pp));
      break;
    case Dim::dp:
      for (int i = 0; i < dp_; ++i) ranks.push_back(rank_of(c.tp, c.cp, i, c.pp));
      break;
    case Dim::pp:
      for (int i = 0; i < pp_; ++i) ranks.push_back(rank_of(c.tp, c.cp, c.dp, i));
      break;
    case Dim::ep:
      for (int i = 0; i < ep_; ++i) ranks.push_back(at_flat(c.expert_dp * ep_ + i));
      break;
    case Dim::expert_dp:
      for (int i = 0; i < expert_dp(); ++i) ranks.push_back(at_flat(i * ep_ + c.ep));
      break;
    case Dim::dp_cp:
      for (int i = 0; i < dp_ * cp_; ++i) ranks.push_back(at_flat(i));
      break;
    case Dim::model_parallel:
      for (int p = 0; p < pp_; ++p)
        for (int t = 0; t < tp_; ++t) ranks.push_back(rank_of(t, c.cp, c.dp, p));
      break;
    case Dim::world:
      for (int i = 0; i < world_size_; ++i) ranks.push_back(i);
      break;
  }
  return ranks;
}

std::string Layout::describe() const {
  const Coordinates& c = coordinates_;
  std::string experts = ep_ == 1 ? "ep 1" : fmt::format("ep {} x expert_dp {}", ep_, expert_dp());
  std::string text = fmt::format(
      "layout: world {} = tp {} x cp {} x dp {} x pp {} ({}) | rank {}: tp {}, cp {}, dp {}, pp {}",
      world_size_, tp_, cp_, dp_, pp_, experts, world_rank_, c.tp, c.cp, c.dp, c.pp);
  if (ep_ > 1) text += fmt::format(", ep {}, expert_dp {}", c.ep, c.expert_dp);
  return text;
}

void validate_model_fit(const Layout& layout, const ModelDims& dims, int64_t vocab_divisible_by) {
  auto positive = [](std::string_view key, int64_t value) {
    if (value < 1) fail("{} must be >= 1, got {}", key, value);
  };
  positive("hidden_size", dims.hidden);
  positive("num_attention_heads", dims.heads);
  positive("num_key_value_heads", dims.kv_heads);
  positive("intermediate_size", dims.ffn);
  positive("vocab_size", dims.vocab);
  positive("num_hidden_layers", dims.layers);
  if (vocab_divisible_by < 1)
    fail("parallel.make_vocab_size_divisible_by must be >= 1, got {}", vocab_divisible_by);

  // Tensor parallelism splits the attention heads (q|k|v columns, output-projection rows), the FFN width
  // and the (padded) vocabulary; the hidden size itself is never split, so it needs no rule of its own.
  const int tp = layout.tp();
  if (dims.heads % tp != 0) fail("parallel.tp = {} does not divide num_attention_heads = {}", tp, dims.heads);
  if (dims.kv_heads % tp != 0 && tp % dims.kv_heads != 0)
    fail(
        "parallel.tp = {} and num_key_value_heads = {}: one must divide the other (kv heads are split "
        "across the tp ranks, or replicated when tp exceeds them)",
        tp, dims.kv_heads);
  if (dims.ffn % tp != 0) fail("parallel.tp = {} does not divide intermediate_size = {}", tp, dims.ffn);
  // How the layers split into pipeline stages is the pipeline's to check (pipeline::stage_layer_counts:
  // even splits, or parallel.pp_layers); here only that every stage can hold one.
  if (dims.layers < layout.pp())
    fail("parallel.pp = {} exceeds num_hidden_layers = {}: every pipeline stage needs at least one layer",
         layout.pp(), dims.layers);
}

int64_t padded_vocab_size(int64_t vocab, int64_t divisible_by, int tp) {
  if (vocab < 1) fail("vocab_size must be >= 1, got {}", vocab);
  if (divisible_by < 1) fail("parallel.make_vocab_size_divisible_by must be >= 1, got {}", divisible_by);
  if (tp < 1) fail("parallel.tp must be >= 1, got {}", tp);
  if (tp == 1) return vocab;
  const int64_t multiple = divisible_by * tp;
  return (vocab + multiple - 1) / multiple * multiple;
}

comm::Communicator& ParallelGroups::get(Dim dim) const {
  const std::unique_ptr<comm::Communicator>* group = nullptr;
  switch (dim) {
    case Dim::tp:
      group = &tp;
      break;
    case Dim::cp:
      group = &cp;
      break;
    case Dim::dp:
      group = &dp;
      break;
    case Dim::pp:
      group = &pp;
      break;
    case Dim::ep:
      group = &ep;
      break;
    case Dim::expert_dp:
      group = &expert_dp;
      break;
    case Dim::dp_cp:
      group = &dp_cp;
      break;
    case Dim::model_parallel:
      group = &model_parallel;
      break;
    case Dim::world:
      break;
  }
  if (!group)
    fail("ParallelGroups holds no '{}' group: use the communicator the groups were made from", dim_name(dim));
  if (!*group) fail("ParallelGroups: the '{}' group was not made (use make_groups)", dim_name(dim));
  return **group;
}

ParallelGroups make_groups(comm::Communicator& world, const Layout& layout) {
  if (world.size() != layout.world_size() || world.rank() != layout.world_rank())
    fail("make_groups: communicator '{}' is rank {} of {}, but the layout was built for rank {} of {}",
         world.name(), world.rank(), world.size(), layout.world_rank(), layout.world_size());
  ParallelGroups groups;
  // Every rank splits along every dimension in the same order (split is collective). A group's color is its
  // smallest world rank (unique per group); the key is the position in the group, so a group's ranks are
  // numbered like the layout's coordinates.
  auto split = [&](Dim dim) {
    std::unique_ptr<comm::Communicator> group =
        world.split(layout.group_ranks(dim).front(), layout.coordinate(dim), dim_name(dim));
    FORGE_CHECK(group && group->size() == layout.size(dim) && group->rank() == layout.coordinate(dim),
                "group '{}' came out with rank {} of {}, expected rank {} of {}", dim_name(dim),
                group ? group->rank() : -1, group ? group->size() : -1, layout.coordinate(dim),
                layout.size(dim));
    group->set_timeout_seconds(world.timeout_seconds());
    return group;
  };
  groups.tp = split(Dim::tp);
  groups.cp = split(Dim::cp);
  groups.dp = split(Dim::dp);
  groups.pp = split(Dim::pp);
  groups.ep = split(Dim::ep);
  groups.expert_dp = split(Dim::expert_dp);
  groups.dp_cp = split(Dim::dp_cp);
  groups.model_parallel = split(Dim::model_parallel);
  return groups;
}

}  // namespace forge::parallel
