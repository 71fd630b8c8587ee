//! CPython's `random.Random`, bit for bit, as far as lm-evaluation-harness uses it: seeding from
//! an integer, the Mersenne Twister (MT19937) stream, `getrandbits`, `_randbelow`, `sample` and
//! `shuffle`. The harness draws few-shot examples with `random.Random(seed).sample`, so the same
//! prompts need the same draws; SGLang deals replicated experts to ranks with
//! `random.Random(42)`, so the same dispatch table needs them too. Written from CPython's `Modules/_randommodule.c` and
//! `Lib/random.py` (3.11); `tests/fixtures/pyrandom.json`, which CPython wrote
//! (`scripts/make_pyrandom_fixtures.py`), holds it to them.

const N: usize = 624;
const M: usize = 397;

/// A `random.Random` instance.
#[derive(Clone, Debug)]
pub struct PyRandom {
    mt: [u32; N],
    index: usize,
}

impl PyRandom {
    /// `random.Random(seed)` for a non-negative integer seed (up to 128 bits).
    pub fn new(seed: u128) -> Self {
        // The seed's 32-bit words, least significant first; zero is one word.
        let mut key = Vec::new();
        let mut rest = seed;
        while rest > 0 {
            key.push(rest as u32);
            rest >>= 32;
        }
        if key.is_empty() {
            key.push(0);
        }
        let mut r = PyRandom::genrand(19_650_218);
        r.mix_in(&key);
        r
    }

    /// `init_genrand`.
    fn genrand(s: u32) -> Self {
        let mut mt = [0u32; N];
        mt[0] = s;
        for i in 1..N {
            mt[i] = 1_812_433_253u32
                .wrapping_mul(mt[i - 1] ^ (mt[i - 1] >> 30))
                .wrapping_add(i as u32);
        }
        PyRandom { mt, index: N }
    }

    /// The rest of `init_by_array`.
    fn mix_in(&mut self, key: &[u32]) {
        let mt = &mut self.mt;
        let (mut i, mut j) = (1usize, 0usize);
        for _ in 0..N.max(key.len()) {
            let prev = mt[i - 1] ^ (mt[i - 1] >> 30);
            mt[i] = (mt[i] ^ prev.wrapping_mul(1_664_525))
                .wrapping_add(key[j])
                .wrapping_add(j as u32);
            i += 1;
            j += 1;
            if i >= N {
                mt[0] = mt[N - 1];
                i = 1;
            }
            if j >= key.len() {
                j = 0;
            }
        }
        for _ in 0..N - 1 {
            let prev = mt[i - 1] ^ (mt[i - 1] >> 30);
            mt[i] = (mt[i] ^ prev.wrapping_mul(1_566_083_941)).wrapping_sub(i as u32);
            i += 1;
            if i >= N {
                mt[0] = mt[N - 1];
                i = 1;
            }
        }
        mt[0] = 0x8000_0000;
    }

