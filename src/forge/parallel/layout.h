// The parallel layout: how the world's ranks split into tensor (tp), context (cp), data (dp), pipeline (pp)
// and expert (ep) parallel groups, and the communicators of those groups.
//
// Ranks are numbered in Megatron-LM's order, tp fastest, then cp, then dp, then pp:
//   world_rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
// so the ranks of one tensor-parallel group are adjacent (on one node, where the bandwidth is) and pipeline
// stages are the farthest apart. Expert parallelism does not add ranks: as in Megatron, the dp x cp ranks of
// one (tp, pp) position are flattened (cp fastest) and cut into consecutive runs of ep ranks (one expert-
// parallel group each); ranks at the same place in every run form the expert-data-parallel group.
//
// The mapping is pure arithmetic (testable in one process); make_groups() turns it into communicators.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "forge/comm/comm.h"

namespace forge::parallel {

// Sizes as configured ([parallel] in the run config). dp = 0 means "whatever the world leaves":
// world_size / (tp * cp * pp).
struct LayoutSpec {
  int tp = 1, pp = 1, dp = 0, cp = 1, ep = 1;
  bool operator==(const LayoutSpec&) const = default;
};

// A dimension along which ranks form groups.
enum class Dim : uint8_t {
  tp,
  cp,
  dp,
  pp,
  ep,              // expert parallel: a run of ep ranks inside dp x cp
  expert_dp,       // the ranks holding the same experts: (dp * cp) / ep of them
  dp_cp,           // dp and cp together: the ranks that reduce gradients of the dense parameters
  model_parallel,  // tp x pp: the ranks holding the parts of one model replica
  world,
};
inline constexpr Dim kAllDims[] = {
    Dim::tp, Dim::cp, Dim::dp, Dim::pp, Dim::ep, Dim::expert_dp, Dim::dp_cp, Dim::model_parallel, Dim::world};
const char* dim_name(Dim dim);  // "tp", ..., "expert_dp", "dp_cp", "model_parallel", "world"

// Where one rank sits. ep and expert_dp are derived from (cp, dp): with f = cp + cp_size * dp,
// ep = f % ep_size and expert_dp = f / ep_size.
struct Coordinates {
  int tp = 0, cp = 0, dp = 0, pp = 0, ep = 0, expert_dp = 0;
  bool operator==(const Coordinates&) const = default;
};

class Layout {
 public:
  // Checks the spec against the world before anything is built: every size >= 1 (dp may be 0 = derived),
  // tp * cp * dp * pp == world_size, ep divides dp * cp, 0 <= world_rank < world_size. Throws forge::Error
  // with one line naming the numbers.
  Layout(const LayoutSpec& spec, int world_size, int world_rank);

  int world_size() const { return world_size_; }
  int world_rank() const { return world_rank_; }
  int tp() const { return tp_; }
  int cp() const { return cp_; }
  int dp() const { return dp_; }
  int pp() const { return pp_; }
  int ep() const { return ep_; }
  int expert_dp() const { return dp_ * cp_ / ep_; }
  LayoutSpec spec() const { return {tp_, pp_, dp_, cp_, ep_}; }  // dp resolved

  // Number of ranks in a group along `dim` (the same for every group of that dimension).
  int size(Dim dim) const;

  // This rank's coordinates; coordinate(dim) is also its rank inside its group along dim.
  const Coordinates& coordinates() const { return coordinates_; }
  int coordinate(Dim dim) const { return coordinate_of(world_rank_, dim); }

  // Any rank's coordinates, and back.
  Coordinates coordinates_of(int world_rank) const;
  int coordinate_of(int world_rank, Dim dim) const;
  int rank_of(int tp_rank, int cp_rank, int dp_rank, int pp_rank) const;

  // World ranks of this rank's (or any rank's) group along dim, ordered by position in the group (which
  // is also ascending world rank).
  std::vector<int> group_ranks(Dim dim) const { return group_ranks_of(world_rank_, dim); }
  std::vector<int> group_ranks_of(int world_rank, Dim dim) const;

  // For the run log: "layout: world 4 = tp 2 x cp 1 x dp 2 x pp 1 (ep 1) | rank 3: tp 1, cp 0, dp 1, pp 0".
  std::string describe() const;

 private:
  int world_size_ = 1, world_rank_ = 0;
  int tp_ = 1, cp_ = 1, dp_ = 1, pp_ = 1, ep_ = 1;
  Coordinates coordinates_;
};

// The shapes of a model that parallelism splits, as plain numbers (models depend on parallel, not the
// reverse). Names follow Hugging Face's config.json.
struct ModelDims {
  int64_t hidden = 0;    // hidden_size
  int64_t heads = 0;     // num_attention_heads
  int64_t kv_heads = 0;  // num_key_value_heads
  int64_t ffn = 0;       // intermediate_size
  int64_t vocab = 0;     // vocab_size
  int64_t layers = 0;    // num_hidden_layers
};

// Checks that the model splits under the layout: tp divides the attention heads and the FFN width; the kv
// heads are split by tp or (when tp exceeds them) replicated, so kv_heads % tp == 0 or tp % kv_heads == 0;
// every pipeline stage gets a layer (pp <= layers; pipeline::stage_layer_counts splits them). The vocabulary
// is padded (padded_vocab_size), not checked. Throws forge::Error
// "parallel.tp = 3 does not divide num_attention_heads = 8" for the first rule broken.
void validate_model_fit(const Layout& layout, const ModelDims& dims, int64_t vocab_divisible_by);

// Megatron's vocabulary padding: vocab rounded up to a multiple of divisible_by * tp, so that every
// tensor-parallel rank holds an equal, aligned slice of the embedding and output layer. With tp == 1 the
// vocabulary is left as it is (a one-rank model keeps the shapes of its config.json).
int64_t padded_vocab_size(int64_t vocab, int64_t divisible_by, int tp);

// One communicator per dimension, each named after it ("tp", "cp", "dp", ...), for this rank's groups.
struct ParallelGroups {
  std::unique_ptr<comm::Communicator> tp, cp, dp, pp, ep, expert_dp, dp_cp, model_parallel;

  // The group along dim (not Dim::world: that is the communicator the groups were made from).
  comm::Communicator& get(Dim dim) const;
};

// Collective over world (every rank calls it, with the same layout spec): splits world into the layout's
// groups. Each group inherits world's timeout. world must have the layout's size and this rank's rank.
ParallelGroups make_groups(comm::Communicator& world, const Layout& layout);

}  // namespace forge::parallel
