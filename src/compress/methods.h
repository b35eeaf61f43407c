#pragma once
// Constructors of every method, called by the factory in compressor.cc (one file per family of methods).
#include <string>

#include "compress/compressor.h"
#include "compress/detail.h"

namespace conduit::compress::methods {

using detail::ParamReader;

CompressorPtr make_none(const ParamReader& p);
CompressorPtr make_fp16(const ParamReader& p);
CompressorPtr make_bf16(const ParamReader& p);
CompressorPtr make_int8(const ParamReader& p);
CompressorPtr make_uint8(const ParamReader& p);
CompressorPtr make_qsgd(const ParamReader& p);
CompressorPtr make_terngrad(const ParamReader& p);
CompressorPtr make_natural(const ParamReader& p);
CompressorPtr make_signsgd(const ParamReader& p);
CompressorPtr make_signum(const ParamReader& p);
CompressorPtr make_scaled_sign(const ParamReader& p);
CompressorPtr make_efsignsgd(const ParamReader& p);
CompressorPtr make_onebit(const ParamReader& p);
CompressorPtr make_topk(const ParamReader& p);
CompressorPtr make_randk(const ParamReader& p);
CompressorPtr make_threshold(const ParamReader& p);
CompressorPtr make_dgc(const ParamReader& p);
CompressorPtr make_powersgd(const ParamReader& p);
// Error feedback around any compressor: residual e; p = g + e; send C(p); e = p - D(C(p)).
CompressorPtr make_error_feedback(CompressorPtr inner, std::string name);

}  // namespace conduit::compress::methods