    /// `genrand_uint32`: the next 32 bits of the stream.
    pub fn next_u32(&mut self) -> u32 {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        const MATRIX_A: u32 = 0x9908_b0df;
        if self.index >= N {
            let mt = &mut self.mt;
            for k in 0..N {
                let y = (mt[k] & UPPER) | (mt[(k + 1) % N] & LOWER);
                let mag = if y & 1 == 1 { MATRIX_A } else { 0 };
                mt[k] = mt[(k + M) % N] ^ (y >> 1) ^ mag;
            }
            self.index = 0;
        }
        let mut y = self.mt[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// `getrandbits(k)` for `k <= 64`: 32-bit words, least significant first, the last one cut
    /// to the bits left.
    pub fn getrandbits(&mut self, k: u32) -> u64 {
        assert!(k <= 64, "getrandbits({k}): at most 64 bits here");
        if k <= 32 {
            return if k == 0 {
                0
            } else {
                u64::from(self.next_u32() >> (32 - k))
            };
        }
        let low = u64::from(self.next_u32());
        let high = u64::from(self.next_u32() >> (64 - k));
        low | (high << 32)
    }

    /// `_randbelow(n)`: uniform in `0..n` by rejection on `n.bit_length()` bits (`n >= 1`).
    pub fn randbelow(&mut self, n: u64) -> u64 {
        assert!(n > 0, "randbelow(0)");
        let k = 64 - n.leading_zeros();
        loop {
            let r = self.getrandbits(k);
            if r < n {
                return r;
            }
        }
    }

    /// `sample(range(n), k)`: `k` distinct indices of `0..n`, in the order drawn, by CPython's
    /// two strategies (a shrinking pool for small populations, rejection from a set otherwise).
    pub fn sample(&mut self, n: usize, k: usize) -> Vec<usize> {
        assert!(k <= n, "sample larger than population");
        let mut setsize = 21usize;
        if k > 5 {
            // 4 ** ceil(log(3k, 4)), computed as Python does (log(x) / log(base)).
            let e = ((k * 3) as f64).ln() / 4f64.ln();
            setsize += 4usize.pow(e.ceil() as u32);
        }
        if n <= setsize {
            let mut pool: Vec<usize> = (0..n).collect();
            (0..k)
                .map(|i| {
                    let j = self.randbelow((n - i) as u64) as usize;
                    let x = pool[j];
                    pool[j] = pool[n - i - 1];
                    x
                })
                .collect()
        } else {
            let mut selected = std::collections::HashSet::new();
            (0..k)
                .map(|_| loop {
                    let j = self.randbelow(n as u64) as usize;
                    if selected.insert(j) {
                        break j;
                    }
                })
                .collect()
        }
    }

    /// `shuffle(x)` in place.
    pub fn shuffle<T>(&mut self, x: &mut [T]) {
        for i in (1..x.len()).rev() {
            let j = self.randbelow((i + 1) as u64) as usize;
            x.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_mt19937_stream() {
        // The first outputs of MT19937 seeded with init_by_array([0x123, 0x234, 0x345, 0x456]),
        // from the authors' mt19937ar.out (independent of CPython).
        let mut r = PyRandom::genrand(19_650_218);
        r.mix_in(&[0x123, 0x234, 0x345, 0x456]);
        let first: Vec<u32> = (0..5).map(|_| r.next_u32()).collect();
        assert_eq!(
            first,
            [1067595299, 955945823, 477289528, 4107218783, 4228976476]
        );
    }

    #[test]
    fn matches_what_cpython_produced() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/pyrandom.json"
        );
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let nums = |x: &serde_json::Value| -> Vec<u64> {
            x.as_array()
                .unwrap()
                .iter()
                .map(|n| n.as_u64().unwrap())
                .collect()
        };
        let mut checked = 0;
        for stream in v["streams"].as_array().unwrap() {
            let seed: u128 = stream["seed"].as_str().unwrap().parse().unwrap();
            let mut r = PyRandom::new(seed);
            for op in stream["ops"].as_array().unwrap() {
                let want = nums(&op["out"]);
                let got: Vec<u64> = match op["op"].as_str().unwrap() {
                    "getrandbits" => {
                        let k = op["k"].as_u64().unwrap() as u32;
                        (0..want.len()).map(|_| r.getrandbits(k)).collect()
                    }
                    "randbelow" => {
                        let n = op["n"].as_u64().unwrap();
                        (0..want.len()).map(|_| r.randbelow(n)).collect()
                    }
                    "sample" => {
                        let (n, k) = (op["n"].as_u64().unwrap(), op["k"].as_u64().unwrap());
                        r.sample(n as usize, k as usize)
                            .into_iter()
                            .map(|x| x as u64)
                            .collect()
                    }
                    "shuffle" => {
                        let mut x: Vec<u64> = (0..op["n"].as_u64().unwrap()).collect();
                        r.shuffle(&mut x);
                        x
                    }
                    other => panic!("unknown op {other}"),
                };
                assert_eq!(got, want, "seed {seed}, {op}");
                checked += 1;
            }
        }
        assert_eq!(checked, 6 * 22);
    }
}
