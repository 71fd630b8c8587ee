//! RoPE's frequencies as `config.json` asks for them: plain (`rope_type` `default`), or YaRN
//! (`yarn`, DeepSeek-V3's and Kimi-K2's long context, and any model served with it), computed as
//! transformers' `_compute_yarn_parameters` does, in f32: each frequency blended between its
//! plain and its `factor`-interpolated value by a linear ramp over the dimensions between the
//! `beta_fast` and `beta_slow` rotation counts, and cos/sin scaled by the attention factor.
//! DeepSeek's latent attention also folds `mscale_all_dim` into its softmax scale
//! ([`RopeScaling::softmax_mscale`]).

use crate::{Error, Result};
use serde_json::Value;

/// How a model's RoPE frequencies are set.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// `1 / theta^(2i / dim)`.
    Plain,
    Yarn(Yarn),
}

/// YaRN's parameters, with transformers' defaults filled in.
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_positions: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// `attention_factor`, or the one `mscale` and `mscale_all_dim` (or `factor` alone) imply.
    pub attention_factor: f64,
    /// `mscale_all_dim`, where given (DeepSeek: its softmax scale's square).
    pub mscale_all_dim: Option<f64>,
    pub truncate: bool,
}

/// YaRN's `0.1 * mscale * ln(scale) + 1` (1 for a scale of at most 1).
fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl RopeScaling {
    /// Reads `rope_scaling` (or transformers v5's `rope_parameters`) from `v`; `origin` names
    /// the file in errors, `max_positions` is `max_position_embeddings`.
    pub fn read(v: &Value, origin: &str, max_positions: Option<usize>) -> Result<Self> {
        let v5 = v.get("rope_parameters").filter(|p| p.is_object());
        let mut found = RopeScaling::Plain;
        for (key, scaling, untyped) in [
            ("rope_scaling", v.get("rope_scaling"), "?"),
            ("rope_parameters", v5, "default"),
        ] {
            let Some(s) = scaling.filter(|s| !s.is_null()) else {
                continue;
            };
            let kind = s
                .get("rope_type")
                .or_else(|| s.get("type"))
                .and_then(Value::as_str)
                .unwrap_or(untyped);
            match kind {
                "default" => {}
                "yarn" => found = RopeScaling::Yarn(Yarn::read(s, key, origin, max_positions)?),
                _ => {
                    return Err(Error::bad_file(
                        origin,
                        format!(
                            "rope_scaling of type {kind:?} is not supported (plain RoPE and \
                             \"yarn\" are)"
                        ),
                    ))
                }
            }
        }
        Ok(found)
    }

    /// The inverse frequencies of `dim` rotated features with base `theta`, and the factor
    /// cos and sin are scaled by.
    pub fn frequencies(&self, dim: usize, theta: f64) -> (Vec<f32>, f32) {
        // transformers computes them in f32: `1 / theta^(arange(0, dim, 2) / dim)`.
        let plain: Vec<f32> = (0..dim / 2)
            .map(|i| 1.0 / (theta.powf((2 * i) as f64 / dim as f64)) as f32)
            .collect();
        match self {
            RopeScaling::Plain => (plain, 1.0),
            RopeScaling::Yarn(y) => (y.blend(&plain, dim, theta), y.attention_factor as f32),
        }
    }

    /// What DeepSeek's attention multiplies its softmax scale by: `mscale(factor,
    /// mscale_all_dim)^2` under YaRN with `mscale_all_dim`, else 1 (transformers'
    /// `yarn_apply_mscale`).
    pub fn softmax_mscale(&self) -> f64 {
        match self {
            RopeScaling::Yarn(Yarn {
                factor,
                mscale_all_dim: Some(m),
                ..
            }) if *m != 0.0 => yarn_mscale(*factor, *m).powi(2),
            _ => 1.0,
        }
    }
}

