//! Copies of the committed model fixtures with their routed experts stored in another layout
//! (per expert, fused, fused transposed), as checkpoints in the wild store them.

use crate::data_parallel::open;

/// How a checkpoint stores its routed experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertStorage {
    /// `{p}.experts.{j}.{gate,up,down}.weight`.
    PerExpert,
    /// `{p}.experts.gate_up_proj` `[E, 2I, H]` and `{p}.experts.down_proj` `[E, H, I]`.
    Fused,
    /// The same, transposed: `[E, H, 2I]` and `[E, I, H]`.
    Transposed,
}

/// A copy of fixture `arch` in `dir` with its routed experts stored in `layout` (every other
/// tensor and file as the fixture has it, in one weight file).
pub fn relayout(arch: &str, layout: ExpertStorage, dir: &std::path::Path) {
    relayout_sized(arch, layout, None, dir)
}

/// As [`relayout`], with the experts' intermediate size made `intermediate` (a multiple of the
/// fixture's, which the config then names): each expert's gate and up rows are repeated and its
/// down columns repeated and scaled to match. With `intermediate` = H / 2 the fused stacks
/// `[E, 2I, H]` and `[E, H, 2I]` have the same shape, and only the down projection tells the
/// layouts apart; with `intermediate` = H only the gate-up stack does.
pub fn relayout_sized(
    arch: &str,
    layout: ExpertStorage,
    intermediate: Option<usize>,
    dir: &std::path::Path,
) {
    use candle::Tensor;
    let ck = open(arch, false);
    let cfg = &ck.cfg;
    let names = cfg.family.names;
    let n = names.experts;
    let mut all = std::collections::HashMap::new();
    for f in &ck.files.weights {
        all.extend(candle::safetensors::load(f, &candle::Device::Cpu).unwrap());
    }
    let e = cfg.moe.num_experts;
    for l in (0..cfg.num_layers).filter(|&l| cfg.moe_layers[l]) {
        let p = format!("model.layers.{l}.{}", names.block);
        // The stacks [E, I, H], [E, I, H], [E, H, I], from whichever layout the fixture has.
        let one = |j: usize, w: &str| format!("{p}.experts.{j}.{w}.weight");
        let (gate, up, down) = if all.contains_key(&one(0, n.gate)) {
            let mut stack = |w: &str| {
                let parts: Vec<Tensor> = (0..e).map(|j| all.remove(&one(j, w)).unwrap()).collect();
                Tensor::stack(&parts, 0).unwrap()
            };
            (stack(n.gate), stack(n.up), stack(n.down))
        } else {
            let gu = all.remove(&format!("{p}.experts.gate_up_proj")).unwrap();
            let down = all.remove(&format!("{p}.experts.down_proj")).unwrap();
            let i = cfg.moe.expert_intermediate;
            (
                gu.narrow(1, 0, i).unwrap(),
                gu.narrow(1, i, i).unwrap(),
                down,
            )
        };
        let (gate, up, down) = match intermediate {
            Some(to) => {
                let i = cfg.moe.expert_intermediate;
                assert_eq!(to % i, 0, "{to} is not a multiple of the fixture's {i}");
                let r = to / i;
                let rows = |t: &Tensor| Tensor::cat(&vec![t; r], 1).unwrap();
                let cols = (Tensor::cat(&vec![&down; r], 2).unwrap() / r as f64).unwrap();
                (rows(&gate), rows(&up), cols)
            }
            None => (gate, up, down),
        };
        let fused = |t: Tensor, transpose: bool| {
            if transpose {
                t.transpose(1, 2).unwrap().contiguous().unwrap()
            } else {
                t.contiguous().unwrap()
            }
        };
        match layout {
            ExpertStorage::PerExpert => {
                for j in 0..e {
                    all.insert(one(j, n.gate), gate.get(j).unwrap());
                    all.insert(one(j, n.up), up.get(j).unwrap());
                    all.insert(one(j, n.down), down.get(j).unwrap());
                }
            }
            ExpertStorage::Fused | ExpertStorage::Transposed => {
                let t = matches!(layout, ExpertStorage::Transposed);
                let gu = Tensor::cat(&[&gate, &up], 1).unwrap();
                all.insert(format!("{p}.experts.gate_up_proj"), fused(gu, t));
                all.insert(format!("{p}.experts.down_proj"), fused(down, t));
            }
        }
    }
    std::fs::create_dir_all(dir).unwrap();
    candle::safetensors::save(&all, dir.join("model.safetensors")).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&ck.files.config).unwrap()).unwrap();
    if let Some(to) = intermediate {
        let key = if config.get("moe_intermediate_size").is_some() {
            "moe_intermediate_size"
        } else {
            "intermediate_size"
        };
        config[key] = to.into();
    }
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&config).unwrap(),
    )
    .unwrap();
    if let Some(t) = &ck.files.tokenizer {
        std::fs::copy(t, dir.join("tokenizer.json")).unwrap();
    }
}
