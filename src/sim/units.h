#pragma once
// Quantities with units, as written in cluster files and on the command line: "312 TFLOP/s", "200 Gb/s",
// "300 GB/s", "0.7 us", "80 GiB". Everything inside the simulator is SI: seconds, bytes, bytes/s, FLOP/s.
// Parse failures are ConfigErrors naming the field and the units allowed.
#include <string>
#include <string_view>

namespace conduit::sim {

double parse_bandwidth(std::string_view text, std::string_view field);  // -> bytes/s (b/s and B/s, K/M/G/T decimal)
double parse_duration(std::string_view text, std::string_view field);   // -> seconds (ns, us, ms, s)
double parse_size(std::string_view text, std::string_view field);       // -> bytes (B, KB.., KiB..)
double parse_flops(std::string_view text, std::string_view field);      // -> FLOP/s (GFLOP/s, TFLOP/s, PFLOP/s)

std::string format_seconds(double s);      // "12.3 ms", "850 us", "1.20 s"
std::string format_bandwidth(double bps);  // "25.0 GB/s"
std::string format_gb(double bytes);       // "31.4 GB" (decimal, as the ZeRO paper)

}  // namespace conduit::sim