impl Yarn {
    fn read(s: &Value, key: &str, origin: &str, max_positions: Option<usize>) -> Result<Self> {
        let bad = |field: &str, want: &str| {
            Error::bad_file(
                origin,
                format!("{key}.{field} = {} is not {want}", s[field]),
            )
        };
        let num = |field: &str| -> Result<Option<f64>> {
            match s.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_f64()
                    .filter(|x| x.is_finite())
                    .map(Some)
                    .ok_or_else(|| bad(field, "a finite number")),
            }
        };
        let original = match s.get("original_max_position_embeddings") {
            None | Some(Value::Null) => max_positions.ok_or_else(|| {
                Error::bad_file(
                    origin,
                    format!(
                        "{key} is YaRN without original_max_position_embeddings or \
                         max_position_embeddings"
                    ),
                )
            })?,
            Some(x) => x
                .as_u64()
                .filter(|&x| x > 0)
                .ok_or_else(|| bad("original_max_position_embeddings", "a positive integer"))?
                as usize,
        };
        let factor = match num("factor")? {
            Some(f) => f,
            // DeepSeek-V3's rule when the factor is left out.
            None => max_positions.ok_or_else(|| bad("factor", "given"))? as f64 / original as f64,
        };
        if factor <= 0.0 {
            return Err(bad("factor", "positive"));
        }
        let (mscale, mscale_all_dim) = (num("mscale")?, num("mscale_all_dim")?);
        let attention_factor = match (num("attention_factor")?, mscale, mscale_all_dim) {
            (Some(a), _, _) => a,
            (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                yarn_mscale(factor, m) / yarn_mscale(factor, all)
            }
            _ => yarn_mscale(factor, 1.0),
        };
        let truncate = match s.get("truncate") {
            None | Some(Value::Null) => true,
            Some(x) => x
                .as_bool()
                .ok_or_else(|| bad("truncate", "true or false"))?,
        };
        // `or` as transformers reads them: a 0 takes the default too.
        let beta = |field: &str, default: f64| -> Result<f64> {
            Ok(num(field)?.filter(|&b| b != 0.0).unwrap_or(default))
        };
        Ok(Yarn {
            factor,
            original_max_positions: original,
            beta_fast: beta("beta_fast", 32.0)?,
            beta_slow: beta("beta_slow", 1.0)?,
            attention_factor,
            mscale_all_dim,
            truncate,
        })
    }

    /// Each plain frequency blended with its interpolated one (`/ factor`) by YaRN's ramp.
    fn blend(&self, plain: &[f32], dim: usize, theta: f64) -> Vec<f32> {
        // The dimension at which a wavelength makes `rotations` turns over the original context.
        let correction = |rotations: f64| {
            dim as f64
                * (self.original_max_positions as f64 / (rotations * 2.0 * std::f64::consts::PI))
                    .ln()
                / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (correction(self.beta_fast), correction(self.beta_slow));
        if self.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0) as f32, high.min(dim as f64 - 1.0) as f32);
        if low == high {
            high += 0.001;
        }
        let factor = self.factor as f32;
        plain
            .iter()
            .enumerate()
            .map(|(i, &p)| {
                let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                let extrapolation = 1.0 - ramp;
                // As transformers writes it: 1 / (factor * pos_freq), pos_freq = 1 / p.
                let interpolated = 1.0 / (factor * (1.0 / p));
                interpolated * (1.0 - extrapolation) + p * extrapolation
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// DeepSeek-V3's published rope_scaling, and a small one with a factor on the attention,
    /// against what transformers 5.25 computed (`_compute_yarn_parameters`, `yarn_apply_mscale`).
    #[test]
    fn yarn_is_transformers() {
        let v3 = json!({"rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40,
            "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
            "type": "yarn"}});
        let small = json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
            "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8,
            "original_max_position_embeddings": 32}});
        for (v, max, dim, at, want, att, mscale) in [
            (
                v3,
                163840,
                64,
                vec![0, 5, 10, 15, 20, 25, 31],
                vec![
                    1.0,
                    0.23713736236095428,
                    0.05623412877321243,
                    0.0083345090970397,
                    0.0007905694073997438,
                    1.8747354260995053e-05,
                    3.3338035336782923e-06,
                ],
                1.0,
                1.8738542070926265,
            ),
            (
                small,
                128,
                8,
                vec![0, 1, 2, 3],
                vec![
                    1.0,
                    0.02500000037252903,
                    0.0024999999441206455,
                    0.0002500000118743628,
                ],
                1.0249579607969668,
                1.2341066949354886,
            ),
        ] {
            let r = RopeScaling::read(&v, "config.json", Some(max)).unwrap();
            let (inv, got_att) = r.frequencies(dim, 10000.0);
            for (&i, &w) in at.iter().zip(&want) {
                assert!(
                    (inv[i] as f64 - w).abs() <= 1e-6 * w,
                    "{v}: [{i}] {} vs {w}",
                    inv[i]
                );
            }
            assert!((got_att as f64 - att).abs() < 1e-6, "{got_att} vs {att}");
            assert!(
                (r.softmax_mscale() - mscale).abs() < 1e-9,
                "{}",
                r.softmax_mscale()
            );
        }
    }

    #[test]
    fn other_scalings_are_refused_by_name() {
        for kind in ["linear", "dynamic", "longrope", "llama3"] {
            let v = json!({"rope_scaling": {"rope_type": kind, "factor": 2.0}});
            let e = RopeScaling::read(&v, "config.json", None)
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("{kind:?} is not supported")), "{e}");
        }
        let v = json!({"rope_scaling": {"type": "yarn", "factor": "x"}});
        let e = RopeScaling::read(&v, "config.json", Some(8))
            .unwrap_err()
            .to_string();
        assert!(e.contains("rope_scaling.factor"), "{e}");
    }
}
