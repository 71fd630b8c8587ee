//! `occult export checkpoint` (a Hugging Face checkpoint with experts renumbered, so that an
//! engine's contiguous expert sharding realises a placement), `occult export sglang` (SGLang's
//! `--init-expert-location` file), `occult export trtllm` (TensorRT-LLM's WIDEEP load-balancer
//! YAML) and `occult export vllm` (the files of vLLM's open placement pull requests).

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
    /// equal to the placement's devices and, with replicas, `--ep-num-redundant-experts R`),
    /// checked as SGLang would load it; or, with `--check FILE`, an existing file checked.
    #[command(after_help = "Examples:\n  \
        occult place --trace t.safetensors --devices 4 --replicas 8 --copy-rule sglang -o p.json\n  \
        occult export sglang --model Qwen/Qwen3-30B-A3B --placement p.json -o location.json\n  \
        python -m sglang.launch_server --model-path Qwen/Qwen3-30B-A3B --tp 4 --ep-size 4 \\\n    \
        --moe-a2a-backend deepep --ep-num-redundant-experts 8 --init-expert-location location.json\n  \
        occult export sglang --model Qwen/Qwen3-30B-A3B --check location.json --ep-size 4\n\n\
        The file is refused where SGLang would misload it: a row per hidden layer, every expert \
        in every row, the slots dividing over the GPUs, no GPU holding an MoE layer's expert \
        twice, and (with --ep-num-redundant-experts) exactly E + R slots. With an all-to-all \
        backend SGLang dispatches by its static table, the copy rule `--copy-rule sglang` \
        places and counts for.")]
    Sglang(SglangArgs),
    /// TensorRT-LLM's static load-balancer YAML for its WIDEEP MoE backend
    /// (`moe_config: {backend: WIDEEP, load_balancer: FILE}`), with or without replicas; or,
    /// with `--check FILE`, an existing one checked as TensorRT-LLM reads it.
    #[command(after_help = "Examples:\n  \
        occult place --trace t.safetensors --devices 8 --replicas 8 --copy-rule trtllm -o p.json\n  \
        occult export trtllm --placement p.json -o load_balancer.yaml\n  \
        occult export trtllm --model deepseek-ai/DeepSeek-V3 --check load_balancer.yaml --ep-size 8\n\n\
        The keys are the model's layer indices (the placement's), every list num_slots logical \
        expert ids, slot s on rank s / (num_slots / ep_size); layer_updates_per_iter: 0 keeps \
        the assignment static. Serve with the EP size of the placement's devices.")]
    Trtllm(TrtllmArgs),
    /// vLLM's placement file, in the format of an open pull request (vLLM's releases read none:
    /// serve a renumbered checkpoint there, `occult export checkpoint`): #49572's expert map
    /// (per MoE layer, replicas allowed) or #34811's expert_to_ep_rank (one map for every
    /// layer, no replicas: place with --shared-across-layers).
    #[command(after_help = "Examples:\n  \
        occult export vllm --placement p.json --pr 49572 -o expert_map.json\n  \
        vllm serve M --enable-expert-parallel --enable-eplb \\\n    \
        --eplb-config '{\"initial_expert_map_path\": \"expert_map.json\"}'   # with PR 49572\n  \
        occult place --trace t.safetensors --devices 4 --shared-across-layers -o shared.json\n  \
        occult export vllm --placement shared.json --pr 34811 -o placement.json\n  \
        vllm serve M --enable-expert-parallel --expert-placement-file placement.json   # with PR 34811")]
    Vllm(VllmArgs),
}

#[derive(Args, Debug)]
pub struct TrtllmArgs {
    /// The placement (v1, or v2 with replicas); its layers are the model's MoE layers.
    #[arg(long, required_unless_present = "check")]
    pub placement: Option<PathBuf>,
    /// The YAML file to write.
    #[arg(short, long, required_unless_present = "check")]
    pub output: Option<PathBuf>,
    /// The model, to check that every MoE layer is placed (needed with --check).
    #[arg(long)]
    pub model: Option<String>,
    /// Check this load-balancer file (any tool's) as TensorRT-LLM reads it; needs --model and
    /// --ep-size.
    #[arg(long, conflicts_with_all = ["placement", "output"], requires_all = ["ep_size", "model"])]
    pub check: Option<PathBuf>,
    /// With --check: the EP size it will be served with.
    #[arg(long)]
    pub ep_size: Option<usize>,
}

