//! Link profiles and projected times: what a measured plan would cost on other hardware.
//!
//! A profile describes a whole machine: the device's achieved throughput for the expert GEMMs
//! and, per link level (inside a node, between nodes), bandwidth and latency. A projected time
//! is, per rank, the expert FLOPs over the device throughput plus, for every exchange, the bytes
//! sent to each other rank over that link's bandwidth and one latency per non-empty message;
//! the slowest rank is the critical path. CPU-measured compute is never mixed into it.

use crate::comm::Exchange;
use crate::{bail, Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One link level.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// Bytes per second, per direction.
    pub bandwidth: f64,
    /// Seconds per message.
    pub latency: f64,
}

/// A machine, from `configs/links/NAME.toml`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkProfile {
    pub name: String,
    pub description: String,
    /// Achieved FLOP/s of the expert GEMMs on one device.
    pub device_flops: f64,
    /// Ranks that share a node (and the intra-node link).
    pub ranks_per_node: usize,
    pub intra: Link,
    pub inter: Link,
}

/// The profiles that ship with Occult, by name.
pub const BUILT_IN: [(&str, &str); 3] = [
    ("pcie4", include_str!("../../configs/links/pcie4.toml")),
    (
        "nvlink-h100",
        include_str!("../../configs/links/nvlink-h100.toml"),
    ),
    ("ib-ndr", include_str!("../../configs/links/ib-ndr.toml")),
];

impl LinkProfile {
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
            && p.ranks_per_node > 0;
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
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(Path::new(&path), e))?;
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

    /// Time for `rank` to send its part of one exchange.
    pub fn exchange_seconds(&self, rank: usize, ex: &Exchange) -> f64 {
        ex.bytes_to
            .iter()
            .enumerate()
            .filter(|&(p, &b)| p != rank && b > 0)
            .map(|(p, &b)| {
                let l = self.link(rank, p);
                b as f64 / l.bandwidth + l.latency
            })
            .sum()
    }
}

/// One rank's projected time, in parts.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Projection {
    pub compute_s: f64,
    pub comm_s: f64,
    pub total_s: f64,
}

/// Projects one rank's step: `flops` of expert compute and its `exchanges`.
pub fn project_rank(
    profile: &LinkProfile,
    rank: usize,
    flops: f64,
    exchanges: &[Exchange],
) -> Projection {
    let compute_s = flops / profile.device_flops;
    let comm_s = exchanges
        .iter()
        .map(|e| profile.exchange_seconds(rank, e))
        .sum();
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
mod tests {
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

    #[test]
    fn hand_checked_projection() {
        let p = LinkProfile {
            name: "t".into(),
            description: String::new(),
            device_flops: 1e12,
            ranks_per_node: 2,
            intra: Link {
                bandwidth: 1e9,
                latency: 1e-6,
            },
            inter: Link {
                bandwidth: 1e8,
                latency: 1e-5,
            },
        };
        // Rank 0 sends 1000 bytes to itself (free), 1000 to rank 1 (intra), 1000 to rank 2
        // (inter), nothing to rank 3.
        let ex = Exchange {
            bytes_to: vec![1000, 1000, 1000, 0],
        };
        let t = p.exchange_seconds(0, &ex);
        assert!((t - (1e-6 + 1e-6 + 1e-5 + 1e-5)).abs() < 1e-12, "{t}");
        let pr = project_rank(&p, 0, 2e9, &[ex.clone(), ex]);
        assert!((pr.compute_s - 2e-3).abs() < 1e-12);
        assert!((pr.total_s - (2e-3 + 2.0 * t)).abs() < 1e-12);
    }
}
