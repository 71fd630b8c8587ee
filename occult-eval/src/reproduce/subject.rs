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
        let names = crate::builtin::world::Domain::ALL;
        let tasks = if r.quality.tasks.is_empty() {
            let generative = crate::builtin::data::gen_task_name(GENERATIVE);
            names
                .iter()
                .map(|d| crate::builtin::data::task_name(*d))
                .chain(r.quality.generative.then_some(generative))
                .map(|name| b.file(&format!("tasks/{name}.toml")).display().to_string())
                .collect()
        } else {
            r.quality.tasks.clone()
        };
        let mut task_data: Vec<String> = names
            .iter()
            .map(|d| {
                let task = crate::builtin::data::task_name(*d);
                format!(
                    "{task}={}",
                    b.file(&format!("tasks/{}", d.name())).display()
                )
            })
            .collect();
        task_data.push(format!(
            "{}={}",
            crate::builtin::data::gen_task_name(GENERATIVE),
            b.file(&format!("tasks/{}", GENERATIVE.name())).display()
        ));
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
