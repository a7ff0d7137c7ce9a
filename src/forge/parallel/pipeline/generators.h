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

}  // namespace forge::pipeline
