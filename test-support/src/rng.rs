//! Random moments for tests that cut runs short: a small xorshift generator whose seed is
//! printed, and taken from the environment when given, so that a failing sequence repeats.

/// A xorshift generator, never seeded with 0.
pub struct Rng(u64);

impl Rng {
    /// Seeded from `$var`, else from the clock; the seed is printed with how to repeat it.
    pub fn from_env(var: &str) -> Rng {
        let seed = seed_from_env(var);
        eprintln!("seed {seed} ({var}={seed} repeats it)");
        Rng::new(seed)
    }

    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A duration from zero up to `max`.
    pub fn within(&mut self, max: std::time::Duration) -> std::time::Duration {
        max.mul_f64((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }

    /// A number below `n` (0 where `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// `$var` as a number, else one from the clock (never 0).
pub fn seed_from_env(var: &str) -> u64 {
    env_number(var).unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            | 1
    })
}

/// `$var` as a number, where it is set and is one.
pub fn env_number<T: std::str::FromStr>(var: &str) -> Option<T> {
    std::env::var(var).ok()?.parse().ok()
}