/// The open vLLM pull request whose file format to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum VllmPr {
    /// vllm-project/vllm#49572: `--eplb-config '{"initial_expert_map_path": FILE}'`.
    #[value(name = "49572")]
    Pr49572,
    /// vllm-project/vllm#34811: `--expert-placement-file FILE`.
    #[value(name = "34811")]
    Pr34811,
}

#[derive(Args, Debug)]
pub struct VllmArgs {
    /// The placement (v1, or v2 with replicas for #49572).
    #[arg(long)]
    pub placement: PathBuf,
    /// Whose format: 49572 or 34811 (both open pull requests, not in a vLLM release).
    #[arg(long, value_enum)]
    pub pr: VllmPr,
    /// #49572: write the one row every layer shares (the placement's layers must agree).
    #[arg(long)]
    pub shared: bool,
    /// The model, to check that the placement covers its MoE layers in order.
    #[arg(long)]
    pub model: Option<String>,
    /// The JSON file to write.
    #[arg(short, long)]
    pub output: PathBuf,
}

#[derive(Args, Debug)]
pub struct CheckpointArgs {
    /// The model: a folder or a Hugging Face hub id in the local cache.
    #[arg(long)]
    pub model: String,
    /// Hub revision (with a hub id).
    #[arg(long)]
    pub revision: Option<String>,
    /// The placement (occult.placement.v1, from `occult place`), covering every MoE layer; a
    /// v2 placement with replicas goes to `occult export sglang` instead.
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
    /// The placement (occult.placement.v1, or v2 with replicas: `occult place --replicas R`).
    #[arg(long, required_unless_present = "check")]
    pub placement: Option<PathBuf>,
    /// The JSON file to write.
    #[arg(short, long, required_unless_present = "check")]
    pub output: Option<PathBuf>,
    /// Check this expert-location file (any tool's) as SGLang would load it, instead of
    /// writing one; needs --ep-size.
    #[arg(long, conflicts_with_all = ["placement", "output"], requires = "ep_size")]
    pub check: Option<PathBuf>,
    /// With --check: the EP size it will be served with.
    #[arg(long)]
    pub ep_size: Option<usize>,
    /// With --check: the `--ep-num-redundant-experts` it will be served with (default: what
    /// the file's width implies, which is then printed).
    #[arg(long)]
    pub ep_num_redundant_experts: Option<usize>,
}

pub fn run(cmd: ExportCmd) -> Result<()> {
    match cmd {
        ExportCmd::Checkpoint(a) => checkpoint(a),
        ExportCmd::Sglang(a) => sglang(a),
        ExportCmd::Trtllm(a) => trtllm(a),
        ExportCmd::Vllm(a) => vllm(a),
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
    let dir = model_dir(&a.model, a.revision.as_deref())?;
    let layout = ExpertLayout::read(&dir)?;
    if let Some(file) = &a.check {
        super::check_io(&[Some(file)], &[])?;
        let ep = a.ep_size.context("--check needs --ep-size")?;
        let text = occult_core::input::read_text(file)?;
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}: not JSON", file.display()))?;
        let r = location::check_servable(&v, &layout, ep, a.ep_num_redundant_experts)
            .with_context(|| file.display().to_string())?;
        println!(
            "{}: SGLang loads it as written; serve with {}",
            file.display(),
            serve_flags(ep, r, file)
        );
        return Ok(());
    }
    let (Some(placement_file), Some(output)) = (&a.placement, &a.output) else {
        anyhow::bail!("give --placement and -o, or --check FILE");
    };
    super::check_io(&[Some(placement_file)], &[Some(output)])?;
    let placement = read_placement(placement_file)?;
    let v = location::location_file(&layout, &placement)?;
    let r = location::check_servable(&v, &layout, placement.num_devices, None)?;
    let text = location::to_text(&v);
    occult_core::atomic::write_atomic(output, |w| w.write_all(text.as_bytes()))?;
    eprintln!(
        "wrote {} ({} layers x {} physical experts); serve with {}",
        output.display(),
        layout.num_layers,
        layout.num_experts + r,
        serve_flags(placement.num_devices, r, output)
    );
    Ok(())
}

/// Checks that `placement` covers exactly the MoE layers of `model`, if one is named.
fn check_layers(model: Option<&str>, placement: &Placement) -> Result<()> {
    let Some(m) = model else { return Ok(()) };
    let layout = ExpertLayout::read(&model_dir(m, None)?)?;
    let mut have: Vec<usize> = placement.layers.iter().map(|l| l.layer).collect();
    have.sort_unstable();
    if have != layout.moe_layers || placement.num_experts != layout.num_experts {
        anyhow::bail!(
            "the placement covers layers {have:?} with {} experts; {m} has MoE layers {:?} with \
             {} experts",
            placement.num_experts,
            layout.moe_layers,
            layout.num_experts
        );
    }
    Ok(())
}

