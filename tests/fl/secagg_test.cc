// Secure aggregation (Bonawitz et al., CCS 2017) and the fixed-point codec.
#include "fl/secagg.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "../error_of.h"

namespace conduit::fl {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

uint32_t mask_of(int bits) { return bits == 32 ? 0xFFFFFFFFu : (1u << bits) - 1u; }

using conduit::test::error_of;

SecAggConfig config(int n, int t, int bits, size_t length, uint64_t round_id = 7, int neighbors = 0) {
  SecAggConfig c;
  c.num_clients = n;
  c.threshold = t;
  c.bits = bits;
  c.length = length;
  c.round_id = round_id;
  c.neighbors = neighbors;
  return c;
}

// One round, driven phase by phase; every message travels through its wire form. A client skipped in a phase
// takes no part in the later ones (it dropped out).
struct Harness {
  SecAggConfig cfg;
  SecAggServer server;
  std::vector<SecAggClient> clients;
  std::vector<std::vector<uint32_t>> x;
  std::map<int, std::vector<ShareMsg>> sent;  // each client's shares, as share_keys returned them
  std::map<int, UnmaskMsg> answers;           // each responder's unmask message

  Harness(const SecAggConfig& c, uint64_t seed) : cfg(c), server(c) {
    std::mt19937_64 rng(seed);
    for (int i = 0; i < cfg.num_clients; ++i) {
      clients.emplace_back(cfg, i);
      x.emplace_back(cfg.length);
      for (auto& e : x.back()) e = static_cast<uint32_t>(rng()) & mask_of(cfg.bits);
    }
  }

