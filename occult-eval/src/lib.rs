#![doc = include_str!("../README.md")]

pub mod bench;
pub mod builtin;
pub mod commands;
pub mod context;
pub mod harness;
pub mod jobs;
pub mod output;
pub mod progress;
pub mod reproduce;
pub mod rows;
pub mod table;
pub mod version;