fn trtllm(a: TrtllmArgs) -> Result<()> {
    use occult_core::interop::trtllm::load_balancer;
    if let Some(file) = &a.check {
        super::check_io(&[Some(file)], &[])?;
        let (Some(m), Some(ep)) = (&a.model, a.ep_size) else {
            anyhow::bail!("--check needs --model and --ep-size");
        };
        let layout = ExpertLayout::read(&model_dir(m, None)?)?;
        let text = occult_core::input::read_text(file)?;
        let p = load_balancer::check_servable(&text, &layout.moe_layers, layout.num_experts, ep)
            .with_context(|| file.display().to_string())?;
        println!(
            "{}: TensorRT-LLM reads it as written ({} MoE layers, {} slots on {ep} ranks{})",
            file.display(),
            p.layers.len(),
            occult_core::interop::slots::layer_rows(&p)?[0].1.len(),
            if p.has_replicas() {
                ", with replicas"
            } else {
                ""
            }
        );
        return Ok(());
    }
    let (Some(placement_file), Some(output)) = (&a.placement, &a.output) else {
        anyhow::bail!("give --placement and -o, or --check FILE");
    };
    super::check_io(&[Some(placement_file)], &[Some(output)])?;
    let placement = read_placement(placement_file)?;
    check_layers(a.model.as_deref(), &placement)?;
    let text = load_balancer::load_balancer_file(&placement)?;
    // What TensorRT-LLM would read back, before it is written.
    let moe: Vec<usize> = placement.layers.iter().map(|l| l.layer).collect();
    load_balancer::check_servable(&text, &moe, placement.num_experts, placement.num_devices)?;
    occult_core::atomic::write_atomic(output, |w| w.write_all(text.as_bytes()))?;
    eprintln!(
        "wrote {} ({} MoE layers); serve on {} EP ranks with moe_config: {{backend: WIDEEP, \
         load_balancer: {}}}",
        output.display(),
        placement.layers.len(),
        placement.num_devices,
        output.display()
    );
    Ok(())
}

fn vllm(a: VllmArgs) -> Result<()> {
    use occult_core::interop::vllm::placement_file;
    super::check_io(&[Some(&a.placement)], &[Some(&a.output)])?;
    let placement = read_placement(&a.placement)?;
    check_layers(a.model.as_deref(), &placement)?;
    if a.shared && a.pr == VllmPr::Pr34811 {
        anyhow::bail!("--shared is #49572's one-row form; #34811's file is always one map");
    }
    let v = match a.pr {
        VllmPr::Pr49572 => placement_file::pr49572_file(&placement, a.shared)?,
        VllmPr::Pr34811 => placement_file::pr34811_file(&placement)?,
    };
    let text = serde_json::to_string(&v)? + "\n";
    occult_core::atomic::write_atomic(&a.output, |w| w.write_all(text.as_bytes()))?;
    let serve = match a.pr {
        VllmPr::Pr49572 => format!(
            "--enable-expert-parallel --enable-eplb --eplb-config \
             '{{\"initial_expert_map_path\": \"{}\"}}'",
            a.output.display()
        ),
        VllmPr::Pr34811 => format!(
            "--enable-expert-parallel --expert-placement-file {}",
            a.output.display()
        ),
    };
    eprintln!(
        "wrote {} in the format of vllm-project/vllm#{} (an open pull request, not in a vLLM \
         release); with it, serve on {} EP ranks with {serve}",
        a.output.display(),
        match a.pr {
            VllmPr::Pr49572 => 49572,
            VllmPr::Pr34811 => 34811,
        },
        placement.num_devices
    );
    Ok(())
}

/// The `sglang.launch_server` flags that load a location file as written (with replicas, an
/// all-to-all backend, under which SGLang dispatches by the static table `--copy-rule sglang`
/// counts).
fn serve_flags(ep: usize, redundant: usize, file: &Path) -> String {
    let mut flags = format!("--ep-size {ep}");
    if redundant > 0 {
        flags += &format!(" --moe-a2a-backend deepep --ep-num-redundant-experts {redundant}");
    }
    flags + &format!(" --init-expert-location {}", file.display())
}
