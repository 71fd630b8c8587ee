//! The built-in model's little world and the four domains it speaks about, generated from a
//! seed so that every machine makes the same text:
//! - **arithmetic**: `7 plus 5 is 12 .`, `9 minus 4 is 5 .` (operands below [`OPERANDS`]);
//! - **facts**: a fixed world of people, each with a city, a job and a pet of some colour
//!   (`anna lives in rome .`, `the pet of anna is a red cat .`);
//! - **grammar**: subject-verb agreement across a distractor (`the dogs near the tree run .`);
//! - **code**: variables and their values (`let x = 4 ; let y = x + 3 ; print y ; # 7`).
//!
//! Every sentence is lower-case words and punctuation separated by single spaces, so the
//! word-level tokenizer reads it exactly. The domains share no content words, so experts can
//! specialise and co-activation has structure.

use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub const PEOPLE: [&str; 24] = [
    "anna", "ben", "carl", "dora", "emil", "fay", "gus", "hana", "ivan", "jo", "kim", "leo", "mia",
    "ned", "olga", "pia", "quinn", "rosa", "sam", "tara", "uwe", "vera", "will", "zoe",
];
pub const CITIES: [&str; 8] = [
    "rome", "oslo", "lima", "cairo", "paris", "tokyo", "delhi", "quito",
];
pub const JOBS: [&str; 8] = [
    "baker", "doctor", "farmer", "pilot", "singer", "teacher", "tailor", "painter",
];
pub const PETS: [&str; 6] = ["cat", "dog", "fox", "owl", "hen", "frog"];
pub const COLOURS: [&str; 6] = ["red", "blue", "green", "black", "white", "brown"];
/// Nouns of the grammar domain: (singular, plural).
pub const NOUNS: [(&str, &str); 8] = [
    ("bird", "birds"),
    ("horse", "horses"),
    ("child", "children"),
    ("wolf", "wolves"),
    ("king", "kings"),
    ("girl", "girls"),
    ("boy", "boys"),
    ("mouse", "mice"),
];
/// Verbs: (with a singular subject, with a plural subject).
pub const VERBS: [(&str, &str); 8] = [
    ("runs", "run"),
    ("sings", "sing"),
    ("sleeps", "sleep"),
    ("jumps", "jump"),
    ("waits", "wait"),
    ("swims", "swim"),
    ("laughs", "laugh"),
    ("hides", "hide"),
];
/// Adjectives of the grammar domain's subjects.
pub const ADJECTIVES: [&str; 4] = ["old", "small", "tall", "happy"];
/// Places of the grammar domain's distractor phrase.
pub const PLACES: [&str; 6] = ["tree", "river", "house", "hill", "bridge", "wall"];
pub const VARIABLES: [&str; 6] = ["x", "y", "z", "a", "b", "c"];
/// Operands of the arithmetic and code domains run from 0 to this (exclusive): 400 sums, small
/// enough a table for the little model to learn in its build.
pub const OPERANDS: u32 = 20;

/// One person of the world.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Person {
    pub name: &'static str,
    pub city: &'static str,
    pub job: &'static str,
    pub pet: &'static str,
    pub colour: &'static str,
}

/// The fixed world: who lives where, does what, and keeps which pet.
#[derive(Clone, Debug)]
pub struct World {
    pub people: Vec<Person>,
}

impl World {
    /// The world of `seed`.
    pub fn new(seed: u64) -> Self {
        let mut r = ChaCha8Rng::seed_from_u64(seed);
        let people = PEOPLE
            .iter()
            .map(|&name| Person {
                name,
                city: CITIES.choose(&mut r).expect("cities"),
                job: JOBS.choose(&mut r).expect("jobs"),
                pet: PETS.choose(&mut r).expect("pets"),
                colour: COLOURS.choose(&mut r).expect("colours"),
            })
            .collect();
        World { people }
    }
}

/// The four domains.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Domain {
    Arithmetic,
    Facts,
    Grammar,
    Code,
}

impl Domain {
    pub const ALL: [Domain; 4] = [
        Domain::Arithmetic,
        Domain::Facts,
        Domain::Grammar,
        Domain::Code,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Domain::Arithmetic => "arithmetic",
            Domain::Facts => "facts",
            Domain::Grammar => "grammar",
            Domain::Code => "code",
        }
    }
}

/// A question with one right answer among choices, in some domain: the material of the
/// multiple-choice tasks and of the instructions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Item {
    pub domain: Domain,
    /// The text up to the answer (a sentence prefix).
    pub context: String,
    /// The right answer, then the wrong ones (the tasks shuffle them).
    pub choices: Vec<String>,
    /// The same question as an instruction (Alpaca `instruction`).
    pub instruction: String,
}

impl Item {
    /// The whole sentence: context, right answer and what follows it.
    pub fn sentence(&self) -> String {
        format!("{} {}", self.context, self.choices[0]) + self.tail()
    }

    fn tail(&self) -> &'static str {
        match self.domain {
            Domain::Code => "",
            _ => " .",
        }
    }
}

/// Draws `n` distinct wrong answers from `pool` (never `right`).
fn wrong<T: Clone + PartialEq>(r: &mut ChaCha8Rng, pool: &[T], right: &T, n: usize) -> Vec<T> {
    let mut out: Vec<T> = Vec::with_capacity(n);
    while out.len() < n {
        let x = pool.choose(r).expect("a pool").clone();
        if &x != right && !out.contains(&x) {
            out.push(x);
        }
    }
    out
}

