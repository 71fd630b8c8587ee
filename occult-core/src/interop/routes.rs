//! Every route a placement takes to an engine, side by side: the file it is written as (the
//! same text `occult export` writes), that file read back as the engine reads it, and the copy
//! rule the engine serves replicas with. What a route realises is the placement read back,
//! counted under its rule, so a route that loses something (a layer-shared map, copies it
//! cannot hold) shows it in E[C_T].
//!
//! | route | file | per layer | replicas | copy rule |
//! |---|---|---|---|---|
//! | renumbered checkpoint | `renumbering.json` beside permuted weights; contiguous sharding | yes | no | - |
//! | SGLang | `--init-expert-location` JSON | yes | yes | SGLang's static table |
//! | TensorRT-LLM | `moe_config.load_balancer` YAML | yes | yes | uniform over copies |
//! | vLLM #49572 | bare JSON list of slot rows | yes | yes | flat position mod copies |
//! | vLLM #34811 | `{"expert_to_ep_rank": [...]}` | no: one map | no | - |
//!
//! vLLM picks copy `(token * k + j) mod copies` of a token's j-th expert within its forward
//! batch (`eplb_map_to_physical_and_record`): which copy a token gets depends on its place in
//! the batch, which no trace records, so it is counted as TensorRT-LLM's rule is, each copy
//! equally likely. That is an approximation: where the copies divide k, the pick follows the
//! expert's rank in the token's top-k, the same copy for every token.

use crate::analysis::placement::replicas::CopyRule;
use crate::analysis::placement::Placement;
use crate::interop::checkpoint::{ExpertLayout, Renumbering};
use crate::interop::slots::{layer_rows, placement_from_rows};
use crate::interop::{sglang, trtllm, vllm};
use crate::{bail, Error, Result};

/// A way to serve a placement on an engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Checkpoint,
    Sglang,
    Trtllm,
    VllmPr49572,
    VllmPr34811,
}

impl Route {
    /// Every route, in the order tables show them.
    pub const ALL: [Route; 5] = [
        Route::Checkpoint,
        Route::Sglang,
        Route::Trtllm,
        Route::VllmPr49572,
        Route::VllmPr34811,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Route::Checkpoint => "renumbered checkpoint",
            Route::Sglang => "SGLang",
            Route::Trtllm => "TensorRT-LLM",
            Route::VllmPr49572 => "vLLM #49572",
            Route::VllmPr34811 => "vLLM #34811",
        }
    }

    /// The rule the engine serves copies with; `None` where the route holds no replicas.
    pub fn rule(self) -> Option<CopyRule> {
        match self {
            Route::Sglang => Some(CopyRule::Sglang),
            // vLLM's position-modulo pick spreads a batch evenly over the copies: counted as
            // TensorRT-LLM's uniform rule is (module docs).
            Route::Trtllm | Route::VllmPr49572 => Some(CopyRule::Trtllm),
            Route::Checkpoint | Route::VllmPr34811 => None,
        }
    }

    /// Whether the route takes one map for every layer only.
    pub fn shared_only(self) -> bool {
        self == Route::VllmPr34811
    }

    /// The file `p` is written as for a model of `layout` (the text `occult export` writes; for
    /// the checkpoint, its renumbering). Refuses what the route cannot hold, with the reason.
    pub fn file(self, p: &Placement, layout: &ExpertLayout) -> Result<String> {
        Ok(match self {
            Route::Checkpoint => {
                let ren = Renumbering::from_placement(p, layout.groups)?;
                serde_json::to_string(&ren).map_err(|e| Error::invalid(e.to_string()))?
            }
            Route::Sglang => {
                sglang::location::to_text(&sglang::location::location_file(layout, p)?)
            }
            Route::Trtllm => trtllm::load_balancer::load_balancer_file(p)?,
            Route::VllmPr49572 => {
                let shared = shared_map(p);
                vllm::placement_file::pr49572_file(p, shared)?.to_string()
            }
            Route::VllmPr34811 => vllm::placement_file::pr34811_file(p)?.to_string(),
        })
    }

    /// The placement the engine serves from `text` (a file of this route) on `ep_size` ranks,
    /// for a model of `layout`.
    pub fn read(self, text: &str, layout: &ExpertLayout, ep_size: usize) -> Result<Placement> {
        let json = || -> Result<serde_json::Value> {
            serde_json::from_str(text).map_err(|e| Error::invalid(format!("not JSON: {e}")))
        };
        let (e, moe) = (layout.num_experts, &layout.moe_layers[..]);
        match self {
            Route::Checkpoint => {
                let ren: Renumbering = serde_json::from_str(text)
                    .map_err(|e| Error::invalid(format!("not a renumbering: {e}")))?;
                ren.validate()?;
                let rows: Vec<_> = ren
                    .layers
                    .into_iter()
                    .map(|l| (l.layer, l.new_to_original))
                    .collect();
                placement_from_rows(&rows, e, ep_size, "checkpoint")
            }
            Route::Sglang => sglang::location::placement_of(layout, &json()?, ep_size),
            Route::Trtllm => {
                let f = trtllm::load_balancer::parse(text)?;
                trtllm::load_balancer::placement_of(&f, Some(ep_size))
            }
            Route::VllmPr49572 => {
                vllm::placement_file::pr49572_placement(&json()?, moe, e, ep_size)
            }
            Route::VllmPr34811 => {
                vllm::placement_file::pr34811_placement(&json()?, moe, e, ep_size)
            }
        }
    }

    /// `p` written as this route's file and read back: the placement the engine serves. Fails
    /// where the route cannot hold `p`, or where what is read back holds other slots than `p`
    /// (a writer and its reader disagreeing).
    pub fn round_trip(self, p: &Placement, layout: &ExpertLayout) -> Result<Placement> {
        let text = self.file(p, layout)?;
        let back = self.read(&text, layout, p.num_devices)?;
        let (want, got) = (layer_rows(p)?, layer_rows(&back)?);
        if back.num_devices != p.num_devices || want != got {
            let at = match want.iter().zip(&got).find(|(a, b)| a != b) {
                Some((a, _)) => format!("layer {}", a.0),
                None => format!("{} layers written, {} read", want.len(), got.len()),
            };
            bail!(
                "{}: the file read back holds other slots than the placement written ({at})",
                self.name()
            );
        }
        Ok(back)
    }
}

