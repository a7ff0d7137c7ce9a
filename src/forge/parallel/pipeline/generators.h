// The schedule generators behind make_schedule (schedule.h). Each returns compute-only action lists with
// their placement; make_schedule checks the request first and adds the communication after.
#pragma once

#include "forge/parallel/pipeline/schedule.h"

namespace forge::pipeline {

// Megatron's one-forward-one-backward: rank r runs P-1-r warm-up forwards, then alternates F and B.
Schedule generate_1f1b(int ranks, int micro_batches);
// Megatron's interleaved 1F1B: vpp chunks per rank (stage c*P + r), micro-batches in groups of P per chunk.
Schedule generate_interleaved(int ranks, int vpp, int micro_batches);
// Zero-bubble schedules (Qi et al.): B split into I and W, the W placed where the rank would wait (under
// unit costs). ZB-H1 keeps 1F1B's order of F and I and its peak memory; ZB-V (stages r and 2P-1-r on rank
// r) runs DualPipeV's phases without the overlap.
Schedule generate_zb_h1(int ranks, int micro_batches);
Schedule generate_zbv(int ranks, int micro_batches);
// DualPipe (v = false: two mirrored directions over P ranks) and DualPipeV (v = true: one direction over
// the V placement), in DeepSeek's eight phases with overlapped forward + backward pairs.
Schedule generate_dualpipe(int ranks, int micro_batches, bool v);

// Expert parallelism's overlap in the interleaved schedule (Megatron's combined 1F1B): each steady-state
// forward and the backward after it (of another chunk or micro-batch) become one overlapped pair, whose
// halves interleave at their all-to-alls. A pair takes both of its inputs before it starts, which can hold
// up the ranks that feed it: every pairing at once is kept when the list still runs to the end and takes no
// longer under unit costs with pairs that hide nothing (F&B = F + B); else each pair alone, in order, on
// that condition. So pairs never lengthen the step and gain whatever their overlap hides. (Plain 1F1B is
// not paired: there a backward's gradient comes from the rank a pair's forward feeds, which serialises the
// stages, 15 -> 22.5 units at P = 2 with 4 micro-batches.)
Schedule pair_forward_backward(const Schedule& compute_only);

}  // namespace forge::pipeline