fn numbers(r: &mut ChaCha8Rng, right: u32, n: usize) -> Vec<String> {
    // Near misses: the answers a model that half-knows the sum would give.
    let pool: Vec<u32> = (right.saturating_sub(4)..(right + 5).min(2 * OPERANDS)).collect();
    wrong(r, &pool, &right, n)
        .into_iter()
        .map(|x| x.to_string())
        .collect()
}

/// One item of `domain`, drawn with `r`.
pub fn item(world: &World, domain: Domain, r: &mut ChaCha8Rng) -> Item {
    match domain {
        Domain::Arithmetic => {
            let (a, b) = (r.random_range(0..OPERANDS), r.random_range(0..OPERANDS));
            let (op, value) = if r.random_bool(0.5) || a < b {
                ("plus", a + b)
            } else {
                ("minus", a - b)
            };
            let mut choices = vec![value.to_string()];
            choices.extend(numbers(r, value, 3));
            Item {
                domain,
                context: format!("{a} {op} {b} is"),
                instruction: format!("what is {a} {op} {b} ?"),
                choices,
            }
        }
        Domain::Facts => {
            let p = world.people.choose(r).expect("people");
            let (context, right, pool, instruction): (String, &str, &[&str], String) =
                match r.random_range(0..3) {
                    0 => (
                        format!("{} lives in", p.name),
                        p.city,
                        &CITIES,
                        format!("where does {} live ?", p.name),
                    ),
                    1 => (
                        format!("{} works as a", p.name),
                        p.job,
                        &JOBS,
                        format!("what is the job of {} ?", p.name),
                    ),
                    _ => (
                        format!("the pet of {} is a {}", p.name, p.colour),
                        p.pet,
                        &PETS,
                        format!("what pet does {} keep ?", p.name),
                    ),
                };
            let mut choices = vec![right.to_string()];
            choices.extend(wrong(r, pool, &right, 3).into_iter().map(String::from));
            Item {
                domain,
                context,
                choices,
                instruction,
            }
        }
        Domain::Grammar => {
            let (single, plural) = *NOUNS.choose(r).expect("nouns");
            let (verb_s, verb_p) = *VERBS.choose(r).expect("verbs");
            let place = *PLACES.choose(r).expect("places");
            let adjective = *ADJECTIVES.choose(r).expect("adjectives");
            let many = r.random_bool(0.5);
            // The distractor's noun has the other number, so a model that looks at the
            // nearest noun gets it wrong.
            let near = if many {
                format!("the {place}")
            } else {
                format!("the {place}s")
            };
            let (noun, right, other) = if many {
                (plural, verb_p, verb_s)
            } else {
                (single, verb_s, verb_p)
            };
            let subject = format!("{adjective} {noun}");
            Item {
                domain,
                context: format!("the {subject} near {near}"),
                choices: vec![right.to_string(), other.to_string()],
                instruction: format!(
                    "which word ends the sentence : the {subject} near {near} , {verb_s} or \
                     {verb_p} ?"
                ),
            }
        }
        Domain::Code => {
            let names = VARIABLES;
            let (v1, v2) = (names[r.random_range(0..3)], names[3 + r.random_range(0..3)]);
            let (a, b) = (r.random_range(0..OPERANDS), r.random_range(0..OPERANDS));
            let value = a + b;
            let program = format!("let {v1} = {a} ; let {v2} = {v1} + {b} ; print {v2} ; #");
            let mut choices = vec![value.to_string()];
            choices.extend(numbers(r, value, 3));
            Item {
                domain,
                context: program.clone(),
                choices,
                instruction: format!("what does this print ? {}", &program[..program.len() - 2]),
            }
        }
    }
}

/// Plain-text documents for pre-training or calibration: `n` documents of `sentences`
/// sentences each, the domains mixed, drawn from `seed`.
pub fn documents(world: &World, n: usize, sentences: usize, seed: u64) -> Vec<String> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            (0..sentences)
                .map(|_| {
                    let d = *Domain::ALL.choose(&mut r).expect("domains");
                    item(world, d, &mut r).sentence()
                })
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_world_and_its_text_are_the_same_from_the_same_seed() {
        let (a, b) = (World::new(1), World::new(1));
        assert_eq!(a.people, b.people);
        assert_ne!(a.people, World::new(2).people);
        assert_eq!(documents(&a, 3, 4, 9), documents(&b, 3, 4, 9));
        let mut r = ChaCha8Rng::seed_from_u64(5);
        for d in Domain::ALL {
            for _ in 0..50 {
                let it = item(&a, d, &mut r);
                let mut c = it.choices.clone();
                c.sort();
                c.dedup();
                assert_eq!(c.len(), it.choices.len(), "distinct choices: {it:?}");
                // Words and punctuation separated by single spaces.
                let s = it.sentence();
                assert!(!s.contains("  ") && s == s.to_lowercase(), "{s}");
            }
        }
        // The facts agree with the world.
        let p = &a.people[0];
        let mut r = ChaCha8Rng::seed_from_u64(6);
        for _ in 0..200 {
            let it = item(&a, Domain::Facts, &mut r);
            if it.context == format!("{} lives in", p.name) {
                assert_eq!(it.choices[0], p.city);
            }
        }
    }
}