impl From<crate::interop::engine_placement::EngineFormat> for Route {
    /// The route whose file a placement file read back was.
    fn from(f: crate::interop::engine_placement::EngineFormat) -> Self {
        use crate::interop::engine_placement::EngineFormat as F;
        match f {
            F::Sglang => Route::Sglang,
            F::Trtllm => Route::Trtllm,
            F::VllmPr49572 => Route::VllmPr49572,
            F::VllmPr34811 => Route::VllmPr34811,
        }
    }
}

/// Whether every layer of `p` holds the same slots (written as one shared row where a format
/// has one).
pub fn shared_map(p: &Placement) -> bool {
    layer_rows(p).is_ok_and(|rows| rows.windows(2).all(|w| w[0].1 == w[1].1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::placement::LayerPlacement;

    fn layout() -> ExpertLayout {
        ExpertLayout {
            model_type: "qwen2_moe".into(),
            num_experts: 8,
            num_layers: 3,
            moe_layers: vec![1, 2],
            block: "mlp".into(),
            router: "gate".into(),
            groups: None,
        }
    }

    fn per_layer() -> Placement {
        let mut p = Placement::uniform(&[1, 2], vec![0, 1, 0, 1, 0, 1, 0, 1], 2, "t");
        p.layers[1].device_of_expert = vec![1, 1, 0, 0, 1, 1, 0, 0];
        p
    }

    fn replicated() -> Placement {
        let mut p = per_layer();
        for (l, slots) in p.layers.iter_mut().zip([
            vec![0, 2, 4, 6, 1, 1, 3, 5, 7, 0],
            vec![2, 3, 6, 7, 0, 0, 1, 4, 5, 2],
        ]) {
            *l = LayerPlacement {
                layer: l.layer,
                device_of_expert: Vec::new(),
                metrics: None,
                slots: Some(slots),
                expert_load: None,
            };
        }
        p.format = crate::analysis::placement::PLACEMENT_FORMAT_V2.into();
        p
    }

    /// Each route that holds a placement reads back the very slots it wrote; the others refuse
    /// it with their reason.
    #[test]
    fn every_route_reads_back_what_it_wrote_or_says_why_not() {
        let l = layout();
        let shared = Placement::uniform(&[1, 2], vec![1, 0, 1, 0, 1, 0, 1, 0], 2, "t");
        for r in Route::ALL {
            let p = r.round_trip(&shared, &l).unwrap();
            assert_eq!(
                layer_rows(&p).unwrap(),
                layer_rows(&shared).unwrap(),
                "{r:?}"
            );
            let back = r.round_trip(&per_layer(), &l);
            assert_eq!(back.is_ok(), !r.shared_only(), "{r:?}");
            let back = r.round_trip(&replicated(), &l);
            assert_eq!(back.is_ok(), r.rule().is_some(), "{r:?}: {back:?}");
            if let Ok(b) = back {
                assert!(b.has_replicas());
            }
        }
        let err = Route::VllmPr34811
            .round_trip(&per_layer(), &l)
            .unwrap_err()
            .to_string();
        assert!(err.contains("one map for every layer"), "{err}");
        let err = Route::Checkpoint
            .round_trip(&replicated(), &l)
            .unwrap_err()
            .to_string();
        assert!(err.contains("replicas"), "{err}");
        assert!(shared_map(&shared) && !shared_map(&per_layer()));
    }

    /// Each engine's file, read back and written again, is the same bytes (the checkpoint's
    /// renumbering names the placement's method, so its rows are compared instead).
    #[test]
    fn every_file_round_trips_byte_for_byte() {
        let l = layout();
        let shared = Placement::uniform(&[1, 2], vec![1, 0, 1, 0, 1, 0, 1, 0], 2, "t");
        let mut checked = 0;
        for p in [shared, per_layer(), replicated()] {
            for r in Route::ALL {
                let Ok(text) = r.file(&p, &l) else {
                    continue;
                };
                checked += 1;
                let back = r.read(&text, &l, p.num_devices).unwrap();
                if r == Route::Checkpoint {
                    assert_eq!(layer_rows(&back).unwrap(), layer_rows(&p).unwrap());
                } else {
                    assert_eq!(r.file(&back, &l).unwrap(), text, "{r:?}");
                }
            }
        }
        // Shared: all 5 routes; per layer: all but #34811; with copies: SGLang, TRT, #49572.
        assert_eq!(checked, 5 + 4 + 3);
    }
}