  void advertise(const std::set<int>& skip = {}) {
    for (auto& c : clients) {
      if (skip.count(c.id())) continue;
      auto bytes = c.advertise().serialize();
      server.add_advertise(AdvertiseMsg::parse(bytes.data(), bytes.size(), cfg.num_clients));
    }
  }
  void share(const std::set<int>& skip = {}) {
    auto u1 = server.advertised();
    for (const auto& a : u1) {
      auto out = clients[a.client].share_keys(u1);
      sent[a.client] = out;
      if (skip.count(a.client)) continue;
      std::vector<ShareMsg> wire;
      for (const auto& m : out) {
        auto bytes = m.serialize();
        wire.push_back(ShareMsg::parse(bytes.data(), bytes.size(), cfg.num_clients));
      }
      server.add_shares(a.client, wire);
    }
  }
  void mask(const std::set<int>& skip = {}) {
    for (int u : server.u2()) {
      auto y = clients[u].mask_input(server.inbox_for(u), x[u].data());
      if (skip.count(u)) continue;
      auto bytes = pack_elements(y.data(), y.size(), cfg.bits);
      server.add_masked_input(u, unpack_elements(bytes.data(), bytes.size(), cfg.bits, cfg.length));
    }
  }
  void unmask(const std::set<int>& skip = {}) {
    auto u3 = server.survivors();
    for (int u : u3) {
      if (skip.count(u)) continue;
      answers[u] = clients[u].unmask(u3);
      auto bytes = answers[u].serialize();
      server.add_unmask(UnmaskMsg::parse(bytes.data(), bytes.size(), cfg.num_clients));
    }
  }
  std::vector<uint32_t> expected() const {
    std::vector<uint32_t> sum(cfg.length, 0);
    for (int u : server.survivors())
      for (size_t i = 0; i < cfg.length; ++i) sum[i] += x[u][i];
    for (auto& e : sum) e &= mask_of(cfg.bits);
    return sum;
  }
  std::vector<uint32_t> run(const std::set<int>& no_share, const std::set<int>& no_mask,
                            const std::set<int>& no_unmask) {
    advertise();
    share(no_share);
    mask(no_mask);
    unmask(no_unmask);
    return server.finish();
  }
};

// ---- protocol ------------------------------------------------------------------------------------------------------

TEST(SecAgg, SumWithoutDropouts32Bits) {
  Harness h(config(5, 3, 32, 3000), 1);  // 3000 elements span three 1024-element keystream chunks
  auto sum = h.run({}, {}, {});
  EXPECT_EQ(h.server.survivors(), (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(sum, h.expected());
  EXPECT_EQ(h.server.finish(), sum);  // a finished round keeps its sum
}

TEST(SecAgg, SumWithoutDropouts16Bits) {
  Harness h(config(5, 3, 16, 1000), 2);
  auto sum = h.run({}, {}, {});
  EXPECT_EQ(sum, h.expected());
  for (uint32_t e : sum) ASSERT_LE(e, 0xFFFFu);
}

TEST(SecAgg, DropBeforeSendingSharesLeavesU2) {
  Harness h(config(5, 3, 32, 257), 3);
  auto sum = h.run({1}, {}, {});
  EXPECT_EQ(h.server.u2(), (std::vector<int>{0, 2, 3, 4}));
  EXPECT_EQ(h.clients[0].u2(), (std::vector<int>{0, 2, 3, 4}));
  EXPECT_EQ(sum, h.expected());
}

TEST(SecAgg, DropAfterSharesIsUnmaskedThroughItsKeyShares) {
  Harness h(config(5, 3, 32, 257), 4);
  auto sum = h.run({}, {0, 3}, {});
  EXPECT_EQ(h.server.survivors(), (std::vector<int>{1, 2, 4}));
  EXPECT_EQ(sum, h.expected());
}

TEST(SecAgg, DropAfterMaskedInputStillCountsItsInput) {
  Harness h(config(5, 3, 32, 257), 5);
  auto sum = h.run({}, {}, {1, 4});  // only t = 3 unmask responses
  EXPECT_EQ(h.server.survivors(), (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(h.server.unmask_count(), 3u);
  EXPECT_EQ(sum, h.expected());
}

TEST(SecAgg, DropoutsInEveryPhaseWithOddBitWidth) {
  Harness h(config(7, 4, 20, 1500), 6);
  auto sum = h.run({6}, {2}, {0});
  EXPECT_EQ(h.server.u2(), (std::vector<int>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(h.server.survivors(), (std::vector<int>{0, 1, 3, 4, 5}));
  EXPECT_EQ(sum, h.expected());
}

TEST(SecAgg, FewerThanThresholdSurvivorsAbortsTheRound) {
  Harness h(config(5, 3, 32, 16), 7);
  h.advertise();
  h.share();
  h.mask({0, 1, 2});
  auto msg = error_of<TooFewClientsError>([&] { h.server.survivors(); });
  EXPECT_THAT(msg, HasSubstr("too few survivors"));
  EXPECT_THROW(h.server.finish(), ProtocolError);
}

TEST(SecAgg, FewerThanThresholdAdvertisersOrSendersIsRefused) {
  Harness h(config(5, 3, 32, 16), 8);
  h.advertise({0, 1, 2});
  EXPECT_THAT(error_of<TooFewClientsError>([&] { h.server.advertised(); }), HasSubstr("too few clients"));
  h.server.add_advertise(h.clients[0].advertise());  // the failed call did not close the phase
  ASSERT_EQ(h.server.advertised().size(), 3u);
  auto u1 = h.server.advertised();
  h.server.add_shares(0, h.clients[0].share_keys(u1));
  h.server.add_shares(3, h.clients[3].share_keys(u1));
  EXPECT_THROW(h.server.u2(), TooFewClientsError);
}

TEST(SecAgg, ServerRefusesToFinishWithThresholdMinusOneResponses) {
  Harness h(config(5, 3, 32, 64), 9);
  h.advertise();
  h.share();
  h.mask();
  h.unmask({0, 1, 2});
  EXPECT_EQ(h.server.unmask_count(), 2u);
  EXPECT_THAT(error_of<TooFewClientsError>([&] { h.server.finish(); }), HasSubstr("only 2 unmask responses"));
  // One more response is all it takes (the refusal changed nothing).
  h.server.add_unmask(h.clients[1].unmask(h.server.survivors()));
  EXPECT_EQ(h.server.finish(), h.expected());
}

TEST(SecAgg, ClientRefusesToRevealBothSharesOfOnePeer) {
  Harness h(config(5, 3, 32, 8), 10);
  h.advertise();
  h.share();
  h.mask();
  auto all = h.server.survivors();
  auto first = h.clients[0].unmask({0, 1, 3, 4});  // 2 declared dropped: its s_sk share is revealed
  ASSERT_EQ(first.key_shares.size(), 1u);
  EXPECT_EQ(first.key_shares[0].first, 2);
  EXPECT_EQ(h.clients[0].unmask({0, 1, 3, 4}), first);  // a plain retry is answered identically
  auto msg = error_of<ProtocolError>([&] { h.clients[0].unmask(all); });
  EXPECT_THAT(msg, HasSubstr("client 2"));
  EXPECT_THAT(msg, HasSubstr("refuses"));
  // The other order: b_2 share first, then a request for s_sk_2.
  h.clients[1].unmask(all);
  EXPECT_THAT(error_of<ProtocolError>([&] { h.clients[1].unmask({0, 1, 3, 4}); }), HasSubstr("client 2"));
}

TEST(SecAgg, ClientChecksSurvivorsAndCallOrder) {
  Harness h(config(5, 3, 32, 8), 11);
  EXPECT_THAT(error_of<ProtocolError>([&] { h.clients[0].unmask({0, 1, 2}); }), HasSubstr("before mask_input"));
  h.advertise();
  h.share({4});  // U2 = {0, 1, 2, 3}
  EXPECT_THAT(error_of<ProtocolError>([&] { h.clients[0].share_keys(h.server.advertised()); }),
              HasSubstr("second time"));
  auto& c = h.clients[0];
  auto y = c.mask_input(h.server.inbox_for(0), h.x[0].data());
  EXPECT_THAT(error_of<ProtocolError>([&] { c.mask_input(h.server.inbox_for(0), h.x[0].data()); }),
              HasSubstr("second time"));
  EXPECT_THAT(error_of<ProtocolError>([&] { c.unmask({0, 1, 4}); }), HasSubstr("not a subset of U2"));
  EXPECT_THAT(error_of<ProtocolError>([&] { c.unmask({1, 2, 3}); }), HasSubstr("do not include this client"));
  EXPECT_THAT(error_of<ProtocolError>([&] { c.unmask({0, 2, 1}); }), HasSubstr("sorted"));
  EXPECT_THAT(error_of<ProtocolError>([&] { c.unmask({0, 1, 1, 2}); }), HasSubstr("sorted"));
  EXPECT_THROW(c.unmask({0, 1}), TooFewClientsError);
  auto m = c.unmask({0, 1, 3});  // the refusals above left the client usable
  EXPECT_EQ(m.self_mask_shares.size(), 3u);
  EXPECT_EQ(m.key_shares.size(), 1u);
}

TEST(SecAgg, TamperedCiphertextIsRejectedNamingTheSender) {
  Harness h(config(5, 3, 32, 8), 12);
  h.advertise();
  h.share();
  auto inbox = h.server.inbox_for(0);
  ASSERT_EQ(inbox.size(), 4u);
  for (size_t pos : {size_t{0}, size_t{50}, kShareCiphertextBytes - 1}) {  // nonce, body, tag
    auto bad = inbox;
    bad[1].ciphertext[pos] ^= 0x01;  // from client 2
    ASSERT_EQ(bad[1].from, 2);
    EXPECT_THAT(error_of<ProtocolError>([&] { h.clients[0].mask_input(bad, h.x[0].data()); }),
                HasSubstr("from client 2"));
  }
  // A share relabelled as coming from another client fails too (the ids are bound into the associated data).
  auto relabelled = inbox;
  std::swap(relabelled[1].ciphertext, relabelled[2].ciphertext);
  EXPECT_THROW(h.clients[0].mask_input(relabelled, h.x[0].data()), ProtocolError);
  // The failures changed nothing: the genuine inbox still works.
  EXPECT_EQ(h.clients[0].mask_input(inbox, h.x[0].data()).size(), 8u);
}

TEST(SecAgg, ShareForAnotherRecipientDoesNotDecrypt) {
  // A share 2 -> 1, relabelled as 2 -> 0 and delivered to client 0, fails authentication there.
  Harness h(config(3, 2, 32, 4), 13);
  h.advertise();
  h.share();
  auto to1 = h.server.inbox_for(1);  // from 0 and 2
  auto inbox0 = h.server.inbox_for(0);
  ShareMsg stolen = to1[1];  // 2 -> 1
  stolen.to = 0;
  inbox0[1] = stolen;  // replaces 2 -> 0
  EXPECT_THAT(error_of<ProtocolError>([&] { h.clients[0].mask_input(inbox0, h.x[0].data()); }),
              HasSubstr("from client 2"));
}

TEST(SecAgg, MaskedVectorLooksUniform) {
  for (int bits : {32, 16}) {
    Harness h(config(4, 3, bits, 4096), 14);
    for (auto& v : h.x) std::fill(v.begin(), v.end(), 1234u);
    h.advertise();
    h.share();
    auto y = h.clients[2].mask_input(h.server.inbox_for(2), h.x[2].data());
    size_t differ = 0;
    std::vector<size_t> ones(bits, 0);
    for (uint32_t e : y) {
      ASSERT_LE(e, mask_of(bits));
      differ += e != 1234u;
      for (int b = 0; b < bits; ++b) ones[b] += (e >> b) & 1u;
    }
    EXPECT_GT(differ, y.size() * 99 / 100) << "bits=" << bits;
    // Each bit is set in half the elements: sd = sqrt(4096)/2 = 32, the bound is 6.4 sd.
    for (int b = 0; b < bits; ++b) EXPECT_NEAR(static_cast<double>(ones[b]), 2048.0, 205.0) << "bit " << b;
  }
}

TEST(SecAgg, ServerValidatesEveryMessage) {
  Harness h(config(5, 3, 16, 8), 15);
  AdvertiseMsg bad = h.clients[0].advertise();
  bad.client = 5;
  EXPECT_THAT(error_of<ProtocolError>([&] { h.server.add_advertise(bad); }), HasSubstr("out of range"));
  bad.client = -1;
  EXPECT_THROW(h.server.add_advertise(bad), ProtocolError);
  h.advertise({4});
  EXPECT_THAT(error_of<ProtocolError>([&] { h.server.add_advertise(h.clients[0].advertise()); }),
              HasSubstr("duplicate"));
  EXPECT_THAT(error_of<ProtocolError>([&] { h.server.add_shares(0, {}); }), HasSubstr("before U1 was fixed"));
  auto u1 = h.server.advertised();
  EXPECT_THAT(error_of<ProtocolError>([&] { h.server.add_advertise(h.clients[4].advertise()); }),
              HasSubstr("after U1"));
  EXPECT_THROW(h.server.add_shares(4, {}), ProtocolError);  // not in U1
  auto s0 = h.clients[0].share_keys(u1);
  auto partial = s0;
  partial.pop_back();
  EXPECT_THAT(error_of<ProtocolError>([&] { h.server.add_shares(0, partial); }), HasSubstr("expected one for each"));
  auto twice = s0;
  twice[1] = twice[0];
  EXPECT_THAT(error_of<ProtocolError>([&] { h.server.add_shares(0, twice); }), HasSubstr("two shares"));
  auto mislabelled = s0;
  mislabelled[0].from = 1;
  EXPECT_THROW(h.server.add_shares(0, mislabelled), ProtocolError);
  h.server.add_shares(0, s0);
  EXPECT_THAT(error_of<ProtocolError>([&] { h.server.add_shares(0, s0); }), HasSubstr("duplicate"));
  for (int u : {1, 2, 3}) h.server.add_shares(u, h.clients[u].share_keys(u1));
  EXPECT_EQ(h.server.u2(), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_THROW(h.server.inbox_for(4), ProtocolError);
  EXPECT_THAT(error_of<ProtocolError>([&] { h.server.add_masked_input(0, std::vector<uint32_t>(7)); }),
              HasSubstr("expected 8"));
  EXPECT_THAT(error_of<ProtocolError>([&] { h.server.add_masked_input(0, std::vector<uint32_t>(8, 0x10000u)); }),
              HasSubstr("exceeds"));
  for (int u : {0, 1, 2}) h.server.add_masked_input(u, h.clients[u].mask_input(h.server.inbox_for(u), h.x[u].data()));
  EXPECT_THROW(h.server.add_masked_input(0, std::vector<uint32_t>(8)), ProtocolError);  // duplicate
  auto u3 = h.server.survivors();
  EXPECT_THROW(h.server.add_masked_input(3, std::vector<uint32_t>(8)), ProtocolError);  // U3 is fixed
  UnmaskMsg m = h.clients[0].unmask(u3);
  UnmaskMsg stranger = m;
  stranger.client = 3;
  EXPECT_THAT(error_of<ProtocolError>([&] { h.server.add_unmask(stranger); }), HasSubstr("not in U3"));
  UnmaskMsg missing = m;
  missing.key_shares.clear();  // 3 dropped after sending shares: its key share is required
  EXPECT_THAT(error_of<ProtocolError>([&] { h.server.add_unmask(missing); }), HasSubstr("key shares"));
  UnmaskMsg both = m;
  both.self_mask_shares.push_back(both.key_shares[0]);
  EXPECT_THROW(h.server.add_unmask(both), ProtocolError);
  h.server.add_unmask(m);
  EXPECT_THROW(h.server.add_unmask(m), ProtocolError);
}

TEST(SecAgg, CorruptKeyShareIsCaughtByThePublicKeyCheck) {
  Harness h(config(5, 3, 32, 8), 16);
  h.advertise();
  h.share();
  h.mask({3});  // 3 is in U2 \ U3: its s_sk is reconstructed
  auto u3 = h.server.survivors();
  for (int u : {0, 1, 2}) {  // exactly t responses: no spare share to cross-check
    auto m = h.clients[u].unmask(u3);
    if (u == 1) m.key_shares[0].second[5] ^= 0x40;
    h.server.add_unmask(m);
  }
  auto msg = error_of<ProtocolError>([&] { h.server.finish(); });
  EXPECT_THAT(msg, HasSubstr("dropped client 3"));
  EXPECT_THAT(msg, HasSubstr("s_pk"));
}

TEST(SecAgg, CorruptShareIsCaughtByASpareResponse) {
  Harness h(config(5, 3, 32, 8), 17);
  h.advertise();
  h.share();
  h.mask({3});
  auto u3 = h.server.survivors();  // {0, 1, 2, 4}
  for (int u : u3) {
    auto m = h.clients[u].unmask(u3);
    if (u == 4) m.self_mask_shares[2].second[0] ^= 0x01;  // this responder's share of b_2
    h.server.add_unmask(m);
  }
  auto msg = error_of<ProtocolError>([&] { h.server.finish(); });
  EXPECT_THAT(msg, HasSubstr("b_2"));
  EXPECT_THAT(msg, HasSubstr("inconsistent"));
}

// t = floor(x * group) + 1 as documented, also where the product in binary falls just under an integer (0.7 x 90 is
// 62.99999999999999: it gave 63 for 64, a collusion threshold one below the one asked for); at least 2, at most the
// group.
TEST(SecAgg, ThresholdIsFloorOfTheFractionPlusOne) {
  EXPECT_EQ(threshold_for(90, 0.7), 64);
  EXPECT_EQ(threshold_for(100, 0.57), 58);
  EXPECT_EQ(threshold_for(100, 0.58), 59);
  EXPECT_EQ(threshold_for(170, 0.7), 120);
  EXPECT_EQ(threshold_for(150, 0.82), 124);
  EXPECT_EQ(threshold_for(10, 0.5), 6);
  EXPECT_EQ(threshold_for(7, 0.66), 5);  // 4.62
  EXPECT_EQ(threshold_for(3, 0.5), 2);
  EXPECT_EQ(threshold_for(5, 1.0), 5);
  for (int g = 2; g <= 400; ++g)
    for (int pct = 50; pct <= 100; ++pct) {
      const int t = threshold_for(g, pct / 100.0);
      EXPECT_EQ(t, std::min(g, std::max(2, g * pct / 100 + 1))) << g << " at " << pct << "%";
    }
}

TEST(SecAgg, ConfigErrorsNameTheField) {
  check(config(5, 3, 32, 1));
  check(config(2, 2, 8, 1));
  EXPECT_THAT(error_of<ConfigError>([] { check(config(1, 1, 32, 1)); }), HasSubstr("num_clients=1"));
  EXPECT_THAT(error_of<ConfigError>([] { check(config(5, 2, 32, 1)); }), HasSubstr("threshold=2"));
  EXPECT_THAT(error_of<ConfigError>([] { check(config(4, 2, 32, 1)); }), HasSubstr("allowed 3..4"));
  EXPECT_THAT(error_of<ConfigError>([] { check(config(5, 6, 32, 1)); }), HasSubstr("threshold=6"));
  EXPECT_THAT(error_of<ConfigError>([] { check(config(5, 3, 7, 1)); }), HasSubstr("bits=7"));
  EXPECT_THAT(error_of<ConfigError>([] { check(config(5, 3, 33, 1)); }), HasSubstr("bits=33"));
  EXPECT_THAT(error_of<ConfigError>([] { check(config(5, 3, 32, 0)); }), HasSubstr("length=0"));
  auto all = error_of<ConfigError>([] { check(config(5, 9, 40, 0)); });
  EXPECT_THAT(all, HasSubstr("threshold=9"));
  EXPECT_THAT(all, HasSubstr("bits=40"));
  EXPECT_THAT(all, Not(HasSubstr("\n")));
  EXPECT_THROW(SecAggServer(config(5, 1, 32, 4)), ConfigError);
  EXPECT_THROW(SecAggClient(config(5, 3, 32, 4), 5), InvalidArgument);
}

TEST(SecAgg, MovedFromObjectsRefuseUse) {
  SecAggClient a(config(3, 2, 32, 4), 0);
  auto keys = a.advertise();
  SecAggClient b(std::move(a));
  EXPECT_EQ(b.advertise(), keys);
  EXPECT_THROW(a.advertise(), InvalidArgument);  // NOLINT(bugprone-use-after-move)
}

// ---- SecAgg+ (Bell et al. 2020): the pairs are a k-regular graph's edges ----------------------------------------

std::set<int> closed_neighbourhood(const SecAggConfig& c, int u) {
  auto nb = neighbors_of(c, u);
  std::set<int> out(nb.begin(), nb.end());
  out.insert(u);
  return out;
}

TEST(SecAggPlus, GraphIsKRegularSymmetricAndDrawnPerRound) {
  const auto c = config(40, 4, 32, 8, 7, 6);
  int far = 0;  // neighbours more than k/2 ids away: the ring is a permutation, not the ids' order
  for (int u = 0; u < 40; ++u) {
    const auto nb = neighbors_of(c, u);
    ASSERT_EQ(nb.size(), 6u) << "client " << u;
    EXPECT_TRUE(std::is_sorted(nb.begin(), nb.end()));
    for (int v : nb) {
      EXPECT_NE(v, u);
      const auto back = neighbors_of(c, v);
      EXPECT_TRUE(std::binary_search(back.begin(), back.end(), u)) << u << " - " << v << " is one-sided";
      const int d = std::abs(u - v);
      far += std::min(d, 40 - d) > 3 ? 1 : 0;
    }
  }
  EXPECT_GT(far, 0);
  // Every party derives the same graph from (round, n, k, graph seed), on any machine: a known answer.
  EXPECT_EQ(neighbors_of(config(12, 3, 32, 1, 5, 4), 0), (std::vector<int>{2, 3, 8, 10}));
  auto seeded = c;  // the same round with another seed (conduit fl's server draws one per round): another graph
  seeded.graph_seed[31] = 1;
  int reseeded = 0;
  for (int u = 0; u < 40; ++u) reseeded += neighbors_of(c, u) != neighbors_of(seeded, u) ? 1 : 0;
  EXPECT_GT(reseeded, 20);
  int differ = 0;
  for (int u = 0; u < 40; ++u) differ += neighbors_of(c, u) != neighbors_of(config(40, 4, 32, 8, 8, 6), u) ? 1 : 0;
  EXPECT_GT(differ, 20);                                                            // another round, another graph
  EXPECT_EQ(neighbors_of(config(5, 3, 32, 8), 2), (std::vector<int>{0, 1, 3, 4}));  // complete graph
  EXPECT_EQ(group_size(c), 7);
  EXPECT_EQ(group_size(config(5, 3, 32, 8)), 5);
  EXPECT_THROW(neighbors_of(c, 40), InvalidArgument);
}

TEST(SecAggPlus, SumWithoutDropoutsSharesAndUnmasksOnlyWithNeighbours) {
  const auto c = config(30, 4, 32, 3000, 7, 6);
  Harness h(c, 41);
  auto sum = h.run({}, {}, {});
  EXPECT_EQ(sum, h.expected());
  EXPECT_EQ(h.server.survivors().size(), 30u);
  for (int u = 0; u < 30; ++u) {
    std::vector<int> to;
    for (const auto& m : h.sent[u]) to.push_back(m.to);
    EXPECT_EQ(to, neighbors_of(c, u)) << "client " << u;
    EXPECT_EQ(h.server.inbox_for(u).size(), 6u);
    const auto want = closed_neighbourhood(c, u);
    EXPECT_EQ(h.clients[u].u2(), std::vector<int>(want.begin(), want.end()));
    ASSERT_EQ(h.answers[u].self_mask_shares.size(), 7u);
    for (const auto& e : h.answers[u].self_mask_shares) EXPECT_TRUE(want.count(e.first));
    EXPECT_TRUE(h.answers[u].key_shares.empty());
  }
}

TEST(SecAggPlus, DropoutsInEveryPhaseAreUnmaskedFromNeighbours) {
  // k = 8, t = 5: three dropouts leave every closed neighbourhood of 9 at least 6.
  const auto c = config(30, 5, 24, 1500, 9, 8);
  Harness h(c, 42);
  const int no_share = 3, no_mask = 11, no_unmask = 20;
  auto sum = h.run({no_share}, {no_mask}, {no_unmask});
  EXPECT_EQ(sum, h.expected());
  const auto u3 = h.server.survivors();
  EXPECT_EQ(u3.size(), 28u);
  EXPECT_FALSE(std::binary_search(u3.begin(), u3.end(), no_mask));
  EXPECT_TRUE(std::binary_search(u3.begin(), u3.end(), no_unmask));
  // The masked-then-dropped client's key was shared out, and asked back, only among its neighbours.
  const auto near = closed_neighbourhood(c, no_mask);
  int holders = 0;
  for (const auto& [u, m] : h.answers) {
    const bool has = !m.key_shares.empty();
    EXPECT_EQ(has, near.count(u) > 0) << "responder " << u;
    if (has) {
      EXPECT_EQ(m.key_shares.size(), 1u);
      EXPECT_EQ(m.key_shares[0].first, no_mask);
      ++holders;
    }
  }
  EXPECT_GE(holders, 5);
  EXPECT_LE(holders, 8);
}

TEST(SecAggPlus, ANeighbourhoodWithTooFewSurvivorsAbortsTheRoundTheCompleteGraphWouldNot) {
  // k = 4, t = 4: two of client 0's neighbours dropping after their shares leave its neighbourhood 3 survivors.
  const auto c = config(20, 4, 32, 64, 7, 4);
  const auto nb = neighbors_of(c, 0);
  const std::set<int> drop{nb[0], nb[1]};
  Harness sparse(c, 43);
  sparse.advertise();
  sparse.share();
  sparse.mask(drop);
  auto msg = error_of<TooFewClientsError>([&] { sparse.server.survivors(); });
  EXPECT_THAT(msg, HasSubstr("secagg server (round id 7): too few survivors near client"));
  // (a survivor counts itself among its neighbourhood's 5, and says so: "3 of its 4 neighbours and itself" read as 4)
  EXPECT_THAT(msg, HasSubstr("near client 0 (a survivor): 3 of the 5 of its neighbourhood (its 4 neighbours and "
                             "itself) sent masked inputs"));
  EXPECT_THAT(msg, HasSubstr("threshold t=4"));
  EXPECT_THROW(sparse.server.finish(), ProtocolError);  // nothing is unmasked

  Harness full(config(20, 11, 32, 64, 7), 43);  // the same dropouts leave the complete graph 18 survivors
  const auto total = full.run({}, drop, {});
  EXPECT_EQ(total, full.expected());

  // A server that sent those 18 survivors anyway: client 0 counts its own neighbourhood and refuses.
  std::vector<int> u3;
  for (int u = 0; u < 20; ++u)
    if (!drop.count(u)) u3.push_back(u);
  auto refused = error_of<TooFewClientsError>([&] { sparse.clients[0].unmask(u3); });
  EXPECT_THAT(refused, HasSubstr("3 survivors in its neighbourhood, fewer than threshold t=4"));
}

// A survivor list naming a neighbour that never sent its shares (not in the client's U2) is refused: the client
// holds no share of its secrets, and its masks were never added.
TEST(SecAggPlus, ASurvivingNeighbourOutsideU2IsRefused) {
  const auto c = config(20, 3, 32, 16, 7, 4);
  const int missing = neighbors_of(c, 0)[0];
  Harness h(c, 48);
  h.advertise();
  h.share({missing});
  h.mask();
  std::vector<int> u3(20);
  for (int u = 0; u < 20; ++u) u3[size_t(u)] = u;  // `missing` included
  EXPECT_THAT(error_of<ProtocolError>([&] { h.clients[0].unmask(u3); }),
              HasSubstr("not a subset of U2: client " + std::to_string(missing)));
  h.unmask();  // the server's own survivor set, without `missing`, unmasks
  EXPECT_EQ(h.server.finish(), h.expected());
}

TEST(SecAggPlus, AdvertisersWithTooFewAdvertisingNeighboursArePruned) {
  // A ring (k = 2, t = 2): client 0 without both its neighbours is left alone and pruned; everyone else keeps a
  // neighbour. (With t above k/2 + 1 a pruned client takes its ring neighbours with it: windows overlap.)
  const auto c = config(20, 2, 32, 64, 7, 2);
  const auto nb = neighbors_of(c, 0);
  ASSERT_EQ(nb.size(), 2u);
  Harness h(c, 44);
  h.advertise({nb[0], nb[1]});
  const auto u1 = h.server.advertised();
  std::vector<int> ids;
  for (const auto& a : u1) ids.push_back(a.client);
  EXPECT_FALSE(std::binary_search(ids.begin(), ids.end(), 0));
  for (int u : ids) {
    int near = 0;
    for (int v : closed_neighbourhood(c, u)) near += std::binary_search(ids.begin(), ids.end(), v) ? 1 : 0;
    EXPECT_GE(near, 2) << "client " << u << " kept in U1";
  }
  EXPECT_EQ(ids.size(), 17u);
  // The pruned client refuses U1 (it is not in it); the rest complete the round.
  EXPECT_THAT(error_of<ProtocolError>([&] { h.clients[0].share_keys(u1); }), HasSubstr("does not include"));
  h.share();
  h.mask();
  h.unmask();
  EXPECT_EQ(h.server.finish(), h.expected());
}

// On a ring (k = 2) two dropouts three or more places apart leave every neighbourhood t = 2 survivors but split the
// survivors into two arcs no pairwise mask joins: unmasking would reveal each arc's sum, so the round is abandoned.
TEST(SecAggPlus, SurvivorsSplitIntoUnjoinedGroupsAbortTheRound) {
  const auto c = config(20, 2, 32, 16, 7, 2);
  const int a = 0;
  std::set<int> near_a = closed_neighbourhood(c, a);
  for (int v : neighbors_of(c, a))
    for (int w : neighbors_of(c, v)) near_a.insert(w);
  int b = 1;
  while (near_a.count(b)) ++b;
  Harness split(c, 46);
  split.advertise();
  split.share();
  split.mask({a, b});
  auto msg = error_of<TooFewClientsError>([&] { split.server.survivors(); });
  EXPECT_THAT(msg, HasSubstr("split the 18 survivors into 2 groups"));
  // A server that sent that survivor set anyway: each client refuses to unmask it (its own neighbourhood has t).
  std::vector<int> u3;
  for (int u = 0; u < 20; ++u)
    if (u != a && u != b) u3.push_back(u);
  for (int u : u3)
    EXPECT_THAT(error_of<ProtocolError>([&] { split.clients[u].unmask(u3); }),
                HasSubstr("survivors fall into 2 groups that no pairwise mask joins"))
        << "client " << u;
  // One dropout leaves one arc: the round completes.
  Harness one(c, 46);
  const auto total = one.run({}, {a}, {});
  EXPECT_EQ(total, one.expected());
}

// U1 is the largest set in which every member has t members of its closed neighbourhood: what peeling off, one at a
// time, the clients below t leaves (k = 4, t = 3, random non-advertisers; a client counted out twice would be
// pruned with t advertising neighbours left, and others after it).
TEST(SecAggPlus, PruningKeepsTheLargestSetWhereEveryMemberHasT) {
  const auto c = config(30, 3, 32, 4, 9, 4);
  std::mt19937 g(5);
  int pruned_some = 0;
  for (int trial = 0; trial < 60; ++trial) {
    std::set<int> skip;
    for (int u = 0; u < 30; ++u)
      if (g() % 4 == 0) skip.insert(u);
    std::set<int> want;
    for (int u = 0; u < 30; ++u)
      if (!skip.count(u)) want.insert(u);
    const size_t advertised = want.size();
    for (bool changed = true; changed;) {
      changed = false;
      for (int u : std::set<int>(want)) {
        int near = 0;
        for (int v : closed_neighbourhood(c, u)) near += want.count(v) ? 1 : 0;
        if (near < 3) {
          want.erase(u);
          changed = true;
        }
      }
    }
    pruned_some += want.size() < advertised ? 1 : 0;
    Harness h(c, 100 + trial);
    h.advertise(skip);
    if (want.size() < 3) {
      EXPECT_THROW(h.server.advertised(), TooFewClientsError) << "trial " << trial;
      continue;
    }
    std::vector<int> ids;
    for (const auto& a : h.server.advertised()) ids.push_back(a.client);
    EXPECT_EQ(ids, std::vector<int>(want.begin(), want.end())) << "trial " << trial;
  }
  EXPECT_GT(pruned_some, 10) << "the draws pruned nobody: the test checks nothing";
}

TEST(SecAggPlus, CorruptShareIsCaughtByASpareNeighbour) {
  const auto c = config(30, 5, 32, 8, 7, 8);
  Harness h(c, 47);
  h.advertise();
  h.share();
  const int dropped = neighbors_of(c, 0).back();
  h.mask({dropped});
  const auto u3 = h.server.survivors();
  const int first = 0;  // client 0 answers with its own share of b_0 among the others
  for (int u : u3) {
    auto m = h.clients[u].unmask(u3);
    if (u == first) {
      ASSERT_EQ(m.self_mask_shares[0].first, 0);
      m.self_mask_shares[0].second[0] ^= 0x01;
    }
    h.server.add_unmask(m);
  }
  auto msg = error_of<ProtocolError>([&] { h.server.finish(); });
  EXPECT_THAT(msg, HasSubstr("b_0"));
  EXPECT_THAT(msg, HasSubstr("inconsistent"));
}

TEST(SecAggPlus, MessagesOffTheGraphAreRefused) {
  const auto c = config(20, 4, 32, 16, 7, 4);
  const auto nb = neighbors_of(c, 0);
  int stranger = 1;
  while (std::binary_search(nb.begin(), nb.end(), stranger)) ++stranger;
  Harness h(c, 45);
  h.advertise();
  const auto u1 = h.server.advertised();
  auto out = h.clients[0].share_keys(u1);
  ASSERT_EQ(out.size(), 4u);
  auto wrong = out;
  wrong[0].to = stranger;
  EXPECT_THAT(error_of<ProtocolError>([&] { h.server.add_shares(0, wrong); }), HasSubstr("among its neighbours"));
  wrong = out;
  wrong.pop_back();
  EXPECT_THAT(error_of<ProtocolError>([&] { h.server.add_shares(0, wrong); }),
              HasSubstr("expected one for each of the 4 other members of U1 among its neighbours"));
  h.server.add_shares(0, out);  // the refusals stored nothing
  for (int u = 1; u < 20; ++u) h.server.add_shares(u, h.clients[u].share_keys(u1));
  // A share from a non-neighbour in a client's inbox is refused before any decryption.
  auto inbox = h.server.inbox_for(0);
  ASSERT_EQ(inbox.size(), 4u);
  ShareMsg forged = inbox[0];
  forged.from = stranger;
  inbox.push_back(forged);
  EXPECT_THAT(error_of<ProtocolError>([&] { h.clients[0].mask_input(inbox, h.x[0].data()); }),
              HasSubstr("among this client's neighbours"));
}

TEST(SecAggPlus, ConfigErrorsNameTheGraph) {
  check(config(20, 3, 32, 1, 7, 4));
  check(config(20, 5, 32, 1, 7, 4));
  check(config(4, 2, 32, 1, 7, 2));
  EXPECT_THAT(
      error_of<ConfigError>([] { check(config(20, 4, 32, 1, 7, 5)); }),
      HasSubstr("neighbors=5 not allowed for num_clients=20; allowed 0 (every pair) or an even number in 2..18"));
  EXPECT_THAT(error_of<ConfigError>([] { check(config(20, 4, 32, 1, 7, 20)); }), HasSubstr("neighbors=20"));
  EXPECT_THAT(error_of<ConfigError>([] { check(config(20, 4, 32, 1, 7, -2)); }), HasSubstr("neighbors=-2"));
  EXPECT_THAT(error_of<ConfigError>([] { check(config(20, 6, 32, 1, 7, 4)); }),
              HasSubstr("threshold=6 out of range for 4 neighbours and self; allowed 3..5"));
  EXPECT_THAT(error_of<ConfigError>([] { check(config(20, 2, 32, 1, 7, 4)); }), HasSubstr("threshold=2"));
}

// ---- wire formats --------------------------------------------------------------------------------------------------

template <class Msg>
void expect_malformed_prefixes_rejected(const std::vector<uint8_t>& bytes, int n) {
  for (size_t k = 0; k < bytes.size(); ++k)
    EXPECT_THROW(Msg::parse(bytes.data(), k, n), ProtocolError) << "prefix of " << k << " bytes";
  auto longer = bytes;
  longer.push_back(0);
  EXPECT_THROW(Msg::parse(longer.data(), longer.size(), n), ProtocolError);
  auto tag = bytes;
  tag[0] ^= 0xFF;
  EXPECT_THAT(error_of<ProtocolError>([&] { Msg::parse(tag.data(), tag.size(), n); }), HasSubstr("tag"));
  auto version = bytes;
  version[1] = 9;
  EXPECT_THAT(error_of<ProtocolError>([&] { Msg::parse(version.data(), version.size(), n); }), HasSubstr("version"));
}

TEST(SecAggWire, MessagesRoundTripAndRejectMalformedBuffers) {
  Harness h(config(5, 3, 32, 8), 18);
  h.advertise();
  h.share();
  h.mask({4});
  auto u3 = h.server.survivors();

  AdvertiseMsg a = h.clients[3].advertise();
  auto ab = a.serialize();
  EXPECT_EQ(ab.size(), 70u);
  EXPECT_EQ(AdvertiseMsg::parse(ab.data(), ab.size(), 5), a);
  expect_malformed_prefixes_rejected<AdvertiseMsg>(ab, 5);
  EXPECT_THAT(error_of<ProtocolError>([&] { AdvertiseMsg::parse(ab.data(), ab.size(), 3); }),
              HasSubstr("out of range"));

  ShareMsg s = h.server.inbox_for(1)[2];
  auto sb = s.serialize();
  EXPECT_EQ(sb.size(), 14u + kShareCiphertextBytes);
  EXPECT_EQ(ShareMsg::parse(sb.data(), sb.size(), 5), s);
  expect_malformed_prefixes_rejected<ShareMsg>(sb, 5);
  auto bad_len = sb;
  bad_len[10] = 0x20;  // ciphertext length field
  EXPECT_THAT(error_of<ProtocolError>([&] { ShareMsg::parse(bad_len.data(), bad_len.size(), 5); }),
              HasSubstr("ciphertext length"));
  EXPECT_THROW(ShareMsg::parse(sb.data(), sb.size(), 1), ProtocolError);  // ids >= num_clients

  UnmaskMsg m = h.clients[0].unmask(u3);
  ASSERT_EQ(m.self_mask_shares.size(), 4u);
  ASSERT_EQ(m.key_shares.size(), 1u);
  auto mb = m.serialize();
  EXPECT_EQ(mb.size(), 14u + 5 * 36);
  EXPECT_EQ(UnmaskMsg::parse(mb.data(), mb.size(), 5), m);
  expect_malformed_prefixes_rejected<UnmaskMsg>(mb, 5);
  auto huge = mb;
  huge[6] = huge[7] = huge[8] = huge[9] = 0xFF;  // self-mask count 2^32-1
  EXPECT_THAT(error_of<ProtocolError>([&] { UnmaskMsg::parse(huge.data(), huge.size(), 5); }), HasSubstr("count"));
  auto unsorted = m;
  std::swap(unsorted.self_mask_shares[0], unsorted.self_mask_shares[1]);
  auto ub = unsorted.serialize();
  EXPECT_THAT(error_of<ProtocolError>([&] { UnmaskMsg::parse(ub.data(), ub.size(), 5); }), HasSubstr("ascending"));

  // Random garbage (with a plausible header) never escapes as anything but a ProtocolError.
  std::mt19937 rng(19);
  for (int i = 0; i < 300; ++i) {
    std::vector<uint8_t> g(rng() % 200);
    for (auto& e : g) e = static_cast<uint8_t>(rng());
    if (g.size() >= 2) g[1] = 1;
    for (uint8_t tag : {0xA1, 0xA2, 0xA3}) {
      if (!g.empty()) g[0] = tag;
      // Each parser on its own: one that throws first must not keep the others from being tried.
      try {
        AdvertiseMsg::parse(g.data(), g.size(), 5);
      } catch (const ProtocolError&) {
      }
      try {
        ShareMsg::parse(g.data(), g.size(), 5);
      } catch (const ProtocolError&) {
      }
      try {
        UnmaskMsg::parse(g.data(), g.size(), 5);
      } catch (const ProtocolError&) {
      }
    }
  }
}

TEST(SecAggWire, PackedElementsUseCeilBitsOver8Bytes) {
  std::mt19937_64 rng(20);
  for (int bits : {8, 12, 16, 24, 31, 32}) {
    std::vector<uint32_t> v(101);
    for (auto& e : v) e = static_cast<uint32_t>(rng()) & mask_of(bits);
    auto bytes = pack_elements(v.data(), v.size(), bits);
    EXPECT_EQ(bytes.size(), v.size() * static_cast<size_t>((bits + 7) / 8)) << bits;
    EXPECT_EQ(unpack_elements(bytes.data(), bytes.size(), bits, v.size()), v) << bits;
    EXPECT_THROW(unpack_elements(bytes.data(), bytes.size() - 1, bits, v.size()), ProtocolError);
    EXPECT_THROW(unpack_elements(bytes.data(), bytes.size(), bits, v.size() + 1), ProtocolError);
  }
  std::vector<uint32_t> v16(10, 0xABCDu);
  EXPECT_EQ(pack_elements(v16.data(), 10, 16).size(), 20u);
  std::vector<uint8_t> over12 = {0x00, 0x10};  // 0x1000 does not fit 12 bits
  EXPECT_THAT(error_of<ProtocolError>([&] { unpack_elements(over12.data(), 2, 12, 1); }), HasSubstr("exceeds"));
  uint32_t big = 0x1000;
  EXPECT_THROW(pack_elements(&big, 1, 12), InvalidArgument);
}

// ---- Shamir over GF(2^16) ------------------------------------------------------------------------------------------

TEST(Shamir, FieldArithmetic) {
  EXPECT_EQ(gf16_mul(0x8000, 2), 0x100B);  // x^16 = x^12 + x^3 + x + 1
  EXPECT_EQ(gf16_mul(0x1234, 1), 0x1234);
  EXPECT_EQ(gf16_mul(0x1234, 0), 0);
  std::mt19937 rng(21);
  for (int i = 0; i < 2000; ++i) {
    const uint16_t a = static_cast<uint16_t>(rng() % 65535 + 1), b = static_cast<uint16_t>(rng()),
                   c = static_cast<uint16_t>(rng());
    EXPECT_EQ(gf16_mul(a, gf16_inv(a)), 1) << a;
    EXPECT_EQ(gf16_mul(a, b), gf16_mul(b, a));
    EXPECT_EQ(gf16_mul(a, b ^ c), gf16_mul(a, b) ^ gf16_mul(a, c));
  }
  EXPECT_THROW(gf16_inv(0), InvalidArgument);
}

TEST(Shamir, AnyThresholdSubsetReconstructsFewerDoNot) {
  std::array<uint8_t, 32> secret;
  for (size_t i = 0; i < 32; ++i) secret[i] = static_cast<uint8_t>(i * 37 + 1);
  const std::vector<uint16_t> xs = {1, 2, 3, 7, 100, 40000, 65535};
  auto shares = shamir_split(secret, 4, xs);
  ASSERT_EQ(shares.size(), xs.size());
  int subsets = 0;
  for (unsigned m = 0; m < (1u << xs.size()); ++m) {
    std::vector<uint16_t> sx;
    std::vector<std::array<uint8_t, 32>> ss;
    for (size_t i = 0; i < xs.size(); ++i)
      if (m >> i & 1) {
        sx.push_back(xs[i]);
        ss.push_back(shares[i]);
      }
    if (sx.size() < 3) continue;
    if (sx.size() == 3)
      EXPECT_NE(shamir_combine(sx, ss), secret) << "3 shares of a 4-of-7 sharing gave the secret";
    else
      EXPECT_EQ(shamir_combine(sx, ss), secret) << "mask " << m;
    ++subsets;
  }
  EXPECT_EQ(subsets, 35 + 35 + 21 + 7 + 1);
  EXPECT_THROW(shamir_split(secret, 8, xs), InvalidArgument);
  EXPECT_THROW(shamir_split(secret, 2, {0, 1}), InvalidArgument);
  EXPECT_THROW(shamir_split(secret, 2, {3, 3}), InvalidArgument);
}

// ---- fixed-point codec ---------------------------------------------------------------------------------------------

TEST(FixedPoint, ConfigErrorsNameTheField) {
  EXPECT_THAT(error_of<ConfigError>([] { FixedPointCodec(7, 1.0, 4); }), HasSubstr("bits=7"));
  EXPECT_THAT(error_of<ConfigError>([] { FixedPointCodec(33, 1.0, 4); }), HasSubstr("bits=33"));
  EXPECT_THAT(error_of<ConfigError>([] { FixedPointCodec(16, 0.0, 4); }), HasSubstr("clip"));
  EXPECT_THAT(error_of<ConfigError>([] { FixedPointCodec(16, -1.0, 4); }), HasSubstr("clip"));
  EXPECT_THAT(error_of<ConfigError>([] { FixedPointCodec(16, std::nan(""), 4); }), HasSubstr("clip"));
  EXPECT_THAT(error_of<ConfigError>([] { FixedPointCodec(16, INFINITY, 4); }), HasSubstr("clip"));
  EXPECT_THAT(error_of<ConfigError>([] { FixedPointCodec(16, 1.0, 0); }), HasSubstr("max_summands"));
  EXPECT_THAT(error_of<ConfigError>([] { FixedPointCodec(8, 1.0, 64); }), HasSubstr("raise bits"));
  FixedPointCodec(8, 1.0, 63);  // 127 / 63 = 2 levels: the coarsest allowed
}

TEST(FixedPoint, ScaleIsWrapFreeAndNotWasteful) {
  for (int bits : {8, 12, 16, 24, 32})
    for (int m : {1, 3, 10, 50})
      for (double clip : {0.01, 1.0, 1000.0}) {
        if ((((int64_t{1} << (bits - 1)) - 1) / m) < 2) continue;
        FixedPointCodec c(bits, clip, m);
        const double half = std::ldexp(1.0, bits - 1);
        EXPECT_LT(m * (clip * c.scale() + 1), half) << bits << " " << m << " " << clip;
        EXPECT_GE(clip * c.scale(), 1.0 - 1e-9);
        EXPECT_GT(m * (clip * c.scale() + 2.0), half - 1 - 1e-6) << "scale wastes more than one level";
        EXPECT_EQ(c.modulus_mask(), mask_of(bits));
      }
}

TEST(FixedPoint, WireBytes) {
  EXPECT_EQ(FixedPointCodec(8, 1, 1).wire_bytes_per_element(), 1u);
  EXPECT_EQ(FixedPointCodec(12, 1, 1).wire_bytes_per_element(), 2u);
  EXPECT_EQ(FixedPointCodec(16, 1, 1).wire_bytes_per_element(), 2u);
  EXPECT_EQ(FixedPointCodec(17, 1, 1).wire_bytes_per_element(), 3u);
  EXPECT_EQ(FixedPointCodec(32, 1, 1).wire_bytes_per_element(), 4u);
}

TEST(FixedPoint, SumOfEncodedVectorsDecodesWithinOneStepPerSummand) {
  for (int bits : {16, 24, 32}) {
    const int m = 8;
    const size_t n = 1000;
    FixedPointCodec c(bits, 1.0, m);
    std::mt19937 rng(22);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<double> truth(n, 0.0);
    std::vector<uint32_t> sum(n, 0), enc(n);
    for (int k = 0; k < m; ++k) {
      std::vector<float> x(n);
      for (auto& e : x) e = dist(rng);
      EXPECT_EQ(c.encode(x.data(), n, enc.data(), 100 + k), 0u);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_LE(enc[i], c.modulus_mask());
        sum[i] += enc[i];
        truth[i] += x[i];
      }
    }
    for (auto& e : sum) e &= c.modulus_mask();
    std::vector<float> out(n);
    c.decode(sum.data(), n, out.data());
    for (size_t i = 0; i < n; ++i) {
      const double tol = m / c.scale() + std::abs(truth[i]) * 1.2e-7 + 1e-12;
      ASSERT_NEAR(out[i], truth[i], tol) << "bits=" << bits << " i=" << i;
    }
  }
}

TEST(FixedPoint, StochasticRoundingIsUnbiasedAndDeterministic) {
  FixedPointCodec c(16, 1.0, 1);
  for (double level : {1000.3, -500.7, 12.05}) {
    const float x = static_cast<float>(level / c.scale());
    const double s = static_cast<double>(x) * c.scale();  // the exact target after float rounding
    const size_t n = 64;
    std::vector<float> xs(n, x);
    std::vector<uint32_t> enc(n);
    double total = 0;
    size_t count = 0;
    for (uint64_t seed = 0; seed < 500; ++seed) {
      c.encode(xs.data(), n, enc.data(), seed);
      for (uint32_t e : enc) {
        const double q = e >= 0x8000u ? static_cast<double>(e) - 65536.0 : static_cast<double>(e);  // signed 16-bit
        ASSERT_TRUE(q == std::floor(s) || q == std::floor(s) + 1) << q << " for " << s;
        total += q - s;
        ++count;
      }
    }
    // 32000 Bernoulli(p) draws: sd of the mean error <= 0.5 / sqrt(32000) = 0.0028; bound 0.012 (> 4 sd).
    // Round-to-nearest would be off by min(p, 1-p) >= 0.05 here.
    EXPECT_NEAR(total / count, 0.0, 0.012) << "level " << level;
  }
  std::vector<float> x(256);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.37f * std::sin(static_cast<float>(i));
  std::vector<uint32_t> a(256), b(256), d(256);
  c.encode(x.data(), 256, a.data(), 42);
  c.encode(x.data(), 256, b.data(), 42);
  c.encode(x.data(), 256, d.data(), 43);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, d);
}

TEST(FixedPoint, ClipsAndCountsAndRejectsNonFinite) {
  FixedPointCodec c(24, 1.0, 4);
  std::vector<float> x = {0.5f, 2.0f, -3.0f, 1.0f, -1.0f, 0.0f};
  std::vector<uint32_t> enc(x.size());
  EXPECT_EQ(c.encode(x.data(), x.size(), enc.data(), 1), 2u);
  std::vector<float> out(x.size());
  c.decode(enc.data(), x.size(), out.data());
  const std::vector<float> want = {0.5f, 1.0f, -1.0f, 1.0f, -1.0f, 0.0f};
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(out[i], want[i], 1.0 / c.scale()) << i;
  x[3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(error_of<InvalidArgument>([&] { c.encode(x.data(), x.size(), enc.data(), 1); }), HasSubstr("x[3]"));
  x[3] = -std::numeric_limits<float>::infinity();
  EXPECT_THAT(error_of<InvalidArgument>([&] { c.encode(x.data(), x.size(), enc.data(), 1); }), HasSubstr("x[3]"));
}

TEST(FixedPoint, NoWrapAtMaxSummandsWithValuesAtClip) {
  for (int bits : {8, 16, 32})
    for (int m : {1, 3, 10, 63}) {
      const double clip = 2.5;
      FixedPointCodec c(bits, clip, m);
      for (float sign : {1.0f, -1.0f}) {
        std::vector<float> x(16, sign * static_cast<float>(clip) * 1.5f);  // beyond clip: clipped to +-clip
        std::vector<uint32_t> sum(16, 0), enc(16);
        for (int k = 0; k < m; ++k) {
          EXPECT_EQ(c.encode(x.data(), 16, enc.data(), k), 16u);
          for (size_t i = 0; i < 16; ++i) sum[i] += enc[i];
        }
        for (auto& e : sum) e &= c.modulus_mask();
        std::vector<float> out(16);
        c.decode(sum.data(), 16, out.data());
        for (float o : out)
          ASSERT_NEAR(o, sign * m * clip, m / c.scale() + m * clip * 1.2e-7) << "bits=" << bits << " m=" << m;
      }
    }
}

TEST(FixedPoint, EndToEndThroughSecureAggregation) {
  const int n = 5;
  const size_t len = 300;
  FixedPointCodec codec(20, 1.0, n);
  Harness h(config(n, 3, 20, len), 23);
  std::mt19937 rng(24);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<std::vector<float>> xf(n, std::vector<float>(len));
  for (int u = 0; u < n; ++u) {
    for (auto& e : xf[u]) e = dist(rng);
    codec.encode(xf[u].data(), len, h.x[u].data(), 1000 + u);
  }
  auto sum = h.run({}, {1}, {});  // client 1 drops after sending shares
  std::vector<float> out(len);
  codec.decode(sum.data(), len, out.data());
  for (size_t i = 0; i < len; ++i) {
    double truth = 0;
    for (int u : {0, 2, 3, 4}) truth += xf[u][i];
    ASSERT_NEAR(out[i], truth, n / codec.scale() + 1e-6) << i;
  }
}

// ---- SecAgg+'s k chosen by bounds (conduit fl --secagg-neighbors auto) -----------------------------------------

double choose(int n, int k) {  // n choose k, exactly in long double for the small cases below
  long double r = 1;
  for (int i = 1; i <= k; ++i) r = r * (n - k + i) / i;
  return double(r);
}

TEST(SecAggPlusAuto, HypergeometricTailMatchesTheDefinition) {
  for (int N : {12, 30})
    for (int K : {0, 3, 7})
      for (int k : {0, 5, 9})
        for (int j = -1; j <= k + 1; ++j) {
          double want = 0;
          for (int i = std::max(j, 0); i <= std::min(K, k); ++i)
            if (k - i <= N - K) want += choose(K, i) * choose(N - K, k - i) / choose(N, k);
          EXPECT_NEAR(hypergeometric_tail(N, K, k, j), want, 1e-12 * std::max(1.0, want))
              << "N=" << N << " K=" << K << " k=" << k << " j=" << j;
        }
  // Large populations (where the sum stops early past the mode) against the pmf's term ratio, summed in full.
  for (auto [N, K, k, j] : std::vector<std::array<int64_t, 4>>{
           {65535, 3277, 40, 21}, {65535, 6554, 46, 24}, {20000, 1000, 2048, 103}, {1000, 50, 36, 5}}) {
    const int64_t hi = std::min(K, k);
    long double term = std::exp((long double)(std::lgamma(N - K + 1.0) - std::lgamma(N - K - k + 1.0) +
                                              std::lgamma(N - k + 1.0) - std::lgamma(N + 1.0)));  // P[X = 0]
    long double tail = 0;
    for (int64_t i = 0; i <= hi; ++i) {
      if (i >= j) tail += term;
      term *= (long double)(K - i) * (k - i) / ((i + 1) * (long double)(N - K - k + i + 1));
    }
    EXPECT_NEAR(hypergeometric_tail(N, K, k, j), double(tail), 1e-9 * double(tail) + 1e-300)
        << "N=" << N << " K=" << K << " k=" << k << " j=" << j;
  }
  EXPECT_THROW(hypergeometric_tail(5, 6, 2, 1), InvalidArgument);
  EXPECT_THROW(hypergeometric_tail(5, 2, 6, 1), InvalidArgument);
}

// The k chosen meets the three bounds its header states, checked here from the definition, and k - 2 misses one.
TEST(SecAggPlusAuto, ChosenKMeetsTheBoundsAndTheNextSmallerDoesNot) {
  auto meets = [](int n, double corrupt, double dropout, double x, int k) {
    const int64_t c = std::min<int64_t>(n - 1, int64_t(std::ceil(corrupt * n)));
    const int64_t d = std::min<int64_t>(n - 1, int64_t(std::ceil(dropout * n)));
    const int64_t r = std::min<int64_t>(n, c + d);
    const int t = std::min(k + 1, std::max(2, int(std::floor(x * (k + 1))) + 1));
    const double split = r < k ? 0.0
                               : double(n) * n / 2 *
                                     std::exp(std::lgamma(r + 1.0) - std::lgamma(r - k + 1.0) - std::lgamma(n + 1.0) +
                                              std::lgamma(n - k + 1.0));
    return n * hypergeometric_tail(n - 1, c, k, t) <= std::ldexp(1.0, -40) &&
           n * hypergeometric_tail(n - 1, d, k, k + 1 - t) <= std::ldexp(1.0, -20) && split <= std::ldexp(1.0, -40);
  };
  int checked = 0;
  for (int n : {20, 100, 1000, 20000})
    for (auto [corrupt, dropout] : std::vector<std::pair<double, double>>{{0.05, 0.1}, {0.1, 0.2}, {0.2, 0.2}})
      for (double x : {0.5, 0.7}) {
        SCOPED_TRACE(testing::Message() << "n=" << n << " corrupt=" << corrupt << " dropout=" << dropout << " x=" << x);
        const int k = choose_neighbors(n, corrupt, dropout, x);
        if (k == 0) {  // every pair: no k short of it meets them
          for (int q = 2; q <= std::min(n - 2, 2048); q += 2) EXPECT_FALSE(meets(n, corrupt, dropout, x, q)) << q;
          continue;
        }
        ++checked;
        EXPECT_EQ(k % 2, 0);
        EXPECT_LE(k, n - 2);
        EXPECT_TRUE(meets(n, corrupt, dropout, x, k));
        if (k > 2) {
          EXPECT_FALSE(meets(n, corrupt, dropout, x, k - 2));
        }
      }
  EXPECT_GE(checked, 20);
}

TEST(SecAggPlusAuto, KGrowsSlowlyWithTheRoundAndWithWhatMayGoWrong) {
  // (pinned: docs/federated.md quotes these)
  EXPECT_EQ(choose_neighbors(100, 0.05, 0.1, 0.5), 22);
  EXPECT_EQ(choose_neighbors(1000, 0.05, 0.1, 0.5), 36);
  EXPECT_EQ(choose_neighbors(20000, 0.05, 0.1, 0.5), 44);
  EXPECT_EQ(choose_neighbors(100, 0.1, 0.2, 0.5), 38);
  EXPECT_EQ(choose_neighbors(1000, 0.1, 0.2, 0.5), 76);
  EXPECT_EQ(choose_neighbors(20000, 0.1, 0.2, 0.5), 96);
  // t = k + 1 (x = 1) tolerates no dropout; with none to tolerate a graph is still chosen.
  EXPECT_EQ(choose_neighbors(100, 0.05, 0.0, 1.0), 6);
  EXPECT_EQ(choose_neighbors(100, 0.07, 0.0, 1.0), 8);  // C = 7 (not ceil(7.000000000000001) = 8 colluders)
  EXPECT_EQ(choose_neighbors(1000, 0.0, 0.0, 0.5), 2);  // nobody colludes or drops: a ring is enough
  int last = 0;
  for (double corrupt : {0.0, 0.05, 0.1, 0.2, 0.3}) {  // more colluders never asks for fewer neighbours
    const int k = choose_neighbors(1000, corrupt, 0.1, 0.5);
    EXPECT_GE(k, last) << "corrupt " << corrupt;
    last = k;
  }
  EXPECT_EQ(choose_neighbors(3, 0.05, 0.1, 0.5), 0);   // too few for any graph but the complete one
  EXPECT_EQ(choose_neighbors(30, 0.45, 0.5, 0.5), 0);  // no k short of every pair: every pair
  EXPECT_THROW(choose_neighbors(100, 0.5, 0.1, 0.5), InvalidArgument);
  EXPECT_THROW(choose_neighbors(100, 0.05, 1.0, 0.5), InvalidArgument);
  EXPECT_THROW(choose_neighbors(100, 0.05, 0.1, 0.4), InvalidArgument);
}

}  // namespace
}  // namespace conduit::fl
