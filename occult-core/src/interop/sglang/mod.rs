//! SGLang, both ways: the expert-location file its `--init-expert-location` reads
//! ([`location`], written from a placement) and its expert-distribution recorder's per-token
//! dump ([`dump`], read as routing).

pub mod dump;
pub mod location;
