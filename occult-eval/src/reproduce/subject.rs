//! The recipe's subject: the model (the built-in one, built and cached on first use, or a
//! checkpoint the recipe names) and its data: calibration text, instructions, held-out
//! instructions and tasks.

use super::recipe::Recipe;
use crate::builtin::data::GENERATIVE;
use crate::builtin::{ensure_cached, BuiltinRecipe};
use anyhow::Result;
use std::path::PathBuf;

/// Where the model and its data are.
pub struct Subject {
    pub model: String,
    pub calibration: PathBuf,
    pub instructions: Option<String>,
    pub held_out: Option<String>,
    pub tasks: Vec<String>,
    pub task_data: Vec<String>,
    pub builtin: Option<BuiltinRecipe>,
    /// How the built-in model's weights came about.
    pub provenance: Option<crate::builtin::Provenance>,
}

pub fn subject(r: &Recipe, mpi: bool) -> Result<Subject> {
    if r.model.builtin {
        let recipe = r.builtin.clone().unwrap_or_default();
        let b = ensure_cached(&recipe, !mpi)?;
        // The built-in tasks in use, each with its data folder: one multiple-choice task a
        // domain, and the generative one where the recipe asks for it.
        let data = crate::builtin::data::task_name;
        let mut builtin: Vec<(String, &str)> = crate::builtin::world::Domain::ALL
            .iter()
            .map(|d| (data(*d), d.name()))
            .collect();
        if r.quality.generative {
            let name = crate::builtin::data::gen_task_name(GENERATIVE);
            builtin.push((name, GENERATIVE.name()));
        }
        let tasks = if r.quality.tasks.is_empty() {
            builtin
                .iter()
                .map(|(name, _)| b.file(&format!("tasks/{name}.toml")).display().to_string())
                .collect()
        } else {
            r.quality.tasks.clone()
        };
        let mut task_data: Vec<String> = builtin
            .iter()
            .map(|(name, folder)| {
                format!("{name}={}", b.file(&format!("tasks/{folder}")).display())
            })
            .collect();
        task_data.extend(r.quality.data.iter().map(|(k, v)| format!("{k}={v}")));
        Ok(Subject {
            model: b.model().display().to_string(),
            calibration: r
                .calibration
                .data
                .clone()
                .unwrap_or_else(|| b.file("calibration.jsonl")),
            instructions: Some(
                r.finetune
                    .data
                    .clone()
                    .unwrap_or_else(|| b.file("instructions/train.jsonl").display().to_string()),
            ),
            held_out: Some(b.file("instructions/held_out.jsonl").display().to_string()),
            tasks,
            task_data,
            builtin: Some(recipe),
            provenance: b.provenance(),
        })
    } else {
        Ok(Subject {
            model: r.model.path.clone().expect("checked"),
            calibration: r.calibration.data.clone().expect("checked"),
            instructions: r.finetune.data.clone(),
            held_out: None,
            tasks: r.quality.tasks.clone(),
            task_data: r
                .quality
                .data
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect(),
            builtin: None,
            provenance: None,
        })
    }
}
