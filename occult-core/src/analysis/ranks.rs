//! Which source rank a token starts on: tokens are split evenly and in order across ranks,
//! the first `tokens % ranks` ranks holding one token more (numpy's `array_split` rule).

use std::ops::Range;

/// An even, in-order split of `tokens` tokens over `ranks` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankSplit {
    pub tokens: usize,
    pub ranks: usize,
}

impl RankSplit {
    pub fn new(tokens: usize, ranks: usize) -> Self {
        assert!(ranks > 0, "a split needs at least one rank");
        RankSplit { tokens, ranks }
    }

    /// Number of tokens rank `r` starts with.
    pub fn len(&self, r: usize) -> usize {
        let base = self.tokens / self.ranks;
        base + usize::from(r < self.tokens % self.ranks)
    }

    /// True when there are no tokens at all.
    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// The tokens of rank `r`, as a range of token positions.
    pub fn range(&self, r: usize) -> Range<usize> {
        let base = self.tokens / self.ranks;
        let extra = self.tokens % self.ranks;
        let start = r * base + r.min(extra);
        start..start + self.len(r)
    }

    /// The rank that token `t` starts on.
    pub fn rank_of(&self, t: usize) -> usize {
        let base = self.tokens / self.ranks;
        let extra = self.tokens % self.ranks;
        let big = extra * (base + 1);
        if t < big {
            t / (base + 1)
        } else {
            extra + (t - big) / base
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_tokens_in_order_and_agree_with_rank_of() {
        for tokens in 0..40 {
            for ranks in 1..9 {
                let s = RankSplit::new(tokens, ranks);
                let mut next = 0;
                for r in 0..ranks {
                    let range = s.range(r);
                    assert_eq!(range.start, next);
                    next = range.end;
                    for t in range {
                        assert_eq!(s.rank_of(t), r);
                    }
                    let l = s.len(r);
                    assert!(l == tokens / ranks || l == tokens / ranks + 1);
                }
                assert_eq!(next, tokens);
            }
        }
    }
}
