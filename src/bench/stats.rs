//! Summaries of repeated measurements: the median with its spread for
//! throughputs, percentiles for latencies. Every figure the bench reports
//! is one of these, so a reader always sees how much the repeats varied.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The median of repeats and how far they spread (min, quartiles, max).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    /// The median.
    pub median: f64,
    /// The smallest repeat.
    pub min: f64,
    /// The first quartile.
    pub q1: f64,
    /// The third quartile.
    pub q3: f64,
    /// The largest repeat.
    pub max: f64,
    /// How many repeats.
    pub n: usize,
}

/// The `q`-quantile (0–1) of sorted samples, by linear interpolation
/// between the two nearest ranks.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        1 => sorted[0],
        n => {
            let rank = q.clamp(0.0, 1.0) * (n - 1) as f64;
            let lo = rank.floor() as usize;
            let hi = rank.ceil() as usize;
            sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
        }
    }
}

fn sorted(samples: &[f64]) -> Vec<f64> {
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    v
}

impl Spread {
    /// The spread of `samples` (all zero when there are none).
    pub fn of(samples: &[f64]) -> Spread {
        let v = sorted(samples);
        Spread {
            median: quantile(&v, 0.5),
            min: v.first().copied().unwrap_or(0.0),
            q1: quantile(&v, 0.25),
            q3: quantile(&v, 0.75),
            max: v.last().copied().unwrap_or(0.0),
            n: v.len(),
        }
    }
}

/// Latency percentiles, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    /// The median.
    pub p50_ms: f64,
    /// The 99th percentile.
    pub p99_ms: f64,
    /// The slowest sample.
    pub max_ms: f64,
    /// The mean.
    pub mean_ms: f64,
    /// How many samples.
    pub n: usize,
}

impl Latency {
    /// The percentiles of `samples`.
    pub fn of(samples: &[Duration]) -> Latency {
        let ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        let v = sorted(&ms);
        Latency {
            p50_ms: quantile(&v, 0.5),
            p99_ms: quantile(&v, 0.99),
            max_ms: v.last().copied().unwrap_or(0.0),
            mean_ms: if v.is_empty() {
                0.0
            } else {
                v.iter().sum::<f64>() / v.len() as f64
            },
            n: v.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_between_ranks() {
        let v = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(quantile(&v, 0.5), 3.0);
        assert_eq!(quantile(&v, 0.25), 2.0);
        assert_eq!(quantile(&v, 0.99), 4.96);
        assert_eq!(quantile(&[7.0], 0.99), 7.0);
    }

    #[test]
    fn spread_sorts_its_samples() {
        let s = Spread::of(&[5.0, 1.0, 3.0]);
        assert_eq!((s.min, s.median, s.max, s.n), (1.0, 3.0, 5.0, 3));
    }
}
