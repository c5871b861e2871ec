//! Order statistics of timing samples.

use serde_json::{Value, json};
use std::time::Duration;

/// Percentiles of a set of samples, in microseconds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Summary {
    pub(crate) n: usize,
    pub(crate) min: f64,
    pub(crate) p50: f64,
    pub(crate) p90: f64,
    pub(crate) p99: f64,
    pub(crate) max: f64,
    pub(crate) mean: f64,
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The `q`-quantile (0..=1) of sorted values, nearest rank.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl Summary {
    pub(crate) fn of(samples: &[Duration]) -> Summary {
        Self::of_micros(samples.iter().map(|&d| micros(d)).collect())
    }

    pub(crate) fn of_micros(mut v: Vec<f64>) -> Summary {
        assert!(!v.is_empty(), "no samples");
        v.sort_by(f64::total_cmp);
        Summary {
            n: v.len(),
            min: v[0],
            p50: quantile(&v, 0.50),
            p90: quantile(&v, 0.90),
            p99: quantile(&v, 0.99),
            max: v[v.len() - 1],
            mean: v.iter().sum::<f64>() / v.len() as f64,
        }
    }

    /// The fields of a JSON record, in microseconds.
    pub(crate) fn json(&self) -> Value {
        json!({
            "n": self.n,
            "min_us": round(self.min),
            "p50_us": round(self.p50),
            "p90_us": round(self.p90),
            "p99_us": round(self.p99),
            "max_us": round(self.max),
            "mean_us": round(self.mean),
        })
    }
}

/// Three decimals are more than the clocks resolve.
pub(crate) fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}
