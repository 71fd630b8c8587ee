//! Link profiles and projected times: what a measured plan would cost on other hardware.
//!
//! A profile describes a whole machine: the device's achieved throughput for the expert GEMMs,
//! the bytes per activation element it moves (2 for bf16), and, per link level (inside a node,
//! between nodes), bandwidth and latency. A projected step is a sequence of synchronising
//! phases (each all-to-all, and the expert compute between dispatch and combine); each phase
//! lasts as long as its slowest rank, and the step is their sum. A rank's time in an exchange is
//! the larger of its send and receive times, each the bytes to or from every other rank over
//! that link's bandwidth plus one latency per non-empty message; its compute time is its expert
//! FLOPs over the device throughput. CPU-measured time never enters a projection.
//!
//! What a step moved is recorded per rank and exchange as an [`Exchange`] (the communicators
//! fill them in; a measured run hands them here).

use crate::{bail, Error, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The bytes one rank sent to each peer in one all-to-all (for link-model projections).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Exchange {
    pub bytes_to: Vec<u64>,
    /// This rank's time between the end of its previous exchange (or the statistics' reset)
    /// and the start of this one: its own compute in between, in seconds.
    #[serde(default)]
    pub compute_before_s: f64,
}

impl Exchange {
    /// Bytes that left rank `me` (sent to the other ranks) in `exchanges`.
    pub fn remote_bytes(exchanges: &[Exchange], me: usize) -> u64 {
        exchanges
            .iter()
            .flat_map(|e| {
                e.bytes_to
                    .iter()
                    .enumerate()
                    .filter(move |(p, _)| *p != me)
                    .map(|(_, b)| *b)
            })
            .sum()
    }

    /// The compute on the critical path of a step whose ranks ran `ranks[r]` exchanges (in the
    /// same order on every rank) and spent `local_s[r]` seconds outside them: the slowest
    /// rank's compute before each exchange (every exchange waits for it), then the slowest
    /// rank's compute after the last. `None` when the ranks' exchanges do not line up.
    pub fn critical_compute(ranks: &[&[Exchange]], local_s: &[f64]) -> Option<f64> {
        let n = ranks.first()?.len();
        if ranks.iter().any(|r| r.len() != n) || ranks.len() != local_s.len() {
            return None;
        }
        let before: f64 = (0..n)
            .map(|j| {
                ranks
                    .iter()
                    .map(|r| r[j].compute_before_s)
                    .fold(0.0, f64::max)
            })
            .sum();
        let after = ranks
            .iter()
            .zip(local_s)
            .map(|(r, &local)| (local - r.iter().map(|e| e.compute_before_s).sum::<f64>()).max(0.0))
            .fold(0.0, f64::max);
        Some(before + after)
    }
}

/// One link level.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// Bytes per second, per direction.
    pub bandwidth: f64,
    /// Seconds per message.
    pub latency: f64,
}

impl Link {
    /// Seconds of one message of `bytes` bytes over this link (nothing for an empty one).
    pub fn message_seconds(&self, bytes: f64) -> f64 {
        if bytes == 0.0 {
            0.0
        } else {
            bytes / self.bandwidth + self.latency
        }
    }
}

/// A machine, from `configs/links/NAME.toml`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkProfile {
    pub name: String,
    pub description: String,
    /// Achieved FLOP/s of the expert GEMMs on one device.
    pub device_flops: f64,
    /// Bytes per activation element on this machine (2 for bf16); measured f32 rows are
    /// scaled by `activation_bytes / 4`.
    #[serde(default = "two")]
    pub activation_bytes: f64,
    /// Ranks that share a node (and the intra-node link).
    pub ranks_per_node: usize,
    pub intra: Link,
    pub inter: Link,
    /// The profile of the machine a benchmark runs on (`scripts/shaped_links.sh` writes one):
    /// a measured step is projected with each rank's own measured time between the exchanges
    /// as its compute (the dense layers, backward and optimizer included, which the experts'
    /// FLOPs leave out; each exchange waits for the slowest rank's), so that only the links
    /// are modelled.
    #[serde(default)]
    pub measured_compute: bool,
}

