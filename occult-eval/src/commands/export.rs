//! `occult export checkpoint` (a Hugging Face checkpoint with experts renumbered, so that an
//! engine's contiguous expert sharding realises a placement) and `occult export sglang`
//! (SGLang's `--init-expert-location` file).

use crate::progress::bar;
use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use occult_core::analysis::placement::Placement;
use occult_core::interop::checkpoint::{
    export_checkpoint, ExpertLayout, Renumbering, RENUMBERING_FILE,
};
use occult_core::interop::sglang::location;
use occult_core::models::checkpoint::resolve;
use std::path::{Path, PathBuf};

#[derive(Subcommand, Debug)]
pub enum ExportCmd {
    /// A Hugging Face checkpoint whose experts are renumbered layer by layer (device 0's first,
    /// then device 1's, ...), so that contiguous expert sharding over the placement's devices
    /// (vLLM's default, Megatron-Core, DeepSpeed) puts every expert where the placement does.
    #[command(after_help = "Example:\n  \
        occult place --trace t.safetensors --devices 4 --method occult -o p.json\n  \
        occult export checkpoint --model allenai/OLMoE-1B-7B-0924 --placement p.json -o olmoe-placed\n\n\
        The output keeps the input's tensor names, dtypes and shards; only expert-indexed tensors \
        (experts, router rows, selection biases) move. occult.renumbering.json beside them maps \
        new ids to the original ones (`occult trace remap` uses it).")]
    Checkpoint(CheckpointArgs),
    /// SGLang's expert-location JSON for `--init-expert-location` (serve with `--ep-size`
    /// equal to the placement's devices).
    #[command(after_help = "Example:\n  \
        occult export sglang --model Qwen/Qwen3-30B-A3B --placement p.json -o location.json\n  \
        python -m sglang.launch_server --model-path Qwen/Qwen3-30B-A3B --tp 4 --ep-size 4 \\\n    \
        --init-expert-location location.json")]
    Sglang(SglangArgs),
}

#[derive(Args, Debug)]
pub struct CheckpointArgs {
    /// The model: a folder or a Hugging Face hub id in the local cache.
    #[arg(long)]
    pub model: String,
    /// Hub revision (with a hub id).
    #[arg(long)]
    pub revision: Option<String>,
    /// The placement (occult.placement.v1, from `occult place`), covering every MoE layer.
    #[arg(long)]
    pub placement: PathBuf,
    /// The new model folder.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Replace an earlier export at the output.
    #[arg(long)]
    pub overwrite: bool,
}

#[derive(Args, Debug)]
pub struct SglangArgs {
    /// The model (its config.json gives the layers and the family).
    #[arg(long)]
    pub model: String,
    #[arg(long)]
    pub revision: Option<String>,
    /// The placement (occult.placement.v1).
    #[arg(long)]
    pub placement: PathBuf,
    /// The JSON file to write.
    #[arg(short, long)]
    pub output: PathBuf,
}

pub fn run(cmd: ExportCmd) -> Result<()> {
    match cmd {
        ExportCmd::Checkpoint(a) => checkpoint(a),
        ExportCmd::Sglang(a) => sglang(a),
    }
}

fn model_dir(model: &str, revision: Option<&str>) -> Result<PathBuf> {
    Ok(resolve(model, revision)?.dir)
}

fn read_placement(path: &Path) -> Result<Placement> {
    Placement::read(path).with_context(|| format!("reading the placement {}", path.display()))
}

fn checkpoint(a: CheckpointArgs) -> Result<()> {
    let dir = model_dir(&a.model, a.revision.as_deref())?;
    let layout = ExpertLayout::read(&dir)?;
    let placement = read_placement(&a.placement)?;
    let mut ren = Renumbering::from_placement(&placement, layout.groups)
        .with_context(|| format!("{} cannot be exported", a.placement.display()))?;
    ren.source.insert("model".into(), a.model.clone().into());
    ren.source
        .insert("placement".into(), a.placement.display().to_string().into());
    ren.source.insert(
        "provenance".into(),
        serde_json::to_value(crate::version::provenance())?,
    );
    let pb = bar(0, "bytes");
    let summary = export_checkpoint(&dir, &a.output, &ren, a.overwrite, &|done, total| {
        pb.set_length(total);
        pb.set_position(done);
    })?;
    pb.finish_and_clear();
    eprintln!(
        "wrote {}: {} per-expert tensors renumbered, {} fused expert and router tensors \
         permuted, {} unchanged ({:.1} MB); {} files copied",
        a.output.display(),
        summary.renamed,
        summary.permuted,
        summary.unchanged,
        summary.bytes as f64 / 1e6,
        summary.copied.len()
    );
    for (name, why) in &summary.skipped {
        eprintln!("  not copied: {name} ({why})");
    }
    let d = placement.num_devices;
    eprintln!(
        "the renumbering is in {}; serve it with contiguous expert sharding over {d} devices \
         (vLLM: --enable-expert-parallel with tensor x data parallel = {d}, the default `linear` \
         expert placement; Megatron-Core / DeepSpeed: expert parallel size {d})",
        a.output.join(RENUMBERING_FILE).display(),
    );
    Ok(())
}

fn sglang(a: SglangArgs) -> Result<()> {
    super::check_io(&[Some(&a.placement)], &[Some(&a.output)])?;
    let dir = model_dir(&a.model, a.revision.as_deref())?;
    let layout = ExpertLayout::read(&dir)?;
    let placement = read_placement(&a.placement)?;
    let v = location::location_file(&layout, &placement)?;
    let text = location::to_text(&v);
    occult_core::atomic::write_atomic(&a.output, |w| w.write_all(text.as_bytes()))?;
    eprintln!(
        "wrote {} ({} layers x {} physical experts); serve with --ep-size {} \
         --init-expert-location {}",
        a.output.display(),
        layout.num_layers,
        v[location::KEY][0]
            .as_array()
            .map_or(layout.num_experts, Vec::len),
        placement.num_devices,
        a.output.display()
    );
    Ok(())
}
