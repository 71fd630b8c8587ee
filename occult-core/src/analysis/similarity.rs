//! Expert similarity tables for the similarity pruning rule: the cosine between experts'
//! router-logit columns over calibration tokens, `S[a][b] = <l_a, l_b> / (|l_a| |l_b|)`.
//!
//! Inner products are accumulated in f64: each block of tokens is summed on its own, then the
//! block sums are added into the running totals with Kahan compensation. Long traces therefore
//! neither overflow (f32 squares of large logits would) nor lose small contributions.

use crate::{bail, Result};

/// Tokens summed per block before a compensated add into the totals.
const BLOCK: usize = 1024;

/// Running inner products of router-logit columns.
#[derive(Clone, Debug)]
pub struct SimilarityAccumulator {
    num_experts: usize,
    sum: Vec<f64>,
    comp: Vec<f64>,
    tokens: u64,
}

impl SimilarityAccumulator {
    pub fn new(num_experts: usize) -> Self {
        SimilarityAccumulator {
            num_experts,
            sum: vec![0.0; num_experts * num_experts],
            comp: vec![0.0; num_experts * num_experts],
            tokens: 0,
        }
    }

    /// Adds router logits of some tokens (`[tokens, E]`, row-major).
    pub fn add(&mut self, logits: &[f32]) -> Result<()> {
        let e = self.num_experts;
        if !logits.len().is_multiple_of(e) {
            bail!(
                "router logits have {} values, not a multiple of {e} experts",
                logits.len()
            );
        }
        let mut block = vec![0.0f64; e * e];
        for chunk in logits.chunks(BLOCK * e) {
            block.iter_mut().for_each(|x| *x = 0.0);
            for row in chunk.chunks_exact(e) {
                for a in 0..e {
                    let la = row[a] as f64;
                    if la == 0.0 {
                        continue;
                    }
                    let out = &mut block[a * e..a * e + a + 1];
                    for (o, &lb) in out.iter_mut().zip(&row[..=a]) {
                        *o += la * lb as f64;
                    }
                }
            }
            for a in 0..e {
                for b in 0..=a {
                    let i = a * e + b;
                    // Kahan summation of the block total into the running sum.
                    let y = block[i] - self.comp[i];
                    let t = self.sum[i] + y;
                    self.comp[i] = (t - self.sum[i]) - y;
                    self.sum[i] = t;
                }
            }
            self.tokens += (chunk.len() / e) as u64;
        }
        Ok(())
    }

    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The cosine table. An expert whose logits are all zero has similarity 0 to every other.
    pub fn finish(&self) -> SimilarityTable {
        let e = self.num_experts;
        let mut cos = vec![0.0f32; e * e];
        let norm: Vec<f64> = (0..e).map(|a| self.sum[a * e + a].sqrt()).collect();
        for a in 0..e {
            for b in 0..=a {
                let denom = norm[a] * norm[b];
                let v = if denom > 0.0 {
                    (self.sum[a * e + b] / denom).clamp(-1.0, 1.0) as f32
                } else {
                    0.0
                };
                cos[a * e + b] = v;
                cos[b * e + a] = v;
            }
        }
        SimilarityTable {
            num_experts: e,
            cos,
        }
    }
}

/// Cosine similarity between experts, E x E, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct SimilarityTable {
    pub num_experts: usize,
    pub cos: Vec<f32>,
}

impl SimilarityTable {
    /// Builds the table from router logits in one go.
    pub fn from_logits(logits: &[f32], num_experts: usize) -> Result<Self> {
        let mut acc = SimilarityAccumulator::new(num_experts);
        acc.add(logits)?;
        Ok(acc.finish())
    }

    pub fn get(&self, a: usize, b: usize) -> f32 {
        self.cos[a * self.num_experts + b]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_checked_cosines() {
        // Columns: e0 = (1, 0), e1 = (1, 1), e2 = (-1, 0).
        let logits = [1.0, 1.0, -1.0, 0.0, 1.0, 0.0];
        let s = SimilarityTable::from_logits(&logits, 3).unwrap();
        assert!((s.get(0, 1) - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-6);
        assert_eq!(s.get(0, 2), -1.0);
        assert_eq!(s.get(1, 1), 1.0);
        assert_eq!(s.get(1, 0), s.get(0, 1));
    }

    #[test]
    fn large_logits_do_not_overflow_and_chunking_does_not_matter() {
        // 1e20 squared overflows f32 but not f64.
        let logits: Vec<f32> = (0..3000)
            .flat_map(|i| [1e20f32, if i % 2 == 0 { 1e20 } else { -1e20 }])
            .collect();
        let s = SimilarityTable::from_logits(&logits, 2).unwrap();
        assert!(s.get(0, 1).abs() < 1e-6);
        assert_eq!(s.get(0, 0), 1.0);
        // Adding in pieces gives the same table as adding at once.
        let mut acc = SimilarityAccumulator::new(2);
        for piece in logits.chunks(2 * 777) {
            acc.add(piece).unwrap();
        }
        assert_eq!(acc.finish(), s);
        assert_eq!(acc.tokens(), 3000);
    }

    #[test]
    fn ragged_input_is_an_error() {
        assert!(SimilarityTable::from_logits(&[1.0, 2.0, 3.0], 2).is_err());
    }
}
