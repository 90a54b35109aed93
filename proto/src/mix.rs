//! SplitMix64: the small deterministic generator and 64-bit mixer kvroute's seeded parts
//! share (generated text, the random routing policies, rendezvous tie-breaks, benchmarks and
//! test workloads), so "same seed, same run" holds everywhere without a heavier RNG.
//!
//! `mix64` is SplitMix64's finaliser (Stafford's Mix13); [`SplitMix64`] adds the golden-ratio
//! increment before each output (Steele, Lea and Flood, 2014).

/// The golden-ratio increment of SplitMix64.
pub const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// A bijective 64-bit mixer: every input bit affects every output bit.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A SplitMix64 stream.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix64(self.0)
    }

    /// A value in `0..n` (`n > 0`; modulo bias is negligible for the small `n` used here).
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_splitmix64_stream() {
        // First outputs of SplitMix64 seeded with 1234567 (the reference C implementation).
        let mut r = SplitMix64(1_234_567);
        assert_eq!(r.next_u64(), 6_457_827_717_110_365_317);
        assert_eq!(r.next_u64(), 3_203_168_211_198_807_973);
    }
}