fn two() -> f64 {
    2.0
}

/// The profiles that ship with Occult, by name.
pub const BUILT_IN: [(&str, &str); 3] = [
    (
        "pcie4",
        include_str!("../../../../configs/links/pcie4.toml"),
    ),
    (
        "nvlink-h100",
        include_str!("../../../../configs/links/nvlink-h100.toml"),
    ),
    (
        "ib-ndr",
        include_str!("../../../../configs/links/ib-ndr.toml"),
    ),
];

impl LinkProfile {
    /// Whether its nodes are joined by a link slower than the one inside a node: where Occult's
    /// rows take the two-level exchange, and a placement is searched for nodes.
    pub fn nodes_slower(&self) -> bool {
        self.inter.bandwidth < self.intra.bandwidth
    }

    /// Parses and checks a profile; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self> {
        let p: LinkProfile = toml::from_str(text)
            .map_err(|e| Error::bad_file(origin, format!("not a valid link profile: {e}")))?;
        let positive = |v: f64| v.is_finite() && v > 0.0;
        let latency_ok = |v: f64| v.is_finite() && v >= 0.0;
        let valid = positive(p.device_flops)
            && positive(p.intra.bandwidth)
            && positive(p.inter.bandwidth)
            && latency_ok(p.intra.latency)
            && latency_ok(p.inter.latency)
            && p.ranks_per_node > 0
            && positive(p.activation_bytes);
        if !valid {
            return Err(Error::bad_file(
                origin,
                "device_flops and bandwidths must be positive, latencies >= 0, ranks_per_node >= 1",
            ));
        }
        Ok(p)
    }

    /// A built-in profile by name, or a TOML file by path.
    pub fn load(name_or_path: &str) -> Result<Self> {
        if let Some((_, text)) = BUILT_IN.iter().find(|(n, _)| *n == name_or_path) {
            return Self::parse(text, name_or_path);
        }
        let path = PathBuf::from(name_or_path);
        if !path.exists() {
            bail!(
                "no link profile {name_or_path:?}: give a file or one of {}",
                BUILT_IN.map(|(n, _)| n).join(", ")
            );
        }
        let text = crate::input::read_text(&path)?;
        Self::parse(&text, name_or_path)
    }

    /// The link between two ranks.
    pub fn link(&self, a: usize, b: usize) -> &Link {
        if a / self.ranks_per_node == b / self.ranks_per_node {
            &self.intra
        } else {
            &self.inter
        }
    }

    /// Time for `rank` in one exchange: the larger of its send and receive times. `all[r]`
    /// is rank r's record of the exchange; `scale` multiplies the bytes.
    pub fn exchange_seconds(&self, rank: usize, all: &[&Exchange], scale: f64) -> f64 {
        let leg =
            |bytes: u64, other: usize| self.link(rank, other).message_seconds(bytes as f64 * scale);
        let send: f64 = all[rank]
            .bytes_to
            .iter()
            .enumerate()
            .filter(|&(p, _)| p != rank)
            .map(|(p, &b)| leg(b, p))
            .sum();
        let recv: f64 = all
            .iter()
            .enumerate()
            .filter(|&(p, _)| p != rank)
            .map(|(p, e)| leg(e.bytes_to.get(rank).copied().unwrap_or(0), p))
            .sum();
        send.max(recv)
    }
}

/// One rank's part of a step: its expert FLOPs and its exchanges, in order.
#[derive(Clone, Debug)]
pub struct RankStep<'a> {
    pub flops: f64,
    pub exchanges: &'a [Exchange],
}

/// A projected step and its parts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Projection {
    /// The slowest rank's expert compute.
    pub compute_s: f64,
    /// The sum over exchanges of the slowest rank's time in each.
    pub comm_s: f64,
    pub total_s: f64,
}

