//! Checks that every rank of an expert-parallel model loads the same model under the same setup
//! (a digest of the routers and embeddings, the placement and the pruning), before any row is
//! exchanged; and [`fingerprint`], the digest ranks compare.

use super::dense::DenseParts;
use super::moe::MoeSetup;
use crate::ep::comm::Communicator;
use crate::{bail, Error, Result};
use candle::DType;

/// A 64-bit FNV-1a digest of bytes (to compare what ranks hold without moving it).
pub fn fingerprint(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// What the ranks of a model must agree on, as (what, value) pairs for messages.
fn layout(dense: &DenseParts, setup: &MoeSetup) -> Result<Vec<(String, String)>> {
    let c = &dense.cfg;
    // The replicated weights that decide routing: the routers (small), and the embeddings' first
    // row. Two different checkpoints of one shape differ here.
    let mut weights = Vec::new();
    let first_row = dense.embed.get(0)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    weights.extend(first_row);
    for layer in &dense.layers {
        if let Some(r) = &layer.router {
            weights.extend(r.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
        }
    }
    // The maps in effect (a file's, or the default contiguous ones) of every MoE layer; under
    // replicas its slots, the copy rule and the loads that break its ties.
    let mut maps: Vec<u8> = Vec::new();
    for l in (0..c.num_layers).filter(|&l| c.moe_layers[l]) {
        let words: Vec<u32> = match setup.replicas.get(&l) {
            Some(r) => [l as u32, u32::MAX, r.rule as u32]
                .into_iter()
                .chain(r.map.slot_expert.iter().copied())
                .collect(),
            None => std::iter::once(l as u32)
                .chain(setup.map(l, c.moe.num_experts))
                .collect(),
        };
        maps.extend(words.into_iter().flat_map(u32::to_le_bytes));
        if let Some(loads) = setup.replicas.get(&l).and_then(|r| r.map.expert_load()) {
            maps.extend(loads.iter().flat_map(|x| x.to_le_bytes()));
        }
    }
    let prune: Vec<String> = setup
        .prune
        .iter()
        .map(|(l, p)| {
            let table = p
                .similarity
                .as_ref()
                .map(|t| fingerprint(t.cos.iter().flat_map(|x| x.to_le_bytes())));
            format!(
                "layer {l}: {:?} to {}, table {table:x?}",
                p.rule,
                p.limit.label()
            )
        })
        .collect();
    Ok(vec![
        (
            "model".into(),
            format!(
                "{} with hidden size {}, {} layers, {} experts, top-{}, vocabulary {}",
                c.family, c.hidden_size, c.num_layers, c.moe.num_experts, c.moe.top_k, c.vocab_size
            ),
        ),
        ("dtype".into(), format!("{:?}", dense.embed.dtype())),
        (
            "checkpoint weights (digest of the routers and the embeddings' first row)".into(),
            format!(
                "{:016x}",
                fingerprint(weights.iter().flat_map(|x| x.to_le_bytes()))
            ),
        ),
        ("dispatch mode".into(), format!("{:?}", setup.mode)),
        (
            "placement (digest)".into(),
            format!("{} devices, {:016x}", setup.num_devices, fingerprint(maps)),
        ),
        ("pruning".into(), format!("{prune:?}")),
    ])
}

/// Checks that every rank loads the same model under the same setup; the error names the
/// first thing that differs and the ranks that differ from rank 0. Collective.
pub(super) fn check_same_layout(
    comm: &dyn Communicator,
    dense: &DenseParts,
    setup: &MoeSetup,
) -> Result<()> {
    if comm.size() < 2 {
        return Ok(());
    }
    let mine = layout(dense, setup)?;
    let bytes = serde_json::to_vec(&mine)
        .map_err(|e| Error::invalid(format!("encoding the layout: {e}")))?;
    let all = comm.all_gather_v_bytes(&bytes)?;
    let decoded: Vec<Vec<(String, String)>> = all
        .iter()
        .map(|b| serde_json::from_slice(b))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| Error::Comm(format!("a rank's layout does not decode: {e}")))?;
    for (k, (what, value)) in decoded[0].iter().enumerate() {
        let differ: Vec<usize> = (1..decoded.len())
            .filter(|&r| decoded[r].get(k).map(|x| &x.1) != Some(value))
            .collect();
        if let Some(&r) = differ.first() {
            let theirs = decoded[r].get(k).map_or("nothing", |x| x.1.as_str());
            bail!(
                "the ranks run different models or setups: rank(s) {differ:?} differ from rank 0 \
                 in the {what}: rank 0 has {value}, rank {r} has {theirs}"
            );
        }
    }
    Ok(())
}
