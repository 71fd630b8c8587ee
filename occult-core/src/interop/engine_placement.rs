//! Any engine's placement file read back into a placement, its format told by its content:
//! SGLang's `--init-expert-location` JSON (`{"physical_to_logical_map": ...}`), vLLM #34811's
//! `{"expert_to_ep_rank": ...}`, vLLM #49572's bare list, or TensorRT-LLM's load-balancer YAML
//! (anything else). What the file leaves out comes from the model's layout (which layers are
//! MoE layers, how many experts) and the EP size it is served with.

use crate::analysis::placement::Placement;
use crate::interop::checkpoint::ExpertLayout;
use crate::interop::{sglang, trtllm, vllm};
use crate::{bail, Error, Result};
use serde_json::Value;
use std::path::Path;

/// The engine formats a placement is read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineFormat {
    Sglang,
    Trtllm,
    VllmPr49572,
    VllmPr34811,
}

impl EngineFormat {
    pub fn name(self) -> &'static str {
        match self {
            EngineFormat::Sglang => "SGLang --init-expert-location",
            EngineFormat::Trtllm => "TensorRT-LLM load balancer",
            EngineFormat::VllmPr49572 => "vLLM #49572 expert map",
            EngineFormat::VllmPr34811 => "vLLM #34811 expert_to_ep_rank",
        }
    }
}

/// The placement in the engine file `path`, for a model of `layout` (needed by every format but
/// TensorRT-LLM's, whose keys are the layers) served on `ep_size` ranks (TensorRT-LLM's file
/// may say it itself).
pub fn read_engine_placement(
    path: &Path,
    layout: Option<&ExpertLayout>,
    ep_size: Option<usize>,
) -> Result<(Placement, EngineFormat)> {
    let text = crate::input::read_text(path)?;
    let at = |e: Error| Error::bad_file(path, e.to_string());
    let json = text.trim_start().starts_with(['{', '[']);
    if !json {
        let f = trtllm::load_balancer::parse(&text).map_err(at)?;
        let p = trtllm::load_balancer::placement_of(&f, ep_size).map_err(at)?;
        if let Some(l) = layout {
            if p.num_experts != l.num_experts {
                return Err(at(Error::invalid(format!(
                    "the file places {} experts, the model has {}",
                    p.num_experts, l.num_experts
                ))));
            }
            if let Some(x) = p.layers.iter().find(|x| !l.moe_layers.contains(&x.layer)) {
                return Err(at(Error::invalid(format!(
                    "layer {} is not an MoE layer of the model",
                    x.layer
                ))));
            }
        }
        return Ok((p, EngineFormat::Trtllm));
    }
    let v: Value =
        serde_json::from_str(&text).map_err(|e| Error::bad_file(path, format!("not JSON: {e}")))?;
    let format = match &v {
        Value::Object(o) if o.contains_key(sglang::location::KEY) => EngineFormat::Sglang,
        Value::Object(o) if o.contains_key(vllm::placement_file::EXPERT_TO_EP_RANK) => {
            EngineFormat::VllmPr34811
        }
        Value::Array(_) => EngineFormat::VllmPr49572,
        _ => {
            return Err(at(Error::invalid(format!(
                "a JSON object with neither {:?} (SGLang) nor {:?} (vLLM #34811), and not a \
                 list (vLLM #49572)",
                sglang::location::KEY,
                vllm::placement_file::EXPERT_TO_EP_RANK
            ))))
        }
    };
    let (Some(layout), Some(ep)) = (layout, ep_size) else {
        bail!(
            "{}: a {} file needs the model (its MoE layers and experts) and the EP size it is \
             served with",
            path.display(),
            format.name()
        );
    };
    let (e, moe) = (layout.num_experts, &layout.moe_layers);
    let p = match format {
        EngineFormat::Sglang => sglang::location::placement_of(layout, &v, ep),
        EngineFormat::VllmPr34811 => vllm::placement_file::pr34811_placement(&v, moe, e, ep),
        _ => vllm::placement_file::pr49572_placement(&v, moe, e, ep),
    }
    .map_err(at)?;
    Ok((p, format))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_format_is_told_by_its_content() {
        let d = tempfile::tempdir().unwrap();
        let layout = ExpertLayout {
            model_type: "qwen3_moe".into(),
            num_experts: 4,
            num_layers: 3,
            moe_layers: vec![1, 2],
            block: "mlp".into(),
            router: "gate".into(),
            groups: None,
        };
        let p = Placement::uniform(&[1, 2], vec![1, 0, 1, 0], 2, "x");
        let files = [
            (
                "a.json",
                sglang::location::to_text(&sglang::location::location_file(&layout, &p).unwrap()),
                EngineFormat::Sglang,
            ),
            (
                "b.yaml",
                trtllm::load_balancer::load_balancer_file(&p).unwrap(),
                EngineFormat::Trtllm,
            ),
            (
                "c.json",
                vllm::placement_file::pr49572_file(&p, false)
                    .unwrap()
                    .to_string(),
                EngineFormat::VllmPr49572,
            ),
            (
                "d.json",
                vllm::placement_file::pr34811_file(&p).unwrap().to_string(),
                EngineFormat::VllmPr34811,
            ),
        ];
        for (name, text, want) in files {
            let path = d.path().join(name);
            std::fs::write(&path, text).unwrap();
            let (back, format) = read_engine_placement(&path, Some(&layout), Some(2)).unwrap();
            assert_eq!((format, &back.layers), (want, &p.layers), "{name}");
        }
        std::fs::write(d.path().join("e.json"), "{\"x\": 1}").unwrap();
        let err = read_engine_placement(&d.path().join("e.json"), Some(&layout), Some(2));
        assert!(err.unwrap_err().to_string().contains("neither"));
        let err = read_engine_placement(&d.path().join("c.json"), None, Some(2));
        assert!(err.unwrap_err().to_string().contains("needs the model"));
    }
}