/// Projects a step of all ranks. Exchanges whose index is in `activation_exchanges` carry f32
/// activations and are scaled to the profile's element size; the others (metadata) are not.
pub fn project_step(
    profile: &LinkProfile,
    ranks: &[RankStep],
    activation_exchanges: &[usize],
) -> Projection {
    let n = ranks.iter().map(|r| r.exchanges.len()).min().unwrap_or(0);
    let comm_s = (0..n)
        .map(|j| {
            let all: Vec<&Exchange> = ranks.iter().map(|r| &r.exchanges[j]).collect();
            let scale = if activation_exchanges.contains(&j) {
                profile.activation_bytes / 4.0
            } else {
                1.0
            };
            (0..ranks.len())
                .map(|r| profile.exchange_seconds(r, &all, scale))
                .fold(0.0, f64::max)
        })
        .sum();
    let compute_s = ranks
        .iter()
        .map(|r| r.flops / profile.device_flops)
        .fold(0.0, f64::max);
    Projection {
        compute_s,
        comm_s,
        total_s: compute_s + comm_s,
    }
}

/// FLOPs of a SwiGLU expert MLP over `rows` rows (three `H x I` matmuls, 2 FLOPs each MAC).
pub fn swiglu_flops(rows: usize, hidden: usize, intermediate: usize) -> f64 {
    6.0 * rows as f64 * hidden as f64 * intermediate as f64
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn built_in_profiles_parse() {
        for (name, _) in BUILT_IN {
            let p = LinkProfile::load(name).unwrap();
            assert_eq!(p.name, name);
        }
        assert!(LinkProfile::load("no-such-profile")
            .unwrap_err()
            .to_string()
            .contains("pcie4"));
        assert!(LinkProfile::parse("name = 'x'", "x.toml").is_err());
    }

    /// Nodes of 2 ranks, 1 GB/s and 1 us inside, 100 MB/s and 10 us across, 1 TFLOP/s.
    pub(crate) fn test_profile() -> LinkProfile {
        LinkProfile {
            name: "t".into(),
            description: String::new(),
            device_flops: 1e12,
            activation_bytes: 2.0,
            ranks_per_node: 2,
            measured_compute: false,
            intra: Link {
                bandwidth: 1e9,
                latency: 1e-6,
            },
            inter: Link {
                bandwidth: 1e8,
                latency: 1e-5,
            },
        }
    }

    /// Each exchange waits for the slowest rank's compute before it; the tail is the slowest
    /// rank's compute after its last exchange.
    #[test]
    fn critical_compute_takes_the_slowest_rank_per_segment() {
        let ex = |before: f64| Exchange {
            compute_before_s: before,
            ..Exchange::default()
        };
        // Rank 0: 1 s, exchange, 3 s, exchange, 0.5 s (4.5 s outside exchanges); rank 1: 2 s,
        // exchange, 1 s, exchange, 2 s (5 s). Critical path: 2 + 3 + 2 = 7 s, not max(4.5, 5).
        let r0 = [ex(1.0), ex(3.0)];
        let r1 = [ex(2.0), ex(1.0)];
        let got = Exchange::critical_compute(&[&r0, &r1], &[4.5, 5.0]).unwrap();
        assert!((got - 7.0).abs() < 1e-12, "{got}");
        // Ranks whose exchanges do not line up have no critical path.
        assert_eq!(
            Exchange::critical_compute(&[&r0, &r1[..1]], &[4.5, 5.0]),
            None
        );
        assert_eq!(Exchange::critical_compute(&[], &[]), None);
    }

    #[test]
    fn hand_checked_projection() {
        let p = test_profile();
        // Rank 0 sends 1000 bytes to itself (free), 1000 to rank 1 (intra), 1000 to rank 2
        // (inter), nothing to rank 3; rank 3 sends 4000 bytes to rank 0 (inter).
        let e0 = Exchange {
            bytes_to: vec![1000, 1000, 1000, 0],
            ..Exchange::default()
        };
        let e3 = Exchange {
            bytes_to: vec![4000, 0, 0, 0],
            ..Exchange::default()
        };
        let none = Exchange {
            bytes_to: vec![0; 4],
            ..Exchange::default()
        };
        let all = [&e0, &none, &none, &e3];
        let send0: f64 = (1e-6 + 1e-6) + (1e-5 + 1e-5);
        let recv0 = 4000.0 / 1e8 + 1e-5;
        assert!((p.exchange_seconds(0, &all, 1.0) - send0.max(recv0)).abs() < 1e-12);
        // A step of two such exchanges (the second scaled to bf16), rank 3 computing most.
        let ex = [e0.clone(), e0.clone()];
        let ex3 = [e3.clone(), e3.clone()];
        let nx = [none.clone(), none.clone()];
        let ranks = [
            RankStep {
                flops: 1e9,
                exchanges: &ex,
            },
            RankStep {
                flops: 0.0,
                exchanges: &nx,
            },
            RankStep {
                flops: 0.0,
                exchanges: &nx,
            },
            RankStep {
                flops: 2e9,
                exchanges: &ex3,
            },
        ];
        let pr = project_step(&p, &ranks, &[1]);
        assert!((pr.compute_s - 2e-3).abs() < 1e-12);
        // First exchange: rank 0 receives 4000 B over IB (4e-5 + 1e-5), rank 3 sends them: 5e-5.
        // Second, at half the bytes: rank 0 receives 2000 B (2e-5 + 1e-5) = 3e-5, and sends
        // 500 B intra (5e-7 + 1e-6) plus 500 B inter (5e-6 + 1e-5) = 1.65e-5: 3e-5.
        assert!((pr.comm_s - (5e-5 + 3e-5)).abs() < 1e-12, "{pr:?}");
        assert!((pr.total_s - (2e-3 + 8e-5)).abs() < 1e-12, "{pr:?}");
        // Rank 3 only sends: 4000 B over IB.
        assert!((p.exchange_seconds(3, &all, 1.0) - (4000.0 / 1e8 + 1e-5)).abs() < 1e-12);
        // Bytes that left each rank, its own share excluded, over both exchanges.
        assert_eq!(Exchange::remote_bytes(&ex, 0), 4000);
        assert_eq!(Exchange::remote_bytes(&ex3, 3), 8000);
        assert_eq!(Exchange::remote_bytes(&ex3, 0), 0);
    }

    /// Which link two ranks share: nodes of `ranks_per_node` consecutive ranks.
    #[test]
    fn ranks_share_the_intra_link_only_inside_a_node() {
        let p = test_profile();
        for (a, b, inside) in [
            (0, 1, true),
            (1, 2, false),
            (2, 3, true),
            (0, 3, false),
            (5, 4, true),
        ] {
            let want = if inside { &p.intra } else { &p.inter };
            assert_eq!(p.link(a, b), want, "ranks {a} and {b}");
        }
    }

    /// Each bound of a profile is checked on its own; activation_bytes defaults to 2 (bf16).
    #[test]
    fn every_field_of_a_profile_is_checked() {
        let good = "name = 'x'\ndescription = ''\ndevice_flops = 1e12\nranks_per_node = 2\n\
                    intra = { bandwidth = 1e9, latency = 1e-6 }\n\
                    inter = { bandwidth = 1e8, latency = 0.0 }\n";
        let p = LinkProfile::parse(good, "x.toml").unwrap();
        assert_eq!(p.activation_bytes, 2.0);
        for (from, to) in [
            ("device_flops = 1e12", "device_flops = 0.0"),
            ("bandwidth = 1e9", "bandwidth = 0.0"),
            ("bandwidth = 1e8", "bandwidth = -1.0"),
            ("latency = 1e-6", "latency = -1e-6"),
            ("latency = 0.0", "latency = nan"),
            ("ranks_per_node = 2", "ranks_per_node = 0"),
            (
                "ranks_per_node = 2",
                "ranks_per_node = 2\nactivation_bytes = 0.0",
            ),
        ] {
            let bad = good.replace(from, to);
            assert_ne!(bad, good);
            let e = LinkProfile::parse(&bad, "x.toml").unwrap_err().to_string();
            assert!(e.contains("must be positive"), "{to}: {e}");
        }
    }

    #[test]
    fn swiglu_flops_are_three_matmuls() {
        // Three [rows, 4] x [4, 5]-sized products, 2 FLOPs per multiply-add.
        assert_eq!(swiglu_flops(3, 4, 5), 3.0 * 2.0 * 3.0 * 4.0 * 5.0);
    }
}
