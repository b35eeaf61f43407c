#pragma once
// Reduction kernels. f16/bf16 are widened to f32 for the arithmetic and rounded once per call.
#include <cstddef>
#include <string_view>

#include "core/dtype.h"

namespace conduit {

enum class ReduceOp : uint8_t { sum = 0, avg, min, max, prod };

const char* reduce_op_name(ReduceOp op);
ReduceOp parse_reduce_op(std::string_view name);  // ConfigError listing sum, avg, min, max, prod
const char* reduce_op_names_allowed();            // "sum, avg, min, max, prod"

// acc[i] = op(acc[i], in[i]) for i < count. avg reduces as sum; call finalize_avg once at the end.
void reduce_into(void* acc, const void* in, size_t count, DType dtype, ReduceOp op);
// out[i] = op(a[i], b[i]); out may alias a or b. Sum and prod are commutative here, NaN payloads aside: of two NaNs
// either may come out (the compiler may swap the operands, and x86 returns the first one's), so an algorithm whose
// ranks must end with the same bits reduces with the same accumulator on every rank (min and max are symmetric).
void reduce_to(void* out, const void* a, const void* b, size_t count, DType dtype, ReduceOp op);
// buf[i] /= n (integer types truncate toward zero).
void finalize_avg(void* buf, size_t count, DType dtype, int n);
// Whether avg divides each rank's input before the sum (out = in / n, then a sum, no finalize_avg): f16, whose sum
// of n in-range values overflows its 65504 where the average does not (NCCL pre-multiplies floats the same way).
// Integers and the wide float types sum first and divide once: an integer sum wraps as sum itself does (i8, 4 ranks
// of 100: -112 / 4 = -28), as NCCL's avg on integers does; dividing first would truncate every rank's share.
inline bool avg_divides_first(DType dtype) { return dtype == DType::f16; }
void prescale_avg(const void* in, void* out, size_t count, DType dtype, int n);  // out may be in

}  // namespace conduit
